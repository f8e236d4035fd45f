"""The AD wrapper: a custom JVP whose tangent is transposed by the reverse sweep.

Undifferentiated, the loop is `plain_sweep` and does no checkpoint work. Its JVP
rule runs `checkpointed_sweep` for the primal and returns the tangent as one linear
primitive (`_linear.loop_tangent`) over the tape:

- forward mode (`jax.jvp`, `jax.jacfwd`, `jax.linearize`) evaluates the primitive:
  the JVP of `replay_sweep`, which takes the same steps again from the initial carry;
- reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`) linearizes, so the tangent stays
  symbolic, and transposes the primitive: `reverse_sweep` over the checkpoints;
- forward over reverse (`jax.hessian`) differentiates the checkpointed and reverse
  sweeps in forward mode, which `lax.while_loop` supports.

Tangents and cotangents exist for the initial carry and for every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves), and
only for those that are actually perturbed: JAX passes symbolic zeros for the rest, so
a weight matrix nobody differentiates costs nothing. Integer and boolean leaves get
none. Arrays the predicate closes over get none (it is piecewise constant).
"""

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._carry import Layout, TracedLoop
from ._forward import (
    checkpointed_sweep,
    plain_sweep,
    planning_horizon,
    replay_sweep,
)
from ._linear import forward_only, loop_tangent
from ._reverse import reverse_sweep
from ._step import advance, float_part, is_float, make_step_vjp
from ._vma import vary_everywhere


class LoopConfig(eqx.Module):
    """The static description of one loop."""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    # the loop always takes `max_steps` steps (a scan): plan checkpoints offline
    known_length: bool = eqx.field(static=True, default=False)


def _loop(diff, nondiff, config):
    # inside `shard_map`, everything varies across devices from here on (see `_vma`)
    (body, x, bufs), (cond, checked) = vary_everywhere((diff, nondiff))
    return TracedLoop(body, cond, checked, x, bufs, config.layout)


@eqx.filter_custom_jvp
def checkpointed_loop(diff, nondiff, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. `diff = (body, x, bufs)`: the
    closure-converted body and the initial arrays; `nondiff = (cond, checked_body)`.
    Returns the final `(x, bufs)`."""
    loop = _loop(diff, nondiff, config)
    return plain_sweep(loop, config.max_steps, loop.checked_body is not None)


def _pick(mask, tree):
    """The leaves of `tree` (shaped like `mask`, `None` allowed) where `mask` is true."""
    treedef = jtu.tree_structure(mask)
    return [v for m, v in zip(jtu.tree_leaves(mask), treedef.flatten_up_to(tree)) if m]


@checkpointed_loop.def_jvp
def _loop_jvp(primals, tangents):
    diff, nondiff, config = primals
    loop = _loop(diff, nondiff, config)
    checked = loop.checked_body is not None
    # which of (body, x, bufs)'s leaves have a tangent, and those tangents
    wanted = jtu.tree_map(lambda _, t: t is not None, diff, tangents[0])
    t_in = jtu.tree_leaves(tangents[0])
    if not t_in:  # only the predicate's arrays are perturbed
        out = plain_sweep(loop, config.max_steps, checked)
        return out, jtu.tree_map(lambda _: None, out)
    out, tape = checkpointed_sweep(
        loop, config.max_steps, config.checkpoints, checked, config.known_length
    )
    out_floating = [is_float(o) for o in jtu.tree_leaves(out)]
    out_def = jtu.tree_structure(out)

    residuals, static = eqx.partition((diff[0], diff[1], tape), eqx.is_array)
    res_leaves, res_def = jtu.tree_flatten(residuals)

    def unpack(res_leaves):
        return vary_everywhere(
            eqx.combine(jtu.tree_unflatten(res_def, res_leaves), static)
        )

    def jvp_fn(res_leaves, t_in):
        body, x, tape = unpack(res_leaves)
        # the final buffers stand in for the initial ones: every value the loop
        # reads is written before and never changes (each location is written once)
        varying, fixed = eqx.partition((body, x, tape.bufs), wanted)
        t_varying = jtu.tree_unflatten(jtu.tree_structure(varying), t_in)

        def replay(varying):
            body, x, bufs = vary_everywhere(eqx.combine(varying, fixed))
            return replay_sweep(body, config.layout, x, bufs, tape.trips, tape.length)

        _, t_out = jax.jvp(replay, (varying,), (t_varying,))
        return [t for t, f in zip(jtu.tree_leaves(t_out), out_floating) if f]

    def vjp_fn(res_leaves, cts):
        body, x, tape = unpack(res_leaves)
        cts = iter(cts)
        ct_x, ct_bufs = jtu.tree_unflatten(
            out_def, [next(cts) if f else None for f in out_floating]
        )
        step_vjp, apply_updates, ct_body_zero = make_step_vjp(
            body, config.layout, wanted[0]
        )
        max_steps = config.max_steps
        ct_in = reverse_sweep(
            lambda x, bufs, active: advance(body, config.layout, x, bufs, active)[0],
            step_vjp,
            apply_updates,
            tape,
            float_part(ct_x),
            float_part(ct_bufs),
            ct_body_zero,
            config.checkpoints,
            planning_horizon(max_steps),
            every_step_stored=max_steps is not None and config.checkpoints >= max_steps,
        )
        ct_body, ct_x, ct_bufs = forward_only(ct_in)
        return _pick(wanted, (ct_body, ct_x, ct_bufs))

    t_out = loop_tangent(
        res_leaves,
        t_in,
        jvp_fn=jvp_fn,
        vjp_fn=vjp_fn,
        out_avals=[jax.typeof(o) for o in jtu.tree_leaves(out) if is_float(o)],
        loop_effects=frozenset(loop.body.jaxpr.effects),
    )
    t_out = iter(t_out)
    return out, jtu.tree_unflatten(
        out_def, [next(t_out) if f else None for f in out_floating]
    )
