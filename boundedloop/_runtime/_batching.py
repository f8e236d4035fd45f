"""Two primitives that keep a loop's control unbatched under `jax.vmap`:
`any_across_batch`, a predicate that stays unbatched, and `select_if_batched`,
masking that is free when nothing is batched (see `docs/guides/vmap.md`).
"""

import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.interpreters import ad, batching, mlir

from ._jax_private import register_batching


any_across_batch_p = jax.extend.core.Primitive("boundedloop_any_across_batch")
select_if_batched_p = jax.extend.core.Primitive("boundedloop_select_if_batched")
select_if_batched_p.multiple_results = True


def _any_across_batch_impl(pred):
    return jnp.any(pred)


def _any_across_batch_abstract_eval(pred):
    # `pred`'s own type (so its sharding and, inside `shard_map`, the mesh axes it
    # varies over), as a scalar bool
    return pred.update(shape=(), dtype=jnp.dtype(bool), weak_type=False)


def _any_across_batch_batch(args, dims):
    (pred,), (dim,) = args, dims
    # reduce the batch axis away; what is left is one element's (scalar) predicate
    return any_across_batch_p.bind(jnp.any(pred, axis=dim)), None


def _any_across_batch_jvp(primals, tangents):
    del tangents  # a boolean: no tangent
    return any_across_batch_p.bind(*primals), _zero_like(jnp.zeros((), bool))


def any_across_batch(pred):
    """`pred` (a scalar bool) unchanged; under `vmap`, true where any element's is."""
    return any_across_batch_p.bind(jnp.asarray(pred, dtype=bool))


def _select_if_batched_impl(pred, *operands):
    # unbatched, `pred` is true wherever this is used (see `select_if_batched`)
    del pred
    half = len(operands) // 2
    return operands[:half]


def _select_if_batched_abstract_eval(pred, *operands):
    # the type of `on_true`; inside `shard_map` the result varies over the mesh axes
    # any operand varies over
    half = len(operands) // 2
    out = []
    for new, old in zip(operands[:half], operands[half:]):
        kind = new.manual_axis_type
        varying = kind.varying | old.manual_axis_type.varying
        varying |= pred.manual_axis_type.varying
        out.append(new.update(manual_axis_type=kind.update(varying=varying)))
    return out


def _select_if_batched_batch(args, dims):
    pred, *operands = args
    pred_dim, *operand_dims = dims
    half = len(operands) // 2
    pairs = zip(
        operands[:half], operands[half:], operand_dims[:half], operand_dims[half:]
    )
    if pred_dim is not None:  # a real select, per element
        size = pred.shape[pred_dim]
        pred = jnp.moveaxis(pred, pred_dim, 0)
        out = []
        for new, old, d_new, d_old in pairs:
            new = batching.bdim_at_front(new, d_new, size)
            old = batching.bdim_at_front(old, d_old, size)
            p = pred.reshape(pred.shape + (1,) * (new.ndim - pred.ndim))
            out.append(jnp.where(p, new, old))
        return out, [0] * half
    # Unbatched at this level, but `pred` may still be batched by an enclosing `vmap`
    # (say `vmap(jacfwd(f))`), where it can be false: select again one level down,
    # with this level's batch axis in front of both operands.
    size = next(o.shape[d] for o, d in zip(operands, operand_dims) if d is not None)
    news, olds, out_dims = [], [], []
    for new, old, d_new, d_old in pairs:
        batched = d_new is not None or d_old is not None
        if batched:
            new = batching.bdim_at_front(new, d_new, size)
            old = batching.bdim_at_front(old, d_old, size)
        news.append(new)
        olds.append(old)
        out_dims.append(0 if batched else None)
    return select_if_batched_p.bind(pred, *news, *olds), out_dims


def _select_if_batched_jvp(primals, tangents):
    pred, *operands = primals
    _, *t_operands = tangents
    half = len(operands) // 2
    out = select_if_batched_p.bind(pred, *operands)
    pairs = list(zip(t_operands[:half], t_operands[half:]))
    live = [k for k, (a, b) in enumerate(pairs) if not (_zero(a) and _zero(b))]
    t_out = [_zero_like(o) for o in out]
    if live:
        t_new = [ad.instantiate_zeros(pairs[k][0]) for k in live]
        t_old = [ad.instantiate_zeros(pairs[k][1]) for k in live]
        for k, t in zip(live, select_if_batched_p.bind(pred, *t_new, *t_old)):
            t_out[k] = t
    return out, t_out


def _zero(t):
    return type(t) is ad.Zero


def _zero_like(x):
    """A symbolic zero tangent for the primal `x`."""
    return ad.Zero(jax.typeof(x).to_tangent_aval())


def select_if_batched(pred, on_true, on_false):
    """Leafwise `where(pred, on_true, on_false)` for a scalar `pred` that is known to
    be true unless it is batched.

    Inside a loop that runs while any element is active, an element's `active` flag
    is always true when there is no batch; only under `vmap` can some elements have
    stopped. So the select costs nothing unbatched and is a real select under vmap.
    """
    new, treedef = jtu.tree_flatten(on_true)
    old = treedef.flatten_up_to(on_false)
    if not new:
        return on_true
    out = select_if_batched_p.bind(jnp.asarray(pred, bool), *new, *old)
    return jtu.tree_unflatten(treedef, out)


any_across_batch_p.def_impl(_any_across_batch_impl)
any_across_batch_p.def_abstract_eval(_any_across_batch_abstract_eval)
ad.primitive_jvps[any_across_batch_p] = _any_across_batch_jvp
register_batching(any_across_batch_p, _any_across_batch_batch)
mlir.register_lowering(
    any_across_batch_p,
    mlir.lower_fun(_any_across_batch_impl, multiple_results=False),
)

select_if_batched_p.def_impl(_select_if_batched_impl)
select_if_batched_p.def_abstract_eval(_select_if_batched_abstract_eval)
ad.primitive_jvps[select_if_batched_p] = _select_if_batched_jvp
register_batching(select_if_batched_p, _select_if_batched_batch)
mlir.register_lowering(
    select_if_batched_p,
    mlir.lower_fun(_select_if_batched_impl, multiple_results=True),
)


def sum_unbatched(ct, axis):
    """The cotangent of an operand without a batch axis (`axis` None), from a
    batched one: the sum over the batch (`float0` stays zero)."""
    if axis == 0:
        return ct
    if ct.dtype == jax.dtypes.float0:
        return np.zeros(ct.shape[1:], jax.dtypes.float0)
    return jnp.sum(ct, axis=0)
