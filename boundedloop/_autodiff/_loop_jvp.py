"""The loop under autodiff: `differentiable_loop`, the loop behind a custom JVP (see
the `_autodiff` package for where each transform lands), and its JVP in the forms
`_jvp_primitive.Passes` asks for (`LoopJVP`): one pass (forward mode), and two (the
checkpointed sweep now, the tangent as a `loop_tangent` over its tape, which reverse
mode transposes into the reverse sweep). The passes that make these differentiable
once more in reverse mode are `_second_order`'s.
"""

import dataclasses

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._runtime._checks import check_stopped
from .._runtime._leaves import fill, pick
from .._runtime._shard_map import vary_everywhere
from .._sweeps._forward_sweeps import plain_sweep, replay_sweep
from .._sweeps._reverse_sweep import reverse_sweep
from .._sweeps._step import ReversibleStep
from .._tracing._perturbation import (
    has_tangent,
    perturbed_leaves,
    seeded_tangents,
)
from .._tracing._trace import LoopConfig, Perturbed, TracedLoop
from ._jvp_primitive import custom_jvp_spec, loop_jvp, Passes, Primal, Spec
from ._loop_parts import LoopParts, Residuals
from ._second_order import ReverseOverAnything
from ._tangent_primitive import loop_tangent


def replay_tangent(primals, wanted, perturbed, t_in, layout):
    """The loop's forward-mode tangent: the JVP of `replay_sweep`.

    **Arguments:**

    - `primals`: `(body, x, tape)`, the traced body, the initial carry and the
        checkpointed sweep's `CheckpointStore`.
    - `wanted`: bools shaped like `(body, x, bufs)`: which leaves have tangents.
    - `perturbed`: the carry's perturbed leaves (`perturbed_leaves`).
    - `t_in`: those tangents, flat.
    - `layout`: the carry's `Layout`.

    **Returns:**

    The tangent of the final `(x, bufs)`.
    """
    body, x, tape = primals
    # the final buffers stand in for the initial ones: every value the loop reads
    # is written before and never changes (each location is written once)
    varying, fixed, t_varying = seeded_tangents(
        (body, x, tape.bufs), wanted, perturbed, t_in
    )

    def replay(varying):
        body, x, bufs = vary_everywhere(eqx.combine(varying, fixed))
        return replay_sweep(body, layout, x, bufs, tape)

    return jax.jvp(replay, (varying,), (t_varying,))[1]


class LoopJVP:
    """The loop's JVP in both forms `_jvp_primitive.Passes` asks for, on flat lists: the
    loop's arrays and the tangents of the `wanted` ones in, the final `(x, bufs)` and
    the tangents of its `perturbed` leaves out. `second` holds the passes that make
    both differentiable in reverse mode once more."""

    def __init__(
        self, loop: TracedLoop, config: LoopConfig, wanted, perturbed, loop_fn
    ):
        self.parts = LoopParts.of(loop, config, wanted, perturbed, loop_fn)
        self.second = ReverseOverAnything(self.parts)
        outs = jtu.tree_leaves((loop.init, loop.bufs))
        out_perturbed = self.parts.out_perturbed
        t_avals = [jax.typeof(o) for o, p in zip(outs, out_perturbed) if p]
        self.out_avals = tuple(jax.typeof(o) for o in outs) + tuple(t_avals)

    def primal(self, leaves) -> list:
        """The loop itself, as `differentiable_loop` runs it: `plain_sweep`."""
        return jtu.tree_leaves(plain_sweep(self.parts.loop(leaves), self.parts.config))

    def tangent_inputs(self) -> tuple[int, ...]:
        """Per tangent operand, the position of its primal among `leaves`."""
        loop = self.parts.positions()
        return tuple(pick(self.parts.wanted, loop.differentiable()))

    def tangent_outputs(self) -> tuple[int, ...]:
        """Per output tangent, the position of its output."""
        return tuple(k for k, p in enumerate(self.parts.out_perturbed) if p)

    def one_pass(self, leaves, t_in) -> list:
        """The JVP of `plain_sweep`: one sweep, each step's primal and tangent
        together."""
        loop = self.parts.loop(leaves)
        varying, fixed, t_varying = seeded_tangents(
            loop.differentiable(), self.parts.wanted, self.parts.perturbed, t_in
        )

        # `bl.max_steps_check`'s error is attached below, to the tangents as well;
        # the buffer checks' to the primal outputs, in the sweep
        unchecked = dataclasses.replace(self.parts.config, stop_check=None)

        def run(varying):
            body, init, bufs = vary_everywhere(eqx.combine(varying, fixed))
            plain = TracedLoop(body, loop.cond, init, bufs, loop.layout)
            return plain_sweep(plain, unchecked)

        (x, bufs), t_out = jax.jvp(run, (varying,), (t_varying,))
        t_out = [
            t for t, f in zip(jtu.tree_leaves(t_out), self.parts.out_perturbed) if f
        ]
        if self.parts.config.stop_check is not None:
            name, max_steps = self.parts.config.stop_check, self.parts.config.max_steps
            x, bufs, t_out = check_stopped(loop, (x, bufs, t_out), name, max_steps)
        return jtu.tree_leaves((x, bufs)) + t_out

    def two_pass(self, leaves, t_in) -> list:
        """`checkpointed_sweep`, and the tangent as `loop_tangent` over its tape:
        evaluated, the JVP of `replay_sweep`; transposed, `reverse_sweep`."""
        out, tangent = self.staged(leaves)
        return out + tangent(t_in)

    def staged(self, leaves):
        """`two_pass` in two stages: `checkpointed_sweep` now, returning the outputs
        and the tangent stage, `t_in -> t_out`, which reads only its tape."""
        config, wanted = self.parts.config, self.parts.wanted
        loop = self.parts.loop(leaves)
        out, tape = self.second.taped_sweep(leaves)
        residuals = Residuals(loop, tape)
        out_perturbed, out_def = self.parts.out_perturbed, self.parts.out_def

        def jvp_fn(res_leaves, t_in):
            body, _, x, tape = residuals.unpack(res_leaves)
            t_out = replay_tangent(
                (body, x, tape), wanted, self.parts.perturbed, t_in, self.parts.layout
            )
            return [t for t, f in zip(jtu.tree_leaves(t_out), out_perturbed) if f]

        def reverse(operands):
            res_leaves, cts = (
                operands[: len(residuals.leaves)],
                operands[len(residuals.leaves) :],
            )
            body, _, _, tape = residuals.unpack(res_leaves)
            ct_x, ct_bufs = jtu.tree_unflatten(out_def, fill(out_perturbed, cts))
            step = ReversibleStep(
                body, self.parts.layout, wanted[0], self.parts.perturbed
            )
            ct_in = reverse_sweep(step, tape, ct_x, ct_bufs, config)
            return pick(wanted, ct_in)

        def vjp_fn(res_leaves, cts):
            return self.second.vjp_with_hvp(residuals, reverse)(*res_leaves, *cts)

        def hvp_fn(res_leaves, t_in, cts):
            return self.second.residual_hvp(residuals, res_leaves, cts, t_in)[1]

        def tangent(t_in):
            t_out = loop_tangent(
                residuals.leaves,
                t_in,
                jvp_fn=jvp_fn,
                vjp_fn=vjp_fn,
                hvp_fn=hvp_fn,
                out_avals=self.out_avals[len(jtu.tree_leaves(out)) :],
                loop_effects=frozenset(loop.body.jaxpr.effects),
            )
            return list(t_out)

        return jtu.tree_leaves(out), tangent

    def spec(self) -> Spec:
        """The `loop_jvp` primitive's parameter for this loop."""
        n_outputs = self.parts.out_def.num_leaves
        return custom_jvp_spec(
            Passes(
                self.one_pass, self.two_pass, self.staged, self.second.reverse_of_jvp
            ),
            Primal(self.primal, self.tangent_inputs(), self.tangent_outputs()),
            n_primals=len(self.parts.leaves),
            out_avals=self.out_avals[:n_outputs],
            t_avals=self.out_avals[n_outputs:],
            effects=self.parts.effects,
        )


@eqx.filter_custom_jvp
def differentiable_loop(loop: TracedLoop, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. Returns the final `(x, bufs)`."""
    # inside `shard_map`, everything varies across devices from here on
    return plain_sweep(vary_everywhere(loop), config)


@differentiable_loop.def_jvp
def _differentiable_loop_jvp(primals, tangents):
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
        loop.layout,
    )
    # only perturbed leaves get tangents (see `_perturbation`)
    jvp = LoopJVP(loop, config, wanted, perturbed, differentiable_loop)
    parts = jvp.parts
    results = loop_jvp(parts.leaves, t_in, jvp.spec())
    out = jtu.tree_unflatten(parts.out_def, results[: parts.out_def.num_leaves])
    t_out = results[parts.out_def.num_leaves :]
    return out, jtu.tree_unflatten(parts.out_def, fill(parts.out_perturbed, t_out))
