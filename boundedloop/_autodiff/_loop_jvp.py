"""The loop's first-order JVP (`LoopJVP`) in the forms `_jvp_primitive.Passes` asks
for: one pass (forward mode), and two (the checkpointed sweep now, the tangent as a
`loop_tangent` over its tape). `_second_order.ReverseOverAnything` extends it.
"""

import dataclasses

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._runtime._checks import check_stopped
from .._runtime._leaves import fill, pick
from .._runtime._shard_map import vary_everywhere
from .._sweeps._forward_sweeps import checkpointed_sweep, plain_sweep, replay_sweep
from .._sweeps._reverse_sweep import reverse_sweep
from .._sweeps._step import ReversibleStep
from .._sweeps._tape import planned
from .._tracing._loop import LoopConfig, TracedLoop
from .._tracing._perturbation import seeded_tangents
from ._jvp_primitive import custom_jvp_spec, Passes, Primal, Spec
from ._loop_parts import LoopParts, Residuals
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
    the tangents of its `perturbed` leaves out. First order: its two-pass form's
    sweeps and transpose are differentiable in forward mode only; the hooks
    `taped_sweep`, `transposable` and `tangent_hvp` are where
    `_second_order.ReverseOverAnything` makes them transposable once more."""

    def __init__(
        self, loop: TracedLoop, config: LoopConfig, wanted, perturbed, loop_fn
    ):
        # with a `memory` budget: its checkpoints and taped steps, for every sweep
        step = ReversibleStep(loop.body, loop.layout, wanted[0], perturbed)
        config = planned(config, step, loop.init, loop.bufs)
        self.parts = LoopParts.of(loop, config, wanted, perturbed, loop_fn)
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

    def forward_sweep(self, leaves):
        """`checkpointed_sweep` of the loop with `leaves` for its arrays, taping
        the steps `config.tape_steps` asks for."""
        parts = self.parts
        loop = parts.loop(leaves)
        step = ReversibleStep(loop.body, loop.layout, parts.wanted[0], parts.perturbed)
        return checkpointed_sweep(loop, parts.config, parts.perturbed.x, step)

    def taped_sweep(self, leaves):
        """`checkpointed_sweep`: the final `(x, bufs)` and the tape."""
        return self.forward_sweep(leaves)

    def transposable(self, residuals: Residuals, reverse):
        """The tangent's transpose, `(residual leaves, cts) -> cts_in`, from the
        reverse sweep `reverse(residual leaves + cts)`."""
        del residuals
        return lambda res_leaves, cts: reverse(list(res_leaves) + list(cts))

    def tangent_hvp(self, residuals: Residuals):
        """The tangent's derivative through its residuals, transposed (`loop_tangent`'s
        `hvp_fn`); `None`: forward mode only."""
        del residuals
        return None

    def staged(self, leaves):
        """`two_pass` in two stages: `checkpointed_sweep` now, returning the outputs
        and the tangent stage, `t_in -> t_out`, which reads only its tape."""
        config, wanted = self.parts.config, self.parts.wanted
        loop = self.parts.loop(leaves)
        out, tape = self.taped_sweep(leaves)
        residuals = Residuals(loop, tape)
        out_perturbed, out_def = self.parts.out_perturbed, self.parts.out_def

        def jvp_fn(res_leaves, t_in):
            body, _, x, tape = residuals.unpack(res_leaves)
            t_out = replay_tangent(
                (body, x, tape), wanted, self.parts.perturbed, t_in, self.parts.layout
            )
            return [t for t, f in zip(jtu.tree_leaves(t_out), out_perturbed) if f]

        def reverse(operands):
            n = len(residuals.leaves)
            res_leaves, cts = operands[:n], operands[n:]
            body, _, _, tape = residuals.unpack(res_leaves)
            ct_x, ct_bufs = jtu.tree_unflatten(out_def, fill(out_perturbed, cts))
            step = ReversibleStep(
                body, self.parts.layout, wanted[0], self.parts.perturbed
            )
            ct_in = reverse_sweep(step, tape, ct_x, ct_bufs, config)
            return pick(wanted, ct_in)

        vjp_fn = self.transposable(residuals, reverse)
        hvp_fn = self.tangent_hvp(residuals)

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

    # the transpose of the JVP's own linearization (`grad` of `jvp`): second order
    reverse_of_jvp = None

    def spec(self) -> Spec:
        """The `loop_jvp` primitive's parameter for this loop."""
        n_outputs = self.parts.out_def.num_leaves
        return custom_jvp_spec(
            Passes(self.one_pass, self.two_pass, self.staged, self.reverse_of_jvp),
            Primal(self.primal, self.tangent_inputs(), self.tangent_outputs()),
            n_primals=len(self.parts.leaves),
            out_avals=self.out_avals[:n_outputs],
            t_avals=self.out_avals[n_outputs:],
            effects=self.parts.effects,
        )
