"""Recomputation in the reverse sweep: from the top checkpoint to the input of the
next step to reverse, storing the checkpoints the binomial schedule places on the way
(`_schedule.revolve_split`, here in-graph: `split_rule`), in tight loops of forward
steps between store events.

The checkpoints form a stack ordered by position. `order[:depth]` are the slots in
use, bottom to top; `order[depth:]` are free. The top segment `[order_pos[top],
end)` may use `slots - top` slots, its own start included. Everything here is a
plain function of the sweep's constants (`Sweep`) and a NamedTuple state.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int

from .._runtime._batching import select_if_batched
from .._runtime._shard_map import varying_while_loop
from .._tracing._loop import LoopConfig
from . import _checkpoint_store, _cost_model
from ._checkpoint_store import CheckpointStore
from ._schedule import binomial_table
from ._step import ReversibleStep


SPLIT_SLOTS = 256
# segments up to this long are split exactly (longer ones validly, as if this long)
SPLIT_LENGTH = 2**17


def split_rule(slots: int, max_steps: int | None, in_order: bool = False) -> Callable:
    """`split(length, k)` in-graph, as `_schedule.revolve_split`, for the segments of
    a loop bounded by `max_steps` (or unbounded: `None`):

    - `in_order` (see `_cost_model.runs_in_order`; segments up to
      `_cost_model.IN_ORDER_STEPS` long): by a loop over the repetition number,
      which keeps no array (a table is one large array);
    - where `_cost_model.lists_splits` (a bounded loop whose table is small enough
      for the backend): read from a table of every split, listed while tracing
      (one lookup, where computing the split takes several kernels for XLA to
      compile);
    - otherwise: computed from a table of binomial coefficients.
    """
    # the table is a constant of the program: past `SPLIT_SLOTS` slots the split is
    # planned as if there were `SPLIT_SLOTS` (a valid schedule, using fewer slots)
    slots = min(slots, SPLIT_SLOTS)
    if in_order:
        return functools.partial(_split_in_order, slots)
    if _cost_model.lists_splits(slots, max_steps):
        splits = jnp.asarray(_all_splits(slots, max_steps))

        def lookup(length, k):
            k = jnp.clip(k, 1, slots)
            length = jnp.clip(length, 0, max_steps)
            return splits.at[k, length].get(mode="promise_in_bounds")

        return lookup
    table = binomial_table(slots, SPLIT_LENGTH)
    table = jnp.asarray(np.minimum(table, np.iinfo(np.int32).max), jnp.int32)
    last = table.shape[1] - 1

    def split(length, k):
        k = jnp.clip(k, 1, slots)
        # the repetition number: the first r with C(k + r, k) >= length (clipped:
        # still valid): the row increases, so r counts its entries below `length`.
        # One vectorized compare, which adds no loop iterations (faster than the
        # alternatives: `docs/design-notes.md`).
        r = jnp.sum(table[k] < length, dtype=jnp.int32)
        r = jnp.minimum(r, last)
        r1 = jnp.maximum(r - 1, 0)
        general = jnp.minimum(table[k, r1], length - table[k - 1, r1])
        out = jnp.where(k == 1, length - 1, general)
        return jnp.where(length <= 1, 0, out).astype(jnp.int32)

    return split


@functools.cache
def _all_splits(slots: int, max_length: int) -> np.ndarray:
    """Every split `split_rule` looks up: `splits[k, l] = revolve_split(l, k)` for
    `1 <= k <= slots` (row 0 as row 1) and `l <= max_length`, found as its computed
    form finds it (the first `r` with `C(k + r, k) >= l`), in NumPy: vectorized over
    the lengths, which is much faster than calling `revolve_split` for each
    (`docs/design-notes.md`); the tests hold the two equal."""
    lengths = np.arange(max_length + 1, dtype=np.int64)
    table = binomial_table(slots, max_length).astype(np.int64)
    rows = [np.maximum(lengths - 1, 0)] * 2  # no slot is as one: `l - 1`
    for k in range(2, slots + 1):
        r1 = np.maximum(np.searchsorted(table[k], lengths, side="left") - 1, 0)
        rows.append(np.minimum(table[k, r1], lengths - table[k - 1, r1]))
    return np.where(lengths <= 1, 0, np.stack(rows)).astype(np.int32)


def _split_in_order(slots: int, length, k):
    """`split_rule`'s split without the table: the repetition number `r` is the
    first with `C(k + r, k) >= length`, found by stepping `C(k + r, k) = C(k + r -
    1, k) (k + r) / r`. Exact in int32: each product is below `length * (k + r) <=
    2**17 * 2**10` (`k <= SPLIT_SLOTS`, and `r <= 511` since `C(2 + 511, 2) >=
    2**17`)."""
    k = jnp.clip(k, 1, slots)

    def below(carry):  # (one slot has a closed form, and would take `length` steps)
        _, binomial, _ = carry
        return (binomial < length) & (k > 1)

    def grow(carry):
        r, binomial, _ = carry
        r = r + 1
        return r, binomial * (k + r) // r, binomial

    one = jnp.array(1, jnp.int32)
    init = (jnp.array(0, jnp.int32), one, one)
    r, _, before = varying_while_loop(below, grow, init)
    # `before = C(k + r - 1, k)`, and `C(k - 1 + r - 1, k - 1)` is it times `k / (k +
    # r - 1)`: the table's `table[k, r - 1]` and `table[k - 1, r - 1]`
    fewer = before * k // jnp.maximum(k + r - 1, 1)
    general = jnp.minimum(before, length - fewer)
    out = jnp.where(k == 1, length - 1, general)
    return jnp.where(length <= 1, 0, out).astype(jnp.int32)


class Stack(NamedTuple):
    """The checkpoints held, as a stack ordered by position (see the module doc)."""

    depth: Int[Array, ""]  # slots in use
    order_pos: Int[Array, " slots"]  # the position of `order[j]`'s state
    storage: _checkpoint_store.Storage  # a row per slot


class Recompute(NamedTuple):
    """The recomputation's carry: advancing from a checkpoint at `i` to `end - 1`."""

    i: Int[Array, ""]
    end: Int[Array, ""]
    stack: Stack
    x: Any  # `x_i`


class Sweep(NamedTuple):
    """The constants of one loop's reverse sweep, which its functions share."""

    step: ReversibleStep
    tape: CheckpointStore
    ct_final: tuple  # the final carry's cotangent
    slots: int  # checkpoints
    split: Callable  # `split_rule`'s function, for these slots
    # cheap steps: runs of stored inputs reversed in a nested loop, and
    # store-every-step recomputation in a loop of its own (see `_cost_model`)
    cheap_steps: bool
    # costly steps: the sweep as one loop sharing one evaluation of the step
    # (`_reverse_sweep.drive`; see `_cost_model.shares_one_step`)
    one_loop: bool
    # the forward stored every state: nothing to recompute, no inner loop
    every_step_stored: bool
    sorted: Int[Array, " slots"]  # the checkpoints' positions, in order
    order: Int[Array, " slots"]  # their slots, in the same order


def make_sweep(
    step: ReversibleStep, tape: CheckpointStore, ct_final, config: LoopConfig
) -> Sweep:
    """The constants of the reverse sweep of the loop recorded in `tape`."""
    # the checkpoints by position (unused slots sort last), and their slots
    slots = jnp.arange(config.checkpoints, dtype=jnp.int32)
    sorted_pos, order = lax.sort((tape.positions, slots), num_keys=1)
    return Sweep(
        step,
        tape,
        ct_final,
        config.checkpoints,
        # (`in_order`: as the forward sweep decided, `_cost_model.runs_in_order`)
        split_rule(config.checkpoints, config.max_steps, tape.storage.in_order),
        cheap := _cost_model.is_cheap(step.body),
        # (not with buffers: a cotangent read whole would be copied every step)
        not cheap and not tape.bufs and _cost_model.shares_one_step(step.body),
        config.max_steps is not None and config.checkpoints >= config.max_steps,
        sorted_pos,
        order,
    )


def forward(sw: Sweep, i, x):
    """`x_{i+1}` from `x_i` (elements whose loop had stopped by step `i` stay)."""
    active = i < sw.tape.trips
    return select_if_batched(active, sw.step.forward(x, sw.tape.bufs, active), x)


def advance(sw: Sweep, i, stop, x):
    """`x_stop` from `x_i`: forward steps only, nothing else in the loop."""

    def step(state):
        i, x = state
        return i + 1, forward(sw, i, x)

    return varying_while_loop(lambda s: s[0] < stop, step, (i, x))


def segment_slots(sw: Sweep, state: Recompute):
    """The slots the top segment may use, its own start's included."""
    return sw.slots - (state.stack.depth - 1)


def next_target(sw: Sweep, state: Recompute):
    """Where the binomial schedule stores the next checkpoint, or `end - 1`."""
    i, end, slots = state.i, state.end, segment_slots(sw, state)
    target = i + jnp.maximum(sw.split(end - i, slots), 1)
    return jnp.minimum(target, end - 1)


def all_stored(sw: Sweep, state: Recompute):
    """Whether the rest of the segment, `[i, end)`, fits its free slots: then
    the binomial schedule stores every step of it (repetition number 1)."""
    slots = segment_slots(sw, state)
    return state.end - state.i <= slots + 1


def store_next_or_end(sw: Sweep, state: Recompute) -> Recompute:
    """Advance to the next store event and store there; or, when the next store
    event is not before `end - 1`, advance to `end - 1` and store nothing."""
    i, x = advance(sw, state.i, next_target(sw, state), state.x)
    return push(sw, state._replace(i=i, x=x), when=i < state.end - 1)


def store_step(sw: Sweep, state: Recompute) -> Recompute:
    """One forward step, storing its result (the schedule stores every step
    from here on, so no next store event is looked up)."""
    x = forward(sw, state.i, state.x)
    return push(sw, state._replace(i=state.i + 1, x=x))


def push(sw: Sweep, state: Recompute, when=True) -> Recompute:
    """Store `x_i` on top of the stack where `when` (a scalar) is true."""
    depth, order_pos, storage = state.stack
    free = jnp.minimum(depth, sw.slots - 1)
    storage = _checkpoint_store.store(storage, sw.order[free], state.x, when)
    order_pos = _checkpoint_store.set_where(order_pos, free, state.i, when)
    grown = depth + (1 if when is True else jnp.asarray(when).astype(jnp.int32))
    return state._replace(stack=Stack(grown, order_pos, storage))


@jax.named_scope("boundedloop_recompute")
def recompute(sw: Sweep, end, stack: Stack) -> Recompute:
    """Advance from the top checkpoint to step `end - 1`, storing the
    checkpoints the binomial schedule places on the way (forward steps only).

    A loop of store events, each a tight loop of forward steps to the next, so
    the schedule's arithmetic runs once per stored checkpoint; where the next
    event is not before `end - 1`, the iteration advances to `end - 1` and its
    store is masked, so that one loop (one copy of the step for XLA to compile)
    does both. With cheap steps (`_cost_model.is_cheap`), once the rest of the
    segment fits the free slots, a loop of a step and a store per iteration
    takes over (no inner loop per store), and the last step to `end - 1` runs
    in a loop of its own."""
    top = jnp.maximum(stack.depth - 1, 0)
    i = stack.order_pos[top]
    x = _checkpoint_store.load(stack.storage, sw.order[top])
    state = Recompute(i, end, stack, x)
    store_next_or_end_ = functools.partial(store_next_or_end, sw)
    if not sw.cheap_steps:
        return varying_while_loop(lambda s: s.i < s.end - 1, store_next_or_end_, state)
    state = varying_while_loop(
        lambda s: (s.i < s.end - 1) & ~all_stored(sw, s), store_next_or_end_, state
    )
    state = varying_while_loop(
        lambda s: (s.i < s.end - 2) & all_stored(sw, s),
        functools.partial(store_step, sw),
        state,
    )
    i, x = advance(sw, state.i, end - 1, state.x)
    return state._replace(i=i, x=x)
