"""The CPU gradient of a cheap step with each reverse-sweep structure forced (issue
53): the 64-element `tanh(W @ x + b)` loop (n=256 of max_steps=1024, 16
checkpoints) nested, plain and as one loop (`_reverse_sweep.drive`), against
`lax.scan` over the 256 steps. XLA compile (median of 7, each traced afresh after
`_common.clear_caches()`, interleaved in a shuffled order after a warm-up
repetition), gradient time (median of 30 interleaved rounds), while loops, and the
largest difference from `lax.scan`'s gradient.

    python benchmarks/probes/cpu_cheap_structures.py
"""

import os
import statistics
import sys

import jax
import jax.numpy as jnp

import boundedloop as bl
from boundedloop._sweeps import _cost_model


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _common import interleaved_compiles, interleaved_medians  # noqa: E402


D, N, MAX = 64, 256, 1024
W = jax.random.normal(jax.random.key(0), (D, D)) / 16
B = jnp.full((D,), 0.01)
X0 = jnp.full((D,), 0.1)
FORCED = {  # (is_cheap, shares_one_step)
    "nested": (lambda body: True, lambda body, backend=None: False),
    "plain": (lambda body: False, lambda body, backend=None: False),
    "one loop": (lambda body: False, lambda body, backend=None: True),
}


def step(w, x):
    return jnp.tanh(w @ x + B)


def loss(w, x, n):
    out = bl.while_loop(
        lambda c: c[1] < n,
        lambda c: (step(w, c[0]), c[1] + 1),
        (x, 0),
        max_steps=MAX,
        checkpoints=16,
    )
    return jnp.sum(out[0] ** 2)


def scan_loss(w, x, n):
    y, _ = jax.lax.scan(lambda y, _: (step(w, y), None), x, None, length=N)
    return jnp.sum(y**2)


def lower(kind):
    if kind == "scan":
        return jax.jit(jax.grad(scan_loss)).lower(W, X0, N)
    rules = _cost_model.is_cheap, _cost_model.shares_one_step
    _cost_model.is_cheap, _cost_model.shares_one_step = FORCED[kind]
    try:
        return jax.jit(jax.grad(loss)).lower(W, X0, N)
    finally:
        _cost_model.is_cheap, _cost_model.shares_one_step = rules


def main():
    kinds = [*FORCED, "scan"]
    compiles, exes = interleaved_compiles(lower, kinds, repeats=7)
    times = interleaved_medians(exes, {k: (W, X0, N) for k in kinds}, rounds=30)
    reference = exes["scan"](W, X0, N)
    scan_compile = statistics.median(compiles["scan"])
    print("| gradient | XLA compile | over scan's | time | while loops | off scan's |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in [*FORCED, "scan"]:
        c = statistics.median(compiles[kind])
        diff = float(jnp.max(jnp.abs(exes[kind](W, X0, N) - reference)))
        print(
            f"| {kind} | {c:.3f} s | {c / scan_compile:.2f} | "
            f"{1e3 * times[kind]:.3f} ms | "
            f"{exes[kind].as_text().count(' while(')} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
