"""The forward sweeps: plain (nothing saved) and checkpointed (saving the carry).

Both run the body while the predicate holds and fewer than `max_steps` steps have
been taken. Where buffers (or, for the checkpointed sweep, checkpoint bookkeeping)
are carried, the sweep keeps its control unbatched under `vmap`: it runs while any
element is still going and masks the elements that have stopped, instead of letting
`lax.while_loop`'s batching select (and so copy) every carried array per step. The
schedule is then shared by the whole batch and each element counts its own trip.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PyTree

from . import _progress, _slots, _vma
from ._buffers import raise_violations
from ._schedule import offline_placement, online_actions
from ._step import advance
from ._unbatched import any_across_batch, select_if_batched


# The forward placement is planned `max_steps` steps ahead, but at least
# `MIN_HORIZON` (so that the compiled program is the same for every smaller
# `max_steps`) and at most `MAX_HORIZON` (planning takes about a second there at 16
# checkpoints; `max_steps=None` plans that far). Past the horizon nothing more is
# stored: still correct, but reversing the tail then costs more.
MIN_HORIZON = 2**14
MAX_HORIZON = 2**17


def planning_horizon(max_steps: int | None) -> int:
    """How many steps ahead the forward placement is planned."""
    if max_steps is None:
        return MAX_HORIZON
    return min(max(max_steps, MIN_HORIZON), MAX_HORIZON)


def _within(step, max_steps):
    return True if max_steps is None else step < max_steps


def _masks(layout):
    """The buffer checks' state: which locations are written, and no violations."""
    none = jnp.array(False)
    return tuple(jnp.zeros(s, bool) for s in layout.mask_shapes), (none, none)


def _continue(loop, active, x, bufs, written):
    active = jnp.logical_and(active, loop.cond(x, bufs))
    if written is not None:
        active = raise_violations(active, written[1])
    return active


def plain_sweep(loop, max_steps: int | None, checked: bool):
    """As `lax.while_loop(cond, body, init)`, stopping after `max_steps` steps.

    `loop` is a `TracedLoop`; returns the final `(x, bufs)`.
    """
    body = loop.checked_body if checked else loop.body
    meter = _progress.start(max_steps)  # None unless `bl.progress_meter` is on
    if not loop.bufs:

        def cond(state):
            t, x = state
            return jnp.logical_and(_within(t, max_steps), loop.cond(x, ()))

        def step(state):
            t, x = state
            _progress.tick(meter, t + 1)
            return t + 1, advance(body, loop.layout, x, (), True)[0]

        t, final = _vma.while_loop(cond, step, (jnp.array(0, jnp.int32), loop.init))
        _progress.done(meter, t)
        return final, ()

    def masked_cond(state):
        t, _, _, _, active = state
        return jnp.logical_and(_within(t, max_steps), any_across_batch(active))

    def masked_step(state):
        t, x, bufs, written, active = state
        new_x, bufs, written = advance(body, loop.layout, x, bufs, active, written)
        x = select_if_batched(active, new_x, x)
        _progress.tick(meter, t + 1)
        return t + 1, x, bufs, written, _continue(loop, active, x, bufs, written)

    written = _masks(loop.layout) if checked else None
    active = jnp.asarray(loop.cond(loop.init, loop.bufs), bool)
    state = (jnp.array(0, jnp.int32), loop.init, loop.bufs, written, active)
    t, x, bufs, _, _ = _vma.while_loop(masked_cond, masked_step, state)
    _progress.done(meter, t)
    return x, bufs


class Tape(NamedTuple):
    """What the checkpointed sweep leaves for the reverse sweep."""

    storage: PyTree[Array]  # a row per slot (buffers are never stored)
    positions: Int[Array, " slots"]  # the step whose state each slot holds
    trips: Int[Array, ""]  # steps this element took (batched under vmap)
    length: Int[Array, ""]  # iterations the sweep ran (never batched)
    bufs: tuple  # the final buffers: every value ever written


def store_plan(
    slots: int, max_steps: int | None, known_length: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """The (step, slot) stores of the forward sweep, `x_0` in slot 0 first and a
    sentinel last; `None` when every step is stored (`slots >= max_steps`).

    With `known_length` the loop always takes `max_steps` steps (a scan), so the
    placement is planned offline for exactly that length."""
    if max_steps is not None and slots >= max_steps:
        return None
    if known_length:
        positions = offline_placement(max_steps, slots)[1:]
        steps, slot_ids = np.asarray(positions), np.arange(1, len(positions) + 1)
    else:
        steps, slot_ids = online_actions(slots, planning_horizon(max_steps))
    steps = np.concatenate([[0], steps, [np.iinfo(np.int32).max]]).astype(np.int32)
    slot_ids = np.concatenate([[0], slot_ids, [0]]).astype(np.int32)
    return steps, slot_ids


def checkpointed_sweep(
    loop, max_steps: int | None, slots: int, checked: bool, known_length: bool = False
):
    """The forward sweep of a differentiated loop.

    **Returns:**

    `((x, bufs), tape)`: the final arrays (equal to `plain_sweep`'s) and the `Tape`.
    """
    body = loop.checked_body if checked else loop.body
    meter = _progress.start(max_steps)  # None unless `bl.progress_meter` is on
    plan = store_plan(slots, max_steps, known_length)
    if plan is not None:
        plan_steps, plan_slots = map(jnp.asarray, plan)

    def cond(state):
        t, _, _, _, active, *_ = state
        return jnp.logical_and(_within(t, max_steps), any_across_batch(active))

    def step(state):
        t, x, bufs, written, active, trips, storage, positions, cursor = state
        if plan is None:
            slot, when = t, True
        else:
            slot, when = plan_slots[cursor], t == plan_steps[cursor]
            cursor = cursor + when.astype(jnp.int32)
        storage = _slots.store(storage, slot, x, when)
        positions = positions.at[slot].set(jnp.where(when, t, positions[slot]))
        new_x, bufs, written = advance(body, loop.layout, x, bufs, active, written)
        x = select_if_batched(active, new_x, x)
        trips = trips + active.astype(jnp.int32)
        active = _continue(loop, active, x, bufs, written)
        _progress.tick(meter, t + 1)
        return t + 1, x, bufs, written, active, trips, storage, positions, cursor

    zero = jnp.array(0, jnp.int32)
    state = (
        zero,
        loop.init,
        loop.bufs,
        _masks(loop.layout) if checked else None,
        jnp.asarray(loop.cond(loop.init, loop.bufs), bool),
        zero,
        _slots.empty(loop.init, slots),
        jnp.full((slots,), _slots.UNUSED, jnp.int32),
        zero,
    )
    length, x, bufs, _, _, trips, storage, positions, _ = _vma.while_loop(
        cond, step, state
    )
    _progress.done(meter, length)
    return (x, bufs), Tape(storage, positions, trips, length, bufs)


def replay_sweep(body, layout, x, bufs, trips, length):
    """The steps a checkpointed sweep took, again, from `x` and `bufs`.

    `trips` and `length` come from its `Tape`: the replay runs `length` iterations and
    each element steps while its own count is below `trips`, without evaluating the
    predicate (evaluating it again could round differently and stop elsewhere). The
    forward-mode tangent of the loop is the JVP of this sweep.

    **Returns:**

    The final `(x, bufs)`.
    """

    def cond(state):
        return state[0] < length

    def step(state):
        t, x, bufs = state
        active = t < trips
        new_x, bufs, _ = advance(body, layout, x, bufs, active)
        return t + 1, select_if_batched(active, new_x, x), bufs

    _, x, bufs = _vma.while_loop(cond, step, (jnp.array(0, jnp.int32), x, bufs))
    return x, bufs
