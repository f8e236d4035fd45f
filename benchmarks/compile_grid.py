"""Trace, lower and XLA compile time of one gradient, over checkpoint counts and
max_steps, against equinox's checkpointed while loop.

    python benchmarks/compile_grid.py [--out FILE] > benchmarks/results/compile_grid.txt

The loop is `cheap_steps.py`'s Euler step (width 32); the gradient is with respect to
(W, b, x0). Every cell is traced from scratch: boundedloop's caches (the reverse
sweep's binomial table) are cleared first, as in a program's first trace. Each cell
is measured `--repeats` times (fresh function objects each time), ours and
equinox's alternating, after one warm-up compile; the median is kept (9 by
default: on 2 noisy cores, two runs of the same code with 5 put the
`max_steps=None` cells at 1.04 to 1.15 and 1.08 to 1.14, two with 9 at 1.05 to
1.07 and 0.94 to 1.06).
"""

import argparse
import json
import pathlib
import statistics
import time

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
from _common import clear_caches

import boundedloop as bl


WIDTH = 32
CHECKPOINTS = [2, 16, 64, 1000, 10**6]
MAX_STEPS = [64, 4096, None]


def make(kind, checkpoints, max_steps):
    def loss(w, b, x0, steps):
        def body(carry):
            x, i = carry
            return x + 0.01 * jnp.tanh(w @ x + b), i + 1

        cond = lambda c: c[1] < steps  # noqa: E731
        init = (x0, jnp.array(0))
        if kind == "boundedloop":
            out = bl.while_loop(
                cond, body, init, max_steps=max_steps, checkpoints=checkpoints
            )
        else:
            out = eqxi.while_loop(
                cond,
                body,
                init,
                max_steps=max_steps,
                kind="checkpointed",
                checkpoints=checkpoints,
            )
        return jnp.sum(out[0] ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))


def measure(kind, checkpoints, max_steps, args):
    clear_caches()
    t0 = time.perf_counter()
    traced = jax.jit(make(kind, checkpoints, max_steps)).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/compile_grid.json")
    args = parser.parse_args()
    kw, kb, kx = jax.random.split(jax.random.key(0), 3)
    a = (
        jax.random.normal(kw, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
        0.1 * jax.random.normal(kb, (WIDTH,)),
        jax.random.normal(kx, (WIDTH,)),
        jnp.array(50, jnp.int32),
    )
    measure("boundedloop", 16, 64, a)  # warm-up: JAX's and XLA's own first-use costs
    rows = []
    for c in CHECKPOINTS:
        for m in MAX_STEPS:
            runs = {"boundedloop": [], "equinox": []}
            errors = {}
            for _ in range(args.repeats):
                for kind in runs:
                    if kind in errors:
                        continue
                    try:
                        runs[kind].append(measure(kind, c, m, a))
                    except Exception as e:  # noqa: BLE001
                        errors[kind] = (
                            f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                        )
            for kind in runs:
                row = {"kind": kind, "checkpoints": c, "max_steps": m}
                if kind in errors:
                    row["error"] = errors[kind]
                else:
                    for key in runs[kind][0]:
                        row[key] = statistics.median(r[key] for r in runs[kind])
                    row["total_s"] = row["trace_s"] + row["lower_s"] + row["compile_s"]
                rows.append(row)
                print(row, flush=True)
    print()
    print(
        f"Gradient of the Euler loop (width {WIDTH}); seconds, each the median of "
        f"{args.repeats} cold traces, alternating with equinox's; ratio = "
        "(trace+lower+compile) ours / equinox."
    )
    print()
    print(
        "| checkpoints | max_steps | ours trace | ours lower | ours compile | "
        "equinox trace | equinox lower | equinox compile | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ours, eqx_row in zip(rows[0::2], rows[1::2]):

        def cells(r):
            if "error" in r:
                return ["error", "", ""]
            return [f"{r[k]:.2f}" for k in ("trace_s", "lower_s", "compile_s")]

        ratio = (
            f"{ours['total_s'] / eqx_row['total_s']:.2f}"
            if "total_s" in ours and "total_s" in eqx_row
            else ""
        )
        print(
            f"| {ours['checkpoints']} | {ours['max_steps']} | "
            + " | ".join(cells(ours) + cells(eqx_row))
            + f" | {ratio} |"
        )
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(
            f"\n{r['kind']} checkpoints={r['checkpoints']} max_steps={r['max_steps']}: {r['error']}"
        )
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
