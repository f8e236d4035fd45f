"""What `bl.buffer_checks()` costs: gradients compiled with the checks on against
the same gradients with them off (the default), timed in one process after
warm-up, the two back to back in a random order each round; the medians, the
median and quartiles of the per-round ratio, and the compiled temporary memory.

    python benchmarks/internal/buffer_checks.py [--rounds 40] [--out FILE]

writes `benchmarks/results/buffer_checks.json` (or FILE); `checks_table` makes the docs' table.

The workloads: `regression.py`'s buffer gradient, an M-step loop writing one row of
an (M, 256) buffer per step (M = 256 and 4096), whose step is a few operations; and
steps of growing work, `v <- tanh(W v + row i - 1)` with a (w, w) matrix, writing
row i of a (256, w) buffer and reading row i - 1, w = 64 to 1024. Internal: it
reaches inside the package to label each step with the work the cost model sees
(`_cost_model.work`), which decides the reverse sweep the checks ride on.
"""

import argparse
import json
import pathlib
import random
import statistics
import time

import jax
import jax.numpy as jnp
from regression import BUFFER_ROWS, make_buffers

import boundedloop as bl
from boundedloop._sweeps import _cost_model


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
    """`(label, fn, args)`."""
    for rows in BUFFER_ROWS:
        args = (jnp.array(1.1), jnp.linspace(-1.0, 1.0, 256))
        yield f"M-row buffer, M={rows} (work 4)", make_buffers(bl, rows), args
    for width in (64, 128, 256, 512, 1024):
        fn, args, work = make_matvec(width)
        yield f"(w, w) matrix, w={width} (work {work})", fn, args


def switch(on: bool):
    return bl.buffer_checks(on)


def temp_bytes(fn, args, on: bool) -> int:
    with switch(on):
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = []
    for label, fn, fn_args in workloads():
        for on in (True, False):
            with switch(on):  # compile, warm up
                for _ in range(3):
                    jax.block_until_ready(fn(*fn_args))
        cases.append((label, fn, fn_args))
    order = [c[0] for c in cases]
    times = {(c[0], on): [] for c in cases for on in (True, False)}
    for _ in range(args.rounds):
        random.shuffle(cases)
        for label, fn, fn_args in cases:
            for on in random.sample((True, False), 2):
                with switch(on):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*fn_args))
                    times[(label, on)].append(time.perf_counter() - start)
    rows = []
    for label, fn, fn_args in sorted(cases, key=lambda c: order.index(c[0])):
        on, off = times[(label, True)], times[(label, False)]
        q1, q2, q3 = statistics.quantiles([a / b for a, b in zip(on, off)], n=4)
        rows.append(
            {
                "workload": label,
                "on_ms": statistics.median(on) * 1e3,
                "off_ms": statistics.median(off) * 1e3,
                "ratio": q2,
                "quartiles": [q1, q3],
                "temp_bytes": [temp_bytes(fn, fn_args, on) for on in (True, False)],
            }
        )
    results = {"backend": jax.default_backend(), "rounds": args.rounds, "rows": rows}
    out = pathlib.Path(args.out or RESULTS)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(checks_table(results))


RESULTS = pathlib.Path(__file__).parents[1] / "results" / "buffer_checks.json"


def checks_table(results: dict | str | None = None) -> str:
    """The docs' table of `results`: a dict, or the committed results file of a
    backend (`"tpu"`: `benchmarks/results/buffer_checks_tpu.json`; `None`: this machine's)."""
    if not isinstance(results, dict):
        suffix = "" if results is None else f"_{results}"
        results = json.loads(RESULTS.with_stem(RESULTS.stem + suffix).read_text())
    lines = [
        "| gradient | checked (ms) | unchecked (ms) | checked / unchecked, median "
        "(quartiles) | temp memory checked / unchecked (kB) |",
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
        "round the two programs run back to back in a random order."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
