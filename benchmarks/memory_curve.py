"""Gradient time against memory on `headline.py`'s workload: ours with `memory=`
budgets and `checkpoints=`, beside `lax.scan` over exactly `n` steps, the scan of
checkpointed scans a user writes when `n` is static (`ckscanK`) and equinox's
checkpointed loop; compiled, then timed interleaved (medians). `--small` (B=64,
D=256) runs anywhere; `--cheap` is the CPU's small body (width 32, n=1000 of 4000),
with budgets of `ckscan40`'s temp memory and of every step taped.

    python benchmarks/memory_curve.py [--small] [--long] [--rounds R] [--out FILE]
    python benchmarks/memory_curve.py --compile-pairs 20 [--only LABEL...] [--out FILE]
    python benchmarks/memory_curve.py --cheap [--out FILE]

Results: the chip's `benchmarks/results/memory_curve_tpu_4d0f910.json` and
`memory_curve_compile_tpu_4d0f910.json`, the CPU's `memory_curve_cpu_cheap.json`.
"""

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
from _common import (
    forget_compiles,
    interleaved,
    interleaved_medians,
    temp_bytes,
    write_json,
)
from _format import load, nbytes, page, seconds, table
from headline import headline_step, loss_fn, workload


def _cheap_step(W, y):
    return y + jnp.tanh(W @ y + 0.1) / 1000


def make(kind, n, max_steps, f=headline_step, **kw):
    """The jitted gradient of `headline.loss_fn`."""
    return jax.jit(jax.grad(loss_fn(kind, n, max_steps, f, **kw)))


def case(rows, n, max_steps, variants, rounds, W, x, f=headline_step, shuffle=False):
    compiled, where = {}, dict(n=n, max_steps=max_steps)
    bounds = {}  # a variant's own `max_steps` (in its `kw`), else the case's
    for label, kind, kw in variants:
        kw = dict(kw)
        bounds[label] = kw.pop("max_steps", max_steps)
        start = time.perf_counter()
        try:
            c = make(kind, n, bounds[label], f, **kw).lower(W, x, n).compile()
            jax.block_until_ready(c(W, x, n))
        except Exception as e:  # noqa: BLE001 (a variant that does not fit)
            rows.append(dict(where, variant=label, error=str(e)[:160]))
            print(rows[-1], flush=True)
            continue
        compiled[label] = (c, time.perf_counter() - start, temp_bytes(c))
    fns = {label: c for label, (c, _, _) in compiled.items()}
    times = interleaved_medians(
        fns, {k: (W, x, n) for k in fns}, rounds, shuffle=shuffle
    )
    for label, (_, compile_s, temp) in compiled.items():
        row = dict(where, max_steps=bounds[label], variant=label)
        row.update(grad_s=times[label], compile_s=compile_s)
        rows.append(dict(row, temp_bytes=temp))
        print(rows[-1], flush=True)


def compile_pairs(n, max_steps, variants, rounds, W, x):
    """Each variant's trace, lower and XLA compile from cleared caches, wall and
    process seconds, in `rounds` shuffled rounds; per variant the medians, and the
    median over rounds of its time over equinox's in the same round."""

    def cold(kind, kw):
        def timed_compile():
            forget_compiles()
            wall, cpu = time.perf_counter(), time.process_time()
            make(kind, n, max_steps, **kw).lower(W, x, n).compile()
            return time.perf_counter() - wall, time.process_time() - cpu

        return timed_compile

    calls = {label: cold(kind, kw) for label, kind, kw in variants}
    for call in calls.values():  # warm-up: imports, first traces
        call()
    samples = interleaved(calls, rounds, rng=random.Random(1))
    equinox = next(label for label, kind, _ in variants if kind == "equinox")
    rows = []
    for label, got in samples.items():
        row = dict(n=n, max_steps=max_steps, variant=label, rounds=rounds)
        for j, clock in enumerate(["wall", "process"]):
            row[f"{clock}_s"] = statistics.median(t[j] for t in got)
            row[f"{clock}_over_equinox"] = statistics.median(
                t[j] / e[j] for t, e in zip(got, samples[equinox])
            )
        rows.append(row)
        print(row, flush=True)
    return rows


RESULTS = {"tpu": "memory_curve_tpu_4d0f910.json", "cpu": "memory_curve_cpu_cheap.json"}
COMPILES = "memory_curve_compile_tpu_4d0f910.json"


def memory_curve_table(which: str) -> str:
    """Per trip count, each variant's time, over `lax.scan`'s, temp memory, compile."""
    results = load(RESULTS[which])
    rows = results["rows"]
    lines = []
    for n in sorted({r["n"] for r in rows}):
        here = [r for r in rows if r["n"] == n and "error" not in r]
        scan = next((r["grad_s"] for r in here if r["variant"] == "scan"), None)
        body = [
            [f"`{r['variant']}`", seconds(r["grad_s"])]
            + ["-" if scan is None else f"{r['grad_s'] / scan:.3f}"]
            + [nbytes(r["temp_bytes"]), seconds(r["compile_s"])]
            + ([r["commit"]] if "commit" in r else [])
            for r in here
        ]
        header = [f"n={n} of {here[0]['max_steps']}", "gradient", "x `lax.scan`"]
        header += ["temp memory", "compile"] + (["tree"] if "commit" in here[0] else [])
        lines.append(table(header, body))
    return page(*lines)


def compile_pairs_table() -> str:
    """Per variant, its cold compile's median wall and process seconds, and the
    medians of its times over equinox's in the same round (`compile_pairs`)."""
    rows = load(COMPILES)["rows"]
    body = [
        [f"`{r['variant']}`", seconds(r["wall_s"]), f"{r['wall_over_equinox']:.2f}"]
        + [seconds(r["process_s"]), f"{r['process_over_equinox']:.2f}"]
        + [r.get("commit", "-"), str(r["rounds"])]
        for r in rows
    ]
    header = ["n=256 of 1024", "compile, wall", "x equinox's", "process time"]
    return page(table(header + ["x equinox's", "tree", "rounds"], body))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--long", action="store_true", help="also n=2048 of 4096")
    parser.add_argument("--cheap", action="store_true", help="the CPU's small body")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, n=256")
    parser.add_argument(
        "--compile-pairs",
        type=int,
        default=0,
        help="instead of timing: this many shuffled rounds of cold compiles, n=256",
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="these variants (labels) only"
    )
    args = parser.parse_args()
    if args.cheap:
        return cheap(args.out)
    B, D = (64, 256) if args.small else (512, 4096)
    scale = (B * D) / (512 * 4096)  # budgets scale with the carry
    W, x = workload(B, D)
    rows, ours, c16 = [], "boundedloop", dict(checkpoints=16)
    short = [("scan", "scan", {}), ("ckscan16", "ckscan16", {})]
    short += [("checkpoints=16", ours, c16), ("eqx checkpoints=16", "equinox", c16)]
    short += [("default", ours, {})]  # neither `checkpoints` nor `memory` given
    for gb in [0.5, 1.3, 2.7, 5.4]:
        short.append((f"memory={gb} GB", ours, dict(memory=int(gb * 1e9 * scale))))
    if args.only:
        short = [v for v in short if v[0] in args.only]
    if args.compile_pairs:
        ours_and_equinox = [v for v in short if v[1] in (ours, "equinox")]
        rows = compile_pairs(256, 1024, ours_and_equinox, args.compile_pairs, W, x)
        if args.out:
            write_json(
                args.out, dict(B=B, D=D, device=str(jax.devices()[0]), rows=rows)
            )
        return
    case(rows, 256, 1024, short, args.rounds, W, x, shuffle=True)
    if args.long:
        long = [("ckscan32", "ckscan32", {}), ("checkpoints=16", ours, c16)]
        long += [("memory=1.3 GB", ours, dict(memory=int(1.3e9 * scale)))]
        case(rows, 2048, 4096, long, 3, W, x)
    if args.out:
        write_json(args.out, dict(B=B, D=D, device=str(jax.devices()[0]), rows=rows))


def cheap(out_file):
    """The small body on a CPU, against the stored scan, in 501 shuffled rounds."""
    D, n, max_steps = 32, 1000, 4000
    W = jax.random.normal(jax.random.key(0), (D, D), jnp.float32) / 6
    x = jnp.ones(D, jnp.float32)
    rows = []
    ckscan = make("ckscan40", n, max_steps, _cheap_step).lower(W, x, n).compile()
    ckscan_temp, ours = temp_bytes(ckscan), "boundedloop"
    everything = 10**9  # every step of max_steps fits: a stored scan
    variants = [
        ("scan", "scan", {}),
        ("ckscan40", "ckscan40", {}),
        ("checkpoints=16", ours, dict(checkpoints=16)),
        ("checkpoints=40", ours, dict(checkpoints=40)),
        (f"memory={ckscan_temp} B (ckscan40's)", ours, dict(memory=ckscan_temp)),
        ("memory=30 kB (blocks that cover max_steps)", ours, dict(memory=30_000)),
        ("memory=1 GB (every step fits)", ours, dict(memory=everything)),
        # ckscan40's structure exactly (25 checkpoints, blocks of 40, bound n): the
        # cost of a trip count that is data, with the budget's split taken away
        (
            "memory=13540 B, max_steps=n (25 x 40)",
            ours,
            dict(memory=13540, max_steps=n),
        ),
    ]
    case(rows, n, max_steps, variants, 501, W, x, _cheap_step, shuffle=True)
    scan = next(r["grad_s"] for r in rows if r["variant"] == "scan")
    for r in rows:
        print(f"{r['variant']:40s} {r['grad_s'] / scan:5.2f}x  {r['temp_bytes']:>9d} B")
    if out_file:
        write_json(out_file, dict(D=D, n=n, max_steps=max_steps, rows=rows))


if __name__ == "__main__":
    main()
