"""The reverse sweep: cotangents from the last step to the first.

Once the forward sweep has ended the trip count is known, so each segment between
stored checkpoints is reversed offline-optimally (Griewank and Walther's binomial
schedule, `_schedule.revolve_split`). Each iteration of the sweep's loop recomputes
the input of step `end - 1` from the top checkpoint, storing the checkpoints the
schedule places on the way, and reverses that step (a vector-Jacobian product). The
recomputation is tight loops of forward steps between store events, so the
schedule's arithmetic runs once per stored checkpoint.

A body with cheap steps (see `_body_size`) gets two more loops, so that loop
iterations stay close to body evaluations: once the rest of a segment fits the free
slots, a loop of a step and a store per iteration; and after the recomputed step, a
loop that reverses the steps below it for as long as the next step's input is on
top of the stack. Costlier steps dwarf this control, and each loop is one more to
compile. `_schedule.reverse_events` is the sweep's pure-Python twin.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array, Int

from . import _body_size, _tape
from ._batching import select_if_batched
from ._schedule import binomial_table
from ._shard_map import varying_while_loop
from ._step import ReversibleStep
from ._tape import Tape
from ._trace import LoopConfig


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
    storage: _tape.Storage  # a row per slot


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

    def __init__(self, step: ReversibleStep, tape: Tape, ct_final, config: LoopConfig):
        self.step = step
        self.tape = tape
        self.ct_final = ct_final
        self.slots = config.checkpoints
        # the same for every `max_steps`: the split reads a row of the table, so a
        # narrower one would make temporary memory depend on `max_steps`
        self.split = split_rule(self.slots, SPLIT_LENGTH)
        # the forward stored every state: nothing to recompute, no inner loop
        self.every_step_stored = (
            config.max_steps is not None and config.checkpoints >= config.max_steps
        )
        # cheap steps: runs of stored inputs reversed in a nested loop, and
        # store-every-step recomputation in a loop of its own (see `_body_size`)
        self.fast = _body_size.is_cheap(step.body)
        # the checkpoints by position (unused slots sort last), and their slots
        slots = jnp.arange(self.slots, dtype=jnp.int32)
        self.sorted, self.order = lax.sort((tape.positions, slots), num_keys=1)

    def initial_stack(self) -> Stack:
        return Stack(self.tape.used, self.sorted, self.tape.storage)

    def forward(self, i, x):
        """`x_{i+1}` from `x_i` (elements whose loop had stopped by step `i` stay)."""
        active = i < self.tape.trips
        return select_if_batched(
            active, self.step.forward(x, self.tape.bufs, active), x
        )

    def advance(self, i, stop, x):
        """`x_stop` from `x_i`: forward steps only, nothing else in the loop."""

        def step(state):
            i, x = state
            return i + 1, self.forward(i, x)

        return varying_while_loop(lambda s: s[0] < stop, step, (i, x))

    def next_target(self, i, end, depth):
        """Where the binomial schedule stores the next checkpoint, or `end - 1`."""
        target = i + jnp.maximum(self.split(end - i, self.slots - (depth - 1)), 1)
        return jnp.minimum(target, end - 1)

    def all_stored(self, state: Recompute):
        """Whether the rest of the segment, `[i, end)`, fits its free slots: then
        the binomial schedule stores every step of it (repetition number 1)."""
        free = self.slots - (state.stack.depth - 1)
        return state.end - state.i <= free + 1

    def store_next(self, state: Recompute) -> Recompute:
        """Advance to the next store event (before `end - 1`) and store there."""
        i, x = self.advance(state.i, state.target, state.x)
        return self.push(state._replace(i=i, x=x))

    def store_step(self, state: Recompute) -> Recompute:
        """One forward step, storing its result (the schedule stores every step
        from here on, so no next store event is looked up)."""
        x = self.forward(state.i, state.x)
        return self.push(state._replace(i=state.i + 1, x=x), find_target=False)

    def push(self, state: Recompute, find_target: bool = True) -> Recompute:
        """Store `x_i` on top of the stack and find the next store event."""
        depth, order_pos, storage = state.stack
        free = jnp.minimum(depth, self.slots - 1)
        storage = _tape.store(storage, self.order[free], state.x)
        order_pos = order_pos.at[free].set(state.i)
        stack = Stack(depth + 1, order_pos, storage)
        if find_target:
            state = state._replace(
                target=self.next_target(state.i, state.end, depth + 1)
            )
        return state._replace(stack=stack)

    @jax.named_scope("boundedloop_recompute")
    def recompute(self, end, stack: Stack) -> Recompute:
        """Advance from the top checkpoint to step `end - 1`, storing the
        checkpoints the binomial schedule places on the way (forward steps only).

        Store events while the schedule skips steps, each a tight loop of forward
        steps, so its arithmetic runs once per stored checkpoint; then the steps to
        `end - 1`. With the fast structure, once the rest of the segment fits the
        free slots, a loop of a step and a store per iteration takes over."""
        top = jnp.maximum(stack.depth - 1, 0)
        i = stack.order_pos[top]
        x = _tape.load(stack.storage, self.order[top])
        state = Recompute(i, end, self.next_target(i, end, top + 1), stack, x)
        if self.fast:
            state = varying_while_loop(
                lambda s: (s.target < s.end - 1) & ~self.all_stored(s),
                self.store_next,
                state,
            )
            state = varying_while_loop(
                lambda s: (s.i < s.end - 2) & self.all_stored(s),
                self.store_step,
                state,
            )
        else:
            state = varying_while_loop(
                lambda s: s.target < s.end - 1, self.store_next, state
            )
        i, x = self.advance(state.i, end - 1, state.x)
        return state._replace(i=i, x=x)

    def carried(self, ct):
        """`ct` without the leaves the body never reads: they are not carried."""
        return tuple(None if u else c for c, u in zip(ct, self.step.unread))

    def unread_ct(self, ct, reversed_none):
        """`ct` with the leaves the body never reads put back: the final carry's
        cotangent while `reversed_none` (per element: none of its steps reversed
        yet), zero after."""

        def put_back(c, final, unread):
            if not unread:
                return c
            return jnp.where(reversed_none, final, jnp.zeros_like(final))

        return tuple(map(put_back, ct, self.ct_final, self.step.unread))

    def reverse_step(self, state: ReverseState, i, x) -> ReverseState:
        """Reverse step `end - 1` from its input `x` (`i == end - 1`, which only
        the data dependence below uses)."""
        # elements whose loop had already stopped there pass `ct` through unchanged
        active = i < self.tape.trips
        pullback = self.step.vjp(x, self.tape.bufs, state.ct_bufs, active)
        state = state._replace(
            ct=self.unread_ct(state.ct, state.end >= self.tape.trips)
        )

        def reverse(ct, ct_body):
            d_body, d_x, updates = pullback(ct)
            d_body = select_if_batched(
                active, d_body, jtu.tree_map(jnp.zeros_like, d_body)
            )
            ct_body = jtu.tree_map(jnp.add, ct_body, d_body)
            return select_if_batched(active, d_x, ct), ct_body, updates

        shapes = None
        if _nbytes(state.ct_bufs) > SMALL_BUFFERS:
            shapes = jax.eval_shape(reverse, state.ct, state.ct_body)[2]
        if shapes is not None and not self.step.wholly_read(shapes, state.ct_bufs):
            # `i == end - 1` always holds. The `lax.cond` is there for XLA: the
            # buffers' cotangents are read inside it and updated in place after it,
            # and only that data dependence lets XLA order the read before the
            # write instead of copying the whole cotangent every step. It is left
            # out without buffers (its operands would take memory of their own),
            # with small ones (a copy of them costs less than the conditional), and
            # when the step reads a whole buffer (its update touches all of the
            # cotangent anyway; measured 1.18x slower with the conditional on a
            # Runge-Kutta stage loop over a state of 200000).
            no_updates = self.step.no_updates(shapes, state.ct_bufs)
            ct, ct_body, updates = lax.cond(
                i == state.end - 1,
                reverse,
                lambda ct, ct_body: (ct, ct_body, no_updates),
                state.ct,
                state.ct_body,
            )
        else:
            ct, ct_body, updates = reverse(state.ct, state.ct_body)
        ct_bufs = self.step.apply_updates(state.ct_bufs, updates)
        ct = self.carried(ct)
        return state._replace(
            end=state.end - 1, ct=ct, ct_bufs=ct_bufs, ct_body=ct_body
        )

    def reverse_stored(self, state: ReverseState) -> ReverseState:
        """Every step whose input is stored: nothing is stored, all is reversed."""
        i = state.end - 1
        return self.reverse_step(state, i, _tape.load(self.tape.storage, i))

    def reverse_segment(self, state: ReverseState) -> ReverseState:
        """Recompute step `end - 1`'s input and reverse it, then reverse the steps
        below it whose inputs are on top of the stack, popping each, in one tight
        loop (no recomputation loop is entered for them)."""
        at = self.recompute(state.end, state.stack)
        at_stack = at.stack

        def reverse_and_pop(carry):
            state, first, recomputed = carry
            depth, order_pos, storage = state.stack
            top = jnp.maximum(depth - 1, 0)
            # the recomputed input first, then inputs on top of the stack (loaded
            # here rather than carried, so the carry is never overwritten while
            # the step still reads it)
            i = jnp.where(first, recomputed.i, order_pos[top])
            stored = _tape.load(storage, self.order[top])
            x = jtu.tree_map(lambda r, s: jnp.where(first, r, s), recomputed.x, stored)
            state = self.reverse_step(state, i, x)
            # drop the top checkpoint once its segment is done
            depth = depth - (state.end == order_pos[top]).astype(jnp.int32)
            state = state._replace(stack=Stack(depth, order_pos, storage))
            return state, jnp.array(False), recomputed

        def more(carry):
            state, first, _ = carry
            depth, order_pos, _ = state.stack
            on_top = order_pos[jnp.maximum(depth - 1, 0)] == state.end - 1
            return first | ((depth > 0) & on_top)

        at = at._replace(stack=None)
        carry = (state._replace(stack=at_stack), jnp.array(True), at)
        if not self.fast:  # one step per iteration of the sweep
            return reverse_and_pop(carry)[0]
        state, *_ = varying_while_loop(more, reverse_and_pop, carry)
        return state


def _steps_left(state: ReverseState):
    """Whether steps remain to be reversed: `end > 0`, written to read a second
    carried scalar, the stack's depth, which is never negative.

    XLA's trip-count analysis (jaxlib 0.10) takes a loop condition that reads one
    carried scalar for an induction variable, and then copies whatever computes that
    scalar in the body, nested loops and all, on each pass that asks: with the
    reverse-and-pop loop nested here that was 0.04 s of a 0.5 s compile. A condition
    on two carried scalars has no single induction variable, and is passed over."""
    return (state.end > 0) | (state.stack.depth < 0)


@jax.named_scope("boundedloop_reverse")
def reverse_sweep(
    step: ReversibleStep, tape: Tape, ct_final, ct_bufs, config: LoopConfig
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
    ct_final = tuple(ct_final)
    sweep = _Sweep(step, tape, ct_final, config)
    state = ReverseState(
        tape.length,
        sweep.initial_stack(),
        sweep.carried(ct_final),
        ct_bufs,
        step.zero_ct_body(),
    )
    body = sweep.reverse_stored if sweep.every_step_stored else sweep.reverse_segment
    state = varying_while_loop(_steps_left, body, state)
    ct_init = sweep.unread_ct(state.ct, tape.trips == 0)
    return state.ct_body, ct_init, state.ct_bufs
