"""What the CPU gradient's XLA compile time follows (issue 53): the gradient of a
64-element loop (n=256 of max_steps=1024) with the step `tanh(W @ x + b)` and with
a trivial step `x * W[0, 0]`, against `lax.scan` over the 256 steps; and, with the
trivial step, at 2, 16 and 1024 checkpoints (1024: every step stored, nothing
recomputed), gradient and forward. Medians of 5 compiles, each after
`jax.clear_caches()`; the number of while loops in the optimized program. With
`--split-table`, also the 16-checkpoint gradients (paired, alternating) with the reverse sweep's split
(`_recompute.split_rule`, computed in the program from a binomial table) replaced by
a lookup in a table of every split computed on the host: what the split costs.

    python benchmarks/probes/cpu_compile_by_structure.py [--split-table]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import boundedloop as bl
from boundedloop._sweeps import _recompute
from boundedloop._sweeps._schedule import revolve_split


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


def host_split_rule(slots: int, max_length: int, in_order: bool = False):
    """`_recompute.split_rule`, as a lookup in a host-computed table of every split
    of a segment up to `MAX` steps long (enough for this probe's loops)."""
    del max_length, in_order
    slots = min(slots, _recompute.SPLIT_SLOTS)
    rows = [
        [revolve_split(n, max(k, 1)) for n in range(MAX + 1)] for k in range(slots + 1)
    ]
    table = jnp.asarray(np.array(rows, np.int32))

    def split(length, k):
        return table[jnp.clip(k, 1, slots), jnp.clip(length, 0, MAX)]

    return split


def split_table(pairs=9):
    """Each gradient compiled with the two rules alternately, `pairs` times; the
    medians, and the median of the per-pair ratios (host table over in-program)."""
    print(
        "| gradient, 16 checkpoints | split in the program (s) | "
        "split from a host table (s) | ratio, median of pairs |"
    )
    print("|---|---:|---:|---:|")
    for name, step in STEPS.items():
        times = {_recompute.split_rule: [], host_split_rule: []}
        for _ in range(pairs):
            for rule in times:
                in_program, _recompute.split_rule = _recompute.split_rule, rule
                try:
                    times[rule].append(compile_seconds(jax.grad(ours(step, 16)), 1)[0])
                finally:
                    _recompute.split_rule = in_program
        ours_s, table_s = times.values()
        ratio = statistics.median(t / o for t, o in zip(table_s, ours_s))
        print(
            f"| {name} | {statistics.median(ours_s):.3f} | "
            f"{statistics.median(table_s):.3f} | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
    if "--split-table" in sys.argv:
        print()
        split_table()
