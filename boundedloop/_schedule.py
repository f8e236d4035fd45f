"""Where checkpoints go: pure Python, testable without autodiff.

Terms used throughout:

- `n`: the number of steps the loop took. Step `i` maps the state `x_i` to `x_{i+1}`.
- `c`: the number of checkpoint slots. Slot 0 always holds `x_0`.
- A *placement* is the sorted list of stored positions at the end of the forward sweep.
  Consecutive positions cut `[0, n)` into *segments*. The reverse sweep reverses them
  last to first; the segment with index `j` (counting from the start) may use the
  `c - j` slots that the earlier segments do not occupy, its own start included.
- `revolve_cost(l, k)`: the fewest extra body evaluations that reverse a segment of
  `l` steps from its stored start with `k` slots (Griewank and Walther 2000).

The forward placement is online: the trip count is unknown until the loop ends. At
each step `t` the forward may overwrite one slot with `x_t`; `online_actions` decides
when and which by steering towards the hindsight-optimal placement for the next trip
count `n* = C(c + r, c)`, where the binomial schedule is tightest (see there). The
choice depends only on `t` and `c`, so it is planned here once, as a short list of
(step, slot) actions that the compiled loop replays.
"""

import bisect
import functools
import math
from typing import NamedTuple

import numpy as np


INT32_MAX = 2**31 - 1

# The forward placement is planned `max_steps` steps ahead (a plan is a prefix of any
# longer one, so planning no further changes nothing), at most `MAX_HORIZON` steps
# (planning takes about 0.3 s there at 16 checkpoints and 3 s at 1000), and
# `UNBOUNDED_HORIZON` steps for `max_steps=None` (about 0.09 s at 16, so that an
# unbounded loop traces about as fast as a bounded one). Past the horizon the plan
# continues at a coarser stride (see `Plan`).
MAX_HORIZON = 2**17
UNBOUNDED_HORIZON = 2**15


def default_checkpoints(max_steps: int | None) -> int:
    """`checkpoints=None`: every step while `max_steps <= 16`, else
    `ceil(log2(max_steps)) + 4` copies of the carry (16 at `max_steps=4096`); 16
    copies for a loop with no bound (`max_steps=None`)."""
    if max_steps is None:
        return 16
    if max_steps <= 16:
        return max(max_steps, 1)
    return min(max_steps, math.ceil(math.log2(max_steps)) + 4)


def planning_horizon(max_steps: int | None) -> int:
    """How many steps ahead the forward placement is planned."""
    if max_steps is None:
        return UNBOUNDED_HORIZON
    return min(max(max_steps, 2), MAX_HORIZON)


@functools.cache
def binomial_table(max_slots: int, max_length: int) -> np.ndarray:
    """`table[k, r] = C(k + r, k)` for `k <= max_slots + 2`, clipped to int32.

    Enough columns that `table[2, r] >= max_length` for the last `r`, so every
    repetition number of a segment no longer than `max_length` is found (for `k >= 2`;
    `k = 1` has a closed form).
    """
    max_length = min(max(max_length, 2), INT32_MAX)
    width = 2
    while math.comb(2 + width - 1, 2) < max_length:
        width *= 2
    # Pascal's rule along each row: C(k + r, k) = sum over j <= r of C(k - 1 + j, j),
    # clipped as it goes (a clipped entry stays clipped: the rows increase)
    rows = [np.ones(width, dtype=np.int64)]
    for _ in range(max_slots + 2):
        rows.append(np.minimum(np.cumsum(rows[-1]), INT32_MAX))
    return np.stack(rows)


def repetitions(length: int, slots: int) -> int:
    """The smallest `r` with `C(slots + r, slots) >= length`: how often the busiest step
    of an optimally reversed segment is evaluated."""
    r = 0
    while math.comb(slots + r, slots) < length:
        r += 1
    return r


def revolve_cost(length: int, slots: int) -> int | float:
    """Extra body evaluations to reverse `length` steps from a stored start, with `slots`
    slots (the start's included): `r * l - C(k + r, r - 1)`. Infinite without slots."""
    if length <= 1:
        return 0
    if slots < 1:
        return math.inf
    r = repetitions(length, slots)
    return r * length - math.comb(slots + r, r - 1)


def revolve_split(length: int, slots: int) -> int:
    """How far to advance from a segment's start before storing the next checkpoint, so
    that the segment is reversed at `revolve_cost(length, slots)`.

    With one slot nothing can be stored: advance to the last step (`length - 1`).
    Otherwise `min(C(k + r - 1, k), l - C(k + r - 2, k - 1))` where `r` is the
    repetition number. Returns 0 for segments of at most one step.
    """
    if length <= 1:
        return 0
    if slots <= 1:
        return length - 1
    r = repetitions(length, slots)
    return min(
        math.comb(slots + r - 1, slots), length - math.comb(slots + r - 2, r - 1)
    )


def placement_cost(positions, n: int, slots: int) -> int | float:
    """Extra body evaluations the reverse sweep spends on a placement."""
    bounds = sorted(positions) + [n]
    assert bounds[0] == 0 and len(bounds) - 1 <= slots
    return sum(
        revolve_cost(bounds[j + 1] - bounds[j], slots - j)
        for j in range(len(bounds) - 1)
    )


def optimal_placement_costs(max_n: int, slots: int) -> np.ndarray:
    """`out[n]`: the cheapest placement cost for `n` steps with `slots` slots, chosen
    with hindsight (the best any forward sweep could leave). Dynamic programming over
    the first segment's length; `O(slots * max_n^2)`, for tests and benchmarks."""
    best = np.zeros(max_n + 1)
    best[1:] = np.inf
    for k in range(1, slots + 1):
        cost_k = np.array(
            [np.inf] + [revolve_cost(length, k) for length in range(1, max_n + 1)]
        )
        new = np.zeros(max_n + 1)
        for n in range(1, max_n + 1):
            # first segment of length l (k slots) + the rest (k - 1 slots)
            new[n] = np.min(cost_k[1 : n + 1] + best[n - 1 :: -1][:n])
        best = new
    return best


def _vector_revolve_cost(lengths: np.ndarray, slots: int, table: np.ndarray):
    lengths = np.asarray(lengths, dtype=np.int64)
    if slots == 1:
        out = lengths * (lengths - 1) // 2
    else:
        r = np.searchsorted(table[slots], lengths, side="left")
        out = r * lengths - table[slots + 1][np.maximum(r - 1, 0)]
    return np.where(lengths <= 1, 0, out)


def _cost_table(slots: int, max_length: int) -> np.ndarray:
    """`out[k, l] = revolve_cost(l, k)` for `1 <= k <= slots + 1`, `l <= max_length`
    (row 0 unused), as floats."""
    table = binomial_table(slots + 1, max_length)
    lengths = np.arange(max_length + 1, dtype=np.int64)
    out = np.zeros((slots + 2, max_length + 1))
    for k in range(1, slots + 2):
        out[k] = _vector_revolve_cost(lengths, k, table)
    return out


class _Target(NamedTuple):
    """The optimal placement for the next tight trip count `n* = C(slots + r, slots)`."""

    boundary: int  # n*
    ideal: list[int]  # its positions after 0, sorted
    ideal_array: np.ndarray
    ideal_set: set[int]


def _next_target(t: int, slots: int) -> _Target:
    """The target for the first `n* >= t + 2`."""
    r = 0
    while math.comb(slots + r, slots) < t + 2:
        r += 1
    boundary = math.comb(slots + r, slots)
    ideal = offline_placement(boundary, slots)[1:]
    return _Target(boundary, ideal, np.asarray(ideal, dtype=np.int64), set(ideal))


class _Options(NamedTuple):
    """The costs of storing the next state in each way, for a fixed placement (the
    cost of the old tail and the new one left out: they depend on `t`)."""

    last: int  # the newest stored position
    before_last: int
    base: float  # the cost of the complete segments
    s_all: int  # the cheapest slot to overwrite among all but the newest
    other_all: float
    s_free: int  # the cheapest among those not kept for the target
    other_free: float
    base_newest: float  # the cost without the newest position's segment
    newest_kept: bool  # the newest position is one of the target's
    newest_kept_from: int  # ... or stands in for one once `t` passes this


class _CostTable:
    """`revolve_cost` for `1 <= k <= slots + 1` slots, as `table(k, lengths)`,
    computed as far as the longest length asked for (doubling): segments stay far
    shorter than the horizon when there are many slots."""

    def __init__(self, slots: int):
        self.slots = slots
        self.seg_slots = slots - np.arange(slots - 1)  # segment j has slots - j slots
        self.flat = np.zeros(slots + 2)
        self.width = 1
        self.seg_rows = self.more_rows = self.merge_rows = self.seg_slots

    def upto(self, need: int) -> np.ndarray:
        """The table, flattened, at least as far as length `need`; index it at
        `*_rows + length` (rows of each segment's slots, one more, a merge's)."""
        if need >= self.width:
            self.width = max(need + 1, 2 * self.width, 1024)
            self.flat = _cost_table(self.slots, self.width - 1).ravel()
            self.seg_rows = self.seg_slots * self.width
            self.more_rows = self.seg_rows + self.width
            # [p_{s-1}, p_{s+1}) takes segment s - 1's slots
            self.merge_rows = self.seg_rows[:-1]
        return self.flat


def _store_options(positions, costs, slots: int, target: _Target, horizon: int):
    last, before_last = int(positions[-1]), int(positions[-2])
    # complete segments j = 0 .. slots - 2, with j's own slot count
    lengths = positions[1:] - positions[:-1]
    # a merged segment is at most twice the longest
    table = costs.upto(2 * int(lengths.max()))
    seg = table[costs.seg_rows + lengths]
    base = float(seg.sum())
    # other[s]: the cost of storing x_t in place of positions[s], 0 < s < slots - 1,
    # without the old tail's: segments s - 1 and s merge, later complete ones gain
    # a slot, the old tail [last, t) becomes a complete segment with two slots and
    # [t, t + 1) costs nothing
    other = np.full(slots, math.inf)
    if slots > 2:
        gain = np.cumsum((table[costs.more_rows + lengths] - seg)[::-1])[::-1]
        merged = table[costs.merge_rows + (positions[2:] - positions[:-2])]
        other[1:-1] = merged - seg[:-1] - seg[1:]
        other[1:-2] += gain[2:]
    s_all = int(other.argmin())
    other_all = base + other[s_all]
    # the positions kept for n*: for each optimal position x <= last, the latest
    # stored position at or before it
    known = bisect.bisect_right(target.ideal, last)
    kept = np.searchsorted(positions, target.ideal_array[:known], side="right") - 1
    other[kept] = math.inf
    s_free = int(other.argmin())
    return _Options(
        last=last,
        before_last=before_last,
        base=base,
        s_all=s_all,
        other_all=other_all,
        s_free=s_free,
        other_free=base + other[s_free],
        base_newest=base - float(seg[-1]),
        newest_kept=last in target.ideal_set,
        newest_kept_from=target.ideal[known] if known < len(target.ideal) else horizon,
    )


def _next_store(t: int, end: int, options: _Options, two_slots, target, slots: int):
    """The first step `t <= step < end` whose state is stored, and the slot index
    (into the sorted positions) it overwrites; `None` if nothing is stored before
    `end`."""
    while t < end:
        # if the loop ended at n = t + 1 with nothing stored at t
        tail = t + 1 - options.last
        skip = options.base + tail * (tail - 1) // 2
        # storing x_t in place of the newest: [positions[-2], t) merges
        newest = options.base_newest + two_slots[t - options.before_last]
        if options.newest_kept or t > options.newest_kept_from:
            # the newest is kept: overwrite one of the others, a free one if any
            if options.other_free < math.inf:
                newest, cost, s = math.inf, options.other_free, options.s_free
            else:
                cost, s = options.other_all, options.s_all
        else:
            cost, s = options.other_free, options.s_free
        cost += two_slots[t - options.last]
        if newest < cost:
            cost, s = newest, slots - 1
        if cost < skip or t in target.ideal_set:
            return t, s
        t += 1
    return None


@functools.lru_cache(maxsize=64)
def online_actions(slots: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Plan the forward sweep's stores for every step `t < horizon`.

    **Arguments:**

    - `slots`: the number of checkpoint slots, `>= 1`.
    - `horizon`: plan steps `t = 1, ..., horizon - 1` (the forward never stores the
      state it ends in).

    **Returns:**

    `(steps, slot_ids)`, increasing steps: at step `steps[a]` the forward stores `x_t`
    in slot `slot_ids[a]`. Slot 0 holds `x_0` and is never overwritten. Every action
    depends on `t` and `slots` only, so a shorter horizon plans a prefix of a longer
    one.

    **The rule.** Against the hindsight optimum an online placement pays most just
    before trip counts `n* = C(slots + r, slots)`, where every segment of the binomial
    schedule is full and the optimum is tightest. So the forward steers towards the
    optimal placement for the next such count, `n* >= t + 2`:

    - *When.* The first `slots - 1` steps fill the free slots. Afterwards `x_t` is
      stored if `t` is a position of that placement, or if storing it makes the loop
      cheaper to reverse should it end right after `x_t`.
    - *Where.* A store overwrites one position `p_s` (`s >= 1`), which merges the two
      segments around it. For each optimal position `x <= t` the latest position at
      or before it (`t` included) stands in for it and is kept; of the other
      positions the one whose merge is cheapest now is overwritten (when every
      position is kept, the cheapest of all).

    With two slots this stores at the triangular numbers, and its worst ratio to the
    optimum over `n <= 10000` (1.097, at `n = 29`) is the least any online placement
    can guarantee there. With more slots the worst ratio over `n <= 10000` falls from
    1.043 (`c = 3`) to 1.002 (`c = 16`) (tested up to 2000).
    """
    if slots <= 1:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if slots >= horizon:  # every step within the horizon has a slot of its own
        return np.arange(1, horizon, dtype=np.int64), np.arange(
            1, horizon, dtype=np.int64
        )
    costs = _CostTable(slots)
    lengths = np.arange(horizon + 1)
    two_slots = _vector_revolve_cost(lengths, 2, binomial_table(2, horizon)).tolist()
    # the first steps fill the free slots
    fill = min(slots, horizon)
    steps, slot_ids = list(range(1, fill)), list(range(1, fill))
    # positions in increasing order; owner[j] is the slot holding positions[j]
    positions = np.arange(fill, dtype=np.int64)
    owner = list(range(fill))
    t, target = fill, None
    while t < horizon:
        if target is None or t + 2 > target.boundary:
            target = _next_target(t, slots)
        options = _store_options(positions, costs, slots, target, horizon)
        # n* is the same for every t <= n* - 2
        store = _next_store(
            t, min(horizon, target.boundary - 1), options, two_slots, target, slots
        )
        if store is None:
            t = min(horizon, target.boundary - 1)
            continue
        t, s = store
        steps.append(t)
        slot_ids.append(owner[s])
        positions[s:-1] = positions[s + 1 :]  # drop positions[s], append t
        positions[-1] = t
        owner.append(owner.pop(s))
        t += 1
    return np.asarray(steps, dtype=np.int64), np.asarray(slot_ids, dtype=np.int64)


def forward_placement(n: int, slots: int, max_steps: int | None = None) -> list[int]:
    """The positions stored when the forward sweep of a loop bounded by `max_steps`
    ends after `n` steps (sorted), past the planning horizon too (see `Plan`)."""
    if n <= slots:
        return list(range(max(n, 1)))
    horizon = min(n, planning_horizon(max_steps))
    steps, slot_ids = online_actions(slots, horizon)
    held = {0: 0}
    for t, s in zip(steps.tolist(), slot_ids.tolist()):
        held[s] = t
    # past the horizon: the plan's second half again, at stride 2, 4, 8, ...
    restart = bisect.bisect_left(steps.tolist(), horizon // 2)
    stride, level_start = 2, horizon
    while level_start < n:
        for t, s in zip(steps[restart:].tolist(), slot_ids[restart:].tolist()):
            if t * stride >= min(2 * level_start, n):
                break
            held[s] = t * stride
        stride, level_start = 2 * stride, 2 * level_start
    return sorted(held.values())


def offline_placement(n: int, slots: int) -> list[int]:
    """The placement for a loop whose trip count `n` is known in advance: the first
    sweep of the binomial schedule (store at `revolve_split` of what is left, one
    slot fewer each time). It attains `optimal_placement_costs` (tested)."""
    positions, p, k = [0], 0, slots
    while k > 1 and n - p > 1:
        m = revolve_split(n - p, k)
        if p + m >= n:
            break
        p += m
        positions.append(p)
        k -= 1
    return positions


def reverse_events(positions, n: int, slots: int) -> list[tuple[str, int]]:
    """Reference simulator of the reverse sweep.

    **Arguments:**

    - `positions`: the placement the forward sweep left (any order; 0 included).
    - `n`: the trip count.
    - `slots`: the number of slots.

    **Returns:**

    The sweep's events in order: `("advance", i)` evaluates step `i` forward,
    `("reverse", i)` evaluates its vector-Jacobian product. Mirrors the compiled
    sweep in `_reverse_sweep.py` event for event.
    """
    stack = sorted(positions)
    events = []
    end = n
    if end == 0:
        return events
    i = stack[-1]
    target = i + revolve_split(end - i, slots - (len(stack) - 1))
    while end > 0:
        assert len(stack) <= slots
        if i == end - 1:
            events.append(("reverse", i))
            end -= 1
            if end == stack[-1]:
                stack.pop()
            if not stack:
                break
            i = stack[-1]
            target = i + revolve_split(end - i, slots - (len(stack) - 1))
        else:
            events.append(("advance", i))
            i += 1
            if i == target and i < end - 1:
                stack.append(i)
                target = i + revolve_split(end - i, slots - (len(stack) - 1))
    return events


def gradient_body_evaluations(n: int, slots: int, max_steps: int | None = None) -> int:
    """Body evaluations in one gradient of an `n`-step loop with `slots` slots,
    bounded by `max_steps`: `n` forward, `n` reversed, plus the reverse sweep's
    recomputation."""
    positions = forward_placement(n, slots, max_steps)
    return 2 * n + placement_cost(positions, n, slots)


class Plan(NamedTuple):
    """The forward sweep's stores: at step `steps[a]` store `x_t` in slot
    `slot_ids[a]`, `x_0` in slot 0 first and a sentinel last.

    A loop that can run past the planning `horizon` (`None` if it cannot) then
    replays the plan's second half (from index `restart`, the first step at or past
    `horizon // 2`) at stride 2, from step `horizon` to `2 * horizon`, then at stride
    4 up to `4 * horizon`, and so on: the placement for a loop `b` times longer is
    much like the placement for the shorter one, scaled by `b`. At 32 slots this
    keeps the gradient within 1.07 times the optimal body evaluations at `10**6`
    steps and 1.13 times at `10**7` (stopping at the horizon instead: 1782 times at
    `2 * 10**5` steps).
    """

    steps: np.ndarray
    slot_ids: np.ndarray
    horizon: int | None = None
    restart: int = 0


def store_plan(slots: int, max_steps: int | None, known_length: bool = False):
    """The `Plan` of the forward sweep; `None` when every step is stored
    (`slots >= max_steps`).

    With `known_length` the loop always takes `max_steps` steps (a scan), so the
    placement is planned offline for exactly that length."""
    if max_steps is not None and slots >= max_steps:
        return None
    horizon = None
    if known_length:
        positions = offline_placement(max_steps, slots)[1:]
        steps, slot_ids = np.asarray(positions), np.arange(1, len(positions) + 1)
    else:
        planned = planning_horizon(max_steps)
        steps, slot_ids = online_actions(slots, planned)
        if max_steps is None or max_steps > planned:
            horizon = planned
    # the restart index counts the leading store of x_0
    restart = 1 + int(np.searchsorted(steps, (horizon or 0) // 2, side="left"))
    steps = np.concatenate([[0], steps, [INT32_MAX]]).astype(np.int32)
    slot_ids = np.concatenate([[0], slot_ids, [0]]).astype(np.int32)
    return Plan(steps, slot_ids, horizon, restart)
