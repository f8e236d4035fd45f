"""The forward sweeps: plain (nothing saved), checkpointed (saving the carry for the
reverse sweep) and replay (the same steps again, for forward-mode tangents).

Each runs the body while the predicate holds and fewer than `max_steps` steps have
been taken. Where buffers (or, for the checkpointed sweep, checkpoint bookkeeping)
are carried, the sweep keeps its control unbatched under `vmap`: it runs while any
element is still going and masks the elements that have stopped, instead of letting
`lax.while_loop`'s batching select (and so copy) every carried array per step. The
schedule is then shared by the whole batch and each element counts its own trip.

Each sweep is a named scope (`boundedloop_forward`, ...), so jaxprs and profiles
show which phase a loop is.
"""

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from . import _body_size, _progress, _tape
from ._batching import any_across_batch, select_if_batched
from ._checks import check_stopped, raise_violations
from ._schedule import INT32_MAX, store_plan
from ._shard_map import varying_while_loop
from ._step import advance
from ._tape import Tape
from ._trace import TracedLoop


if TYPE_CHECKING:
    from ._autodiff import LoopConfig


def _within(step, max_steps):
    return True if max_steps is None else step < max_steps


def _masks(bufs):
    """The buffer checks' state: which elements are written, and no violations."""
    none = jnp.array(False)
    return tuple(jnp.zeros(b.shape, bool) for b in bufs), (none, none)


def _continue(loop, active, x, bufs, written):
    active = jnp.logical_and(active, loop.cond(x, bufs))
    if written is not None:
        active = raise_violations(active, written[1])
    return active


def _finish(loop: TracedLoop, config: "LoopConfig", tree):
    """`tree`, with `bl.max_steps_check`'s error attached when it is on."""
    if config.stop_check is None:
        return tree
    return check_stopped(loop, tree, config.stop_check, config.max_steps)


def _body(loop: TracedLoop):
    return loop.body if loop.checked_body is None else loop.checked_body


@jax.named_scope("boundedloop_forward")
def plain_sweep(loop: TracedLoop, config: "LoopConfig"):
    """As `lax.while_loop(cond, body, init)`, stopping after `max_steps` steps.

    **Returns:**

    The final `(x, bufs)`.
    """
    body = _body(loop)
    max_steps = config.max_steps
    meter = _progress.start(max_steps)  # None unless `bl.progress_meter` is on
    if not loop.bufs:

        def cond(state):
            t, x = state
            return jnp.logical_and(_within(t, max_steps), loop.cond(x, ()))

        def step(state):
            t, x = state
            _progress.tick(meter, t + 1)
            return t + 1, advance(body, loop.layout, x, (), True)[0]

        init = (jnp.array(0, jnp.int32), loop.init)
        t, final = varying_while_loop(cond, step, init)
        _progress.done(meter, t)
        return _finish(loop, config, (final, ()))

    def masked_cond(state):
        t, _, _, _, active = state
        return jnp.logical_and(_within(t, max_steps), any_across_batch(active))

    def masked_step(state):
        t, x, bufs, written, active = state
        new_x, bufs, written = advance(body, loop.layout, x, bufs, active, written)
        x = select_if_batched(active, new_x, x)
        _progress.tick(meter, t + 1)
        return t + 1, x, bufs, written, _continue(loop, active, x, bufs, written)

    written = None if loop.checked_body is None else _masks(loop.bufs)
    active = jnp.asarray(loop.cond(loop.init, loop.bufs), bool)
    state = (jnp.array(0, jnp.int32), loop.init, loop.bufs, written, active)
    t, x, bufs, _, _ = varying_while_loop(masked_cond, masked_step, state)
    _progress.done(meter, t)
    return _finish(loop, config, (x, bufs))


def _planned(plan, t, cursor, level):
    """Where step `t` stands in `plan`: `(cursor, level, (aligned, u))`, storing at
    `t` if `aligned` and `u` is the plan's next step. `level` is `(stride,
    level_end)`: past the horizon the plan's second half replays at that stride (see
    `_schedule.Plan`); `None` for a loop that cannot pass the horizon."""
    if level is None:
        return cursor, level, (True, t)
    stride, level_end = level
    new_level = t == level_end  # at the horizon, and at each doubling of it
    cursor = jnp.where(new_level, plan.restart, cursor)
    stride = jnp.where(new_level, 2 * stride, stride)
    doubled = jnp.where(level_end > INT32_MAX // 2, INT32_MAX, 2 * level_end)
    level_end = jnp.where(new_level, doubled, level_end)
    return cursor, (stride, level_end), (t % stride == 0, t // stride)


def _next_due(plan, cursor, level, t):
    """The first step after `t` at which `_planned` may store or change level: the
    step of `plan.steps[cursor]` at the current stride, or the level's end."""
    stride, level_end = level
    step = plan.steps[cursor]
    scaled = jnp.where(step > INT32_MAX // stride, INT32_MAX, step * stride)
    due = jnp.minimum(scaled, level_end)
    return jnp.maximum(due, t + 1)  # always progress


@jax.named_scope("boundedloop_checkpointed_forward")
def checkpointed_sweep(loop: TracedLoop, config: "LoopConfig"):
    """The forward sweep of a differentiated loop: `plain_sweep`, storing the
    checkpoints `_schedule.store_plan` places.

    With a plan and cheap steps (see `_body_size`), a loop over store events,
    each followed by a tight loop of steps up to the next one, so that no step pays
    for a store it does not make; with costlier steps, one loop that stores where
    due (fewer loops to compile).

    **Returns:**

    `((x, bufs), tape)`: the final arrays (equal to `plain_sweep`'s) and the `Tape`.
    """
    body = _body(loop)
    max_steps, slots = config.max_steps, config.checkpoints
    meter = _progress.start(max_steps)  # None unless `bl.progress_meter` is on
    plan = store_plan(slots, max_steps, config.known_length)
    if plan is not None:
        plan = plan._replace(
            steps=jnp.asarray(plan.steps), slot_ids=jnp.asarray(plan.slot_ids)
        )

    def going(state):
        t, _, _, _, active, *_ = state
        return jnp.logical_and(_within(t, max_steps), any_across_batch(active))

    def step(state):
        t, x, bufs, written, active, trips, *rest = state
        new_x, bufs, written = advance(body, loop.layout, x, bufs, active, written)
        x = select_if_batched(active, new_x, x)
        trips = trips + active.astype(jnp.int32)
        active = _continue(loop, active, x, bufs, written)
        _progress.tick(meter, t + 1)
        return (t + 1, x, bufs, written, active, trips, *rest)

    def store_every_step(state):
        t, x, *rest, storage, positions, cursor, level, stop = state
        storage = _tape.store(storage, t, x)  # slot t holds x_t
        return step((t, x, *rest, storage, positions, cursor, level, stop))

    def store_if_due(state, going_now=True):
        """Store `x_t` if the plan says so and the loop goes on from it."""
        t, x, *rest, storage, positions, cursor, level, stop = state
        cursor, level, due = _planned(plan, t, cursor, level)
        slot = plan.slot_ids[cursor]
        when = jnp.logical_and(due[0], due[1] == plan.steps[cursor])
        when = jnp.logical_and(when, going_now)
        cursor = cursor + when.astype(jnp.int32)
        storage = _tape.store(storage, slot, x, when)
        positions = positions.at[slot].set(jnp.where(when, t, positions[slot]))
        return (t, x, *rest, storage, positions, cursor, level, stop)

    def store_event(state):
        """A store event, after a run of steps that may have ended the loop, and
        the next step that may store."""
        state = store_if_due(state, going(state))
        *state, cursor, level, _ = state
        return (*state, cursor, level, _next_due(plan, cursor, level, state[0]))

    def store_and_step(state):
        return step(store_if_due(state))

    def steps_then_store(state):
        # the steps up to the next store event, carrying nothing else; the store
        # comes after them so that the inner loop takes the carry as it is
        stepping, rest = state[:6], state[6:]
        stop = rest[-1]
        stepping = varying_while_loop(
            lambda s: jnp.logical_and(s[0] < stop, going(s)), step, stepping
        )
        return store_event((*stepping, *rest))

    zero = jnp.array(0, jnp.int32)
    cheap = plan is not None and _body_size.is_cheap(body)
    horizon = None if plan is None else plan.horizon
    if cheap and horizon is None:
        # a loop that cannot pass the horizon never changes level; the loop over
        # store events carries one anyway, so its temporary memory does not
        # depend on `max_steps`
        horizon = INT32_MAX
    state = (
        zero,
        loop.init,
        loop.bufs,
        None if loop.checked_body is None else _masks(loop.bufs),
        jnp.asarray(loop.cond(loop.init, loop.bufs), bool),
        zero,
        _tape.empty(loop.init, slots),
        jnp.full((slots,), _tape.UNUSED, jnp.int32),
        zero,
        None
        if horizon is None
        else (jnp.array(1, jnp.int32), jnp.array(horizon, jnp.int32)),
        zero,
    )
    if plan is None:
        outer = store_every_step
    elif cheap:
        outer = steps_then_store
        state = store_event(state)
    else:
        outer = store_and_step
    length, x, bufs, _, _, trips, storage, positions, *_ = varying_while_loop(
        going, outer, state
    )
    _progress.done(meter, length)
    if plan is None:
        steps = jnp.arange(slots, dtype=jnp.int32)
        positions = jnp.where(steps < length, steps, _tape.UNUSED)
    # the check travels with the trip count too, which every backward pass reads
    x, bufs, length = _finish(loop, config, (x, bufs, length))
    return (x, bufs), Tape(storage, positions, trips, length, bufs)


@jax.named_scope("boundedloop_replay")
def replay_sweep(body, layout, x, bufs, tape: Tape):
    """The steps a checkpointed sweep took, again, from `x` and `bufs`.

    The replay runs `tape.length` iterations and each element steps while its own
    count is below `tape.trips`, without evaluating the predicate (evaluating it
    again could round differently and stop elsewhere). The forward-mode tangent of
    the loop is the JVP of this sweep.

    **Returns:**

    The final `(x, bufs)`.
    """

    def cond(state):
        return state[0] < tape.length

    def step(state):
        t, x, bufs = state
        active = t < tape.trips
        new_x, bufs, _ = advance(body, layout, x, bufs, active)
        return t + 1, select_if_batched(active, new_x, x), bufs

    init = (jnp.array(0, jnp.int32), x, bufs)
    _, x, bufs = varying_while_loop(cond, step, init)
    return x, bufs
