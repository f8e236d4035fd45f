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

The forward placement is online: the trip count is unknown until the loop ends. After
storing `x_t` we pick, among "store nothing" and "overwrite one slot with `x_t`", the
placement that would be cheapest to reverse if the loop ended right after `x_t`. That
choice depends only on `t` and `c`, so it is planned here once, as a short list of
(step, slot) actions that the compiled loop replays.
"""

import functools
import math

import numpy as np


_INT32_MAX = 2**31 - 1


@functools.cache
def binomial_table(max_slots: int, max_length: int) -> np.ndarray:
    """`table[k, r] = C(k + r, k)` for `k <= max_slots + 2`, clipped to int32.

    Enough columns that `table[2, r] >= max_length` for the last `r`, so every
    repetition number of a segment no longer than `max_length` is found (for `k >= 2`;
    `k = 1` has a closed form).
    """
    max_length = min(max(max_length, 2), _INT32_MAX)
    width = 2
    while math.comb(2 + width - 1, 2) < max_length:
        width *= 2
    rows = []
    for k in range(max_slots + 3):
        rows.append([min(math.comb(k + r, k), _INT32_MAX) for r in range(width)])
    return np.asarray(rows, dtype=np.int64)


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


@functools.lru_cache(maxsize=1 << 16)
def _cached_cost(length: int, slots: int) -> int | float:
    return revolve_cost(length, slots)


def _vector_revolve_cost(lengths: np.ndarray, slots: int, table: np.ndarray):
    lengths = np.asarray(lengths, dtype=np.int64)
    if slots == 1:
        out = lengths * (lengths - 1) // 2
    else:
        r = np.searchsorted(table[slots], lengths, side="left")
        out = r * lengths - table[slots + 1][np.maximum(r - 1, 0)]
    return np.where(lengths <= 1, 0, out)


@functools.lru_cache(maxsize=64)
def online_actions(slots: int, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Plan the forward sweep's stores for every step `t < horizon`.

    **Arguments:**

    - `slots`: the number of checkpoint slots, `>= 1`.
    - `horizon`: plan steps `t = 1, ..., horizon - 1` (the forward never stores the
      state it ends in).

    **Returns:**

    `(steps, slot_ids)`, increasing steps: at step `steps[a]` the forward stores `x_t`
    in slot `slot_ids[a]`. Slot 0 holds `x_0` and is never overwritten. The list is
    short: the placement changes roughly `slots * log(horizon)` times.
    """
    table = binomial_table(slots, horizon)
    steps: list[int] = []
    slot_ids: list[int] = []
    # positions[j] in increasing order; owner[j] is the slot holding positions[j]
    positions = [0]
    owner = [0]
    t = 1
    while t < horizon and len(positions) < slots:
        steps.append(t)
        slot_ids.append(len(positions))
        positions.append(t)
        owner.append(len(owner))
        t += 1
    window = 64
    while t < horizon:
        ts = np.arange(t, min(t + window, horizon), dtype=np.int64)
        last = positions[-1]
        # complete segments j = 0 .. slots - 2, with j's own slot count and one more
        seg = [
            _cached_cost(positions[j + 1] - positions[j], slots - j)
            for j in range(slots - 1)
        ]
        seg_up = [
            _cached_cost(positions[j + 1] - positions[j], slots - j + 1)
            for j in range(slots - 1)
        ]
        base = sum(seg)
        # if the loop ended at n = t + 1 with nothing stored at t
        skip = base + _vector_revolve_cost(ts + 1 - last, 1, table)
        # storing x_t in place of positions[s], s < slots - 1: segments s - 1 and s
        # merge, later ones gain a slot, the old tail [last, t) becomes a complete
        # segment with two slots and [t, t + 1) costs nothing
        fixed, best_s = math.inf, 0
        gain = 0
        for s in range(slots - 2, 0, -1):
            gain += seg_up[s + 1] - seg[s + 1] if s + 1 < slots - 1 else 0
            merged = _cached_cost(positions[s + 1] - positions[s - 1], slots - s + 1)
            cost_s = base - seg[s - 1] - seg[s] + merged + gain
            if cost_s <= fixed:
                fixed, best_s = cost_s, s
        replace = fixed + _vector_revolve_cost(ts - last, 2, table)
        # storing x_t in place of the newest checkpoint: [positions[-2], t) merges
        if slots >= 2:
            newest = (
                base
                - seg[slots - 2]
                + _vector_revolve_cost(ts - positions[slots - 2], 2, table)
            )
            use_newest = newest < replace
            replace = np.where(use_newest, newest, replace)
        act = np.nonzero(replace < skip)[0]
        if len(act) == 0:
            t = int(ts[-1]) + 1
            window *= 2
            continue
        a = int(act[0])
        t_act = int(ts[a])
        s = slots - 1 if (slots >= 2 and use_newest[a]) else best_s
        steps.append(t_act)
        slot_ids.append(owner[s])
        freed = owner.pop(s)
        positions.pop(s)
        positions.append(t_act)
        owner.append(freed)
        t = t_act + 1
        window = 64
    return np.asarray(steps, dtype=np.int64), np.asarray(slot_ids, dtype=np.int64)


def forward_placement(n: int, slots: int) -> list[int]:
    """The positions stored when the forward sweep ends after `n` steps (sorted)."""
    if n <= slots:
        return list(range(max(n, 1)))
    steps, slot_ids = online_actions(slots, n)
    held = {0: 0}
    for t, s in zip(steps.tolist(), slot_ids.tolist()):
        held[s] = t
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
    sweep in `_reverse.py` one iteration per event.
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


def gradient_body_evaluations(n: int, slots: int) -> int:
    """Body evaluations in one gradient of an `n`-step loop with `slots` slots:
    `n` forward, `n` reversed, plus the reverse sweep's recomputation."""
    return 2 * n + placement_cost(forward_placement(n, slots), n, slots)
