"""Where the checkpointed forward stores: a rule it consults at each store event.

The forward sweep runs its steps in a tight loop up to the next *store event*; at
each event a rule says whether to store the current state, in which slot, and where
the next event is. Two rules:

- `OnlineRule`: the rule of `_schedule.online_stores`, computed in the loop from a
  few arrays of one entry per slot that it carries. Nothing is planned while
  tracing, so any trip count is placed alike: for unbounded loops and bounds past
  `TABLE_STEPS`.
- `TableRule`: the stores listed while tracing, replayed from a table: the same
  `online_stores` up to a bound of `TABLE_STEPS`, or a scan's
  `_schedule.offline_stores` (its trip count is known).

Both keep the choice unbatched: under `vmap` the whole batch shares one schedule.
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._schedule import (
    BAND_CAP,
    grown_bands,
    INT32_MAX,
    offline_stores,
    online_stores,
)


class Decision(NamedTuple):
    """What a store event does."""

    store: Bool[Array, ""]  # store the current state
    slot: Int[Array, ""]  # ... in this slot
    state: object  # the rule's state after the event
    stop: Int[Array, ""]  # the step of the next event


class OnlineState(NamedTuple):
    """`OnlineRule`'s carry (see `_schedule.online_stores`)."""

    # row 0: the stored positions in increasing order; row 1: the slot of each
    held: Int[Array, "2 slots"]
    # `bands[k] = C(k + r, k)` in the current regime `r`
    bands: Float[Array, " slots+1"]


class OnlineRule:
    """`_schedule.online_stores`, in the compiled loop (which tests hold to it).

    **Arguments:**

    - `slots`: the number of checkpoint slots, at least 2.

    A store event comes every `r + 1` steps in regime `r`. Each is elementwise
    operations and one reduction on arrays of `slots` entries, about eight kernels
    (XLA's compile time grows with their number: 0.05 to 0.1 s here), in a
    `lax.cond` branch that the first `slots - 1` events (which fill the free slots)
    skip. At run time they cost no more than a table lookup: a width-4 Euler
    gradient at 32 slots takes 0.93 to 0.95 times as long unbounded as with a
    table (`max_steps=16384`) at 10**3 and 10**4 steps.
    """

    def __init__(self, slots: int):
        assert slots >= 2
        self.slots = slots

    def initial(self) -> OnlineState:
        """The state after `x_0` is stored: as if the free slots were filled (the
        first events fill them without reading it)."""
        ramp = jnp.arange(self.slots, dtype=jnp.int32)
        bands = jnp.ones(self.slots + 1, jnp.float32)
        return OnlineState(jnp.stack([ramp, ramp]), bands)

    def first_stop(self, state: OnlineState) -> Int[Array, ""]:
        return jnp.array(1, jnp.int32)

    def decide(self, t: Int[Array, ""], state: OnlineState) -> Decision:
        """The event at step `t` (after the previous event's `stop`)."""

        def fill(state):
            return Decision(jnp.array(True), t, state, t + 1)

        return lax.cond(t < self.slots, fill, functools.partial(self._merge, t), state)

    def _merge(self, t: Int[Array, ""], state: OnlineState) -> Decision:
        """An event past the first `slots - 1`, which fill the free slots."""
        slots = self.slots
        held, bands = state
        tail = held[0, -1]
        # the scalars first, from `bands[1] = r + 1` and `bands[-1]`, so that the
        # vectors are only read by the choice and written by the update
        r1, last = bands[1], bands[-1]
        end = jnp.minimum(jnp.round(last * (slots + r1) / r1), BAND_CAP)
        # past the regime's last trip count, `C(slots + r + 1, slots) - 1`
        crossing = _f32(t + 1) >= end
        width = jnp.where(crossing, r1 + 1, r1)  # bands[1] after: r + 1
        due = _f32(t - tail) >= width
        stop = jnp.maximum(jnp.where(due, t, tail) + width.astype(jnp.int32), t + 1)
        bands = jnp.where(crossing, grown_bands(bands, jnp), bands)
        merged, slot = _merge(held, t, bands)
        held = jnp.where(due, merged, held)
        return Decision(due, slot, OnlineState(held, bands), stop)


def _f32(x):
    return jnp.asarray(x).astype(jnp.float32)


def _merge(held, t, bands):
    """`held` after storing `x_t` in place of position `s`, chosen as
    `_schedule._merge_choice` does (`t` last, in the freed slot); and that slot."""
    slots = held.shape[1]
    positions, order = held
    # dropping positions[s] (s = 1 .. slots - 1) merges [ext[s - 1], ext[s + 1]),
    # where `ext` is `positions` with `t` appended; its band is that of
    # `slots - s + 1` slots
    after = jnp.concatenate([positions[2:], t[None]])
    merged = _f32(after - positions[:-1])
    limit = bands[slots:1:-1]
    s = jnp.arange(1, slots, dtype=jnp.float32)
    # the fitting merge nearest the tail, else the least overfilled (by ratio)
    key = jnp.where(merged <= limit, 2.0 + s / slots, -(merged / limit))
    pick = 1 + jnp.argmax(key).astype(jnp.int32)
    slot = order[pick]
    # columns from `pick` on shift left by one, and `(t, slot)` comes last
    shifted = jnp.concatenate([held[:, 1:], jnp.stack([t, slot])[:, None]], axis=1)
    cols = jnp.arange(slots, dtype=jnp.int32)
    return jnp.where(cols < pick, held, shifted), slot


class TableRule:
    """Stores listed while tracing, as `(t, slot)` pairs in order (`x_0`'s first).

    A loop with a short bound replays `_schedule.online_stores` from a table,
    which costs a few milliseconds of Python and fewer kernels to compile than
    `OnlineRule`'s arithmetic; a scan replays `_schedule.offline_stores`.
    """

    def __init__(self, steps: np.ndarray, slot_ids: np.ndarray):
        # a sentinel step past any loop ends the table
        self.steps = jnp.asarray(np.append(steps, INT32_MAX), jnp.int32)
        self.slot_ids = jnp.asarray(np.append(slot_ids, 0), jnp.int32)

    def initial(self) -> Int[Array, ""]:
        """The cursor: the table's next entry, after `x_0`'s."""
        return jnp.array(1, jnp.int32)

    def first_stop(self, cursor: Int[Array, ""]) -> Int[Array, ""]:
        return self.steps[cursor]

    def decide(self, t: Int[Array, ""], cursor: Int[Array, ""]) -> Decision:
        store = t == self.steps[cursor]
        slot = self.slot_ids[cursor]
        cursor = cursor + store.astype(jnp.int32)
        return Decision(store, slot, cursor, jnp.maximum(self.steps[cursor], t + 1))


# bounds up to this many steps replay a table (listing it takes 4 ms of Python at 16
# slots, 15 ms at 1000, 44 ms at 256, the slowest); longer and unbounded loops
# decide as they run
TABLE_STEPS = 16384


@functools.lru_cache(maxsize=64)
def _table(slots: int, length: int, known_length: bool):
    if known_length:
        stores = offline_stores(length, slots)
    else:
        stores = online_stores(length, slots)
    steps, slot_ids = np.asarray(stores, dtype=np.int64).reshape(-1, 2).T
    return steps, slot_ids


def store_rule(slots: int, max_steps: int | None, known_length: bool):
    """The rule of a checkpointed forward sweep; `None` when every step is stored
    (`slots >= max_steps`)."""
    if max_steps is not None and slots >= max_steps:
        return None
    if known_length or slots <= 1:  # a scan; or only `x_0` is stored
        return TableRule(*_table(slots, max_steps or 0, known_length))
    if max_steps is not None and max_steps <= TABLE_STEPS:
        return TableRule(*_table(slots, max_steps, False))
    return OnlineRule(slots)
