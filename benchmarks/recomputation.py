"""Body evaluations in one gradient, counted by `jax.debug.callback` in the compiled
programs: ours (`bl.while_loop`, and `bl.scan` for the length known in advance),
equinox's checkpointed loop, and the optimum when the trip count is unknown until
the forward sweep ends (checkpoints placed with hindsight, each segment reversed by
the binomial schedule).

    python benchmarks/recomputation.py [--out benchmarks/results/recomputation.json]
"""

import argparse
import itertools
import math

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import EvalCounter, write_json
from _format import index, load, page, table
from tests.schedule_reference import gradient_body_evaluations, optimal_placement_costs

import boundedloop as bl


def count(kind, n, c):
    counter = EvalCounter()

    def body(carry):
        x, i = carry
        counter(i)
        return jnp.sin(x) * 0.9 + 0.1, i + 1

    def loss(x):
        cond = lambda carry: carry[1] < n  # noqa: E731
        init = (x, jnp.array(0))
        if kind == "boundedloop":
            out = bl.while_loop(cond, body, init, max_steps=n, checkpoints=c)
        elif kind == "scan":
            out = bl.scan(lambda v, _: (body(v), None), init, length=n, checkpoints=c)
            out = out[0]
        else:
            out = eqxi.while_loop(
                cond, body, init, max_steps=n, kind="checkpointed", checkpoints=c
            )
        return out[0]

    jax.block_until_ready(jax.jit(jax.grad(loss))(0.3))
    return counter.count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/recomputation.json")
    args = parser.parse_args()
    ns = [10, 100, 1000, 10000]
    cs = [2, 4, 8, 16]
    rows = []
    for c in cs:
        best = optimal_placement_costs(max(ns), c)
        for n in ns:
            optimum = int(2 * n + best[n])
            ours = count("boundedloop", n, c)
            assert ours == gradient_body_evaluations(n, c)
            # the trip count known in advance: the checkpoints placed offline
            scan = count("scan", n, c)
            # counting by callback is slow; equinox's c=2 loop at n=10000 makes tens
            # of millions of evaluations, so it is left out
            theirs = None if (c == 2 and n >= 10000) else count("equinox", n, c)
            row = dict(n=n, c=c, optimum=optimum, boundedloop=ours, scan=scan)
            row.update(equinox=theirs, ours_over_optimum=round(ours / optimum, 4))
            row["equinox_over_optimum"] = theirs and round(theirs / optimum, 4)
            rows.append(row)
            print(rows[-1], flush=True)
    write_json(args.out, rows)
    print(recomputation_table(rows))


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------

STEPS = (10, 100, 1000, 10000, 100000)
CHECKPOINTS = (2, 4, 8, 16, 32)
# the cells `docs/why-boundedloop.md` compares, as (steps n, checkpoints c)
WHY_CELLS = ((10000, 4), (1000, 2), (1000, 4), (10000, 8), (10000, 16))


def repetitions(n: int, c: int) -> int:
    """The smallest integer `r >= 0` with `binomial(c + r, r) >= n`."""
    return next(r for r in itertools.count() if math.comb(c + r, r) >= n)


def repetitions_table(steps=STEPS, checkpoints=CHECKPOINTS) -> str:
    """`repetitions(n, c)` (a gradient then recomputes fewer than `r n` steps), a
    row per `n` and a column per `c`."""
    header = ["steps `n`", *(f"r for c = {c}" for c in checkpoints)]
    rows = [[n, *(repetitions(n, c) for c in checkpoints)] for n in steps]
    return page(table(header, rows, left=0))


def recomputation_table(rows=None) -> str:
    """Body evaluations per gradient, each with its ratio to the optimum."""

    def cell(count, optimum):
        return "not run" if count is None else f"{count} ({count / optimum:.3f})"

    rows = [
        [r["n"], r["c"], r["optimum"]]
        + [cell(r[k], r["optimum"]) for k in ("boundedloop", "scan", "equinox")]
        for r in sorted(
            rows or load("recomputation.json"), key=lambda r: (r["n"], r["c"])
        )
    ]
    header = ["n", "c", "optimum", "bl.while_loop", "bl.scan", "equinox checkpointed"]
    return page(
        "Body evaluations in one gradient, and in brackets their ratio to the optimum:",
        table(header, rows, left=0),
    )


def why_recomputation_table() -> str:
    """The `WHY_CELLS`, with equinox's count over ours (the why page)."""
    by_cell = index(load("recomputation.json"), "n", "c")
    rows = []
    for n, c in WHY_CELLS:
        r = by_cell[(n, c)]
        ours, theirs = r["boundedloop"], r["equinox"]
        rows.append(
            [n, c, r["optimum"], ours]
            + (["not run", "-"] if theirs is None else [theirs, f"{theirs / ours:.3g}"])
        )
    header = ["steps n", "checkpoints c", "optimum", "bl.while_loop"]
    header += ["equinox checkpointed", "equinox / ours"]
    return page(table(header, rows, left=0))


if __name__ == "__main__":
    main()
