"""The forward sweeps: plain (nothing saved), checkpointed (saving the carry for the
reverse sweep) and replay (the same steps again, for forward-mode tangents).

Each runs the body while the predicate holds and fewer than `max_steps` steps have
been taken. Where buffers (or, for the checkpointed sweep, checkpoint bookkeeping)
are carried, the sweep keeps its control unbatched under `vmap` and masks the
elements that have stopped (`docs/guides/vmap.md`). Each sweep is a named scope
(`boundedloop_forward`, ...), so jaxprs and profiles show which phase a loop is.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._runtime import _progress
from .._runtime._batching import any_across_batch, select_if_batched
from .._runtime._checks import check_stopped
from .._runtime._shard_map import varying_while_loop
from .._tracing._dtypes import is_inexact
from .._tracing._loop import LoopConfig, TracedLoop
from . import _checkpoint_store, _cost_model, _tape
from ._buffer_checks import differs
from ._checkpoint_store import CheckpointStore
from ._step import advance, invariant_leaves
from ._store_rules import store_rule


def _within(step, max_steps):
    return True if max_steps is None else step < max_steps


def _going_on(loop, x, bufs):
    """Each element's predicate at `x`."""
    return jnp.asarray(loop.cond(x, bufs), bool)


def _active(loop, x, bufs):
    """Inside a masked loop's body: which elements step. The loop runs while any
    element's predicate holds, so without a batch this is `True` and the predicate
    is evaluated once per step, in the loop's condition (as `lax.while_loop`
    evaluates it); under `vmap` it is each element's predicate. An element that
    stops keeps its carry and buffers, so its predicate stays false."""
    going = _going_on(loop, x, bufs)
    # `going | True`: true, typed as `going` (inside `shard_map` too)
    return select_if_batched(going, jnp.logical_or(going, True), going)


def _finish(loop: TracedLoop, config: LoopConfig, tree):
    """`tree`, with `bl.max_steps_check`'s error attached when it is on."""
    if config.stop_check is None:
        return tree
    return check_stopped(loop, tree, config.stop_check, config.max_steps)


@jax.named_scope("boundedloop_forward")
def plain_sweep(loop: TracedLoop, config: LoopConfig):
    """As `lax.while_loop(cond, body, init)`, stopping after `max_steps` steps.

    **Returns:**

    The final `(x, bufs)`.
    """
    body = loop.body
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

    going, step = _stepping(loop, body, max_steps, meter)
    state = (jnp.array(0, jnp.int32), loop.init, loop.bufs, None, None, None)
    t, x, bufs, *_ = varying_while_loop(going, step, state)
    _progress.done(meter, t)
    return _finish(loop, config, (x, bufs))


class _Stores(NamedTuple):
    """The checkpointed forward's store bookkeeping, carried next to the step's."""

    storage: _checkpoint_store.Storage  # a row per slot
    positions: Int[Array, " slots"]  # the step whose state each slot holds
    rule: Any  # the store rule's state (see `_store_rules`)
    stop: Int[Array, ""]  # the step of the next store event


def _first_store(rule, x0, stores: _Stores) -> _Stores:
    """`stores` holding `x_0` in slot 0, even if the loop takes no step (the
    reverse sweep then reads nothing), and the rule's first event."""
    state = rule.initial()
    return stores._replace(
        storage=_checkpoint_store.store(stores.storage, 0, x0),
        positions=stores.positions.at[0].set(0),
        rule=state,
        stop=rule.first_stop(state),
    )


def _store_event(rule, t, x, stores: _Stores, going) -> _Stores:
    """After a run of steps that may have ended the loop: store `x_t` if the rule
    says so and the loop goes on from it, and find the next event."""
    decision = rule.decide(t, stores.rule)
    when = jnp.logical_and(decision.store, going)
    slot, positions = decision.slot, stores.positions
    return _Stores(
        storage=_checkpoint_store.store(stores.storage, slot, x, when),
        # a slot in use is counted once, after the loop: a second read of
        # `positions` here made XLA copy it at every store event, and the loop too
        # large for XLA's CPU backend to compile it into one kernel
        # (`docs/design-notes.md`)
        positions=_checkpoint_store.set_where(positions, slot, t, when),
        rule=decision.state,
        stop=decision.stop,
    )


def _initial_stores(
    loop: TracedLoop, slots: int, perturbed=None, in_order: bool = False
) -> _Stores:
    """Empty storage; the rule's state comes with the first store."""
    invariant = invariant_leaves(loop.body, len(loop.init))
    return _Stores(
        _checkpoint_store.empty(loop.init, slots, perturbed, in_order, invariant),
        jnp.full((slots,), _checkpoint_store.UNUSED, jnp.int32),
        None,
        jnp.array(0, jnp.int32),
    )


def initial_stamps(loop: TracedLoop, config: LoopConfig) -> tuple | None:
    """The checkpointed sweep's stamps before its first step: per buffer, `-1` per
    element where it stamps the buffer, else `None`; `None` if it stamps none. It
    stamps a floating buffer lent to an inner loop (`Layout.shared`), in a checked
    loop, where the body or an inner loop reads it (`Layout.lent_read`): by
    default one of at most `_cost_model.SMALL_BUFFERS` bytes (a larger one would be
    copied every step to compare), inside `bl.buffer_checks()` any. The stamps, the
    last step that changed each element, let the reverse sweep's check find an
    inner loop's read of a location that a later step of this loop writes
    (`_buffer_checks.reverse_check`)."""
    if config.buffer_check is None:
        return None
    stamps = tuple(
        jnp.full(b.shape, -1, jnp.int32)
        if leaf in loop.layout.shared
        and (leaf in loop.layout.lent_read or leaf in loop.layout.read_leaves)
        and is_inexact(b)
        and (
            config.buffer_rules
            or b.size * b.dtype.itemsize <= _cost_model.SMALL_BUFFERS
        )
        else None
        for leaf, b in enumerate(loop.bufs)
    )
    return stamps if any(s is not None for s in stamps) else None


def _stepping(loop: TracedLoop, body, max_steps, meter, taped=None):
    """`(going, step)` on `(t, x, bufs, trips, tape, stamps)`: whether the loop
    goes on, and one masked step, counting each element's trips (unless `trips` is
    `None`), with a `_tape.TapedStep` `taped`, writing its residuals into `tape`,
    and stamping `t` where it changes a buffer that has stamps (`initial_stamps`;
    `stamps` `None`: none has)."""

    def going(stepping):
        t, x, bufs = stepping[:3]
        on = any_across_batch(_going_on(loop, x, bufs))
        return jnp.logical_and(_within(t, max_steps), on)

    def step(stepping):
        t, x, bufs, trips, tape, stamps = stepping
        active = _active(loop, x, bufs)
        if taped is None:
            new_x, new_bufs = advance(body, loop.layout, x, bufs, active)
        else:
            new_x, new_bufs, row = taped.forward(x, bufs, active)
            tape = _tape.write(tape, t, row)
        if stamps is not None:
            stamps = tuple(
                None if s is None else jnp.where(differs(new, old), t, s)
                for s, new, old in zip(stamps, new_bufs, bufs)
            )
        x = select_if_batched(active, new_x, x)
        if trips is not None:
            trips = trips + active.astype(jnp.int32)
        _progress.tick(meter, t + 1)
        return t + 1, x, new_bufs, trips, tape, stamps

    return going, step


@jax.named_scope("boundedloop_checkpointed_forward")
def checkpointed_sweep(
    loop: TracedLoop, config: LoopConfig, perturbed=None, taped_step=None
):
    """The forward sweep of a differentiated loop: `plain_sweep`, storing the
    checkpoints where `_store_rules.store_rule` says.

    With a rule, a loop over store events, each followed by a tight loop of steps up
    to the next one, so that no step pays for a store it does not make (a store
    writes every carry leaf; `docs/design-notes.md`); without one
    (every step stored), one loop that stores each step.

    `perturbed`, optional, one bool per carry leaf, lets the storage pack floating
    scalars by whether they are perturbed (see `_checkpoint_store.empty`).
    `taped_step`, optional, `loop`'s step as a `ReversibleStep`: where
    `config.forward_tapes`, each step is linearized and its residuals kept
    (`_tape`, row `t % tape_steps`), for the reverse sweep.

    **Returns:**

    `((x, bufs), tape)`: the final arrays (equal to `plain_sweep`'s) and the `CheckpointStore`.
    """
    body = loop.body
    max_steps, slots = config.max_steps, config.checkpoints
    meter = _progress.start(max_steps)  # None unless `bl.progress_meter` is on
    rows = [jax.ShapeDtypeStruct((slots, *x.shape), x.dtype) for x in loop.init]
    in_order = _cost_model.runs_in_order(body, slots, max_steps, (rows, loop.bufs))
    # a reverse sweep in taped blocks wants its checkpoints a block apart
    block = 0 if config.tapes_every_step else config.tape_steps
    rule = store_rule(slots, max_steps, config.known_length, in_order, block)

    # the carry: `stepping = (t, x, bufs, trips, tape, stamps)` and `_Stores`
    taped = tape = None
    if taped_step is not None and config.forward_tapes:
        taped = _tape.TapedStep(taped_step, loop.init, loop.bufs)
        tape = taped.empty(config.tape_steps)
    going, step = _stepping(loop, body, max_steps, meter, taped)

    def store_every_step(state):
        stepping, stores = state
        t, x = stepping[:2]  # slot t holds x_t
        return step(stepping), stores._replace(
            storage=_checkpoint_store.store(stores.storage, t, x)
        )

    def steps_then_store(state):
        # the steps up to the next store event, carrying nothing else; the store
        # comes after them so that the inner loop takes the carry as it is
        stepping, stores = state
        stepping = varying_while_loop(
            lambda s: jnp.logical_and(s[0] < stores.stop, going(s)), step, stepping
        )
        return stepping, _store_event(rule, *stepping[:2], stores, going(stepping))

    zero = jnp.array(0, jnp.int32)
    stepping = (zero, loop.init, loop.bufs, zero, tape, initial_stamps(loop, config))
    stores = _initial_stores(loop, slots, perturbed, in_order)
    if rule is None:
        outer = store_every_step
    else:
        outer = steps_then_store
        stores = _first_store(rule, loop.init, stores)
    stepping, stores = varying_while_loop(
        lambda state: going(state[0]), outer, (stepping, stores)
    )
    length, x, bufs, trips, tape, stamps = stepping
    _progress.done(meter, length)
    positions = stores.positions
    used = jnp.sum(positions != _checkpoint_store.UNUSED, dtype=jnp.int32)
    if rule is None:
        steps = jnp.arange(slots, dtype=jnp.int32)
        positions = jnp.where(steps < length, steps, _checkpoint_store.UNUSED)
        used = jnp.minimum(length, slots)
    # the check travels with the trip count too, which every backward pass reads
    x, bufs, length = _finish(loop, config, (x, bufs, length))
    return (x, bufs), CheckpointStore(
        stores.storage, positions, used, trips, length, bufs, tape, stamps
    )


@jax.named_scope("boundedloop_replay")
def replay_sweep(body, layout, x, bufs, tape: CheckpointStore):
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
        new_x, bufs = advance(body, layout, x, bufs, active)
        return t + 1, select_if_batched(active, new_x, x), bufs

    init = (jnp.array(0, jnp.int32), x, bufs)
    _, x, bufs = varying_while_loop(cond, step, init)
    return x, bufs
