"""A gradient through a long loop with no bound (`max_steps=None`): 10**6 and 10**7
steps with 32 checkpoints.

    python benchmarks/long_loop.py [--steps 1000000 10000000] [--checkpoints 32] > benchmarks/results/long_loop.txt

Body `x + 0.01 * tanh(W x + b)` on a state of 4, `max_steps=None`, run for exactly
`n` steps (the predicate compares a counter with a traced `n`), gradient with
respect to (W, b, x0), checked against `jax.lax.scan` over the same `n` steps. The
forward decides its stores as it runs (`_store_rules.OnlineRule`).
Reported: gradient wall time (one warm call), body evaluations per gradient from
`_schedule.gradient_body_evaluations` (which `tests/test_while_loop.py` checks
equals the compiled loop's count), against the optimum for
that `n` and checkpoint count (the hindsight-optimal placement), and the compiled
temporary memory of the same gradient with `max_steps` 10**3, the largest `n`, and
`None`.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import euler_step, temp_bytes
from tests.schedule_reference import gradient_body_evaluations, placement_cost

import boundedloop as bl
from boundedloop._sweeps._schedule import offline_placement


WIDTH = 4


def loss_of(max_steps, checkpoints, loop=True):
    def loss(w, b, x0, n):
        body = euler_step(w, b)
        init = (x0, jnp.array(0))
        if loop:
            out = bl.while_loop(
                lambda c: c[1] < n,
                body,
                init,
                max_steps=max_steps,
                checkpoints=checkpoints,
            )
        else:
            out = jax.lax.scan(lambda c, _: (body(c), None), init, length=max_steps)[0]
        return jnp.sum(out[0] ** 2)

    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[10**6, 10**7])
    parser.add_argument("--checkpoints", type=int, default=32)
    args = parser.parse_args()
    c = args.checkpoints
    kw, kb, kx = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(kw, (WIDTH, WIDTH)) / np.sqrt(WIDTH)
    b = 0.1 * jax.random.normal(kb, (WIDTH,))
    x0 = jax.random.normal(kx, (WIDTH,))
    grad = jax.jit(jax.grad(loss_of(None, c), argnums=(0, 1, 2)))
    rows = []
    for n in args.steps:
        a = (w, b, x0, jnp.array(n, jnp.int32))
        jax.block_until_ready(grad(*a))
        t0 = time.perf_counter()
        ours = jax.block_until_ready(grad(*a))
        seconds = time.perf_counter() - t0
        ideal = jax.jit(jax.grad(loss_of(n, c, loop=False), argnums=(0, 1, 2)))(*a)
        diff = max(float(jnp.max(jnp.abs(p - q))) for p, q in zip(ours, ideal))
        evals = gradient_body_evaluations(n, c)
        optimum = 2 * n + placement_cost(offline_placement(n, c), n, c)
        rows.append((n, seconds, evals, optimum, diff))
        print(n, seconds, evals, optimum, diff, flush=True)
    memory = {}
    for m in [10**3, max(args.steps), None]:
        fn = jax.jit(jax.grad(loss_of(m, c), argnums=(0, 1, 2)))
        compiled = fn.lower(w, b, x0, jnp.array(10, jnp.int32)).compile()
        memory[m] = temp_bytes(compiled)
    print()
    print(
        f"Euler steps of width {WIDTH}, max_steps=None, {c} checkpoints; gradient "
        "w.r.t. (W, b, x0); one warm call each."
    )
    print()
    print(
        "| n | gradient s | body evaluations | optimum | ratio | "
        "max abs diff vs lax.scan |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n, seconds, evals, optimum, diff in rows:
        print(
            f"| {n} | {seconds:.2f} | {evals} | {optimum} | {evals / optimum:.3f} | "
            f"{diff:.1e} |"
        )
    print()
    print("| max_steps | temp bytes |")
    print("|---:|---:|")
    for m, nbytes in memory.items():
        print(f"| {m} | {nbytes} |")


if __name__ == "__main__":
    main()
