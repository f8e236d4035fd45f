"""What the default buffer checks cost: each workload of `regression.py` that has
buffers, compiled with the checks on (the default) and off (`bl.buffer_checks(False)`),
timed round-robin in one process after warm-up; the medians and their ratio, and
the compiled temporary memory of each.

    python benchmarks/buffer_checks.py [--rounds 40] [--out FILE]

writes `results/buffer_checks.json`; `checks_table` makes the docs' table from it.

The workloads: the gradient (and the forward) of an M-step loop writing one row of
an (M, 256) buffer per step, M = 256 and 4096; the gradient of the neural ODE of
`diffrax_adjoint.py` through `CheckpointedAdjoint()` and `(checkpoints=16)`, whose
save loop writes its output buffers; and the 100-step `Tsit5` solve of
`small_solves.py`, whose stage loops read all their stages each step. The MLP
workloads of `regression.py` have no buffers: there the checks add nothing.
"""

import argparse
import contextlib
import json
import pathlib
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
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = []
    for label, (fn, fn_args) in workloads():
        for on in (True, False):
            with switch(on):  # compile, warm up
                for _ in range(3):
                    jax.block_until_ready(fn(*fn_args))
        cases.append((label, fn, fn_args))
    times = {(label, on): [] for label, _, _ in cases for on in (True, False)}
    for _ in range(args.rounds):
        random.shuffle(cases)
        for label, fn, fn_args in cases:
            # on and off back to back, in a random order: a ratio per round
            for on in random.sample((True, False), 2):
                with switch(on):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*fn_args))
                    times[(label, on)].append(time.perf_counter() - start)
    rows = []
    for label, fn, fn_args in sorted(cases, key=lambda c: c[0]):
        on, off = times[(label, True)], times[(label, False)]
        q1, q2, q3 = statistics.quantiles([a / b for a, b in zip(on, off)], n=4)
        mem = [temp_bytes(fn, fn_args, s) for s in (True, False)]
        rows.append(
            {
                "workload": label,
                "on_ms": statistics.median(on) * 1e3,
                "off_ms": statistics.median(off) * 1e3,
                "ratio": q2,
                "quartiles": [q1, q3],
                "temp_bytes": mem,
            }
        )
    results = {"backend": jax.default_backend(), "rounds": args.rounds, "rows": rows}
    out = pathlib.Path(args.out or RESULTS)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(checks_table(results))


RESULTS = pathlib.Path(__file__).parent / "results" / "buffer_checks.json"


def checks_table(results: dict | None = None) -> str:
    """The docs' table of `results` (by default, the committed results file)."""
    if results is None:
        results = json.loads(RESULTS.read_text())
    lines = [
        "| workload | checked (ms) | unchecked (ms) | checked / unchecked, "
        "median (quartiles) | temp memory checked / unchecked (kB) |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        q1, q3 = row["quartiles"]
        on, off = (b / 1e3 for b in row["temp_bytes"])
        lines.append(
            f"| {row['workload']} | {row['on_ms']:.3f} | {row['off_ms']:.3f} | "
            f"{row['ratio']:.3f} ({q1:.3f} to {q3:.3f}) | {on:.1f} / {off:.1f} |"
        )
    lines.append("")
    lines.append(
        f"{results['rounds']} rounds on the {results['backend']} backend; in each "
        "round the checked and unchecked programs run back to back in a random "
        "order."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
