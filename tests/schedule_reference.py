"""The schedule's pure-Python references, for tests and benchmarks: what a placement
costs, the hindsight optimum, and the reverse sweep's twin, event for event.

The package holds what the compiled loop runs (`boundedloop._sweeps._schedule`); this
holds what it is measured against. Terms are `_schedule`'s."""

import math

import numpy as np

from boundedloop._sweeps._schedule import online_stores, repetitions, revolve_split


def revolve_cost(length: int, slots: int) -> int | float:
    """Extra body evaluations to reverse `length` steps from a stored start, with `slots`
    slots (the start's included): `r * l - C(k + r, r - 1)`. Infinite without slots."""
    if length <= 1:
        return 0
    if slots < 1:
        return math.inf
    r = repetitions(length, slots)
    return r * length - math.comb(slots + r, r - 1)


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


def forward_placement(n: int, slots: int) -> list[int]:
    """The positions stored when the forward sweep ends after `n` steps (sorted)."""
    held = {}
    for t, slot in online_stores(n, slots):
        held[slot] = t
    return sorted(held.values())


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


def gradient_body_evaluations(n: int, slots: int) -> int:
    """Body evaluations in one gradient of an `n`-step loop with `slots` slots: `n`
    forward, `n` reversed, plus the reverse sweep's recomputation."""
    positions = forward_placement(n, slots)
    return 2 * n + placement_cost(positions, n, slots)
