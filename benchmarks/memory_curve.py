"""Gradient time against memory for the headline workload (B=512, D=4096,
`x <- tanh(x @ W)`, stopping at a traced `n`, gradient with respect to `W`): ours
with `memory=` budgets and with `checkpoints=`, beside `lax.scan` over exactly the `n`
steps (every step stored), the scan of checkpointed scans a user writes when `n` is
static (`ckscanK`: an outer `lax.scan` of `n // K` inner scans of `K` steps under
`jax.checkpoint`) and equinox's checkpointed loop. One process; compiled first, then
timed interleaved (median of the rounds). Public API only.

    python benchmarks/memory_curve.py [--small] [--long] [--out FILE]
    python benchmarks/memory_curve.py --cheap [--out FILE]

`--small` (B=64, D=256) runs anywhere; the published curve is the chip's
(`benchmarks/results/memory_curve_tpu_2df5c68.json`). `--cheap` is the CPU's small
body instead (`x + tanh(W x + b) / n`, width 32, n=1000 of `max_steps` 4000), with
budgets of the scan of checkpointed scans' temp memory and of every step taped
(`benchmarks/results/memory_curve_cpu_cheap.json`)."""

import argparse
import json
import statistics
import time

import equinox.internal as eqxi
import jax
import jax.numpy as jnp

import boundedloop as bl


def _headline_step(W, y):
    return jnp.tanh(y @ W)


def _cheap_step(W, y):
    return y + jnp.tanh(W @ y + 0.1) / 1000


def make(kind, n, max_steps, W, f=_headline_step, **kw):
    def loss(W, x, n_dyn):
        def body(c):
            return c[0] + 1, f(W, c[1])

        def cond(c):
            return c[0] < n_dyn

        def step(y, _):
            return f(W, y), None

        if kind == "bl":
            _, y = bl.while_loop(cond, body, (0, x), max_steps=max_steps, **kw)
        elif kind == "eqx":
            _, y = eqxi.while_loop(
                cond, body, (0, x), max_steps=max_steps, kind="checkpointed", **kw
            )
        elif kind.startswith("ckscan"):
            k = int(kind[6:])
            inner = jax.checkpoint(lambda y: jax.lax.scan(step, y, None, length=k)[0])
            y, _ = jax.lax.scan(lambda y, _: (inner(y), None), x, None, length=n // k)
        else:
            y, _ = jax.lax.scan(step, x, None, length=n)
        return jnp.mean(y**2)

    return jax.jit(jax.grad(loss))


def case(rows, n, max_steps, variants, rounds, W, x, f=_headline_step):
    compiled = {}
    for label, kind, kw in variants:
        start = time.perf_counter()
        try:
            c = make(kind, n, max_steps, W, f, **kw).lower(W, x, n).compile()
            jax.block_until_ready(c(W, x, n))
        except Exception as e:  # noqa: BLE001 (a variant that does not fit)
            rows.append(
                dict(n=n, max_steps=max_steps, variant=label, error=str(e)[:160])
            )
            print(rows[-1], flush=True)
            continue
        seconds = time.perf_counter() - start
        temp = c.memory_analysis().temp_size_in_bytes
        compiled[label] = (c, seconds, temp)
    times = {label: [] for label in compiled}
    for _ in range(rounds):
        for label, (c, _, _) in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(W, x, n))
            times[label].append(time.perf_counter() - start)
    for label, (_, seconds, temp) in compiled.items():
        row = dict(n=n, max_steps=max_steps, variant=label)
        row.update(grad_s=statistics.median(times[label]), compile_s=seconds)
        row.update(temp_bytes=temp)
        rows.append(row)
        print(row, flush=True)


RESULTS = {
    "tpu": "memory_curve_tpu_2df5c68.json",
    "cpu": "memory_curve_cpu_cheap.json",
}


def memory_curve_table(which: str) -> str:
    """The curve as the docs show it: per trip count, each variant's gradient time,
    its ratio to the stored scan's (where that fits), compiled temp memory and
    compile time (with the first run)."""
    from _format import load, nbytes, page, seconds, table

    results = load(RESULTS[which])
    rows = results["rows"]
    lines = []
    for n in sorted({r["n"] for r in rows}):
        here = [r for r in rows if r["n"] == n and "error" not in r]
        scan = next((r["grad_s"] for r in here if r["variant"] == "scan"), None)
        body = [
            [
                f"`{r['variant']}`",
                seconds(r["grad_s"]),
                "-" if scan is None else f"{r['grad_s'] / scan:.2f}",
                nbytes(r["temp_bytes"]),
                seconds(r["compile_s"]),
            ]
            for r in here
        ]
        header = [
            f"n={n} of {here[0]['max_steps']}",
            "gradient",
            "x `lax.scan`",
            "temp memory",
            "compile",
        ]
        lines.append(table(header, body))
    return page(*lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--long", action="store_true", help="also n=2048 of 4096")
    parser.add_argument("--cheap", action="store_true", help="the CPU's small body")
    args = parser.parse_args()
    if args.cheap:
        return cheap(args.out)
    B, D = (64, 256) if args.small else (512, 4096)
    scale = (B * D) / (512 * 4096)  # budgets scale with the carry
    W = jax.random.normal(jax.random.key(0), (D, D), jnp.float32) / jnp.sqrt(D)
    x = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)
    rows = []
    short = [
        ("scan", "scan", {}),
        ("ckscan16", "ckscan16", {}),
        ("checkpoints=16", "bl", dict(checkpoints=16)),
        ("eqx checkpoints=16", "eqx", dict(checkpoints=16)),
    ]
    for gb in [0.5, 1.3, 2.7, 5.4]:
        short.append((f"memory={gb} GB", "bl", dict(memory=int(gb * 1e9 * scale))))
    case(rows, 256, 1024, short, 5, W, x)
    if args.long:
        long = [
            ("ckscan32", "ckscan32", {}),
            ("checkpoints=16", "bl", dict(checkpoints=16)),
            ("memory=1.3 GB", "bl", dict(memory=int(1.3e9 * scale))),
        ]
        case(rows, 2048, 4096, long, 3, W, x)
    out = dict(B=B, D=D, device=str(jax.devices()[0]), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def cheap(out_file):
    """The small body on a CPU, against the stored scan, in 101 interleaved rounds."""
    D, n, max_steps = 32, 1000, 4000
    W = jax.random.normal(jax.random.key(0), (D, D), jnp.float32) / 6
    x = jnp.ones(D, jnp.float32)
    rows = []
    ckscan = make("ckscan40", n, max_steps, W, _cheap_step).lower(W, x, n).compile()
    ckscan_temp = ckscan.memory_analysis().temp_size_in_bytes
    everything = 10**9  # every step of max_steps fits: a stored scan
    variants = [
        ("scan", "scan", {}),
        ("ckscan40", "ckscan40", {}),
        ("checkpoints=16", "bl", dict(checkpoints=16)),
        ("checkpoints=40", "bl", dict(checkpoints=40)),
        (f"memory={ckscan_temp} B (ckscan40's)", "bl", dict(memory=ckscan_temp)),
        ("memory=30 kB (blocks that cover max_steps)", "bl", dict(memory=30_000)),
        ("memory=1 GB (every step fits)", "bl", dict(memory=everything)),
    ]
    case(rows, n, max_steps, variants, 101, W, x, _cheap_step)
    scan = next(r["grad_s"] for r in rows if r["variant"] == "scan")
    for r in rows:
        print(f"{r['variant']:40s} {r['grad_s'] / scan:5.2f}x  {r['temp_bytes']:>9d} B")
    if out_file:
        with open(out_file, "w") as f:
            json.dump(dict(D=D, n=n, max_steps=max_steps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
