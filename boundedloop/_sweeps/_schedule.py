"""Where checkpoints go: pure Python, testable without autodiff.

Terms used throughout:

- `n`: the number of steps the loop took. Step `i` maps the state `x_i` to `x_{i+1}`.
- `c`: the number of checkpoint slots. Slot 0 always holds `x_0`.
- A *placement* is the sorted list of stored positions at the end of the forward sweep.
  Consecutive positions cut `[0, n)` into *segments*. The reverse sweep reverses them
  last to first; the segment with index `j` (counting from the start) may use the
  `c - j` slots that the earlier segments do not occupy, its own start included.
- The fewest extra body evaluations that reverse a segment of `l` steps from its
  stored start with `k` slots are `r l - C(k + r, r - 1)`, `r` its `repetitions`
  (Griewank and Walther 2000).

The forward's placement is online (`online_stores`), the reverse sweep's offline
(`revolve_split`): see `docs/architecture.md`, "Where checkpoints go". What a
placement costs and the hindsight optimum are the tests' (`tests/schedule_reference.py`).
"""

import bisect
import functools
import itertools
import math

import numpy as np


INT32_MAX = 2**31 - 1


def default_checkpoints(max_steps: int | None) -> int:
    """`checkpoints=None`: every step while `max_steps <= 16`, else
    `2 * (ceil(log2(max_steps)) + 4)` copies of the carry (28 at `max_steps=1024`,
    32 at 4096), at most `max_steps`; 32 copies for a loop with no bound
    (`max_steps=None`).

    Up to 4d0f910 it was half that, `ceil(log2(max_steps)) + 4`. Twice the copies
    buy less recomputation: on `headline.py`'s small workload on a CPU, 28
    checkpoints took 0.92 times 14's gradient time at n=256 of 1024, and 32 took
    0.89 times 16's at n=2048 of 4096 (`docs/performance.md`, "Time against
    memory")."""
    if max_steps is None:
        return 32
    if max_steps <= 16:
        return max(max_steps, 1)
    return min(max_steps, 2 * (math.ceil(math.log2(max_steps)) + 4))


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


def revolve_split(length: int, slots: int) -> int:
    """How far to advance from a segment's start before storing the next checkpoint, so
    that the segment is reversed at the fewest extra evaluations.

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


BAND_CAP = 2**30


def grown_bands(bands: list[int]) -> list[int]:
    """The next regime's bands (see `online_stores`), exact: `C(k + r + 1, k) =
    C(k + r, k) + C(k + r, k) k / (r + 1)`, clipped at `BAND_CAP` (a clipped band
    stays clipped: bands only grow). `bands[1] = r + 1`. The compiled rule computes
    the same integers in int32 (`_store_rules._grown`)."""
    r1 = bands[1]
    return [min(b + b * k // r1, BAND_CAP) for k, b in enumerate(bands)]


# `_merge_choice`'s keys: a merge that overfills its band by more than `KEY_CAP`
# counts as `KEY_CAP` over; a kept position's key is raised by `KEPT`, so that the
# keys stay below `2**31`
KEY_CAP = 2**29
KEPT = 2**30


def targets(grown: list[int]) -> list[int]:
    """The positions `q_j` (`1 <= j < slots`) of the placement that is optimal at
    the regime's last trip count: its segments are the bands, the first of
    `C(slots + r, slots)` steps and the last of `C(1 + r, 1)`. By the hockey-stick
    identity `q_j = C(slots + r + 1, slots) - C(slots - j + r + 1, slots - j)`,
    differences of the next regime's bands `grown` (as the compiled rule reads
    them; clipped entries give other integers, alike in both)."""
    slots = len(grown) - 1
    return [grown[slots] - grown[slots - j] for j in range(1, slots)]


def _merge_choice(held: list[int], t: int, limits: list[int], goal: list[int]) -> int:
    """Which stored position `held[s]` (`1 <= s < slots`) to drop when storing
    `x_t` (see `online_stores`); `limits[k]` is the band of `k` slots and `goal`
    the regime's `targets`. Exact, in integers, as the compiled rule decides: the
    least key, the first of equals."""
    slots = len(held)
    ext = held + [t]
    # the least key, when one exists, is that of the fitting merge nearest the tail
    # that drops no stand-in (keys `-s`; every other key is positive): found from
    # the tail, as a loop of any length mostly finds it, in a few steps
    for s in range(slots - 1, 0, -1):
        if ext[s + 1] - ext[s - 1] <= limits[slots - s + 1]:
            if bisect.bisect_left(goal, ext[s + 1]) == bisect.bisect_left(goal, ext[s]):
                return s
    ext = np.asarray(ext, np.int64)
    # how many targets lie before each position (`goal` increases): `held[s]`
    # stands in for a target when one lies in `[held[s], ext[s + 1])`
    before = np.searchsorted(np.asarray(goal, np.int64), ext, side="left")
    kept = before[2:] > before[1:-1]
    # the segment that dropping `held[s]` (s = 1 .. slots - 1) leaves, against its
    # band (that of `slots - s + 1` slots)
    over = ext[2:] - ext[:-2] - np.asarray(limits[slots:1:-1], np.int64)
    s = np.arange(1, slots)
    key = np.where(over <= 0, -s, np.minimum(over, KEY_CAP)) + np.where(kept, KEPT, 0)
    return 1 + int(np.argmin(key))  # the first of the least


def online_stores(n: int, slots: int) -> list[tuple[int, int]]:
    """The stores the forward sweep of an `n`-step loop makes: `(t, slot)` pairs in
    order, storing `x_t` in `slot`. The reference for the compiled rule in
    `_store_rules.py`, which makes the same choices.

    **The rule.** With `k` slots (its start's included) a segment of `l` steps is
    reversed at `r` recomputations of its busiest step while `l <= C(k + r, k)`.
    Number the segments by their slots: the tail has 1, the one before it 2, and
    the first `slots`. The hindsight optimum for a trip count `n` fills every
    segment to the same repetition number `r`, the least with `n <= C(slots + r + 1,
    slots) - 1`: segment `k` at most `C(k + r, k)` steps long (its *band*). So:

    - *When.* The first `slots - 1` steps fill the free slots. Afterwards `x_t` is
      stored when the tail would outgrow its band, `r + 1` steps.
    - *Where.* A store drops one position, which merges the two segments around it
      into one with the slots of the earlier one (and gives every later segment
      one slot more). The positions that stand in for the regime's `targets` (the
      optimal placement at its last trip count, whose segments are the bands) are
      kept: the latest position at or before each target, `t` included. Of the
      others, the merge that fits its band nearest the tail; when none fits, the
      one that overfills its band least (in steps; the first of equals). When
      every position stands in for a target, the same choice among all.

    Choices depend on `t` and `slots` only, so a longer loop's stores extend a
    shorter loop's. How close it comes to the hindsight optimum:
    `docs/design-notes.md`, `_sweeps/_schedule.py`.
    """
    # `x_0` in slot 0, even if the loop takes no step; then the free slots
    stores = [(t, t) for t in range(min(max(n, 1), slots))]
    if slots <= 1:
        return stores
    held = list(range(slots))  # the stored positions once the slots are filled
    order = list(range(slots))  # the slot holding each
    bands = [1] * (slots + 1)  # `bands[k] = C(k + r, k)`, `r = 0`
    grown = grown_bands(bands)
    goal = targets(grown)
    t = slots
    while t < n:
        # past the regime's last trip count, `C(slots + r + 1, slots) - 1`; a
        # regime whose end is clipped is the last (past `BAND_CAP` steps)
        if t + 1 >= grown[-1] and grown[-1] < BAND_CAP:
            bands, grown = grown, grown_bands(grown)
            goal = targets(grown)
        width = bands[1]  # `r + 1`
        if t - held[-1] >= width:
            s = _merge_choice(held, t, bands, goal)
            stores.append((t, order[s]))
            del held[s]
            held.append(t)
            order.append(order.pop(s))
        t = max(t + 1, held[-1] + width)
    return stores


def offline_placement(n: int, slots: int) -> list[int]:
    """The placement for a loop whose trip count `n` is known in advance: the first
    sweep of the binomial schedule (store at `revolve_split` of what is left, one
    slot fewer each time). It attains the hindsight optimum (tested)."""
    positions, p, k = [0], 0, slots
    while k > 1 and n - p > 1:
        m = revolve_split(n - p, k)
        if p + m >= n:
            break
        p += m
        positions.append(p)
        k -= 1
    return positions


def offline_stores(n: int, slots: int) -> list[tuple[int, int]]:
    """The stores of the forward sweep of a loop known to take `n` steps (a scan):
    `offline_placement`, as `(t, slot)` pairs in order."""
    return list(zip(offline_placement(n, slots), itertools.count()))


def _revolve_cost(length: int, slots: int) -> int:
    """Extra body evaluations to reverse `length` steps from a stored start with
    `slots` slots (the start's included): `r * l - C(k + r, r - 1)`."""
    if length <= 1:
        return 0
    r = repetitions(length, slots)
    return r * length - math.comb(slots + r, r - 1)


def _block_advances(positions, n: int, slots: int, steps: int) -> int:
    """The forward steps the reverse sweep's advances make when it reverses `n`
    steps in blocks of up to `steps` (`_reverse_sweep.reverse_blocks`): from the top
    checkpoint to each block's start, storing where `revolve_split` says."""
    stack, end, count = sorted(positions), n, 0
    while end > 0:
        start = max(end - steps, stack[-1])
        i = stack[-1]
        while i < start:  # `recompute` to `start`, as for reversing step `start`
            split = revolve_split(start + 1 - i, slots - (len(stack) - 1))
            target = min(i + max(split, 1), start)
            count += target - i
            i = target
            if i < start:
                stack.append(i)
        end = start
        if stack[-1] == end:
            stack.pop()
    return count


def _placement(n: int, slots: int, known_length: bool, uniform=()) -> list[int]:
    """The positions the forward sweep of an `n`-step loop leaves stored: those of
    `uniform` below `n` (where the rule stores a block apart), or the rule's."""
    if uniform:
        return [p for p in uniform if p < max(n, 1)]
    if known_length:
        return offline_placement(n, slots)
    held = {}
    for t, slot in online_stores(n, slots):
        held[slot] = t
    return sorted(held.values())


def gradient_evaluations(
    n: int,
    slots: int,
    tape_steps: int = 0,
    known_length: bool = False,
    every_step_taped: bool = False,
    uniform=(),
    *,
    ring: bool = False,
) -> int:
    """Body evaluations in one gradient of an `n`-step loop with `slots` slots and a
    tape of `tape_steps` rows: `n` forward; with every step taped, nothing more;
    with a tape of blocks, each step once more to tape it and the advances to each
    block (`_block_advances`); without a tape, each step once more for its
    vector-Jacobian product plus the recomputation from the checkpoints.
    `uniform`: the positions a rule storing a block apart gives
    (`_store_rules.uniform_positions`), if it does. `ring`: the forward sweep
    tapes its last `tape_steps` steps, and the last block is not taped again."""
    if n == 0 or every_step_taped:
        return n
    positions = _placement(n, slots, known_length, uniform)
    if tape_steps:
        last_block = n - max(n - tape_steps, max(positions, default=0))
        again = n - last_block if ring else n
        return n + again + _block_advances(positions, n, slots, tape_steps)
    bounds = positions + [n]
    extra = sum(
        _revolve_cost(bounds[j + 1] - bounds[j], slots - j)
        for j in range(len(bounds) - 1)
    )
    return 2 * n + extra
