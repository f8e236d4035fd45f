"""The tape: what a step's vector-Jacobian product reads (its residuals), kept so
that the reverse sweep reverses steps without evaluating them again; and how a
`memory=` budget is split between it and the checkpoints (`plan`).

A step's residuals (`ReversibleStep.linearize`) split in two. Those that depend on
the carry or the buffers change from step to step: they go into a tape of
`tape_steps` rows (step `t` in row `t % tape_steps`), written by the forward sweep
when it tapes every step, or by the reverse sweep for each block it recomputes
(`_reverse_sweep.reverse_blocks`). The others (the body's parameters, or values
computed from them alone) are the same at every step: they are found once, where
the reverse sweep starts, never taped. Which is which is read off the traced
linearization (`_varying_outputs`).
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.extend.core import jaxpr_as_fun, Literal

from .._tracing._loop import LoopConfig
from ._cost_model import is_cheap, stores_before_taping
from ._step import invariant_leaves, ReversibleStep


def _varying_outputs(jaxpr) -> list[bool]:
    """Per output of `jaxpr`, whether it may depend on an input (not only on its
    constants): an equation with any such operand makes all its outputs so."""
    depends = set(jaxpr.invars)
    for e in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in depends for v in e.invars):
            depends.update(e.outvars)
    return [not isinstance(v, Literal) and v in depends for v in jaxpr.outvars]


# elementwise operations (and moves of data within an array): a tape keeps their
# inputs, not their results, and the pullback computes the results again, as XLA
# would fuse them into their consumers (for `tanh(y @ W)`, a row holds `y` and
# `y @ W`, not also `tanh`'s result and derivative)
RECOMPUTED = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh broadcast_in_dim cbrt ceil
    clamp convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2
    expm1 floor ge gt imag integer_pow is_finite le log log1p logistic lt max min mul
    ne neg nextafter not or pow real reduce_precision rem reshape round rsqrt
    select_n sign sin sinh sqrt square squeeze sub tan tanh transpose xor""".split()
)


def kept(primitive, *_, **__) -> bool:
    """The `jax.checkpoint` policy of a tape: keep every value but those of the
    operations in `RECOMPUTED`."""
    return primitive.name not in RECOMPUTED


class TapedStep:
    """A `ReversibleStep` whose residuals are taped.

    **Arguments:**

    - `step`: the loop's step.
    - `x`, `bufs`: a carry and buffers of the loop (their shapes are what matter;
        their values are read only by `invariants`).
    """

    def __init__(self, step: ReversibleStep, x, bufs):
        self.step = step
        # a body with effects (a `jax.debug.callback`, say) keeps every value, so
        # that its effects run once per evaluation of the step, not again in the
        # pullback as `jax.checkpoint` would run them
        self.policy = None if step.body.jaxpr.effects else kept
        found = {}

        def residual_leaves(x, bufs):
            residuals = step.linearize(x, bufs, policy=self.policy)[2]
            leaves, found["treedef"] = jtu.tree_flatten(residuals)
            return leaves

        self._x, self._bufs = x, bufs
        self._closed = jax.make_jaxpr(residual_leaves)(x, bufs)
        self.treedef = found["treedef"]
        self.varying = tuple(_varying_outputs(self._closed.jaxpr))
        avals = self._closed.out_avals
        self.shapes = [
            jax.ShapeDtypeStruct(a.shape, a.dtype)
            for a, v in zip(avals, self.varying)
            if v
        ]

    @property
    def bytes_per_step(self) -> int:
        """The bytes one step's row of the tape holds."""
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.shapes)

    def empty(self, steps: int) -> "Tape":
        """A tape of `steps` rows, uninitialized where the backend allows (a TPU's
        is never zeroed: at the headline size, zeroing 5 GB took 6 ms of a 92 ms
        gradient). Every row is written before it is read: the forward sweep
        writes step `t`'s for each `t` below the trip count, the reverse sweep a
        block's before reversing it."""
        rows = tuple(lax.empty((steps, *s.shape), s.dtype) for s in self.shapes)
        return Tape(rows, self.step.key)

    def forward(self, x, bufs, active):
        """`(x', bufs', row)`: one step, and the varying residuals it tapes."""
        x_next, bufs_next, residuals = self.step.linearize(x, bufs, active, self.policy)
        leaves = jtu.tree_leaves(residuals)
        return x_next, bufs_next, [r for r, v in zip(leaves, self.varying) if v]

    def _direct(self) -> list:
        """Per residual, its value where the linearization forwards it from its
        constants as it is (or it is a literal), else `None`."""
        jaxpr, consts = self._closed.jaxpr, self._closed.consts
        const_of = dict(zip(jaxpr.constvars, consts))
        return [
            v.val if isinstance(v, Literal) else const_of.get(v) for v in jaxpr.outvars
        ]

    @property
    def evaluates_shared(self) -> bool:
        """Whether `invariants` evaluates the step: some residual every step shares
        is computed from the body's parameters, not one of them as it is."""
        return any(d is None and not v for d, v in zip(self._direct(), self.varying))

    def invariants(self) -> list:
        """The residuals every step shares: those the linearization forwards from
        its constants as they are, and (only if there are others) the rest from
        one evaluation of the linearized step at the carry it was made with."""
        direct = self._direct()
        if self.evaluates_shared:
            flat = jtu.tree_leaves((self._x, self._bufs))
            values = jaxpr_as_fun(self._closed)(*flat)
            direct = [d if d is not None else o for d, o in zip(direct, values)]
        return [d for d, v in zip(direct, self.varying) if not v]

    def pullback(self, row, invariants, ct_bufs, active):
        """`ReversibleStep.vjp`'s pullback, from a row of the tape."""
        row, invariants = iter(row), iter(invariants)
        leaves = [next(row) if v else next(invariants) for v in self.varying]
        residuals = jtu.tree_unflatten(self.treedef, leaves)
        return self.step.pullback(residuals, ct_bufs, active)


class Tape(eqx.Module):
    """Steps' residuals: a stacked array per varying residual, a row per step."""

    rows: tuple
    # the `ReversibleStep.key` of the step that taped them: a reverse sweep whose
    # step differentiates other leaves (an outer reverse pass, under `grad` of
    # `grad`) has other residuals, and does not read these
    key: Any = eqx.field(static=True)


def write(tape: Tape, t, row) -> Tape:
    """`tape` with step `t`'s `row` in its row `t % steps`."""
    steps = tape.rows[0].shape[0] if tape.rows else 1
    slot = t % steps
    rows = tuple(
        lax.dynamic_update_index_in_dim(a, r.astype(a.dtype), slot, 0)
        for a, r in zip(tape.rows, row)
    )
    return Tape(rows, tape.key)


def read(tape: Tape, t) -> list:
    """Step `t`'s row of `tape`."""
    steps = tape.rows[0].shape[0] if tape.rows else 1
    return [lax.dynamic_index_in_dim(a, t % steps, keepdims=False) for a in tape.rows]


def plan(
    memory: int,
    carry_bytes: int,
    row_bytes: int,
    max_steps: int | None,
    cheap: bool = False,
    stores_first: bool = False,
) -> tuple[int, int]:
    """`(checkpoints, tape_steps)` for a budget of `memory` bytes, where a copy of
    the carry takes `carry_bytes` and a step's row of the tape `row_bytes`; `cheap`:
    the step is cheap (`_cost_model.is_cheap`); `stores_first`: the carry is stored
    every step where `max_steps` copies fit, before any tape is considered
    (`_cost_model.stores_before_taping`).

    - With `stores_first`, the carry is stored every step where `max_steps` copies
      fit: no step is evaluated twice, and none is taped.
    - Every step is taped by the forward sweep when `max_steps` rows and one carry
      copy fit: the gradient is then a stored scan (no step evaluated twice).
    - Otherwise a cheap step is stored every step where `max_steps` carry copies
      fit: its residuals are larger than its carry, and reading them back costs
      about what evaluating it again does (`docs/design-notes.md`, "How a memory
      budget is split").
    - Otherwise the reverse sweep reverses blocks of `tape_steps` steps
      (`_reverse_sweep.reverse_blocks`). Checkpoints a block apart leave each block
      one recomputation, as a scan of checkpointed scans does, so the fewest
      checkpoints `c` whose blocks of `ceil(max_steps / c)` steps fit beside them:
      more cost a store event each in the forward sweep (on a TPU v5e, 321
      checkpoints for 256 steps made the headline gradient 154 ms against 121 ms
      at 77; `benchmarks/results/memory_curve_tpu_blocks.json`).
    - Where no such split fits (or the loop is unbounded), half the budget is the
      block tape and half checkpoints: the split whose blocks cover the most steps.
    - A tape of fewer than 2 rows is not worth its loop: then all checkpoints.

    `memory` must hold one copy of the carry (the caller checks)."""
    carry_bytes = max(carry_bytes, 1)

    def capped(c):
        return max(1, c if max_steps is None else min(c, max(max_steps, 1)))

    stores_every_step = max_steps is not None and max_steps * carry_bytes <= memory
    if stores_first and stores_every_step:
        return capped(max_steps), 0
    if max_steps is not None and carry_bytes + max_steps * row_bytes <= memory:
        return 1, max_steps
    if cheap and stores_every_step:
        return capped(max_steps), 0
    if row_bytes == 0:
        return capped(memory // carry_bytes), 0
    if max_steps is not None:
        c = 1
        # (a bounded search: past 2**12 copies, the half-and-half split below)
        while c * carry_bytes <= memory and c <= min(max_steps, 2**12):
            rows = -(-max_steps // c)
            if rows >= 2 and c * carry_bytes + rows * row_bytes <= memory:
                # the budget left after the checkpoints, as rows
                rows = min((memory - c * carry_bytes) // row_bytes, max_steps)
                return c, rows
            c += 1
    rows = min(memory // 2, memory - carry_bytes) // row_bytes
    if max_steps is not None:
        rows = min(rows, max_steps)
    if rows < 2:
        return capped(memory // carry_bytes), 0
    return capped((memory - rows * row_bytes) // carry_bytes), rows


def carry_bytes(body, x) -> int:
    """The bytes of one checkpoint: the carry leaves the loop changes (`x`, the
    ordinary leaves; a leaf the body returns as it took it is stored once)."""
    invariant = invariant_leaves(body, len(x))
    return sum(
        math.prod(jnp.shape(v)) * jnp.result_type(v).itemsize
        for v, fixed in zip(x, invariant)
        if not fixed
    )


def planned(config: LoopConfig, step: ReversibleStep, x, bufs) -> LoopConfig:
    """`config` with its checkpoints and taped steps planned from `config.memory`
    (`plan`), for the gradient's sweeps; `config` itself without a budget."""
    if config.memory is None:
        return config
    row = TapedStep(step, x, bufs).bytes_per_step
    size = carry_bytes(step.body, x)
    cheap, first = is_cheap(step.body), stores_before_taping(step.body)
    slots, steps = plan(config.memory, size, row, config.max_steps, cheap, first)
    return dataclasses.replace(config, checkpoints=slots, tape_steps=steps)
