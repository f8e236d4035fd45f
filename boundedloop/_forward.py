"""The forward sweeps: plain (nothing saved) and checkpointed (saving the carry).

Both run `step(x)` while `predicate(x)` holds and fewer than `max_steps` steps
have been taken. The checkpointed sweep keeps its control (the step counter and the
checkpoint bookkeeping) unbatched under `vmap`: it runs while any element is still
going and masks the elements that have stopped, so the schedule is shared by the
whole batch and each element counts its own trip.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int, PyTree

from . import _slots
from ._schedule import online_actions
from ._unbatched import any_across_batch


# The forward placement is planned this many steps ahead, whatever `max_steps` is, so
# that the compiled program is the same for every `max_steps`. Past it nothing more
# is stored: still correct, but reversing the tail then costs more.
PLANNING_HORIZON = 2**14


def _within(step, max_steps):
    return True if max_steps is None else step < max_steps


def plain_sweep(step: Callable, predicate: Callable, init, max_steps: int | None):
    """As `lax.while_loop(predicate, step, init)`, stopping after `max_steps` steps."""

    def cond(state):
        t, x = state
        return jnp.logical_and(_within(t, max_steps), predicate(x))

    def body(state):
        t, x = state
        return t + 1, step(x)

    _, final = lax.while_loop(cond, body, (jnp.array(0, jnp.int32), init))
    return final


class Tape(NamedTuple):
    """What the checkpointed sweep leaves for the reverse sweep."""

    storage: PyTree[Array]  # a row per slot
    positions: Int[Array, " slots"]  # the step whose state each slot holds
    trips: Int[Array, ""]  # steps this element took (batched under vmap)
    length: Int[Array, ""]  # iterations the sweep ran (never batched)


def store_plan(slots: int, max_steps: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The (step, slot) stores of the forward sweep, `x_0` in slot 0 first and a
    sentinel last; `None` when every step is stored (`slots >= max_steps`)."""
    if max_steps is not None and slots >= max_steps:
        return None
    steps, slot_ids = online_actions(slots, PLANNING_HORIZON)
    steps = np.concatenate([[0], steps, [np.iinfo(np.int32).max]]).astype(np.int32)
    slot_ids = np.concatenate([[0], slot_ids, [0]]).astype(np.int32)
    return steps, slot_ids


def checkpointed_sweep(
    step: Callable, predicate: Callable, init, max_steps: int | None, slots: int
):
    """The forward sweep of a differentiated loop.

    **Returns:**

    `(final, tape)`: the final carry (equal to `plain_sweep`'s) and the `Tape`.
    """
    plan = store_plan(slots, max_steps)
    if plan is not None:
        plan_steps, plan_slots = map(jnp.asarray, plan)

    def cond(state):
        t, _, active, *_ = state
        return jnp.logical_and(_within(t, max_steps), any_across_batch(active))

    def body(state):
        t, x, active, trips, storage, positions, cursor = state
        if plan is None:
            slot, when = t, True
        else:
            slot, when = plan_slots[cursor], t == plan_steps[cursor]
            cursor = cursor + when.astype(jnp.int32)
        storage = _slots.store(storage, slot, x, when)
        positions = positions.at[slot].set(jnp.where(when, t, positions[slot]))
        x = _slots.select(active, step(x), x)
        trips = trips + active.astype(jnp.int32)
        active = jnp.logical_and(active, predicate(x))
        return t + 1, x, active, trips, storage, positions, cursor

    zero = jnp.array(0, jnp.int32)
    state = (
        zero,
        init,
        jnp.asarray(predicate(init), bool),
        zero,
        _slots.empty(init, slots),
        jnp.full((slots,), _slots.UNUSED, jnp.int32),
        zero,
    )
    length, final, _, trips, storage, positions, _ = lax.while_loop(cond, body, state)
    return final, Tape(storage, positions, trips, length)
