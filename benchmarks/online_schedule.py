"""Recomputation of the online store rule against the hindsight optimum (issue 30,
item 1), in pure Python: `_schedule.online_stores` is the rule the compiled loops
follow event for event (`tests/test_structure.py`), so nothing is run or timed.

    python benchmarks/online_schedule.py > benchmarks/results/online_schedule.txt

Each ratio is the extra body evaluations of one gradient with `max_steps=None`
(beyond the `2n` every gradient makes) over the optimum's, `J(n, c)`:

- the issue's grid, `n` in {100, 1000} and `c` in {4, 8, 16};
- the wide grid: 90 trip counts spaced geometrically from 100 to `2 * 10**6`, at
  `c` = 16, 32 and 64 (the worst of each);
- the worst over every `n <= 1000`, at `c` = 3, 4, 8 and 16;
- the worst over every `n <= 2000` of all the evaluations of one gradient (the `2n`
  included) over the optimum's, at `c` = 2, 3, 4, 8 and 16.
"""

import numpy as np
from tests.schedule_reference import optimal_placement_costs, placement_cost

from boundedloop._sweeps._schedule import offline_placement, online_stores


def placements(slots: int, trip_counts) -> dict[int, list[int]]:
    """The placement the forward leaves after `n` steps, for each `n`, from one
    run of the rule up to the largest."""
    stores = online_stores(max(trip_counts), slots)
    out, held, k = {}, {}, 0
    for n in sorted(trip_counts):
        while k < len(stores) and stores[k][0] < n:
            t, slot = stores[k]
            held[slot] = t
            k += 1
        out[n] = sorted(held.values())
    return out


def ratio(positions, n: int, slots: int) -> float:
    optimum = placement_cost(offline_placement(n, slots), n, slots)
    ours = placement_cost(positions, n, slots)
    if not optimum:
        return 1.0 if ours == 0 else np.inf
    return ours / optimum


def main():
    print("| n | c=4 | c=8 | c=16 |")
    print("|---:|---:|---:|---:|")
    for n in (100, 1000):
        cells = [ratio(placements(c, [n])[n], n, c) for c in (4, 8, 16)]
        print(f"| {n} | " + " | ".join(f"{r:.3f}" for r in cells) + " |")
    print()
    wide = sorted(set(np.geomspace(100, 2e6, 90).astype(int).tolist()))
    print("| c | worst over the wide grid | at n |")
    print("|---:|---:|---:|")
    for c in (16, 32, 64):
        held = placements(c, wide)
        worst = max(wide, key=lambda n: ratio(held[n], n, c))
        print(f"| {c} | {ratio(held[worst], worst, c):.4f} | {worst} |")
    print()
    print("| c | worst over n <= 1000 | at n |")
    print("|---:|---:|---:|")
    for c in (3, 4, 8, 16):
        best = optimal_placement_costs(1000, c)
        held = placements(c, range(1, 1001))
        ratios = {
            n: placement_cost(held[n], n, c) / best[n]
            for n in range(1, 1001)
            if best[n]
        }
        worst = max(ratios, key=ratios.get)
        print(f"| {c} | {ratios[worst]:.4f} | {worst} |")
    print()
    print("| c | worst over n <= 2000, all evaluations | at n |")
    print("|---:|---:|---:|")
    for c in (2, 3, 4, 8, 16):
        best = optimal_placement_costs(2000, c)
        held = placements(c, range(1, 2001))
        totals = {
            n: (2 * n + placement_cost(held[n], n, c)) / (2 * n + best[n])
            for n in range(1, 2001)
        }
        worst = max(totals, key=totals.get)
        print(f"| {c} | {totals[worst]:.4f} | {worst} |")


if __name__ == "__main__":
    main()
