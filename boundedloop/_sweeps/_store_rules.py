"""Where the checkpointed forward stores: a rule it consults at each store event,
`OnlineRule` or `TableRule` (see `docs/architecture.md`, "Where checkpoints go").
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int

from ._schedule import (
    BAND_CAP,
    grown_bands,
    INT32_MAX,
    KEPT,
    KEY_CAP,
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

    # the stored positions in increasing order, and the slot of each
    held: tuple[Int[Array, " slots"], Int[Array, " slots"]]
    # `bands[k] = C(k + r, k)` in the current regime `r`, clipped at `BAND_CAP`
    bands: Int[Array, " slots+1"]
    # the next regime's, `C(k + r + 1, k)`, as `_schedule.grown_bands` gives them
    grown: Int[Array, " slots+1"]


class OnlineRule:
    """`_schedule.online_stores`, in the compiled loop (which tests hold to it).

    **Arguments:**

    - `slots`: the number of checkpoint slots, at least 2.

    A store event comes every `r + 1` steps in regime `r`. Each is elementwise
    operations, one comparison of the positions with the regime's targets and one
    `argmin` on arrays of `slots` entries, in a `lax.cond`
    branch that the first `slots - 1` events (which fill the free slots) skip; the
    next regime's bands are computed in a branch taken once a regime. All of it is
    exact int32 arithmetic (no float rounding, which differs between backends:
    a TPU divides otherwise than NumPy), so every backend places alike. At run time
    they cost no more than a table lookup (`docs/design-notes.md`).
    """

    def __init__(self, slots: int):
        assert slots >= 2
        self.slots = slots

    def initial(self) -> OnlineState:
        """The state after `x_0` is stored: as if the free slots were filled (the
        first events fill them without reading it)."""
        ramp = jnp.arange(self.slots, dtype=jnp.int32)
        bands = [1] * (self.slots + 1)
        grown = jnp.asarray(grown_bands(bands), jnp.int32)
        return OnlineState((ramp, ramp), jnp.asarray(bands, jnp.int32), grown)

    def first_stop(self, state: OnlineState) -> Int[Array, ""]:
        return jnp.array(1, jnp.int32)

    def decide(self, t: Int[Array, ""], state: OnlineState) -> Decision:
        """The event at step `t` (after the previous event's `stop`)."""

        def fill(state):
            return Decision(jnp.array(True), t, state, t + 1)

        return lax.cond(t < self.slots, fill, functools.partial(self._merge, t), state)

    def _merge(self, t: Int[Array, ""], state: OnlineState) -> Decision:
        """An event past the first `slots - 1`, which fill the free slots."""
        held, bands, grown = state
        tail = held[0][-1]
        # past the regime's last trip count, `C(slots + r + 1, slots) - 1` (the
        # last of the next regime's bands); a regime whose end is clipped is the
        # last (as in `online_stores`)
        end = grown[-1]
        crossing = (t + 1 >= end) & (end < BAND_CAP)
        width = jnp.where(crossing, grown[1], bands[1])  # bands[1] after: r + 1
        due = t - tail >= width
        stop = jnp.maximum(jnp.where(due, t, tail) + width, t + 1)
        # a branch: the vector's integer divisions (scalar on a CPU) run once a
        # regime
        bands, grown = lax.cond(
            crossing,
            lambda bands, grown: (grown, _grown_bands(grown)),
            lambda bands, grown: (bands, grown),
            bands,
            grown,
        )
        merged, slot = _merge(held, t, bands, grown)
        held = tuple(jnp.where(due, m, h) for m, h in zip(merged, held))
        return Decision(due, slot, OnlineState(held, bands, grown), stop)


def _grown_bands(bands):
    """The next regime's bands (`_schedule.grown_bands`)."""
    ks = jnp.arange(bands.shape[0], dtype=jnp.int32)
    return _grown(bands, ks, bands[1])


def _grown(b, k, r1):
    """`_schedule.grown_bands`: `min(b + b * k // r1, BAND_CAP)`, the same integers
    in int32 without overflow. With `q, rem = divmod(b, r1)`, `b * k // r1 = q * k +
    rem * k // r1`. `rem * k < r1 * slots <= 2 C(slots + r, slots) < 2**31`, since a
    regime is entered only while its `C(slots + r, slots)` is below `BAND_CAP`
    (`r1 = 1` in regime 0, where `rem = 0`). `q` is first clipped where `q * k`
    alone would pass `BAND_CAP` (the result is clipped then anyway), so the sum
    stays below `BAND_CAP + 2k`, and the clipping adds without overflow."""
    # every operand is non-negative: truncating `lax.div` is floor division
    q, rem = lax.div(b, r1), lax.rem(b, r1)
    q = jnp.minimum(q, lax.div(jnp.int32(BAND_CAP), jnp.maximum(k, 1)) + 1)
    more = q * k + lax.div(rem * k, r1)
    return jnp.minimum(b, BAND_CAP - more) + more


# up to this many slots the online rule's search compares every pair (see `_merge`)
COMPARE_ALL = 8


def _merge(held, t, bands, grown):
    """`held` after storing `x_t` in place of position `s`, chosen as
    `_schedule._merge_choice` does (`t` last, in the freed slot); and that slot."""
    positions, order = held
    slots = positions.shape[0]
    ext = jnp.concatenate([positions, t[None]])
    # the regime's targets (`_schedule.targets`) and how many lie before each of
    # `ext`: `positions[s]` stands in for one in `[ext[s], ext[s + 1])` and is kept
    goal = grown[slots] - grown[slots - 1 : 0 : -1]  # increasing
    # a binary search unrolled (no loop), `slots * log2(slots)` comparisons: a
    # comparison of every pair would take `slots**2` of them, and memory
    # (`docs/design-notes.md`). Up to `COMPARE_ALL` slots every pair is
    # compared: the search over one target (`slots = 2`) lowers to a one-step loop
    # from a known counter, which no loop of ours may have (`opaque_counters`)
    method = "compare_all" if slots <= COMPARE_ALL else "scan_unrolled"
    before = jnp.searchsorted(goal, ext, side="left", method=method)
    before = before.astype(jnp.int32)
    kept = before[2:] > before[1:-1]
    # dropping positions[s] (s = 1 .. slots - 1) merges [ext[s - 1], ext[s + 1]),
    # whose band is that of `slots - s + 1` slots; every operand is below `2**31`
    over = ext[2:] - ext[:-2] - bands[slots:1:-1]
    s = jnp.arange(1, slots, dtype=jnp.int32)
    key = jnp.where(over <= 0, -s, jnp.minimum(over, KEY_CAP))
    key = key + jnp.where(kept, KEPT, 0)
    pick = 1 + jnp.argmin(key).astype(jnp.int32)  # the first of the least
    slot = order[pick]
    # columns from `pick` on shift left by one, and `(t, slot)` comes last
    cols = jnp.arange(slots, dtype=jnp.int32)

    def shift(row, last):
        shifted = jnp.concatenate([row[1:], last[None]])
        return jnp.where(cols < pick, row, shifted)

    return (shift(positions, t), shift(order, slot)), slot


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
        # past `t`: `t` is at most the event's step, and the steps increase
        return Decision(store, slot, cursor, self.steps[cursor])


# bounds up to this many steps replay a table (what listing it costs:
# `docs/design-notes.md`); longer and unbounded loops decide as they run
TABLE_STEPS = 16384


@functools.lru_cache(maxsize=64)
def _table(slots: int, length: int, known_length: bool):
    if known_length:
        stores = offline_stores(length, slots)
    else:
        stores = online_stores(length, slots)
    steps, slot_ids = np.asarray(stores, dtype=np.int64).reshape(-1, 2).T
    return steps, slot_ids


def uniform_positions(slots: int, block: int, max_steps: int | None) -> list[int]:
    """Where a loop reversed in blocks of `block` steps stores, when `slots`
    checkpoints a block apart cover `max_steps` (else `[]`): every `block` steps,
    so that each block starts at a checkpoint and is never advanced to."""
    if not block or max_steps is None or slots * block < max_steps:
        return []
    return [k * block for k in range(slots) if k * block < max(max_steps, 1)]


def store_rule(
    slots: int,
    max_steps: int | None,
    known_length: bool,
    in_order: bool = False,
    block: int = 0,
):
    """The rule of a checkpointed forward sweep; `None` when every step is stored
    (`slots >= max_steps`). `in_order` (see `_cost_model.runs_in_order`): a loop
    whose arrays are all small computes its rule rather than read a table, which
    is one large array. `block`: the reverse sweep's blocks of taped steps (0:
    none), stored a block apart where that covers the loop (`uniform_positions`)."""
    if max_steps is not None and slots >= max_steps:
        return None
    if uniform := uniform_positions(slots, block, max_steps):
        return TableRule(np.asarray(uniform), np.arange(len(uniform)))
    if known_length or slots <= 1:  # a scan; or only `x_0` is stored
        return TableRule(*_table(slots, max_steps or 0, known_length))
    if max_steps is not None and max_steps <= TABLE_STEPS and not in_order:
        return TableRule(*_table(slots, max_steps, False))
    return OnlineRule(slots)
