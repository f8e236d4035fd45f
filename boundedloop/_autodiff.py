"""The loop under autodiff: a custom JVP, and which sweep runs under which transform.

Undifferentiated, the loop is `plain_sweep` and does no checkpoint work. Its JVP
rule binds one primitive (`_loop_jvp`) that returns the outputs and their tangents,
and that JAX evaluates or splits as the transform requires:

- forward mode (`jax.jvp`, `jax.jacfwd`) evaluates it: the JVP of `plain_sweep`, one
  sweep with each step's value and tangent together (`_LoopJVP.one_pass`);
- `jax.linearize`, and so reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`),
  partially evaluates it: `checkpointed_sweep` now, and the tangent as one linear
  primitive (`_tangent.loop_tangent`) over the tape (`_LoopJVP.two_pass`). Applied,
  that primitive is the JVP of `replay_sweep` (the same steps again from the initial
  carry); transposed, it is `reverse_sweep` over the checkpoints;
- forward over reverse (`jax.hessian`) differentiates the checkpointed and reverse
  sweeps in forward mode, which `lax.while_loop` supports.

Tangents and cotangents exist for the initial carry and for every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves), and
only for those that are actually perturbed: JAX passes symbolic zeros for the rest, so
a weight matrix nobody differentiates costs nothing. Integer and boolean leaves get
none. Arrays the predicate closes over get none (it is piecewise constant).
"""

import dataclasses

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._checks import check_stopped
from ._forward_sweeps import checkpointed_sweep, plain_sweep
from ._loop_jvp import loop_jvp, Passes, Spec
from ._perturbation import has_tangent, Perturbed, perturbed_leaves
from ._reverse_sweep import reverse_sweep
from ._shard_map import vary_everywhere
from ._step import ReversibleStep
from ._tangent import forward_only, loop_tangent, replay_tangent
from ._trace import Layout, TracedLoop


class LoopConfig(eqx.Module):
    """The static description of one loop."""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    # the loop always takes `max_steps` steps (a scan): plan checkpoints offline
    known_length: bool = eqx.field(static=True, default=False)
    # the loop's name for `bl.max_steps_check`'s error, or None: no check
    stop_check: str | None = eqx.field(static=True, default=None)


@eqx.filter_custom_jvp
def checkpointed_loop(loop: TracedLoop, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. Returns the final `(x, bufs)`."""
    # inside `shard_map`, everything varies across devices from here on
    return plain_sweep(vary_everywhere(loop), config)


def _pick(mask, tree):
    """The leaves of `tree` (shaped like `mask`, `None` allowed) where `mask` is true."""
    treedef = jtu.tree_structure(mask)
    return [v for m, v in zip(jtu.tree_leaves(mask), treedef.flatten_up_to(tree)) if m]


class _Residuals:
    """The arrays the loop's tangent depends on nonlinearly: the body, the initial
    carry and the tape, flattened for the primitive and rebuilt inside its rules."""

    def __init__(self, loop: TracedLoop, tape):
        arrays, self.static = eqx.partition((loop.body, loop.init, tape), eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(arrays)

    def unpack(self, leaves):
        """`(body, init, tape)` from the primitive's residual operands."""
        arrays = jtu.tree_unflatten(self.treedef, leaves)
        return vary_everywhere(eqx.combine(arrays, self.static))


class _LoopJVP:
    """The loop's JVP in both forms `_loop_jvp.Passes` asks for, on flat lists: the
    loop's arrays and the tangents of the `wanted` ones in, the final `(x, bufs)` and
    the tangents of its `perturbed` leaves out."""

    def __init__(self, loop: TracedLoop, config: LoopConfig, wanted, perturbed):
        arrays, self.static = eqx.partition(loop, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(arrays)
        self.config, self.wanted = config, wanted
        self.out_perturbed = list(perturbed.x + perturbed.bufs)
        self.perturbed = perturbed
        outs = jtu.tree_leaves((loop.init, loop.bufs))
        self.out_def = jtu.tree_structure((loop.init, loop.bufs))
        t_avals = [jax.typeof(o) for o, p in zip(outs, self.out_perturbed) if p]
        self.out_avals = tuple(jax.typeof(o) for o in outs) + tuple(t_avals)

    def _loop(self, leaves) -> TracedLoop:
        arrays = jtu.tree_unflatten(self.treedef, leaves)
        return vary_everywhere(eqx.combine(arrays, self.static))

    def primal(self, leaves) -> list:
        """The loop itself, as `checkpointed_loop` runs it: `plain_sweep`."""
        return jtu.tree_leaves(plain_sweep(self._loop(leaves), self.config))

    def tangent_inputs(self) -> tuple[int, ...]:
        """Per tangent operand, the position of its primal among `leaves`."""
        positions = jtu.tree_unflatten(self.treedef, range(len(self.leaves)))
        loop = eqx.combine(positions, self.static)
        return tuple(_pick(self.wanted, loop.differentiable()))

    def tangent_outputs(self) -> tuple[int, ...]:
        """Per output tangent, the position of its output."""
        return tuple(k for k, p in enumerate(self.out_perturbed) if p)

    def one_pass(self, leaves, t_in) -> list:
        """The JVP of `plain_sweep`: one sweep, each step's primal and tangent
        together."""
        loop = self._loop(leaves)
        if loop.checked_body is not None:  # `bl.buffer_checks`: a debugging mode
            return self.two_pass(leaves, t_in)
        varying, fixed = eqx.partition(loop.differentiable(), self.wanted)
        t_varying = jtu.tree_unflatten(jtu.tree_structure(varying), t_in)

        # `bl.max_steps_check`'s error is attached below, to the tangents as well
        unchecked = dataclasses.replace(self.config, stop_check=None)

        def run(varying):
            body, init, bufs = vary_everywhere(eqx.combine(varying, fixed))
            plain = TracedLoop(body, loop.cond, None, init, bufs, loop.layout)
            return plain_sweep(plain, unchecked)

        (x, bufs), t_out = jax.jvp(run, (varying,), (t_varying,))
        t_out = [t for t, f in zip(jtu.tree_leaves(t_out), self.out_perturbed) if f]
        if self.config.stop_check is not None:
            name, max_steps = self.config.stop_check, self.config.max_steps
            x, bufs, t_out = check_stopped(loop, (x, bufs, t_out), name, max_steps)
        return jtu.tree_leaves((x, bufs)) + t_out

    def two_pass(self, leaves, t_in) -> list:
        """`checkpointed_sweep`, and the tangent as `loop_tangent` over its tape:
        evaluated, the JVP of `replay_sweep`; transposed, `reverse_sweep`."""
        out, tangent = self.checkpointed(leaves)
        return out + tangent(t_in)

    def checkpointed(self, leaves):
        """`two_pass` in two stages: `checkpointed_sweep` now, returning the outputs
        and the tangent stage, `t_in -> t_out`, which reads only its tape."""
        loop, config, wanted = self._loop(leaves), self.config, self.wanted
        out, tape = checkpointed_sweep(loop, config)
        residuals = _Residuals(loop, tape)
        out_perturbed, out_def = self.out_perturbed, self.out_def

        def jvp_fn(res_leaves, t_in):
            body, x, tape = residuals.unpack(res_leaves)
            t_out = replay_tangent((body, x, tape), wanted, t_in, config.layout)
            return [t for t, f in zip(jtu.tree_leaves(t_out), out_perturbed) if f]

        def vjp_fn(res_leaves, cts):
            body, _, tape = residuals.unpack(res_leaves)
            cts = iter(cts)
            ct_x, ct_bufs = jtu.tree_unflatten(
                out_def, [next(cts) if f else None for f in out_perturbed]
            )
            step = ReversibleStep(body, config.layout, wanted[0], self.perturbed)
            ct_in = reverse_sweep(step, tape, ct_x, ct_bufs, config)
            return _pick(wanted, forward_only(ct_in))

        def tangent(t_in):
            t_out = loop_tangent(
                residuals.leaves,
                t_in,
                jvp_fn=jvp_fn,
                vjp_fn=vjp_fn,
                out_avals=self.out_avals[len(jtu.tree_leaves(out)) :],
                loop_effects=frozenset(loop.body.jaxpr.effects),
            )
            return list(t_out)

        return jtu.tree_leaves(out), tangent


@checkpointed_loop.def_jvp
def _loop_jvp(primals, tangents):
    loop, config = primals
    loop = vary_everywhere(loop)
    # which of (body, init, bufs)'s leaves have a tangent, and those tangents
    t_diff = tangents[0].differentiable()
    wanted = jtu.tree_map(lambda _, t: t is not None, loop.differentiable(), t_diff)
    t_in = jtu.tree_leaves(t_diff)
    if not t_in:  # only the predicate's arrays are perturbed
        out = plain_sweep(loop, config)
        return out, jtu.tree_map(lambda _: None, out)
    t_body, t_init, t_bufs = t_diff
    perturbed = perturbed_leaves(
        loop.body,
        has_tangent(t_body),
        Perturbed(tuple(has_tangent(t_init)), tuple(has_tangent(t_bufs))),
        config.layout,
    )
    # only perturbed leaves get tangents (see `_perturbation`)
    jvp = _LoopJVP(loop, config, wanted, perturbed)
    spec = Spec(
        Passes(jvp.one_pass, jvp.two_pass, jvp.checkpointed, jvp.primal),
        n_primals=len(jvp.leaves),
        n_outputs=jvp.out_def.num_leaves,
        out_avals=jvp.out_avals,
        effects=frozenset(loop.body.jaxpr.effects),
        tangent_inputs=jvp.tangent_inputs(),
        tangent_outputs=jvp.tangent_outputs(),
    )
    results = loop_jvp(jvp.leaves, t_in, spec)
    out = jtu.tree_unflatten(jvp.out_def, results[: jvp.out_def.num_leaves])
    t_out = iter(results[jvp.out_def.num_leaves :])
    return out, jtu.tree_unflatten(
        jvp.out_def, [next(t_out) if f else None for f in jvp.out_perturbed]
    )
