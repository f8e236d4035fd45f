"""Where the reverse sweep's nested loops for cheap steps stop paying: the gradient of
`x <- tanh(x @ W)` at growing work per step, with the nested structure forced on and
forced off (`_cost_model.is_cheap`), side by side in one process.

    python benchmarks/cheap_threshold.py [--rounds 15] [--out FILE] > benchmarks/results/cheap_threshold.txt

A state of shape (batch, width), `max_steps=4096`, 16 checkpoints, `n` steps (a
traced counter), gradient with respect to `W`. Reported per size: the work per step
(`_cost_model.work`: a product's multiply-adds counted twice), gradient time (medians
of interleaved rounds after warm-up) and XLA compile time (median of 3) with each
structure, and the while loops each compiled program has. `HEAVY_WORK` in
`boundedloop/_cost_model.py` is chosen from these figures.
"""

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
from _common import write_results

import boundedloop as bl
from boundedloop import _cost_model


SIZES = [  # (batch, width, n)
    (1, 32, 1000),
    (1, 64, 1000),
    (1, 128, 1000),
    (1, 256, 1000),
    (2, 256, 1000),
    (4, 256, 500),
    (8, 256, 500),
    (64, 256, 256),
]
STRUCTURES = {"nested": True, "plain": False}


def compiled(nested: bool, batch: int, width: int, n: int):
    w = jax.random.normal(jax.random.key(0), (width, width)) / jnp.sqrt(width)
    x = jax.random.normal(jax.random.key(1), (batch, width))

    def loss(w, x, n):
        def body(c):
            return c[0] + 1, jnp.tanh(c[1] @ w)

        final = bl.while_loop(
            lambda c: c[0] < n, body, (0, x), max_steps=4096, checkpoints=16
        )
        return jnp.mean(final[1] ** 2)

    original = _cost_model.is_cheap
    _cost_model.is_cheap = lambda body: nested
    try:
        lowered = jax.jit(jax.grad(loss)).lower(w, x, n)
    finally:
        _cost_model.is_cheap = original
    t0 = time.perf_counter()
    exe = lowered.compile()
    return exe, (w, x, n), time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/cheap_threshold.json")
    args = parser.parse_args()
    rows = []
    for batch, width, n in SIZES:
        exes, compile_s = {}, {k: [] for k in STRUCTURES}
        for _ in range(3):
            for name, nested in STRUCTURES.items():
                exe, fn_args, seconds = compiled(nested, batch, width, n)
                exes[name] = (exe, fn_args)
                compile_s[name].append(seconds)
        samples = {k: [] for k in exes}
        order = list(exes)
        for r in range(args.rounds + 1):
            random.Random(r).shuffle(order)
            for name in order:
                exe, fn_args = exes[name]
                t0 = time.perf_counter()
                jax.block_until_ready(exe(*fn_args))
                if r:  # the first round warms up
                    samples[name].append(time.perf_counter() - t0)
        row = dict(batch=batch, width=width, n=n, work=2 * batch * width * width)
        for name, (exe, _) in exes.items():
            row[f"{name}_grad_ms"] = 1e3 * statistics.median(samples[name])
            row[f"{name}_compile_s"] = statistics.median(compile_s[name])
            row[f"{name}_whiles"] = exe.as_text().count(" while(")
        row["plain_over_nested"] = row["plain_grad_ms"] / row["nested_grad_ms"]
        rows.append(row)
        print(row, flush=True)
    print(
        "\nGradient of tanh(x @ W), 16 checkpoints, max_steps 4096; medians of "
        f"{args.rounds} interleaved rounds; compile: median of 3.\n"
    )
    print(
        "| batch x width | work per step | nested ms | plain ms | plain / nested "
        "| nested compile s | plain compile s | while loops |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['batch']} x {r['width']} | {r['work']} | {r['nested_grad_ms']:.2f} "
            f"| {r['plain_grad_ms']:.2f} | {r['plain_over_nested']:.3f} "
            f"| {r['nested_compile_s']:.3f} | {r['plain_compile_s']:.3f} "
            f"| {r['nested_whiles']} / {r['plain_whiles']} |"
        )
    write_results(args.out, rounds=args.rounds, rows=rows)


if __name__ == "__main__":
    main()
