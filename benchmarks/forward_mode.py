"""Forward mode against `lax.while_loop`'s: `jax.jvp` and `jax.jacfwd` of the cheap
Euler loop of `cheap_steps.py` (`x + 0.01 * tanh(W x + b)`, width 32), exactly n
steps, with respect to x0 (jvp: one tangent; jacfwd: 32).

    python benchmarks/forward_mode.py [--rounds 30] [--out FILE] > benchmarks/results/forward_mode.txt
    python benchmarks/forward_mode.py --smoke   # tiny sizes, checks that it runs

Side by side in one process: `bl.while_loop` (checkpoints 16, and store-all), which
`jax.jvp` evaluates in one pass, and `lax.while_loop`. Times are medians over rounds
run round-robin in a shuffled order after a warm-up; body evaluations per call are
counted with `jax.debug.callback` in a separate compile.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    compile_time,
    EULER_DT,
    euler_step,
    EvalCounter,
    interleaved_medians,
    write_results,
)
from _format import index, load, page, table
from jax import lax

import boundedloop as bl


WIDTH = 32
DT = EULER_DT
REFERENCE = "lax.while_loop"
KINDS = ["boundedloop checkpoints=16", "boundedloop store all", REFERENCE]
MODES = ["jvp", "jacfwd"]


def make(kind, mode, n, counter=None):
    """`(W, b, x0, v, steps) -> result` for one loop and one mode."""

    def final(w, b, x0, steps):
        body = euler_step(w, b, counter)

        cond = lambda c: c[1] < steps  # noqa: E731
        init = (x0, jnp.array(0))
        if kind == REFERENCE:
            return lax.while_loop(cond, body, init)[0]
        checkpoints = 16 if kind == "boundedloop checkpoints=16" else n
        return bl.while_loop(cond, body, init, max_steps=n, checkpoints=checkpoints)[0]

    if mode == "jvp":
        return lambda w, b, x0, v, steps: jax.jvp(
            lambda x: final(w, b, x, steps), (x0,), (v,)
        )
    return lambda w, b, x0, v, steps: jax.jacfwd(lambda x: final(w, b, x, steps))(x0)


def count_evals(fn, args):
    counter = EvalCounter()
    counted = jax.jit(fn(counter))
    jax.block_until_ready(counted(*args))
    counter.count = 0
    jax.block_until_ready(counted(*args))
    return counter.count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="n = 50, 2 rounds")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes, rounds = ([50], 2) if args.smoke else ([1000, 10000], args.rounds)
    out = args.out
    if out is None and not args.smoke:
        out = "benchmarks/results/forward_mode.json"

    kw, kb, kx, kv = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(kw, (WIDTH, WIDTH)) / np.sqrt(WIDTH)
    b = 0.1 * jax.random.normal(kb, (WIDTH,))
    x0 = jax.random.normal(kx, (WIDTH,))
    v = jax.random.normal(kv, (WIDTH,))

    rows, fns, fn_args = [], {}, {}
    for n in sizes:
        a = (w, b, x0, v, jnp.array(n, dtype=jnp.int32))
        for mode in MODES:
            results = {}
            for kind in KINDS:
                ct, compiled = compile_time(make(kind, mode, n), *a)
                results[kind] = jax.block_until_ready(compiled(*a))  # warm-up
                evals = count_evals(lambda c: make(kind, mode, n, c), a)
                rows.append(
                    {
                        "kind": kind,
                        "mode": mode,
                        "n": n,
                        "compile_s": ct,
                        "evals": evals,
                    }
                )
                fns[(kind, mode, n)], fn_args[(kind, mode, n)] = compiled, a
            for row in rows[-len(KINDS) :]:
                diff = jax.tree.map(
                    lambda x, y: float(jnp.max(jnp.abs(x - y))),
                    results[row["kind"]],
                    results[REFERENCE],
                )
                row["max_abs_diff"] = max(jax.tree.leaves(diff))
            print("compiled", mode, n, flush=True)

    medians = interleaved_medians(fns, fn_args, rounds)
    for row in rows:
        row["s"] = medians[(row["kind"], row["mode"], row["n"])]
    for row in rows:
        ref = next(
            r
            for r in rows
            if (r["kind"], r["mode"], r["n"]) == (REFERENCE, row["mode"], row["n"])
        )
        row["over_reference"] = row["s"] / ref["s"]
        row["compile_over_reference"] = row["compile_s"] / ref["compile_s"]

    print()
    print(
        f"Euler steps x + {DT} * tanh(W x + b), width {WIDTH}, exactly n steps; "
        f"jvp (one tangent) and jacfwd ({WIDTH} tangents) w.r.t. x0; medians of "
        f"{rounds} interleaved rounds; ratios within this run."
    )
    print()
    print(
        "| loop | mode | n | ms | over lax.while_loop | body evals | "
        "compile s | compile ratio | max abs diff |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['kind']} | {row['mode']} | {row['n']} | {1e3 * row['s']:.3f} | "
            f"{row['over_reference']:.2f} | {row['evals']} | {row['compile_s']:.2f} | "
            f"{row['compile_over_reference']:.2f} | {row['max_abs_diff']:.1e} |"
        )
    if out:
        write_results(out, rounds=rounds, rows=rows)


# --- the docs' table (`benchmarks/internal/tables.py` writes it) ------------------------


def forward_mode_table() -> str:
    """Forward-mode time over `lax.while_loop`'s JVP, for each loop and `n` (the
    why page)."""
    rows = load("forward_mode.json")["rows"]
    by = index(rows, "kind", "mode", "n")
    kinds = [k for k in dict.fromkeys(r["kind"] for r in rows) if k != REFERENCE]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    names = {
        k: k.replace("boundedloop", "bl.while_loop,").replace(
            "store all", "storing every step"
        )
        for k in kinds
    }
    cells = [
        [names[kind], n]
        + [f"{by[(kind, mode, n)]['over_reference']:.2f}" for mode in modes]
        for kind in kinds
        for n in sorted({r["n"] for r in rows})
    ]
    return page(table(["loop", "n", *(f"`jax.{mode}`" for mode in modes)], cells))


if __name__ == "__main__":
    main()
