"""`bl.memory_plan`: what a `memory=` budget buys for a loop."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .._sweeps._cost_model import is_cheap, stores_before_taping
from .._sweeps._schedule import gradient_evaluations
from .._sweeps._step import ReversibleStep
from .._sweeps._store_rules import uniform_positions
from .._sweeps._tape import carry_bytes, plan, TapedStep
from .._tracing._buffers import lend_buffers, lent_gate
from .._tracing._dtypes import is_inexact
from .._tracing._loop import LoopConfig, Perturbed
from .._tracing._perturbation import perturbed_leaves
from .._tracing._trace import trace_loop
from ._arguments import (
    check_max_steps,
    check_memory,
    checkpoints_within,
)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a `memory=` budget buys for one loop's gradient (`bl.memory_plan`).

    - `checkpoints`: the copies of the carry the backward pass holds.
    - `tape_steps`: the rows of the tape of step residuals. When they are
        `max_steps`, the forward sweep tapes every step and none is evaluated
        again (a stored scan); otherwise the reverse sweep reverses blocks of
        this many steps, each recomputed once while taped, but for the last
        block where they are at least a quarter of `max_steps`: the forward
        sweep tapes its last steps in a ring, and that block is reversed from it.
    - `checkpoint_bytes`: the bytes of one copy of the carry.
    - `tape_step_bytes`: the bytes of one taped step's residuals.
    - `bytes`: all of it, `checkpoints * checkpoint_bytes + tape_steps *
        tape_step_bytes`, at most the budget.
    - `max_steps`, `known_length`: the loop's bound, and whether it always takes
        all its steps (a `bl.scan`).
    - `evaluates_shared_residuals`: whether the reverse sweep evaluates the step
        once more, to find the residuals every step shares (values computed from
        the body's parameters alone).
    """

    checkpoints: int
    tape_steps: int
    checkpoint_bytes: int
    tape_step_bytes: int
    bytes: int
    max_steps: int | None
    known_length: bool = False
    evaluates_shared_residuals: bool = False

    def body_evaluations(self, steps: int) -> int:
        """The body evaluations of one gradient of the loop when it takes `steps`
        steps: each step forward once, the untaped ones once more for their
        vector-Jacobian product, and the recomputation from the checkpoints."""
        config = LoopConfig(
            self.max_steps, self.checkpoints, tape_steps=self.tape_steps
        )
        every = config.tapes_every_step
        block = 0 if every else self.tape_steps
        uniform = uniform_positions(self.checkpoints, block, self.max_steps)
        count = gradient_evaluations(
            steps,
            self.checkpoints,
            self.tape_steps,
            self.known_length,
            every,
            uniform,
            ring=config.forward_tapes,
        )
        return count + int(self.evaluates_shared_residuals and steps > 0)


def memory_plan(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init_val: Any,
    *,
    max_steps: int | None,
    memory: int | str,
    buffers: Callable[[Any], Any] | None = None,
) -> MemoryPlan:
    """What `bl.while_loop(cond_fun, body_fun, init_val, max_steps=max_steps,
    memory=memory)` holds for its gradient: how many copies of the carry, how many
    taped steps, the bytes of each, and (`MemoryPlan.body_evaluations(n)`) the body
    evaluations for `n` steps taken. Traces the functions; runs nothing.

    The residuals are those of a gradient with respect to every floating input (the
    initial carry and the arrays the body closes over): a gradient with respect to
    fewer may tape less per step.

    **Arguments:**

    - `cond_fun`, `body_fun`, `init_val`, `max_steps`, `buffers`: as for
        `bl.while_loop`.
    - `memory`: the budget, an `int` of bytes or a string with a unit (`"2 GiB"`).

    **Returns:**

    A [`bl.MemoryPlan`][boundedloop.MemoryPlan].
    """
    name = "bl.memory_plan"
    max_steps = check_max_steps(max_steps, name)
    memory = check_memory(memory, None, name)
    init_val, buffers, lent = lend_buffers(init_val, buffers)
    loop = trace_loop(
        cond_fun, body_fun, init_val, buffers, name=name, gate=lent_gate(lent)
    )
    size = carry_bytes(loop.body, loop.init)
    checkpoints_within(memory, size, max_steps, name)
    wanted_body = jtu.tree_map(eqx.is_inexact_array, loop.body)
    initial = Perturbed(
        tuple(map(is_inexact, loop.init)), tuple(map(is_inexact, loop.bufs))
    )
    consts = jtu.tree_leaves(wanted_body)
    perturbed = perturbed_leaves(loop.body, consts, initial, loop.layout)
    step = ReversibleStep(loop.body, loop.layout, wanted_body, perturbed)
    taped = TapedStep(step, loop.init, loop.bufs)
    cheap, first = is_cheap(loop.body), stores_before_taping(loop.body)
    row = taped.bytes_per_step
    slots, steps = plan(memory, size, row, max_steps, cheap, first)
    return MemoryPlan(
        checkpoints=slots,
        tape_steps=steps,
        checkpoint_bytes=size,
        tape_step_bytes=taped.bytes_per_step,
        bytes=slots * size + steps * taped.bytes_per_step,
        max_steps=max_steps,
        evaluates_shared_residuals=taped.evaluates_shared,
    )
