"""What the buffer checks cost: gradients compiled with the checks as chosen (by
default, or forced on with `bl.buffer_checks()`) against the same gradients with
them off (`bl.buffer_checks(False)`), timed in one process after warm-up, the two
back to back in a random order each round; the medians, the median and quartiles
of the per-round ratio, and the compiled temporary memory of each.

    python benchmarks/buffer_checks.py [--rounds 40] [--out FILE]

writes `results/buffer_checks.json` (or FILE); `checks_table` makes the docs' table.

The workloads:

- `regression.py`'s with buffers, by default: an M-step loop writing one row of an
  (M, 256) buffer per step (M = 256 and 4096), the neural ODE of
  `diffrax_adjoint.py` through `CheckpointedAdjoint()` and `(checkpoints=16)`, and
  the 100-step `Tsit5` solve of `small_solves.py`;
- the M-row loop forced on, the cost the default spares its cheap steps;
- a step of growing work, forced on: `v <- tanh(W v + row i - 1)` with a (w, w)
  matrix, writing row i of a (256, w) buffer and reading row i - 1, w = 64 to 1024,
  where the default's threshold (`_buffer_checks.CHECKED_WORK`) is chosen.
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
from boundedloop import _cost_model


def make_buffers(rows, width=256, checkpoints=16):
    """`regression.make_buffers`' gradient."""

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

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (
        jnp.array(1.1),
        jnp.linspace(-1.0, 1.0, width),
    )


def make_matvec(width, rows=256, checkpoints=16):
    """The gradient of a step of `width**2` work that writes row i and reads row
    i - 1 of a (rows, width) buffer."""
    w = jax.random.normal(jax.random.key(0), (width, width)) / (2 * width**0.5)

    def body(carry):
        v, buf, i = carry
        last = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], 0.0)
        v = jnp.tanh(w @ v + 0.5 * last)
        return v, buf.at[i].set(v), i + 1

    def loss(v0):
        out = bl.while_loop(
            lambda c: c[2] < rows,
            body,
            (v0, jnp.zeros((rows, width)), jnp.array(0)),
            max_steps=rows,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2)

    v0 = jnp.linspace(-1.0, 1.0, width)
    steps = jax.make_jaxpr(body)((v0, jnp.zeros((rows, width)), jnp.array(1)))
    return jax.jit(jax.grad(loss)), (v0,), _cost_model.work(steps.jaxpr)


def workloads():
    """`(label, mode, fn, args)`: `mode` is `"default"` or `"forced"`."""
    for rows in BUFFER_ROWS:
        yield f"buffers (M={rows})", "default", *make_buffers(rows)
    for c in DIFFRAX_CHECKPOINTS:
        yield f"diffrax neural ODE, checkpoints={c}", "default", *make_diffrax(bl, c)
    yield "Tsit5, 1 number, 100 steps", "default", *make_small_solve(bl)
    for rows in BUFFER_ROWS:
        yield f"buffers (M={rows})", "forced", *make_buffers(rows)
    for width in (64, 128, 256, 512, 1024):
        fn, args, work = make_matvec(width)
        yield f"w={width} (work {work})", "forced", fn, args


def switch(mode: str):
    """The checks as `mode` says: `"default"`, `"forced"` (on) or `"off"`."""
    if mode == "default":
        return contextlib.nullcontext()
    return bl.buffer_checks(mode == "forced")


def temp_bytes(fn, args, mode: str) -> int:
    with switch(mode):
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = []
    for label, mode, fn, fn_args in workloads():
        for m in (mode, "off"):
            with switch(m):  # compile, warm up
                for _ in range(3):
                    jax.block_until_ready(fn(*fn_args))
        cases.append((label, mode, fn, fn_args))
    times = {(c[0], c[1], m): [] for c in cases for m in (c[1], "off")}
    for _ in range(args.rounds):
        random.shuffle(cases)
        for label, mode, fn, fn_args in cases:
            for m in random.sample((mode, "off"), 2):
                with switch(m):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*fn_args))
                    times[(label, mode, m)].append(time.perf_counter() - start)
    rows = []
    for label, mode, fn, fn_args in sorted(cases, key=lambda c: (c[1], c[0])):
        on, off = times[(label, mode, mode)], times[(label, mode, "off")]
        q1, q2, q3 = statistics.quantiles([a / b for a, b in zip(on, off)], n=4)
        rows.append(
            {
                "workload": label,
                "checks": mode,
                "on_ms": statistics.median(on) * 1e3,
                "off_ms": statistics.median(off) * 1e3,
                "ratio": q2,
                "quartiles": [q1, q3],
                "temp_bytes": [temp_bytes(fn, fn_args, m) for m in (mode, "off")],
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
        "| gradient | checks | with (ms) | off (ms) | with / off, median "
        "(quartiles) | temp memory with / off (kB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        q1, q3 = row["quartiles"]
        on, off = (b / 1e3 for b in row["temp_bytes"])
        lines.append(
            f"| {row['workload']} | {row['checks']} | {row['on_ms']:.3f} | "
            f"{row['off_ms']:.3f} | "
            f"{row['ratio']:.3f} ({q1:.3f} to {q3:.3f}) | {on:.1f} / {off:.1f} |"
        )
    lines.append("")
    lines.append(
        f"{results['rounds']} rounds on the {results['backend']} backend; in each "
        "round the two programs run back to back in a random order."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
