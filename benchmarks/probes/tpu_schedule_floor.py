"""The floor of the one loop's work on the chip (issue 53, target 1): the headline
gradient's matrix products as the 16-checkpoint schedule runs them, in loops with no
control and no data movement, timed beside the one loop and `lax.scan`.

At n=256 of 1024 the one loop's profile
(`benchmarks/results/one_loop_tpu_session46/ops.txt`) counts 256 forward steps in
the forward sweep, and in the reverse loop 602 forward steps, 256 of which are
reversed (two products each); the sweep's pure-Python twin
(`tests/schedule_reference.py`) counts the same 346 recomputed steps, and gives the
counts at any `n`. The floor program runs exactly those: a loop of `n` steps, a
loop of the recomputed steps, and a loop of `n` steps each with its
vector-Jacobian product, accumulating `W`'s cotangent. It stores and restores nothing and branches nowhere, so its time bounds
from below any program that follows this schedule: the one loop's conditionals,
stores and restores can only add to it.

    python benchmarks/probes/tpu_schedule_floor.py [--n 256] [--rounds 7] [--out FILE]
        [--shape 512 4096]
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path += [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests")]
import headline  # noqa: E402  (benchmarks/: the workload and the losses)
import schedule_reference  # noqa: E402  (tests/: the sweep's twin)
from _common import interleaved_medians  # noqa: E402


CHECKPOINTS = 16
MAX_STEPS = {256: 1024, 2048: 4096}  # the headline's two rows


def recomputed_steps(n: int) -> int:
    """Forward steps the reverse sweep recomputes after an `n`-step forward sweep."""
    positions = schedule_reference.forward_placement(n, CHECKPOINTS)
    return schedule_reference.placement_cost(positions, n, CHECKPOINTS)


def floor_gradient(w, x, n, advances, reversed_):
    """The schedule's products with nothing else: `W`'s cotangent of a loss of
    the final state, from `reversed_` reversed steps (not the true gradient: the
    reversed steps run forwards from `x`, as a chain)."""

    def step(x):
        return jnp.tanh(x @ w)

    y = lax.fori_loop(0, n, lambda _, x: step(x), x)  # the forward sweep
    ct = 2 * y / y.size
    recomputed = lax.fori_loop(0, advances, lambda _, x: step(x), x)

    def reverse(_, carry):
        x, ct, ct_w = carry
        y, pullback = jax.vjp(lambda w, x: jnp.tanh(x @ w), w, x)
        d_w, d_x = pullback(ct)
        return y, d_x, ct_w + d_w

    zero = jnp.zeros_like(w)
    _, _, ct_w = lax.fori_loop(0, reversed_, reverse, (recomputed, ct, zero))
    return ct_w


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=256, choices=sorted(MAX_STEPS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", type=int, nargs=2, default=(512, 4096))
    args = parser.parse_args()

    w, x = headline.workload(*args.shape)  # (batch, width); small to check on a CPU
    n, max_steps = args.n, MAX_STEPS[args.n]
    counts = (jnp.int32(recomputed_steps(n)), jnp.int32(n))
    fns = {
        "one loop": jax.jit(
            jax.grad(headline.loss_fn("boundedloop", n, max_steps, CHECKPOINTS))
        ),
        "floor": jax.jit(floor_gradient),
    }
    if n == 256:  # (at 2048 every step stored does not fit)
        fns["lax.scan"] = jax.jit(jax.grad(headline.loss_fn("scan", n, n, None)))
    n = jnp.int32(n)
    fn_args = {k: (w, x, n) for k in fns} | {"floor": (w, x, n, *counts)}
    for k in fns:  # compile and warm up
        jax.block_until_ready(fns[k](*fn_args[k]))
    medians = interleaved_medians(fns, fn_args, args.rounds)
    for k, s in medians.items():
        print(f"{k:10s} {s * 1e3:8.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            found = {"n": args.n, "recomputed": int(counts[0]), "medians_s": medians}
            json.dump({"platform": jax.default_backend(), **found}, f)


if __name__ == "__main__":
    main()
