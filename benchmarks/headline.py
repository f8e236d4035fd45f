"""The headline: the gradient of `x <- tanh(x @ W)` on a (batch, width) float32
state, stopped when a counter reaches a traced `n`, whose store-every-step tape does
not fit in an accelerator's memory: `lax.scan` over exactly `n` steps, the same scan
offloading each step to `pinned_host` memory, equinox's checkpointed loop and
`bl.while_loop`, at (n, max_steps) = (256, 1024) and (2048, 4096). Per row: trace +
lower and compile seconds, temp (and host temp) bytes, seconds per gradient
(interleaved medians), or the `error` (with `needs_gb`, `hbm_gb` out of memory).

    python benchmarks/headline.py [--batch 512] [--width 4096] [--rounds 3]
        [--out benchmarks/results/headline_<platform>.json]
"""

import argparse
import os
import pathlib
import re
import time

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import interleaved_medians, temp_bytes, write_results
from _format import index, load, nbytes, page, RESULTS, seconds, table
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import boundedloop as bl


# (n, max_steps, also boundedloop with EXTRA_CHECKPOINTS)
GRADIENT_CASES = [(256, 1024, False), (2048, 4096, True)]
GRADIENT_KINDS = ("scan", "scan_offload", "equinox", "boundedloop")
CHECKPOINTS = 16
EXTRA_CHECKPOINTS = 64
NO_PINNED_HOST = "no pinned_host memory on this device"


def workload(batch, width):
    w = jax.random.normal(jax.random.key(0), (width, width), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (batch, width), jnp.float32)
    return w / jnp.sqrt(width), x


def has_pinned_host() -> bool:
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


def headline_step(w, y):
    return jnp.tanh(y @ w)


def loss_fn(kind, n, max_steps, step=headline_step, **kw):
    """`(W, x, n_dyn) -> mean(y ** 2)` of `y <- step(W, y)` run by the loop `kind`
    (`kw`: its `checkpoints=` or `memory=`) until a counter reaches `n_dyn`; the
    scans run `n` steps (static), `ckscanK` as `n // K` checkpointed scans of `K`."""

    def loss(w, x, n_dyn):
        def body(c):
            return c[0] + 1, step(w, c[1])

        def cond(c):
            return c[0] < n_dyn

        def scanned(y, _):
            return step(w, y), None

        if kind == "boundedloop":
            _, y = bl.while_loop(cond, body, (0, x), max_steps=max_steps, **kw)
        elif kind == "equinox":
            _, y = eqxi.while_loop(
                cond, body, (0, x), max_steps=max_steps, kind="checkpointed", **kw
            )
        elif kind == "scan":
            y, _ = lax.scan(scanned, x, None, length=n)
        elif kind.startswith("ckscan"):
            k = int(kind[6:])
            inner = jax.checkpoint(lambda y: lax.scan(scanned, y, None, length=k)[0])
            y, _ = lax.scan(lambda y, _: (inner(y), None), x, None, length=n // k)
        elif kind == "scan_offload":
            policy = jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=["y"],
                offload_src="device",
                offload_dst="pinned_host",
            )

            def offloaded(y, _):
                return scanned(checkpoint_name(y, "y"), _)

            y, _ = lax.scan(jax.checkpoint(offloaded, policy=policy), x, None, length=n)
        else:
            raise ValueError(kind)
        return jnp.mean(y**2)

    return loss


def _out_of_memory(e) -> dict:
    """What XLA says the program needs and the chip has (GB), where memory ran out."""
    found = re.search(
        r"\((\d+\.?\d*)G\) exceeds available HBM \((\d+\.?\d*)G\)", str(e)
    )
    return dict(needs_gb=float(found[1]), hbm_gb=float(found[2])) if found else {}


def gradient_rows(batch, width, rounds) -> list:
    w, x = workload(batch, width)
    pinned = has_pinned_host()
    rows = []
    for n, max_steps, extra in GRADIENT_CASES:
        args = (w, x, jnp.int32(n))
        entries = [(kind, CHECKPOINTS) for kind in GRADIENT_KINDS]
        if extra:
            entries.append(("boundedloop", EXTRA_CHECKPOINTS))
        compiled, case_rows = {}, {}
        for kind, checkpoints in entries:
            key = f"{kind}, checkpoints={checkpoints}"
            row = dict(part="gradient", kind=kind, n=n, max_steps=max_steps)
            row.update(checkpoints=checkpoints, B=batch, D=width)
            case_rows[key] = row
            rows.append(row)
            if kind == "scan_offload" and not pinned:
                row["error"] = NO_PINNED_HOST
                print(row, flush=True)
                continue
            stage = "trace/lower"
            try:
                fn = jax.grad(loss_fn(kind, n, max_steps, checkpoints=checkpoints))
                t0 = time.perf_counter()
                lowered = jax.jit(fn).trace(*args).lower()
                t1 = time.perf_counter()
                stage = "compile"
                exe = lowered.compile()
                row.update(trace_lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
                row["temp_bytes"] = temp_bytes(exe)
                host = getattr(exe.memory_analysis(), "host_temp_size_in_bytes", None)
                if host is not None:
                    row["host_temp_bytes"] = int(host)
                stage = "run"
                jax.block_until_ready(exe(*args))  # warm-up
            except Exception as e:
                error = f"{stage}: {type(e).__name__}: {e}"[:300]
                row.update(error=error, **_out_of_memory(e))
                print(row, flush=True)
                continue
            compiled[key] = exe
        times = interleaved_medians(compiled, {k: args for k in compiled}, rounds)
        for key, grad_s in times.items():
            case_rows[key]["grad_s"] = grad_s
            print(case_rows[key], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512, help="B, rows of x")
    parser.add_argument("--width", type=int, default=4096, help="D, W is D x D")
    parser.add_argument("--rounds", type=int, default=3, help="timed gradient rounds")
    parser.add_argument("--out", default=None, help="results path (.json)")
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    out = pathlib.Path(args.out or RESULTS / f"headline_{platform}.json")
    results = dict(batch=args.batch, width=args.width, rounds=args.rounds)
    results.update(platform=platform, device_kind=jax.devices()[0].device_kind)
    results.update(jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""))
    results["pinned_host"] = has_pinned_host()
    said = f"{platform}: {jax.devices()[0]}, B={args.batch}, D={args.width}, "
    print(said + f"pinned_host={results['pinned_host']}", flush=True)
    results["gradient"] = gradient_rows(args.batch, args.width, args.rounds)
    write_results(out, **results)
    print("wrote", out, flush=True)


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------

HEADLINE_KINDS = {
    "scan": "`lax.scan`, every step stored",
    "scan_offload": "`lax.scan`, steps offloaded to host memory",
    "equinox": "equinox checkpointed",
    "boundedloop": "`bl.while_loop`",
}


def _cell(row: dict) -> str:
    """Time per gradient and compiled temporary memory, or why there is none."""
    if "needs_gb" in row:
        return f"does not fit: needs {row['needs_gb']:g} GB of {row['hbm_gb']:g} GB"
    if "error" in row:
        return "failed: " + row["error"].split(":")[0]
    cell = f"{seconds(row['grad_s'])}, {nbytes(row['temp_bytes'])}"
    if row.get("host_temp_bytes"):
        cell += f" + {nbytes(row['host_temp_bytes'])} on host"
    return cell


def headline_comparisons(rows: list[dict]) -> dict:
    """The ratios the headline's text states, at `CHECKPOINTS` checkpoints."""
    by = index([r for r in rows if "error" not in r], "kind", "n", "checkpoints")
    small, large = min(r["n"] for r in rows), max(r["n"] for r in rows)
    ours, eqx, off = (
        by[(k, large, CHECKPOINTS)] for k in ("boundedloop", "equinox", "scan_offload")
    )
    ours_small, eqx_small = (
        by[(k, small, CHECKPOINTS)] for k in ("boundedloop", "equinox")
    )
    found = dict(small=small, large=large, over_equinox=ours["grad_s"] / eqx["grad_s"])
    found.update(less_memory=eqx["temp_bytes"] / ours["temp_bytes"])
    found.update(over_offload=ours["grad_s"] / off["grad_s"])
    return found | dict(over_equinox_small=ours_small["grad_s"] / eqx_small["grad_s"])


def headline_table(platform: str = "tpu") -> str:
    """Time and memory four ways at two trip counts (README, performance page)."""
    run = load(f"headline_{platform}.json")
    rows = run["gradient"]
    cases = sorted({(r["n"], r["max_steps"]) for r in rows})
    by = index(rows, "kind", "checkpoints", "n", "max_steps")
    cells = []
    for kind, label in HEADLINE_KINDS.items():
        for c in sorted({r["checkpoints"] for r in rows if r["kind"] == kind}):
            name = label if kind.startswith("scan") else f"{label}, {c} checkpoints"
            found = [by.get((kind, c, *case)) for case in cases]
            cells.append([name, *(_cell(r) if r else "-" for r in found)])
    f = headline_comparisons(rows)
    return page(
        f"On one {run['device_kind']} chip (JAX {run['jax']}): the gradient with "
        f"respect to `W` of `x <- tanh(x @ W)` on a float32 state of {run['batch']} x "
        f"{run['width']}, stopping when a counter reaches a traced `n`. Time per "
        f"gradient (median of {run['rounds']} interleaved rounds after warm-up) and "
        "the compiled program's temporary memory (`benchmarks/headline.py`, "
        f"`benchmarks/results/headline_{platform}.json`); `lax.scan` runs exactly "
        "`n` steps, known when it is traced:",
        table(["gradient", *(f"`n={n}`, `max_steps={m}`" for n, m in cases)], cells),
        f"At `n={f['large']}` ours takes {f['over_equinox']:.2f} times equinox's time "
        f"in {f['less_memory']:.1f} times less memory, and {f['over_offload']:.2f} "
        f"times the offloading scan's time with no host memory; at `n={f['small']}`, "
        f"{f['over_equinox_small']:.2f} times equinox's.",
    )


if __name__ == "__main__":
    main()
