"""Quickstart: the gradient of an adaptive loop costs the steps it takes.

An MLP step `x -> mlp(x)` (1 -> 256 -> tanh -> 256 -> tanh -> 1) is applied
until a counter reaches 8; `max_steps` is only a bound. For growing `max_steps`
this prints the time of one compiled gradient and its temporary memory, for
`bl.while_loop` and for the usual workaround, nested `lax.scan` + `lax.cond`.
The `bl.while_loop` gradient stays flat; the nested loop's grows with
`max_steps`, so it is run only up to `max_steps=512` and its cost at 4096 is
estimated from the 512 row.

    python examples/quickstart.py            # 12 to 18 s on 2 CPU cores
    python examples/quickstart.py --quick    # smaller: max_steps 8 and 64
"""

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

import boundedloop as bl


def mlp(weights, x):
    w1, w2, w3 = weights
    return w3 @ jnp.tanh(w2 @ jnp.tanh(w1 @ x))


def nested_scan_loop(cond_fun, body_fun, init, max_steps):
    """The usual workaround: nested scans of length 2 with a cond at each level
    (`max_steps` must be a power of two)."""

    def run(level, val):
        if level == 0:
            return lax.cond(cond_fun(val), body_fun, lambda v: v, val)

        def step(v, _):
            return lax.cond(
                cond_fun(v), lambda v: run(level - 1, v), lambda v: v, v
            ), None

        return lax.scan(step, val, length=2)[0]

    return run(max_steps.bit_length() - 1, init)


def make_loss(loop, max_steps):
    def loss(weights, x):
        def body(carry):
            x, step = carry
            return mlp(weights, x), step + 1

        def cond(carry):
            return carry[1] < 8

        if loop == "boundedloop":
            out = bl.while_loop(
                cond, body, (x, 0), max_steps=max_steps, checkpoints=8
            )
        else:
            out = nested_scan_loop(cond, body, (x, jnp.array(0)), max_steps)
        return jnp.sum(out[0])

    return jax.grad(loss)


def compiled_gradient(loop, max_steps, weights, x):
    """The compiled gradient and its temporary memory in bytes."""
    compiled = jax.jit(make_loss(loop, max_steps)).lower(weights, x).compile()
    return compiled, compiled.memory_analysis().temp_size_in_bytes


def nbytes(n):
    """`n` bytes, readably."""
    for unit, size in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)]:
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def timed(f, *args, reps=5, min_time=0.2):
    """Best wall time of `f(*args)` over at least `reps` runs and `min_time`
    seconds."""
    jax.block_until_ready(f(*args))
    best, runs, start = float("inf"), 0, time.perf_counter()
    while runs < reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def main(quick=False):
    width = 64 if quick else 256
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    weights = (
        jax.random.normal(k1, (width, 1)),
        jax.random.normal(k2, (width, width)) / jnp.sqrt(width),
        jax.random.normal(k3, (1, width)) / jnp.sqrt(width),
    )
    x = jnp.array([0.5])
    ours_steps = [8, 64] if quick else [8, 64, 512, 4096]
    theirs_steps = [8, 64] if quick else [8, 64, 512]

    print(
        f"Gradient of a loop that stops after 8 steps (MLP width {width}):\n"
        "best time of the compiled gradient and its temporary memory.",
        flush=True,
    )
    print(
        f"{'max_steps':>9} | {'bl.while_loop':<22} | nested lax.scan + lax.cond"
    )
    print(f"{'-' * 9}-+-{'-' * 22}-+-{'-' * 26}", flush=True)
    results, grads, last, note = {}, {}, None, None
    for m in ours_steps:
        f, mem = compiled_gradient("boundedloop", m, weights, x)
        ours = timed(f, weights, x)
        grads[m] = f(weights, x)
        ours_text = f"{ours * 1e3:8.2f} ms {nbytes(mem):>10}"
        if m in theirs_steps:
            g, their_mem = compiled_gradient("nested", m, weights, x)
            theirs = timed(g, weights, x)
            if m == 8:
                reference = g(weights, x)
            last = (m, theirs, their_mem)
            theirs_text = f"{theirs * 1e3:8.2f} ms {nbytes(their_mem):>10}"
        else:
            # its time and memory grow linearly with max_steps: estimate from
            # the largest size run instead of running it
            m0, t0, mem0 = last
            theirs = None
            theirs_text = (
                f"(skipped: would take ~{t0 * m / m0:.1f} s, "
                f"~{nbytes(mem0 * m / m0)})"
            )
            note = (
                f"(skipped row estimated as {m // m0}x the {m0} row: the "
                "nested loop grows linearly)"
            )
        results[m] = (ours, theirs)
        print(f"{m:>9} | {ours_text} | {theirs_text}", flush=True)

    if note:
        print(note)
    err = max(
        float(jnp.max(jnp.abs(a - b)))
        for g in grads.values()
        for a, b in zip(g, reference)
    )
    print(f"largest gradient difference from the nested loop's: {err:.2e}")
    return results, err


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Time the gradient of a loop that stops after 8 steps, for "
        "max_steps 8 .. 4096: bl.while_loop against nested lax.scan + lax.cond."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smaller model (width 64) and only max_steps 8 and 64, for a "
        "smoke test (a few seconds)",
    )
    main(parser.parse_args().quick)
