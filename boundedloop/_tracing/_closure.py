"""Closure conversion: a traced function as a module whose closed-over arrays are
leaves, so that the loop's custom JVP sees (and differentiates) them. Unlike
`eqx.filter_closure_convert`, it works inside `jax.shard_map`: see
`docs/architecture.md`, "Inside shard_map".
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.extend.linear_util as lu
import jax.extend.source_info_util as source_info_util
import jax.tree_util as jtu

from .._runtime._shard_map import vary, vary_as_stepped, vary_everywhere, varying_axes


class ClosureConverted(eqx.Module):
    """`fn`, traced once against example arguments; its closed-over arrays are the
    field `consts`. Call it with arguments shaped like the examples."""

    jaxpr: jax.extend.core.Jaxpr = eqx.field(static=True)
    consts: list
    in_treedef: Any = eqx.field(static=True)
    in_static: Any = eqx.field(static=True)
    out_treedef: Any = eqx.field(static=True)
    out_static: Any = eqx.field(static=True)

    def __call__(self, *args):
        dynamic, static = eqx.partition(vary_everywhere(args), eqx.is_array)
        leaves, treedef = jtu.tree_flatten(dynamic)
        if treedef != self.in_treedef or not _same_static(static, self.in_static):
            raise ValueError(
                "boundedloop internal error: a closure-converted function was "
                "called with arguments of another structure; please report it."
            )
        out = _replay(self.jaxpr, self.consts, leaves)
        return eqx.combine(jtu.tree_unflatten(self.out_treedef, out), self.out_static)

    def out_shapes(self):
        """The output as `jax.ShapeDtypeStruct`s (static leaves as they are), read
        off the traced jaxpr."""
        shapes = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
            for v in self.jaxpr.outvars
        ]
        return eqx.combine(
            jtu.tree_unflatten(self.out_treedef, shapes), self.out_static
        )


def _replay(jaxpr, consts, args):
    """`jax.core.eval_jaxpr` (source locations and `jax.named_scope`s included),
    except that the casts to varying which tracing put in (`pvary`, inside
    `shard_map`) leave values that vary already as they are. The loop passes
    closed-over arrays in already varying, once, outside its loops; casting them
    inside would make their cotangents be summed across devices inside the reverse
    loop, whose trip count differs between devices."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    # only inside `shard_map` can a value vary more than when it was traced
    in_shard_map = bool(jax.sharding.get_abstract_mesh().manual_axes)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        # as `eval_jaxpr` does: keep the equation's source location and name stack
        # (`jax.named_scope` in the body), under the name stack of the replay
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        context = source_info_util.user_context(
            eqn.source_info.traceback, name_stack=name_stack
        )
        with context, eqn.ctx.manager:
            if eqn.primitive.name == "pvary":
                out = [vary(x, eqn.params["axes"]) for x in invals]
                out = out if eqn.primitive.multiple_results else out[0]
            else:
                params = eqn.params
                if in_shard_map and _more_varying(eqn.invars, invals):
                    params, invals = _retyped_equation(eqn.primitive, params, invals)
                params = eqn.primitive.get_bind_params(params)
                out = eqn.primitive.bind(*invals, **params)
        outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _more_varying(invars, invals) -> bool:
    """Whether a value in `invals` varies over mesh axes its traced variable did not."""
    return any(
        varying_axes(x) - varying_axes(v.aval)
        for v, x in zip(invars, invals)
        if hasattr(v.aval, "manual_axis_type")
    )


def _retyped_equation(primitive, params, invals):
    """An equation's parameters and operands, for operands that vary over more mesh
    axes than when it was traced. Tracing casts the operands of an operation on
    values of different axes to vary alike, and the loop's varying inputs can make
    values differ that were alike then (an array the body closes over, added to
    one the body makes): they are cast alike again here. A higher-order primitive's
    jaxprs are traced again for the new types (`RETYPE`)."""
    retype = RETYPE.get(primitive.name)
    if retype is not None:
        return retype(params, invals)
    arrays = [x for x in invals if isinstance(x, jax.Array)]
    axes = frozenset().union(*map(varying_axes, arrays))
    return params, [vary(x, axes) if isinstance(x, jax.Array) else x for x in invals]


def _carry_fixed_point(retype, invals, carry: slice):
    """`retype(avals) -> (params, carry_out_avals)` for the operands `invals`, with
    the carry operands cast to vary wherever the step makes them vary (as
    `lax.while_loop` and `lax.scan` do when traced)."""
    invals = list(invals)

    def step(carry_vals):
        operands = list(invals)
        operands[carry] = carry_vals
        params, out = retype([jax.typeof(x) for x in operands])
        return out, params

    invals[carry], params = vary_as_stepped(invals[carry], step)
    return params, invals


def _retyped(jaxpr, consts, avals, out_axes=None):
    """`jaxpr` traced again through `_replay` for arguments of types `avals`; each
    output cast to vary over `out_axes`' entry for it, if given."""

    def replay(*args):
        out = _replay(jaxpr, consts, args)
        return out if out_axes is None else list(map(vary, out, out_axes))

    return jax.make_jaxpr(replay)(*avals)


# Each rule traces a higher-order primitive's jaxprs again through `_replay` for the
# operands `invals`' types (why: `docs/architecture.md`, "Inside shard_map"), and
# returns the parameters and the operands (a loop's carry cast to vary where its
# step now makes it vary).


def _retyped_custom_jvp(params, invals):
    avals = [jax.typeof(x) for x in invals]
    closed = params["call_jaxpr"]
    call_jaxpr = _retyped(closed.jaxpr, closed.consts, avals)
    jvp_jaxpr_fun, num_consts = params["jvp_jaxpr_fun"], params["num_consts"]

    def jvp_jaxpr(*zeros):
        jaxpr, consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
        primals = avals[num_consts:]
        tangents = [a.to_tangent_aval() for a, z in zip(primals, zeros) if not z]
        closed = _retyped(jaxpr, consts, [*primals, *tangents])
        return closed.jaxpr, closed.consts, out_zeros

    jvp_fun = lu.wrap_init(jvp_jaxpr, debug_info=jvp_jaxpr_fun.debug_info)
    params = {**params, "call_jaxpr": call_jaxpr, "jvp_jaxpr_fun": jvp_fun}
    return params, invals


def _retyped_scan(params, invals):
    closed = params["jaxpr"]
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    fixed = n_consts + n_carry

    def retype(avals):
        avals = avals[:fixed] + [a.update(shape=a.shape[1:]) for a in avals[fixed:]]
        jaxpr = _retyped(closed.jaxpr, closed.consts, avals)
        return {**params, "jaxpr": jaxpr}, jaxpr.out_avals[:n_carry]

    return _carry_fixed_point(retype, invals, slice(n_consts, fixed))


def _retyped_while(params, invals):
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]

    def retype(avals):
        carry = avals[n_cond + n_body :]
        body_jaxpr = _retyped(
            body.jaxpr, body.consts, avals[n_cond : n_cond + n_body] + carry
        )
        cond_jaxpr = _retyped(cond.jaxpr, cond.consts, avals[:n_cond] + carry)
        new = {**params, "cond_jaxpr": cond_jaxpr, "body_jaxpr": body_jaxpr}
        return new, body_jaxpr.out_avals

    return _carry_fixed_point(retype, invals, slice(n_cond + n_body, None))


def _retyped_cond(params, invals):
    avals = [jax.typeof(x) for x in invals[1:]]
    branches = [_retyped(b.jaxpr, b.consts, avals) for b in params["branches"]]
    # the branches' outputs must vary alike, as tracing makes them
    outs = [[varying_axes(a) for a in b.out_avals] for b in branches]
    axes = [frozenset().union(*out) for out in zip(*outs)]
    if any(out != axes for out in outs):  # trace again, casting where they differ
        branches = [
            _retyped(b.jaxpr, b.consts, avals, axes) for b in params["branches"]
        ]
    return {**params, "branches": tuple(branches)}, invals


def _retyped_remat(params, invals):
    closed = _retyped(params["jaxpr"], (), [jax.typeof(x) for x in invals])
    if closed.consts:  # (a replay makes no new constants)
        raise AssertionError("boundedloop internal error: constants in a remat")
    return {**params, "jaxpr": closed.jaxpr}, invals


RETYPE = {
    "custom_jvp_call": _retyped_custom_jvp,
    "scan": _retyped_scan,
    "while": _retyped_while,
    "cond": _retyped_cond,
    "remat2": _retyped_remat,
}


def _same_static(a, b) -> bool:
    return jtu.tree_structure(a) == jtu.tree_structure(b) and all(
        x is y or x == y for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    )


def closure_convert(fn: Callable, *args) -> ClosureConverted:
    """Trace `fn(*args)` and return it as a `ClosureConverted`.

    **Arguments:**

    - `fn`: any function of pytrees; array leaves of its arguments are traced, other
        leaves are static.
    - `args`: example arguments.

    **Returns:**

    A `ClosureConverted` that computes `fn`.
    """
    args = vary_everywhere(args)
    closed, out_struct, out_static = eqx.filter_make_jaxpr(fn)(*args)
    dynamic, static = eqx.partition(args, eqx.is_array)
    return ClosureConverted(
        jaxpr=closed.jaxpr,
        consts=list(closed.consts),
        in_treedef=jtu.tree_structure(dynamic),
        in_static=static,
        out_treedef=jtu.tree_structure(out_struct),
        out_static=out_static,
    )


def with_inputs_added(fn: ClosureConverted, at: int, *args) -> ClosureConverted:
    """`fn`, whose jaxpr gained inputs while it was traced (`_jax_private.new_input`
    puts them after its arguments), as a function of `*args`: the flattened array
    leaves of `args` are those of `fn`'s arguments with the gained inputs, in
    order, inserted at position `at`."""
    dynamic, static = eqx.partition(vary_everywhere(args), eqx.is_array)
    treedef = jtu.tree_structure(dynamic)
    invars = list(fn.jaxpr.invars)
    old = fn.in_treedef.num_leaves
    if treedef.num_leaves != len(invars):
        raise AssertionError("boundedloop internal error: inputs gained in tracing")
    invars = invars[:at] + invars[old:] + invars[at:old]
    debug = fn.jaxpr.debug_info
    if debug.arg_names is not None:
        names = debug.arg_names
        added = tuple(f"dummy{i}" for i in range(len(invars) - old))
        debug = debug._replace(arg_names=names[:at] + added + names[at:])
    return ClosureConverted(
        jaxpr=fn.jaxpr.replace(invars=invars, debug_info=debug),
        consts=fn.consts,
        in_treedef=treedef,
        in_static=static,
        out_treedef=fn.out_treedef,
        out_static=fn.out_static,
    )
