"""The checkpoint schedule, in pure Python: exhaustive checks on small cases."""

import functools
import math

import numpy as np
import pytest

from boundedloop._sweeps._schedule import (
    offline_placement,
    online_stores,
    revolve_split,
)

from .schedule_reference import (
    forward_placement,
    gradient_body_evaluations,
    optimal_placement_costs,
    placement_cost,
    reverse_events,
    revolve_cost,
)


@functools.cache
def brute_force_cost(length, slots):
    """Fewest extra evaluations to reverse `length` steps from a stored start."""
    if length <= 1:
        return 0
    if slots <= 0:
        return math.inf
    return min(
        m + brute_force_cost(length - m, slots - 1) + brute_force_cost(m, slots)
        for m in range(1, length)
    )


@pytest.mark.parametrize("slots", range(1, 7))
def test_revolve_cost_is_the_optimum(slots):
    for length in range(1, 120):
        assert revolve_cost(length, slots) == brute_force_cost(length, slots)


@pytest.mark.parametrize("slots", range(1, 7))
def test_revolve_split_attains_the_optimum(slots):
    for length in range(2, 120):
        m = revolve_split(length, slots)
        assert 1 <= m <= length - 1
        cost = m + brute_force_cost(length - m, slots - 1) + brute_force_cost(m, slots)
        assert cost == revolve_cost(length, slots)


def check_events(events, positions, n, slots):
    """Each step reversed once, last to first; advances only from held states; the
    number of advances is the placement's cost; never more than `slots` held."""
    reversed_steps = [i for kind, i in events if kind == "reverse"]
    assert reversed_steps == list(range(n - 1, -1, -1))
    advances = sum(kind == "advance" for kind, _ in events)
    assert advances == placement_cost(positions, n, slots)


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 8])
def test_reverse_events_exhaustive(slots):
    for n in range(0, 60):
        positions = forward_placement(n, slots)
        assert len(positions) <= slots and positions[0] == 0
        assert all(p < max(n, 1) for p in positions)
        check_events(reverse_events(positions, n, slots), positions, n, slots)


def test_reverse_events_live_checkpoints_bounded():
    # the simulator asserts the bound itself; exercise odd placements too
    rng = np.random.default_rng(0)
    for _ in range(300):
        slots = int(rng.integers(1, 7))
        n = int(rng.integers(1, 80))
        k = int(rng.integers(1, slots + 1))
        positions = sorted({0, *rng.integers(0, n, size=k - 1).tolist()})
        check_events(reverse_events(positions, n, slots), positions, n, slots)


@pytest.mark.parametrize("slots", [1, 2, 3, 6, 16, 64])
def test_online_stores_are_consistent(slots):
    stores = online_stores(3000, slots)
    steps, slot_ids = np.array(stores).T
    assert stores[0] == (0, 0) and np.all(np.diff(steps) > 0) and steps[-1] < 3000
    assert np.all((slot_ids[1:] >= 1) & (slot_ids[1:] < slots))
    # a shorter loop's stores are a prefix of a longer one's (online: no lookahead)
    short = online_stores(700, slots)
    assert stores[: len(short)] == short
    assert all(t >= 700 for t, _ in stores[len(short) :])


def test_store_every_step_when_enough_slots():
    for n in range(1, 10):
        assert forward_placement(n, 10) == list(range(n))
        assert gradient_body_evaluations(n, 10) == 2 * n


@pytest.mark.parametrize("slots", [2, 8, 32])
def test_online_placement_near_optimal_at_any_length(slots):
    # nothing is planned ahead: long loops are placed as well as short ones
    for n in [1000, 10**4, 10**5, 3 * 10**5]:
        ours = gradient_body_evaluations(n, slots)
        optimum = 2 * n + placement_cost(offline_placement(n, slots), n, slots)
        assert ours <= 1.02 * optimum, (n, slots, ours, optimum)


def online_placements(slots, max_n):
    """`forward_placement(n, slots)` for every `n <= max_n`, from one run."""
    stores = online_stores(max_n, slots)
    held, out, next_store = {}, [[0]], 0
    for n in range(1, max_n + 1):
        while next_store < len(stores) and stores[next_store][0] < n:
            t, slot = stores[next_store]
            held[slot] = t
            next_store += 1
        out.append(sorted(held.values()))
    return out


@pytest.mark.parametrize("slots", [2, 3, 4, 8, 16])
def test_reverse_events_online_placement(slots):
    # each step reversed exactly once, never more than `slots` held (the simulator
    # asserts it), the advances are the placement's cost
    placements = online_placements(slots, 400)
    for n in [*range(1, 120), *range(120, 401, 7)]:
        positions = placements[n]
        if n % 50 == 0:
            assert positions == forward_placement(n, slots)
        assert len(positions) <= slots and positions[0] == 0 and positions[-1] < n
        check_events(reverse_events(positions, n, slots), positions, n, slots)


# the worst ratio of ours to the optimum over n <= 2000 (2n + extra evaluations); with
# two slots no online placement does better than 1.0967 (next test)
WORST_RATIO = {2: 1.0968, 3: 1.084, 4: 1.057, 8: 1.029, 16: 1.010}


@pytest.mark.parametrize("slots", [2, 3, 4, 8, 16])
def test_online_placement_worst_ratio(slots):
    max_n = 2000
    best = optimal_placement_costs(max_n, slots)
    placements = online_placements(slots, max_n)
    worst = max(
        (2 * n + placement_cost(placements[n], n, slots)) / (2 * n + best[n])
        for n in range(1, max_n + 1)
    )
    assert worst <= WORST_RATIO[slots], worst


@pytest.mark.parametrize("slots", [4, 8, 16])
def test_online_recomputation_within_three_percent_of_the_optimum(slots):
    # the recomputation alone (beyond the `2n` every gradient makes) against the
    # optimum's, on the grid of issue 30 (docs/design-notes.md, long loops)
    for n in [100, 1000]:
        ours = placement_cost(forward_placement(n, slots), n, slots)
        optimum = placement_cost(offline_placement(n, slots), n, slots)
        assert ours <= 1.03 * optimum, (n, slots, ours, optimum)


def two_slot_lower_bound_holds(lo, hi, ratio):
    """Whether no online placement with two slots keeps every `n` in `[lo, hi]`
    within `ratio` of the optimum. Two slots hold `{0, s}`, `s` the last store (or
    `{0}`, `s = 0`); a store at `s'` serves `n` in `(s', next store]`."""
    best = optimal_placement_costs(hi, 2)

    def within(s, n):
        extra = (
            revolve_cost(n, 2)
            if s == 0
            else (revolve_cost(s, 2) + revolve_cost(n - s, 1))
        )
        return n < lo or 2 * n + extra <= ratio * (2 * n + best[n])

    reachable = [True] + [False] * hi
    for s in range(hi):
        if reachable[s]:
            n = s + 1
            while n <= hi and within(s, n):
                reachable[n] = True  # store at n: s still serves n itself
                n += 1
            if n > hi:
                return False
    return True


@pytest.mark.parametrize("lo, hi, ratio", [(20, 40, 1.0967), (90, 110, 1.05)])
def test_two_slots_online_lower_bound(lo, hi, ratio):
    # whatever it does before, an online placement with two slots leaves some n in
    # [20, 40] above 1.0967 times the optimum (ours: 1.0968 at most, n = 29), and some
    # n in [90, 110] above 1.05 times it: n = 100 is within 5% only because of where
    # it falls between two stores
    assert two_slot_lower_bound_holds(lo, hi, ratio)
    assert not two_slot_lower_bound_holds(lo, hi, 1.1)
