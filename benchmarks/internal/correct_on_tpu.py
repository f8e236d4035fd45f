"""Right on every backend, and what it costs. `errors`: a loop whose step `i` reads
the row step `i - 1` wrote (the loop XLA's TPU while-loop simplifier miscompiles) as
`lax` loops, equinox's and ours, through jit, jvp, jacfwd, jacrev, grad, vmap and
hessian: the largest error against the loop unrolled in Python on the host CPU.
`cost`: ours with the guard on and off: time (interleaved medians), XLA compile
(medians of alternating repetitions) and temp bytes. Internal: it turns the guard
off (`boundedloop._runtime._shard_map.HIDE_COUNTERS`).

    python benchmarks/internal/correct_on_tpu.py [--part errors|cost|all]

writes `benchmarks/results/correct_on_tpu_<backend>.json` and its `.txt`.
"""

import argparse
import pathlib
import statistics
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/

import equinox.internal as eqxi  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    compile_parts,
    interleaved_medians,
    temp_bytes,
    write_results,
)
from _format import load, nbytes, page, RESULTS, seconds, table  # noqa: E402
from jax import lax  # noqa: E402

import boundedloop as bl  # noqa: E402
from boundedloop._runtime import _shard_map  # noqa: E402


ROWS, STEPS = 6, 4
W = np.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]], np.float32)
X0 = np.array([0.3, -0.2, 0.5], np.float32)
V = np.array([0.7, -1.1, 0.4], np.float32)
XS = np.stack([X0, -X0])  # a batch, for vmap


def body(carry):
    x, buf, i, n = carry
    prev = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], x)
    return x, buf.at[i].set(jnp.tanh(W @ prev + 0.1) * x), i + 1, n


def init(x):
    return x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(STEPS)


def unrolled(x):
    buf = jnp.zeros((ROWS, 3))
    for i in range(STEPS):
        prev = x if i == 0 else buf[i - 1]
        buf = buf.at[i].set(jnp.tanh(W @ prev + 0.1) * x)
    return buf


def cond(carry):
    return carry[2] < carry[3]


def ours(checkpoints, buffers):
    kwargs = dict(buffers=lambda c: c[1]) if buffers else {}
    return lambda x: bl.while_loop(
        cond, body, init(x), max_steps=ROWS, checkpoints=checkpoints, **kwargs
    )[1]


def loops() -> dict:
    out = {
        "lax.scan": lambda x: lax.scan(
            lambda c, _: (body(c), None), init(x), length=STEPS
        )[0][1],
        "lax.while_loop": lambda x: lax.while_loop(cond, body, init(x))[1],
        "lax.fori_loop": lambda x: lax.fori_loop(
            0, STEPS, lambda _, c: body(c), init(x)
        )[1],
    }
    for kind in ("checkpointed", "bounded"):
        out[f"equinox {kind}"] = lambda x, kind=kind: eqxi.while_loop(
            cond, body, init(x), max_steps=ROWS, kind=kind
        )[1]
    for checkpoints in (1, 2, None):
        for buffers in (False, True):
            name = f"ours, checkpoints={checkpoints}" + (", buffers" if buffers else "")
            out[name] = ours(checkpoints, buffers)
    return out


def _sum_squares(f):
    return lambda x: jnp.sum(f(x) ** 2)


TRANSFORMS = {
    "jit": lambda f: jax.jit(f)(X0),
    "jvp": lambda f: jax.jit(lambda x, v: jax.jvp(f, (x,), (v,))[1])(X0, V),
    "jacfwd": lambda f: jax.jit(jax.jacfwd(f))(X0),
    "jacrev": lambda f: jax.jit(jax.jacrev(f))(X0),
    "grad": lambda f: jax.jit(jax.grad(_sum_squares(f)))(X0),
    "vmap(jvp)": lambda f: jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (V,))[1]))(XS),
    "hessian": lambda f: jax.jit(jax.hessian(_sum_squares(f)))(X0),
}


def errors() -> dict:
    with jax.default_device(jax.devices("cpu")[0]):
        truth = {k: np.asarray(t(unrolled)) for k, t in TRANSFORMS.items()}
    rows = {}

    def measure(name, f):
        rows[name] = {k: _error(t, f, truth[k]) for k, t in TRANSFORMS.items()}
        print(name, rows[name], flush=True)

    for name, f in loops().items():
        measure(name, f)
    _shard_map.HIDE_COUNTERS = False
    try:
        measure("ours, checkpoints=2, buffers, guard off", ours(2, True))
    finally:
        _shard_map.HIDE_COUNTERS = True
    return rows


def _error(transform, f, truth):
    try:
        return float(np.max(np.abs(np.asarray(transform(f)) - truth)))
    except Exception as e:  # equinox's checkpointed loop refuses forward mode
        return f"{type(e).__name__}"


SHAPE = ("batch", "width", "steps", "max_steps", "checkpoints")


def _workloads(backend: str) -> dict:
    """A `SHAPE` per workload: the issue's on an accelerator, smaller on a CPU."""
    if backend == "cpu":
        return {"wide": (64, 256, 64, 256, 16), "tiny": (1, 64, 2000, 4096, 16)}
    return {"wide": (512, 4096, 256, 1024, 16), "tiny": (1, 64, 5000, 8192, 16)}


def _programs(batch, width, steps, max_steps, checkpoints):
    """Forward and gradient of `x <- tanh(x @ W)` until a counter reaches `n`."""

    def loop(w, x, n):
        def step(carry):
            x, i = carry
            return jnp.tanh(x @ w), i + 1

        kw = dict(max_steps=max_steps, checkpoints=checkpoints)
        return jnp.sum(bl.while_loop(lambda c: c[1] < n, step, (x, 0), **kw)[0] ** 2)

    w = jax.random.normal(jax.random.key(0), (width, width)) / np.sqrt(width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    args = (w, x, jnp.array(steps))
    return {"forward": loop, "gradient": jax.grad(loop)}, args


def cost(reps: int = 3, rounds: int = 15) -> dict:
    results = {}
    for name, shape in _workloads(jax.default_backend()).items():
        compiled, compile_s, temp = {}, {}, {}
        for rep in range(reps):
            for hide in (True, False) if rep % 2 == 0 else (False, True):
                _shard_map.HIDE_COUNTERS = hide
                programs, args = _programs(*shape)
                for kind, fn in programs.items():
                    key = f"{kind}, guard {'on' if hide else 'off'}"
                    _, took, compiled[key] = compile_parts(fn, *args)
                    compile_s.setdefault(key, []).append(took)
                    temp[key] = temp_bytes(compiled[key])
        _shard_map.HIDE_COUNTERS = True
        for fn in compiled.values():  # warm-up
            jax.block_until_ready(fn(*args))
        times = interleaved_medians(compiled, {k: args for k in compiled}, rounds)
        compile_s = {k: statistics.median(v) for k, v in compile_s.items()}
        results[name] = dict(shape=dict(zip(SHAPE, shape)), time_s=times)
        results[name].update(compile_s=compile_s, temp_bytes=temp)
        print(name, results[name], flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["errors", "cost", "all"], default="all")
    parser.add_argument("--out", default=None, help="results path (.json)")
    parser.add_argument("--reps", type=int, default=3, help="compiles per setting")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    backend = jax.default_backend()
    payload = {"backend": backend, "jax": jax.__version__}
    if args.part in ("errors", "all"):
        payload["errors"] = errors()
    if args.part in ("cost", "all"):
        payload["cost"] = cost(args.reps, args.rounds)
        payload["repetitions"] = {"compiles": args.reps, "rounds": args.rounds}
    out = pathlib.Path(args.out or RESULTS / f"correct_on_tpu_{backend}.json")
    write_results(out, **payload)
    text = page(
        errors_table(payload) if "errors" in payload else None,
        cost_table(payload) if "cost" in payload else None,
    )
    out.with_suffix(".txt").write_text(text)
    print(text)


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------


def _error_cell(v) -> str:
    """An error, or the exception a loop raised for that transform."""
    if isinstance(v, str):
        return f"raises {v}"
    return "0" if v == 0 else f"{v:.0e}"


def errors_table(payload: dict) -> list[str]:
    """The largest error of each loop (a row) through each transform (a column)."""
    transforms = list(next(iter(payload["errors"].values())))
    rows = [
        [f"`{loop}`", *(_error_cell(row[k]) for k in transforms)]
        for loop, row in payload["errors"].items()
    ]
    return table(["loop", *transforms], rows, right="--:")


def cost_table(payload: dict) -> list[str]:
    """Per workload and program: time and compile, guard on and on / off; temp bytes."""
    rows = []
    for workload, r in payload["cost"].items():
        s, time, compile_s = r["shape"], r["time_s"], r["compile_s"]
        for program in ("forward", "gradient"):
            on, off = f"{program}, guard on", f"{program}, guard off"
            rows.append(
                [
                    f"{workload}: batch {s['batch']}, width {s['width']}, "
                    f"{s['steps']} of {s['max_steps']} steps",
                    program,
                    f"{time[on] / time[off]:.3f} ({seconds(time[on])})",
                    f"{compile_s[on] / compile_s[off]:.2f} ({compile_s[on]:.2f} s)",
                    " / ".join(nbytes(r["temp_bytes"][k]) for k in (on, off)),
                ]
            )
    header = ["workload", "program", "time, on/off", "XLA compile, on/off"]
    return table([*header, "temp, on / off"], rows, left=2, right="--:")


def correct_on_tpu_table(backend: str) -> str:
    """The errors, then what the guard costs (the correct-on-TPU page)."""
    payload = load(f"correct_on_tpu_{backend}.json")
    device = payload["devices"][0].split("(")[0]
    return page(
        f"Run on {device} (JAX {payload['jax']}): the largest absolute error against "
        "the same transform of the loop unrolled in Python on the host CPU.",
        errors_table(payload),
        "What the guard costs: ours with it on over ours with it off, in one process "
        "(time: interleaved medians after warm-up; compile: medians of alternating "
        "repetitions):",
        cost_table(payload),
    )


def fuzz_findings(name: str = "fuzz_tpu.jsonl") -> dict:
    """What `tests/test_differential.py`'s fuzzer found (`results/<name>`): bodies,
    ours' largest error, how many `lax.fori_loop` got wrong, and of two or more
    steps, how many it got right and wrong by each guard form of single-read bodies
    (`forms`) and by a read of the previous row guarded by `i > 0` (`by_guard`)."""
    found = load(name)
    forms, by_guard = {}, {(a, b): 0 for a in (True, False) for b in (True, False)}
    for f in found:
        p, wrong = f["program"], f["lax"] > 1e-3
        trip = p["steps"] if p["max_steps"] is None else min(p["steps"], p["max_steps"])
        if trip < 2:
            continue
        if len(p["reads"]) == 1:
            lag, test, _ = p["reads"][0]
            forms.setdefault((lag, test), [0, 0])[wrong] += 1
        guarded = any(lag == 1 and test in (">", "cond") for lag, test, _ in p["reads"])
        by_guard[guarded, wrong] += 1
    said = dict(by_guard=by_guard, bodies=len(found), backend=found[0]["backend"])
    said.update(ours_max=max(f["ours"] for f in found))
    return said | dict(lax_wrong=sum(f["lax"] > 1e-3 for f in found), forms=forms)


LAX = ["lax right", "lax wrong"]
# how a body of the fuzzer guards its read `buf[i - n]`, written out (k = n - 1)
GUARDS_WRITTEN = {
    ">": "i > {k}",
    ">=": "i >= {n}",
    "!<": "~(i < {n})",
    "-0": "i - {n} >= 0",
    "cond": "lax.cond(i > {k}, ...)",
}


def tpu_fuzz_table() -> str:
    """The fuzzer's findings on the TPU by guard, and on the CPU in one line."""
    f, cpu = fuzz_findings(), fuzz_findings("fuzz_cpu.jsonl")
    forms = [
        [f"`{GUARDS_WRITTEN[test].format(k=lag - 1, n=lag)}` before `buf[i - {lag}]`"]
        + counts
        for (lag, test), counts in sorted(f["forms"].items())
    ]
    guarded = [
        [label, f["by_guard"][flag, False], f["by_guard"][flag, True]]
        for flag, label in ((True, "yes"), (False, "no"))
    ]
    return page(
        f"{f['bodies']} random bodies on the {f['backend'].upper()}. Ours: largest "
        f"error {f['ours_max']:.1e} against complex-step NumPy, none wrong. "
        f"`lax.fori_loop`: {f['lax_wrong']} wrong (error above 1e-3). The bodies with "
        "one read and two or more steps, by how the read is guarded:",
        table(["guard", *LAX], forms, right="--:"),
        "All bodies of two or more steps (one or two reads), by whether one of their "
        "reads of the previous row is guarded by `i > 0` (`where` or `lax.cond`):",
        table(["a read guarded by `i > 0`", *LAX], guarded, right="--:"),
        f"The same fuzzer on the {cpu['backend'].upper()}, {cpu['bodies']} bodies: "
        f"ours, largest error {cpu['ours_max']:.1e}; `lax.fori_loop`, "
        f"{cpu['lax_wrong']} wrong.",
    )


if __name__ == "__main__":
    main()
