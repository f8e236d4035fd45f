"""What the default buffer checks cost: each workload of `regression.py` that has
buffers, compiled with the checks on (the default) and off (`bl.buffer_checks(False)`),
timed round-robin in one process after warm-up; the medians and their ratio, and
the compiled temporary memory of each.

    python benchmarks/buffer_checks.py [--rounds 30] [--out FILE]

The workloads: the gradient (and the forward) of an M-step loop writing one row of
an (M, 256) buffer per step, M = 256 and 4096; the gradient of the neural ODE of
`diffrax_adjoint.py` through `CheckpointedAdjoint()` and `(checkpoints=16)`, whose
save loop writes its output buffers; and the 100-step `Tsit5` solve of
`small_solves.py`, whose stage loops read all their stages each step. The MLP
workloads of `regression.py` have no buffers: there the checks add nothing.
"""

import argparse
import contextlib
import random
import statistics
import time

import jax
import jax.numpy as jnp
from regression import BUFFER_ROWS, DIFFRAX_CHECKPOINTS, make_diffrax, make_small_solve

import boundedloop as bl


def make_buffers(rows, width=256, checkpoints=16, grad=True):
    """`regression.make_buffers`' loop, its gradient or its forward."""

    def loss(scale, v0):
        def body(carry):
            v, buf, i = carry
            v = jnp.tanh(v * scale + 0.01)
            return v, buf.at[i].set(v), i + 1

        out = bl.while_loop(
            lambda c: c[2] < rows,
            body,
            (v0, jnp.zeros((rows, width)), jnp.array(0)),
            max_steps=rows,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2)

    fn = jax.grad(loss, argnums=(0, 1)) if grad else loss
    return jax.jit(fn), (jnp.array(1.1), jnp.linspace(-1.0, 1.0, width))


def workloads():
    for rows in BUFFER_ROWS:
        yield f"buffers, gradient (M={rows})", make_buffers(rows)
        yield f"buffers, forward (M={rows})", make_buffers(rows, grad=False)
    for c in DIFFRAX_CHECKPOINTS:
        yield f"diffrax neural ODE, checkpoints={c}", make_diffrax(bl, c)
    yield "Tsit5, 1 number, 100 steps", make_small_solve(bl)


def switch(on: bool):
    return contextlib.nullcontext() if on else bl.buffer_checks(False)


def temp_bytes(fn, args, on: bool) -> int:
    with switch(on):
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = []
    for label, (fn, fn_args) in workloads():
        for on in (True, False):
            with switch(on):  # compile, warm up
                for _ in range(3):
                    jax.block_until_ready(fn(*fn_args))
            cases.append((label, on, fn, fn_args))
    times = {(label, on): [] for label, on, _, _ in cases}
    for _ in range(args.rounds):
        random.shuffle(cases)
        for label, on, fn, fn_args in cases:
            with switch(on):
                start = time.perf_counter()
                jax.block_until_ready(fn(*fn_args))
                times[(label, on)].append(time.perf_counter() - start)
    lines = [
        f"buffer checks on (default) against off, {jax.default_backend()}, "
        f"{args.rounds} rounds, medians",
        "| workload | on (ms) | off (ms) | on / off | temp memory on / off (kB) |",
        "|---|---|---|---|---|",
    ]
    seen = []
    for label, on, fn, fn_args in cases:
        if label in seen:
            continue
        seen.append(label)
    for label in sorted(seen):
        fn, fn_args = next((f, a) for lb, _, f, a in cases if lb == label)
        on, off = (statistics.median(times[(label, s)]) for s in (True, False))
        mem = [temp_bytes(fn, fn_args, s) / 1e3 for s in (True, False)]
        lines.append(
            f"| {label} | {on * 1e3:.3f} | {off * 1e3:.3f} | {on / off:.3f} | "
            f"{mem[0]:.1f} / {mem[1]:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
