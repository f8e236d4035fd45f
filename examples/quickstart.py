"""Quickstart: the gradient of an adaptive loop costs the steps it takes.

An MLP step `x -> mlp(x)` is applied until a counter reaches 8. `max_steps` is only
a bound. With `bl.while_loop` the gradient's time stays flat as `max_steps` grows;
with the usual nested `lax.scan` + `lax.cond` loop it grows with `max_steps`.

    python examples/quickstart.py [--quick]
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
    """The usual workaround: nested scans of length 2 with a cond at each level."""

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
            out = bl.while_loop(cond, body, (x, 0), max_steps=max_steps, checkpoints=8)
        else:
            out = nested_scan_loop(cond, body, (x, jnp.array(0)), max_steps)
        return jnp.sum(out[0])

    return jax.jit(jax.grad(loss))


def timed(f, *args, reps=5):
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(quick=False):
    width = 64 if quick else 1024
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    weights = (
        jax.random.normal(k1, (width, 1)),
        jax.random.normal(k2, (width, width)) / jnp.sqrt(width),
        jax.random.normal(k3, (1, width)) / jnp.sqrt(width),
    )
    x = jnp.array([0.5])
    ours_steps = [8, 64] if quick else [8, 64, 512, 4096]
    theirs_steps = [8, 64] if quick else [8, 64, 512]
    results = {}
    print(f"{'max_steps':>9} | {'bl.while_loop grad':>18} | {'nested scan grad':>16}")
    for m in ours_steps:
        ours = timed(make_loss("boundedloop", m), weights, x)
        theirs = (
            timed(make_loss("nested", m), weights, x) if m in theirs_steps else None
        )
        results[m] = (ours, theirs)
        theirs_text = (
            f"{theirs * 1e3:13.2f} ms" if theirs is not None else f"{'(skipped)':>16}"
        )
        print(f"{m:>9} | {ours * 1e3:15.2f} ms | {theirs_text}")
    g_ours = make_loss("boundedloop", ours_steps[-1])(weights, x)
    g_ref = make_loss("nested", 8)(weights, x)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_ours, g_ref))
    print(f"largest gradient difference from the reference: {err:.2e}")
    return results, err


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
