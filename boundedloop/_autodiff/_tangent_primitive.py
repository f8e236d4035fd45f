"""The loop's tangent as a linear primitive, `loop_tangent_p`, whose parameters are
Python functions (see `loop_tangent`) and whose transpose is written by hand. Its
rules are named after it and registered together at the end. See
`docs/architecture.md`, "The primitives".
"""

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from .._runtime._batching import sum_unbatched
from .._runtime._jax_private import register_batching
from .._runtime._leaves import fill, jvp_at
from .._runtime._shard_map import sum_over_devices, vary_everywhere
from .._tracing._dtypes import is_inexact


loop_tangent_p = jax.extend.core.Primitive("boundedloop_loop_tangent")
loop_tangent_p.multiple_results = True


class Named:
    """A function as the primitive's parameter: called as itself, printed by its
    name (a jaxpr shows `jvp_fn=LoopJVP.staged.jvp_fn`, not an address), and equal
    only to itself, as the function is."""

    def __init__(self, fn, name: str | None = None):
        self.fn = fn
        qualname = getattr(fn, "__qualname__", "a function")
        self.name = name or qualname.replace("<locals>.", "")

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self) -> str:
        return self.name


def named(fn, name: str | None = None):
    """`fn` as a `Named` parameter (`None` and a `Named` as they are)."""
    return fn if fn is None or isinstance(fn, Named) else Named(fn, name)


def _loop_tangent_impl(*args, n_res, jvp_fn, **_):
    return jvp_fn(list(args[:n_res]), list(args[n_res:]))


def _loop_tangent_abstract_eval(*args, out_avals, loop_effects, **_):
    return list(out_avals), loop_effects


def _loop_tangent_transpose(cts, *args, n_res, vjp_fn, out_avals, **_):
    residuals, linear = args[:n_res], args[n_res:]
    if any(ad.is_undefined_primal(r) for r in residuals):
        raise RuntimeError(
            "boundedloop: the loop's tangent was transposed with respect to its "
            "residuals; this is a bug, please report it."
        )
    cts = [
        jnp.zeros(a.shape, a.dtype) if type(ct) is ad.Zero else ct
        for ct, a in zip(cts, out_avals)
    ]
    # inside `shard_map` the loop's outputs vary over every manual axis (it casts its
    # carry so, `vary_everywhere`); a zero or unvarying cotangent is cast to match
    cts_in = vjp_fn(list(residuals), vary_everywhere(cts))
    assert len(cts_in) == len(linear)
    # inside `shard_map`, an input the same on every device (a weight, say) was
    # used by every device's loop: its cotangent is the sum of theirs
    cts_in = [sum_over_devices(ct, x.aval) for ct, x in zip(cts_in, linear)]
    return [None] * n_res + list(cts_in)


def _loop_tangent_batch(
    args, dims, *, n_res, jvp_fn, vjp_fn, hvp_fn, out_avals, loop_effects
):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [
        a if d is None else batching.bdim_at_front(a, d, size)
        for a, d in zip(args, dims)
    ]
    axes = [None if d is None else 0 for d in dims]
    res_axes, lin_axes = axes[:n_res], axes[n_res:]
    batched_jvp = jax.vmap(jvp_fn, in_axes=(res_axes, lin_axes), out_axes=0)
    per_element_vjp = jax.vmap(vjp_fn, in_axes=(res_axes, 0), out_axes=0)

    def batched_vjp(residuals, cts):
        cts_in = per_element_vjp(residuals, cts)
        # a tangent input without a batch axis gets the sum over the batch
        return [c if a == 0 else jnp.sum(c, axis=0) for c, a in zip(cts_in, lin_axes)]

    batched_hvp = None
    if hvp_fn is not None:
        per_element_hvp = jax.vmap(hvp_fn, in_axes=(res_axes, lin_axes, 0), out_axes=0)

        def batched_hvp(residuals, linear, cts):
            cts_res = per_element_hvp(residuals, linear, cts)
            return [sum_unbatched(c, a) for c, a in zip(cts_res, res_axes)]

    out_avals = tuple(jax.extend.core.unmapped_aval(size, 0, a) for a in out_avals)
    out = loop_tangent_p.bind(
        *args,
        n_res=n_res,
        jvp_fn=named(batched_jvp, f"vmap({jvp_fn!r})"),
        vjp_fn=named(batched_vjp, f"vmap({vjp_fn!r})"),
        hvp_fn=named(batched_hvp, f"vmap({hvp_fn!r})"),
        out_avals=out_avals,
        loop_effects=loop_effects,
    )
    return out, [0] * len(out)


def _loop_tangent_jvp(primals, tangents, **params):
    n_res, jvp_fn, out_avals = params["n_res"], params["jvp_fn"], params["out_avals"]
    out = loop_tangent_p.bind(*primals, **params)
    residuals, linear = list(primals[:n_res]), list(primals[n_res:])
    d_res, d_lin = tangents[:n_res], tangents[n_res:]
    parts = []
    # linear in the tangent inputs: the primitive again, on their tangents
    if not all(type(t) is ad.Zero for t in d_lin):
        d_lin = [ad.instantiate_zeros(t) for t in d_lin]
        parts.append(loop_tangent_p.bind(*residuals, *d_lin, **params))
    # through the residuals: forward over forward, on the floating ones
    floating = [
        is_inexact(r) and type(t) is not ad.Zero for r, t in zip(residuals, d_res)
    ]
    if any(floating):

        def of_floats(float_res, residuals, linear):
            full = fill(floating, float_res, lambda k: residuals[k])
            return jvp_fn(full, linear)

        float_d = [d for f, d in zip(floating, d_res) if f]
        parts.append(
            _residual_tangent(residuals, linear, floating, float_d, of_floats, params)
        )
    if not parts:
        return out, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
    return out, [sum(ts[1:], ts[0]) for ts in zip(*parts)]


def _residual_tangent(residuals, linear, floating, float_d, of_floats, params):
    """The tangent's derivative through its residuals, `d(J(p) t)/dp . dp`, as a
    linear primitive of its own: evaluated, forward over forward; transposed (grad
    of `jvp`), `hvp_fn`, a forward-over-reverse product (the derivative is a block
    of the Hessian of `v . F`, symmetric). Without `hvp_fn`, transposing it raises
    a clear error."""
    n_res = len(residuals)
    hvp_fn = params["hvp_fn"]

    def jvp_fn(operands, d):
        res, lin = operands[:n_res], operands[n_res:]
        float_res = [r for f, r in zip(floating, res) if f]
        return jax.jvp(lambda r: of_floats(r, res, lin), (float_res,), (list(d),))[1]

    def vjp_fn(operands, cts):
        if hvp_fn is None:  # a tangent that is itself a second derivative
            raise RuntimeError(THIRD_ORDER_REVERSE)
        res, lin = operands[:n_res], operands[n_res:]
        ct_res = hvp_fn(list(res), list(lin), list(cts))
        return [c for f, c in zip(floating, ct_res) if f]

    return loop_tangent(
        [*residuals, *linear],
        float_d,
        jvp_fn=jvp_fn,
        vjp_fn=vjp_fn,
        out_avals=params["out_avals"],
        loop_effects=params["loop_effects"],
    )


def loop_tangent(
    residuals, tangents, *, jvp_fn, vjp_fn, out_avals, loop_effects, hvp_fn=None
):
    """Bind the loop's tangent.

    **Arguments:**

    - `residuals`: a list of arrays the tangent depends on nonlinearly.
    - `tangents`: a list of arrays it is linear in.
    - `jvp_fn`: `(residuals, tangents) -> list`, the tangent loop.
    - `vjp_fn`: `(residuals, cts) -> list`, its transpose: one cotangent per tangent.
    - `out_avals`: the avals of `jvp_fn`'s outputs.
    - `loop_effects`: the effects of `jvp_fn` (those of the loop body).
    - `hvp_fn`: optional, `(residuals, tangents, cts) -> cts of residuals`, the
        residuals' cotangent of `cts . jvp_fn(residuals, tangents)`: what makes the
        tangent's derivative through its residuals transposable (grad of a
        linearized loop). `None`: that derivative is forward mode only.

    **Returns:**

    The list `jvp_fn(residuals, tangents)`.
    """
    return loop_tangent_p.bind(
        *residuals,
        *tangents,
        n_res=len(residuals),
        jvp_fn=named(jvp_fn),
        vjp_fn=named(vjp_fn),
        hvp_fn=named(hvp_fn),
        out_avals=tuple(out_avals),
        loop_effects=loop_effects,
    )


THIRD_ORDER_REVERSE = (
    "boundedloop: reverse-mode differentiation of a loop to third order (`jax.grad` "
    "of `jax.grad` of `jax.grad`, `jax.jacrev` of `jax.hessian`, ...) is not "
    "supported: second derivatives work in every mode, but a third reverse pass "
    "would have to transpose a forward-mode loop. Put forward mode outermost for "
    "third derivatives: `jax.jacfwd(jax.hessian(f))`, or `jax.jvp` of "
    "`jax.grad(jax.grad(f))`."
)


loop_tangent_p.def_impl(_loop_tangent_impl)
loop_tangent_p.def_effectful_abstract_eval(_loop_tangent_abstract_eval)
ad.primitive_jvps[loop_tangent_p] = _loop_tangent_jvp
ad.primitive_transposes[loop_tangent_p] = _loop_tangent_transpose
register_batching(loop_tangent_p, _loop_tangent_batch)
mlir.register_lowering(
    loop_tangent_p, mlir.lower_fun(_loop_tangent_impl, multiple_results=True)
)


def outputs_and_tangent(
    fn,
    primals,
    where,
    tangents,
    *,
    with_tangent,
    transpose,
    effects,
    keep_outputs=False,
) -> list:
    """The two-pass form of `fn`, as every hand-transposed pass makes it: `fn` now,
    and its linearization as a `loop_tangent` that JAX evaluates as the JVP of `fn`
    and transposes by `transpose`.

    **Arguments:**

    - `fn`: a list of arrays to a list of arrays.
    - `primals`: its operands.
    - `where`: the positions of the perturbed ones.
    - `tangents`: their tangents.
    - `with_tangent`: per output, whether it gets a tangent (the inexact outputs
        that depend on a perturbed operand).
    - `transpose`: `(res, cts) -> cotangents of primals[where]`, `res` the primals
        (then `fn`'s outputs, with `keep_outputs`), `cts` one per output (`None`
        where it has no tangent); `None`: not transposable, a third reverse pass,
        which raises `THIRD_ORDER_REVERSE`.
    - `effects`: `fn`'s effects.
    - `keep_outputs`: whether `transpose` reads `fn`'s outputs as well.

    **Returns:**

    `fn`'s outputs, then the tangents of those marked `with_tangent`.
    """
    primals = list(primals)
    outs = list(fn(primals))
    n = len(primals)

    def jvp_fn(res, ts):
        t_out = jvp_at(fn, res[:n], where, ts)[1]
        return [t for t, f in zip(t_out, with_tangent) if f]

    def vjp_fn(res, cts):
        if transpose is None:
            raise RuntimeError(THIRD_ORDER_REVERSE)
        return transpose(res, fill(with_tangent, cts))

    t_out = loop_tangent(
        primals + (outs if keep_outputs else []),
        list(tangents),
        jvp_fn=named(jvp_fn),
        vjp_fn=named(vjp_fn),
        out_avals=tuple(
            jax.typeof(o).to_tangent_aval() for o, f in zip(outs, with_tangent) if f
        ),
        loop_effects=effects,
    )
    return outs + list(t_out)
