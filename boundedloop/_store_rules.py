"""Where the checkpointed forward stores, decided in the compiled loop.

The forward sweep runs its steps in a tight loop up to the next *store event*; at
each event a rule says whether to store the current state, in which slot, and where
the next event is. Two rules:

- `OnlineRule`: the trip count is unknown. The rule of `_schedule.online_stores`,
  computed from a few arrays of one entry per slot that the loop carries: nothing is
  planned while tracing, and any trip count is placed alike.
- `TableRule`: a scan's trip count is known while tracing, so its stores are
  `_schedule.offline_stores`, a table of at most one entry per slot.

Both keep the choice unbatched: under `vmap` the whole batch shares one schedule.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._schedule import BAND_CAP, INT32_MAX, offline_stores


class Decision(NamedTuple):
    """What a store event does."""

    store: Bool[Array, ""]  # store the current state
    slot: Int[Array, ""]  # ... in this slot
    state: object  # the rule's state after the event
    stop: Int[Array, ""]  # the step of the next event


class OnlineState(NamedTuple):
    """`OnlineRule`'s carry: the stored positions in order and their slots, and
    the bands of the current regime (see `_schedule.online_stores`)."""

    held: Int[Array, " slots"]
    order: Int[Array, " slots"]
    bands: Int[Array, " slots+1"]  # `bands[k] = C(k + r, k)`, clipped at `BAND_CAP`


class OnlineRule:
    """`_schedule.online_stores`, in the compiled loop (which tests hold to it).

    **Arguments:**

    - `slots`: the number of checkpoint slots, at least 2.

    Per event this is a handful of operations on arrays of `slots` entries, in a
    `lax.cond` branch that the first `slots - 1` events (which fill the free slots)
    skip. A store event comes every `r + 1` steps in regime `r`.
    """

    def __init__(self, slots: int):
        assert slots >= 2
        self.slots = slots

    def initial(self) -> OnlineState:
        """The state after `x_0` is stored: as if the free slots were filled (the
        first events fill them without reading it)."""
        ramp = jnp.arange(self.slots, dtype=jnp.int32)
        return OnlineState(ramp, ramp, jnp.ones(self.slots + 1, jnp.int32))

    def first_stop(self, state: OnlineState) -> Int[Array, ""]:
        return jnp.array(1, jnp.int32)

    def decide(self, t: Int[Array, ""], state: OnlineState) -> Decision:
        """The event at step `t` (after the previous event's `stop`)."""
        slots = self.slots

        def fill(state):
            return Decision(jnp.array(True), t, state, t + 1)

        def merge(state):
            held, order, bands = state
            wider = _wider_bands(bands)
            # past the regime's last trip count, `C(slots + r + 1, slots) - 1`
            bands = jnp.where(t + 1 >= wider[slots], wider, bands)
            due = t - held[-1] >= bands[1]
            new_held, new_order = _merge(held, order, t, bands)
            held = jnp.where(due, new_held, held)
            order = jnp.where(due, new_order, order)
            stop = jnp.maximum(t + 1, held[-1] + bands[1])
            return Decision(due, order[-1], OnlineState(held, order, bands), stop)

        return lax.cond(t < slots, fill, merge, state)


def _wider_bands(bands: Int[Array, " slots+1"]) -> Int[Array, " slots+1"]:
    """The next regime's bands: a cumulative sum (Pascal's rule), in float32 so
    that it cannot overflow (exact below `2**24`), clipped at `BAND_CAP`."""
    total = jnp.cumsum(bands.astype(jnp.float32))
    return jnp.minimum(total, BAND_CAP).astype(jnp.int32)


def _merge(held, order, t, bands):
    """Store `x_t` in place of `held[s]`, `s` chosen as `_schedule._merge_choice`
    does: `(held, order)` afterwards (`t` last, in the freed slot)."""
    slots = held.shape[0]
    ext = jnp.append(held, t)
    # dropping held[s] (s = 1 .. slots - 1) merges [ext[s - 1], ext[s + 1]), whose
    # band is that of slots - s + 1 slots
    merged = ext[2:] - ext[:-2]
    limit = bands[slots:1:-1]
    s = jnp.arange(1, slots, dtype=jnp.int32)
    fits = merged <= limit
    # the fitting merge nearest the tail, else the least overfilled (by ratio)
    ratio: Float[Array, " slots-1"] = merged.astype(jnp.float32) / limit.astype(
        jnp.float32
    )
    key = jnp.where(fits, 2.0 + s.astype(jnp.float32) / slots, -ratio)
    pick = 1 + jnp.argmax(key).astype(jnp.int32)
    rows = jnp.arange(slots, dtype=jnp.int32)
    take = jnp.where(rows < pick, rows, rows + 1)
    ext_order = jnp.append(order, order[pick])
    return ext[take], ext_order[take]


class TableRule:
    """The stores of `_schedule.offline_stores(length, slots)`, from a table."""

    def __init__(self, length: int, slots: int):
        stores = offline_stores(length, slots)
        # a sentinel step past any loop ends the table
        self.steps = jnp.asarray([t for t, _ in stores] + [INT32_MAX], jnp.int32)
        self.slot_ids = jnp.asarray([s for _, s in stores] + [0], jnp.int32)

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


def store_rule(slots: int, max_steps: int | None, known_length: bool):
    """The rule of a checkpointed forward sweep; `None` when every step is stored
    (`slots >= max_steps`)."""
    if max_steps is not None and slots >= max_steps:
        return None
    if known_length:
        return TableRule(max_steps, slots)
    if slots <= 1:  # only `x_0`
        return TableRule(0, slots)
    return OnlineRule(slots)
