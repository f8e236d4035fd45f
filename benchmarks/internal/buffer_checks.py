"""What the buffer checks cost: gradients with every rule checked
(`bl.buffer_checks()`), with the default's check of the reads, and with none
(`bl.buffer_checks(False)`), back to back in a random order each round after a
warm-up: medians, the per-round ratios' medians and quartiles, temp memory. On `buffers.py`'s workload, on steps of growing
work (`v <- tanh(W v + row i - 1)`, W of (w, w)), labelled with the work the cost
model sees (internal: `_cost_model.work`), and on loops in loops sharing a buffer.

    python benchmarks/internal/buffer_checks.py [--rounds 40]
        [--out benchmarks/results/buffer_checks.json]
"""

import argparse
import contextlib
import json
import pathlib
import random
import statistics
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import timed  # noqa: E402
from _format import load, page, RESULTS, table  # noqa: E402
from regression import BUFFER_ROWS, make_buffers  # noqa: E402

import boundedloop as bl  # noqa: E402
from boundedloop._sweeps import _cost_model  # noqa: E402


def _reading_the_last_row(width):
    """A step of `width**2` work, `v <- tanh(W v + row i - 1)`, writing row `i`."""
    w = jax.random.normal(jax.random.key(0), (width, width)) / (2 * width**0.5)

    def body(carry):
        v, buf, i = carry
        last = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], 0.0)
        v = jnp.tanh(w @ v + 0.5 * last)
        return v, buf.at[i].set(v), i + 1

    return body


def _gradient(body, rows, width, steps, checkpoints):
    """The jitted gradient of a loop of `steps` steps of `body` over a `(rows,
    width)` buffer, and its arguments."""

    def loss(v0):
        out = bl.while_loop(
            lambda c: c[2] < steps,
            body,
            (v0, jnp.zeros((rows, width)), jnp.array(0)),
            max_steps=steps,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2)

    return jax.jit(jax.grad(loss)), (jnp.linspace(-1.0, 1.0, width),)


def make_matvec(width, rows=256, checkpoints=16):
    """The gradient of `width**2` work a step, writing row i and reading row i - 1."""
    body = _reading_the_last_row(width)
    fn, args = _gradient(body, rows, width, rows, checkpoints)
    steps = jax.make_jaxpr(body)((*args, jnp.zeros((rows, width)), jnp.array(1)))
    return fn, args, _cost_model.work(steps.jaxpr)


def make_nested(rows, width=32, outer=16, inner=4):
    """The gradient of loops in loops: each of `outer` steps runs an inner loop of
    `inner` steps of `_reading_the_last_row`, writing rows of the outer loop's
    `(rows, width)` buffer, lent to it (stamped by the outer loop's check where it
    is at most `_cost_model.SMALL_BUFFERS` bytes, and inside `bl.buffer_checks()`
    whatever its size)."""
    inner_body = _reading_the_last_row(width)

    def outer_body(c):
        v, buf, i = c
        start = inner * i
        v, buf, _ = bl.while_loop(
            lambda c: c[2] < start + inner, inner_body, (v, buf, start), max_steps=inner
        )
        return v, buf, i + 1

    return _gradient(outer_body, rows, width, outer, checkpoints=4)


def workloads():
    """`(label, fn, args)`."""
    for rows in BUFFER_ROWS:
        args = (jnp.array(1.1), jnp.linspace(-1.0, 1.0, 256))
        yield f"M-row buffer, M={rows} (work 4)", make_buffers(bl, rows), args
    for width in (64, 128, 256, 512, 1024):
        fn, args, work = make_matvec(width)
        yield f"(w, w) matrix, w={width} (work {work})", fn, args
    for rows in (64, 128, 512):
        fn, args = make_nested(rows)
        stamped = rows * 32 * 4 <= _cost_model.SMALL_BUFFERS
        how = "stamped" if stamped else "stamped for every rule only"
        kb = f"{rows * 32 * 4 // 1024} kB, {how}"
        yield f"loops in loops, a ({rows}, 32) buffer lent ({kb})", fn, args


# every rule; the default (the reads); none
MODES = dict(rules=bl.buffer_checks, reads=contextlib.nullcontext, off=bl.buffer_checks)


def checks(mode: str):
    return MODES[mode](False) if mode == "off" else MODES[mode]()


def temp_bytes(fn, args, mode: str) -> int:
    with checks(mode):
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def ratios(times, off):
    """The median of `times / off` per round, and its quartiles."""
    q1, q2, q3 = statistics.quantiles([a / b for a, b in zip(times, off)], n=4)
    return q2, [q1, q3]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = []
    for label, fn, fn_args in workloads():
        for mode in MODES:
            with checks(mode):  # compile, warm up
                for _ in range(3):
                    jax.block_until_ready(fn(*fn_args))
        cases.append((label, fn, fn_args))
    times = {(c[0], mode): [] for c in cases for mode in MODES}
    shuffled = list(cases)
    for _ in range(args.rounds):
        random.shuffle(shuffled)
        for label, fn, fn_args in shuffled:
            for mode in random.sample(list(MODES), len(MODES)):
                with checks(mode):
                    times[(label, mode)].append(timed(fn, *fn_args))
    rows = []
    for label, fn, fn_args in cases:
        on, reads, off = (times[(label, mode)] for mode in MODES)
        on_ms, reads_ms, off_ms = (statistics.median(t) * 1e3 for t in (on, reads, off))
        row = dict(workload=label, on_ms=on_ms, off_ms=off_ms, reads_ms=reads_ms)
        row["ratio"], row["quartiles"] = ratios(on, off)
        row["reads_ratio"], row["reads_quartiles"] = ratios(reads, off)
        row["temp_bytes"] = [temp_bytes(fn, fn_args, mode) for mode in ("rules", "off")]
        rows.append(row)
    results = {"backend": jax.default_backend(), "rounds": args.rounds, "rows": rows}
    out = pathlib.Path(args.out or RESULTS / "buffer_checks.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(checks_table(results))


def _spread(row, kind: str) -> str:
    q1, q3 = row[f"{kind}quartiles"]
    return f"{row[f'{kind}ratio']:.3f} ({q1:.3f} to {q3:.3f})"


def checks_table(results: dict | str | None = None) -> str:
    """The docs' table of `results`: a dict, or a backend's results file (`"tpu"`:
    `buffer_checks_tpu.json`; `None`: `buffer_checks.json`)."""
    if not isinstance(results, dict):
        results = load(f"buffer_checks{'' if results is None else '_' + results}.json")
    reads = "reads_ratio" in results["rows"][0]  # (results before the default's)
    header = ["gradient", "every rule (ms)", "unchecked (ms)"]
    header += ["every rule / unchecked, median (quartiles)"]
    header += ["default (reads) / unchecked"] if reads else []
    header += ["temp memory checked / unchecked (kB)"]
    cells = []
    for row in results["rows"]:
        on, off = (b / 1e3 for b in row["temp_bytes"])
        cells.append(
            [row["workload"], f"{row['on_ms']:.3f}", f"{row['off_ms']:.3f}"]
            + [_spread(row, kind) for kind in ("", "reads_")[: 1 + reads]]
            + [f"{on:.1f} / {off:.1f}"]
        )
    return page(
        table(header, cells, left=len(header)),
        f"{results['rounds']} rounds on the {results['backend']} backend; in each "
        "round the programs run back to back in a random order.",
    )


if __name__ == "__main__":
    main()
