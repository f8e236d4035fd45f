"""The reverse sweep: cotangents from the last step to the first.

Once the forward sweep has ended the trip count is known, so each segment between
stored checkpoints is reversed offline-optimally (Griewank and Walther's binomial
schedule, `_schedule.revolve_split`). Each iteration of the sweep's loop reverses
one step (a vector-Jacobian product), after recomputing that step's input from the
nearest checkpoint: a loop over the checkpoints the schedule stores on the way, each
reached by a tight loop of forward steps, so the schedule's arithmetic runs once per
stored checkpoint rather than once per step. `_schedule.reverse_events` is its
pure-Python twin.

The checkpoints form a stack ordered by position. `order[:depth]` are the slots in
use, bottom to top; `order[depth:]` are free. The top segment `[order_pos[top],
end)` may use `slots - top` slots, its own start included.

??? cite "References"

    ```bibtex
    @article{griewank2000revolve,
      author = {Griewank, Andreas and Walther, Andrea},
      title = {Algorithm 799: Revolve: An Implementation of Checkpointing for the
               Reverse or Adjoint Mode of Computational Differentiation},
      journal = {ACM Transactions on Mathematical Software},
      volume = {26}, number = {1}, pages = {19--45}, year = {2000},
    }
    ```
"""

from collections.abc import Callable
from typing import Any, NamedTuple, TYPE_CHECKING

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, Int, PyTree

from . import _tape
from ._batching import select_if_batched
from ._schedule import binomial_table
from ._shard_map import varying_while_loop
from ._step import ReversibleStep
from ._tape import Tape


if TYPE_CHECKING:
    from ._autodiff import LoopConfig


SPLIT_SLOTS = 256
# segments up to this long are split exactly (longer ones validly, as if this long)
SPLIT_LENGTH = 2**17
# buffers' cotangents up to this many bytes in all are cheaper to copy than to keep
# in place (see `_Sweep.reverse_step`)
SMALL_BUFFERS = 16 * 1024


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jtu.tree_leaves(tree))


def split_rule(slots: int, max_length: int) -> Callable:
    """`split(length, k)` in-graph: as `_schedule.revolve_split`, from a table."""
    # the table is a constant of the program: past `SPLIT_SLOTS` slots the split is
    # planned as if there were `SPLIT_SLOTS` (a valid schedule, using fewer slots)
    slots = min(slots, SPLIT_SLOTS)
    table = binomial_table(slots, max_length)
    table = jnp.asarray(np.minimum(table, np.iinfo(np.int32).max), jnp.int32)
    last = table.shape[1] - 1

    def split(length, k):
        k = jnp.clip(k, 1, slots)
        # the repetition number: the first r with C(k + r, k) >= length (clipped:
        # still valid): the row increases, so r counts its entries below `length`.
        # One vectorized compare; measured faster than a scalar while loop or an
        # unrolled binary search, and it adds no loop iterations.
        r = jnp.sum(table[k] < length, dtype=jnp.int32)
        r = jnp.minimum(r, last)
        r1 = jnp.maximum(r - 1, 0)
        general = jnp.minimum(table[k, r1], length - table[k - 1, r1])
        out = jnp.where(k == 1, length - 1, general)
        return jnp.where(length <= 1, 0, out).astype(jnp.int32)

    return split


class Stack(NamedTuple):
    """The checkpoints held, as a stack ordered by position (see the module doc)."""

    depth: Int[Array, ""]  # slots in use
    order_pos: Int[Array, " slots"]  # the position of `order[j]`'s state
    storage: PyTree[Array]  # a row per slot


class ReverseState(NamedTuple):
    """The outer loop's carry: steps `[0, end)` are still to be reversed."""

    end: Int[Array, ""]
    stack: Stack
    ct: Any  # the cotangent of `x_end`
    ct_bufs: tuple  # the buffers' cotangents
    ct_body: Any  # the accumulated cotangent of the body's arrays


class Recompute(NamedTuple):
    """The recomputation's carry: advancing from a checkpoint at `i` to `end - 1`."""

    i: Int[Array, ""]
    end: Int[Array, ""]
    target: Int[Array, ""]  # where the schedule stores the next checkpoint
    stack: Stack
    x: Any  # `x_i`


class _Sweep:
    """The reverse sweep of one loop: its pieces, sharing the loop's constants."""

    def __init__(self, step: ReversibleStep, tape: Tape, config: "LoopConfig"):
        self.step = step
        self.tape = tape
        self.slots = config.checkpoints
        # the same for every `max_steps`: the split reads a row of the table, so a
        # narrower one would make temporary memory depend on `max_steps`
        self.split = split_rule(self.slots, SPLIT_LENGTH)
        # the forward stored every state: nothing to recompute, no inner loop
        self.every_step_stored = (
            config.max_steps is not None and config.checkpoints >= config.max_steps
        )
        # sort the checkpoints by position (unused slots sort last)
        self.order = jnp.argsort(tape.positions).astype(jnp.int32)

    def initial_stack(self) -> Stack:
        positions = self.tape.positions
        depth = jnp.sum(positions != _tape.UNUSED).astype(jnp.int32)
        return Stack(depth, positions[self.order], self.tape.storage)

    def advance(self, i, stop, x):
        """`x_stop` from `x_i`: forward steps only, nothing else in the loop."""

        def step(state):
            i, x = state
            # elements whose loop had already stopped at step i do not move
            active = i < self.tape.trips
            new_x = self.step.forward(x, self.tape.bufs, active)
            return i + 1, select_if_batched(active, new_x, x)

        return varying_while_loop(lambda s: s[0] < stop, step, (i, x))

    def next_target(self, i, end, depth):
        """Where the binomial schedule stores the next checkpoint, or `end - 1`."""
        target = i + jnp.maximum(self.split(end - i, self.slots - (depth - 1)), 1)
        return jnp.minimum(target, end - 1)

    def store_next(self, state: Recompute) -> Recompute:
        """Advance to the next store event (before `end - 1`) and store there."""
        i, x = self.advance(state.i, state.target, state.x)
        depth, order_pos, storage = state.stack
        free = jnp.minimum(depth, self.slots - 1)
        storage = _tape.store(storage, self.order[free], x)
        order_pos = order_pos.at[free].set(i)
        stack = Stack(depth + 1, order_pos, storage)
        target = self.next_target(i, state.end, depth + 1)
        return Recompute(i, state.end, target, stack, x)

    @jax.named_scope("boundedloop_recompute")
    def recompute(self, end, stack: Stack) -> Recompute:
        """Advance from the top checkpoint to step `end - 1`, storing the
        checkpoints the binomial schedule places on the way (forward steps only):
        tight loops of steps between store events, the schedule's arithmetic once
        per event."""
        top = jnp.maximum(stack.depth - 1, 0)
        i = stack.order_pos[top]
        x = _tape.load(stack.storage, self.order[top])
        state = Recompute(i, end, self.next_target(i, end, top + 1), stack, x)
        state = varying_while_loop(
            lambda s: s.target < s.end - 1, self.store_next, state
        )
        i, x = self.advance(state.i, end - 1, state.x)
        return state._replace(i=i, x=x)

    def reverse_step(self, state: ReverseState) -> ReverseState:
        """Reverse step `end - 1`, recomputing its input first."""
        if self.every_step_stored:  # slot t holds x_t: no stack to keep
            i = state.end - 1
            at = Recompute(
                i, state.end, i, state.stack, _tape.load(self.tape.storage, i)
            )
        else:
            at = self.recompute(state.end, state.stack)
        # elements whose loop had already stopped there pass `ct` through unchanged
        active = at.i < self.tape.trips
        pullback = self.step.vjp(at.x, self.tape.bufs, state.ct_bufs, active)

        def reverse(ct, ct_body):
            d_body, d_x, updates = pullback(ct)
            d_body = select_if_batched(
                active, d_body, jtu.tree_map(jnp.zeros_like, d_body)
            )
            ct_body = jtu.tree_map(jnp.add, ct_body, d_body)
            return select_if_batched(active, d_x, ct), ct_body, updates

        if _nbytes(state.ct_bufs) > SMALL_BUFFERS:
            # `at.i == end - 1` always holds. The `lax.cond` is there for XLA: the
            # buffers' cotangents are read inside it and updated in place after it,
            # and only that data dependence lets XLA order the read before the
            # write instead of copying the whole cotangent every step. (Without
            # buffers it is left out: its operands would take memory of their own;
            # with small ones too: a copy of them costs less than the conditional.)
            shapes = jax.eval_shape(reverse, state.ct, state.ct_body)[2]
            no_updates = self.step.no_updates(shapes, state.ct_bufs)
            ct, ct_body, updates = lax.cond(
                at.i == state.end - 1,
                reverse,
                lambda ct, ct_body: (ct, ct_body, no_updates),
                state.ct,
                state.ct_body,
            )
        else:
            ct, ct_body, updates = reverse(state.ct, state.ct_body)
        ct_bufs = self.step.apply_updates(state.ct_bufs, updates)
        # drop the top checkpoint once its segment is done
        end = state.end - 1
        stack = at.stack
        if self.every_step_stored:
            return ReverseState(end, stack, ct, ct_bufs, ct_body)
        done = end == stack.order_pos[jnp.maximum(stack.depth - 1, 0)]
        stack = stack._replace(depth=stack.depth - done.astype(jnp.int32))
        return ReverseState(end, stack, ct, ct_bufs, ct_body)


@jax.named_scope("boundedloop_reverse")
def reverse_sweep(
    step: ReversibleStep, tape: Tape, ct_final, ct_bufs, config: "LoopConfig"
):
    """Reverse the loop recorded in `tape`.

    **Arguments:**

    - `step`: the loop's step, forward and linearized.
    - `tape`: the forward sweep's `Tape`.
    - `ct_final`, `ct_bufs`: the cotangents of the final carry and buffers.
    - `config`: the loop's `LoopConfig` (checkpoints, max_steps).

    **Returns:**

    `(ct_body, ct_init, ct_bufs_init)`.
    """
    sweep = _Sweep(step, tape, config)
    state = ReverseState(
        tape.length, sweep.initial_stack(), ct_final, ct_bufs, step.zero_ct_body()
    )
    state = varying_while_loop(lambda s: s.end > 0, sweep.reverse_step, state)
    return state.ct_body, state.ct, state.ct_bufs
