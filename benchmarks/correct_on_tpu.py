"""Right on every backend, and what it costs: the loop XLA's TPU while-loop simplifier
miscompiles, through every transform, and the guard's price.

`errors`: a loop whose counter starts at a constant 0 and whose step `i` reads the row
step `i - 1` wrote (`where(i > 0, buf[max(i - 1, 0)], x)`), through jit, jvp, jacfwd,
jacrev, grad, vmap of jvp and hessian, as `lax.scan`, `lax.while_loop`,
`lax.fori_loop`, equinox's loops and ours (checkpoints 1, 2 and None, with and
without `buffers=`, and once with the guard off), each against the same transform of
the loop unrolled in Python (no loop for XLA to simplify) on the host CPU backend: the
largest absolute error.

`cost`: ours with the guard (`boundedloop._shard_map.HIDE_COUNTERS`) on and off:
forward and gradient time per call (interleaved medians after warm-up, one process),
XLA compile seconds (alternating, several repetitions) and compiled temp bytes.

    python benchmarks/correct_on_tpu.py [--part errors|cost|all]

writes `benchmarks/results/correct_on_tpu_<backend>.json` and a `.txt` table;
`python benchmarks/tables.py` makes the docs' tables from the JSON.
"""

import argparse
import pathlib
import statistics
import time

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import tables
from _common import interleaved_medians, temp_bytes, write_results
from jax import lax

import boundedloop as bl
from boundedloop import _shard_map


jax.config.update("jax_default_matmul_precision", "highest")

ROWS, STEPS = 6, 4
W = np.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]], np.float32)
X0 = np.array([0.3, -0.2, 0.5], np.float32)
V = np.array([0.7, -1.1, 0.4], np.float32)


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
    "vmap(jvp)": lambda f: jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (V,))[1]))(
        np.stack([X0, -X0])
    ),
    "hessian": lambda f: jax.jit(jax.hessian(_sum_squares(f)))(X0),
}


def errors() -> dict:
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        truth = {k: np.asarray(t(unrolled)) for k, t in TRANSFORMS.items()}
    rows = {}
    for name, f in loops().items():
        rows[name] = {k: _error(t, f, truth[k]) for k, t in TRANSFORMS.items()}
        print(name, rows[name], flush=True)
    _shard_map.HIDE_COUNTERS = False
    try:
        name = "ours, checkpoints=2, buffers, guard off"
        f = ours(2, True)
        rows[name] = {k: _error(t, f, truth[k]) for k, t in TRANSFORMS.items()}
        print(name, rows[name], flush=True)
    finally:
        _shard_map.HIDE_COUNTERS = True
    return rows


def _error(transform, f, truth):
    try:
        return float(np.max(np.abs(np.asarray(transform(f)) - truth)))
    except Exception as e:  # equinox's checkpointed loop refuses forward mode
        return f"{type(e).__name__}"


def _workloads(backend: str) -> dict:
    """(batch, width, steps, max_steps, checkpoints) per workload: the issue's on an
    accelerator, smaller on a CPU."""
    if backend == "cpu":
        return {"wide": (64, 256, 64, 256, 16), "tiny": (1, 64, 2000, 4096, 16)}
    return {"wide": (512, 4096, 256, 1024, 16), "tiny": (1, 64, 5000, 8192, 16)}


def _programs(batch, width, steps, max_steps, checkpoints):
    """Forward and gradient of `x <- tanh(x @ W)` until a counter reaches `n`."""

    def loop(w, x, n):
        def step(carry):
            x, i = carry
            return jnp.tanh(x @ w), i + 1

        out = bl.while_loop(
            lambda c: c[1] < n,
            step,
            (x, 0),
            max_steps=max_steps,
            checkpoints=checkpoints,
        )
        return jnp.sum(out[0] ** 2)

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
                    lowered = jax.jit(fn).lower(*args)
                    t0 = time.perf_counter()
                    compiled[key] = lowered.compile()
                    compile_s.setdefault(key, []).append(time.perf_counter() - t0)
                    temp[key] = temp_bytes(compiled[key])
        _shard_map.HIDE_COUNTERS = True
        for fn in compiled.values():  # warm-up
            jax.block_until_ready(fn(*args))
        times = interleaved_medians(compiled, {k: args for k in compiled}, rounds)
        results[name] = {
            "shape": dict(
                zip(["batch", "width", "steps", "max_steps", "checkpoints"], shape)
            ),
            "time_s": times,
            "compile_s": {k: statistics.median(v) for k, v in compile_s.items()},
            "temp_bytes": temp,
        }
        print(name, results[name], flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["errors", "cost", "all"], default="all")
    parser.add_argument("--out", default=None, help="results path (.json)")
    parser.add_argument("--reps", type=int, default=3, help="compiles per setting")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds")
    args = parser.parse_args()
    backend = jax.default_backend()
    payload = {"backend": backend, "jax": jax.__version__}
    if args.part in ("errors", "all"):
        payload["errors"] = errors()
    if args.part in ("cost", "all"):
        payload["cost"] = cost(args.reps, args.rounds)
        payload["repetitions"] = {"compiles": args.reps, "rounds": args.rounds}
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parent / "results" / f"correct_on_tpu_{backend}.json"
    )
    write_results(out, **payload)
    lines = []
    if "errors" in payload:
        lines += tables.correct_on_tpu_errors(payload)
    if "cost" in payload:
        lines += ["", *tables.correct_on_tpu_cost(payload)]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
