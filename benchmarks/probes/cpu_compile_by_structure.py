"""What the CPU gradient's XLA compile time follows (issue 53): the gradient of a
64-element loop (n=256 of max_steps=1024) with the step `tanh(W @ x + b)` and with
a trivial step `x * W[0, 0]`, against `lax.scan` over the 256 steps; and, with the
trivial step, at 2, 16 and 1024 checkpoints (1024: every step stored, nothing
recomputed), gradient and forward. Medians of 5 compiles, each after
`jax.clear_caches()`; the number of while loops in the optimized program.

    python benchmarks/probes/cpu_compile_by_structure.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import boundedloop as bl


D, N, MAX = 64, 256, 1024
W = jax.random.normal(jax.random.key(0), (D, D)) / 16
B = jnp.full((D,), 0.01)
STEPS = {
    "tanh(W x + b)": lambda w, x: jnp.tanh(w @ x + B),
    "x * W[0, 0]": lambda w, x: x * w[0, 0],
}
ARGS = (W, jnp.ones(D), jnp.int32(N))


def ours(step, checkpoints):
    def f(w, x0, n):
        out = bl.while_loop(
            lambda c: c[1] < c[2],
            lambda c: (step(w, c[0]), c[1] + 1, c[2]),
            (x0, 0, n),
            max_steps=MAX,
            checkpoints=checkpoints,
        )
        return jnp.sum(out[0])

    return f


def scan(step, checkpoints=None):
    del checkpoints

    def f(w, x0, n):
        del n
        return jnp.sum(lax.scan(lambda x, _: (step(w, x), None), x0, length=N)[0])

    return f


def compile_seconds(fn, repeats=5):
    times, loops = [], None
    for _ in range(repeats):
        jax.clear_caches()
        lowered = jax.jit(fn).lower(*ARGS)
        start = time.perf_counter()
        compiled = lowered.compile()
        times.append(time.perf_counter() - start)
        loops = compiled.as_text().count(" while(")
    return statistics.median(times), loops


def main():
    cases = [(f"{s}, lax.scan", scan(STEPS[s]), "grad") for s in STEPS]
    cases += [(f"{s}, ours, 16 checkpoints", ours(STEPS[s], 16), "grad") for s in STEPS]
    trivial = STEPS["x * W[0, 0]"]
    for c in (2, 16, 1024):
        for what in ("grad", "forward"):
            cases.append(
                (f"x * W[0, 0], ours, {c} checkpoints", ours(trivial, c), what)
            )
    print("| gradient or forward | XLA compile (s) | while loops |")
    print("|---|---:|---:|")
    for label, fn, what in cases:
        seconds, loops = compile_seconds(jax.grad(fn) if what == "grad" else fn)
        print(f"| {label}, {what} | {seconds:.3f} | {loops} |")


if __name__ == "__main__":
    main()
