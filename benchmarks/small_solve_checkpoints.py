"""Where the scalar solve's gradient spends its time against RCA's: the gradient of
`small_solves.py`'s 100-step constant-step Tsit5 solve on a state of 1 element,
with each adjoint at several checkpoint counts, in one process, interleaved.

    python benchmarks/small_solve_checkpoints.py [--rounds 400] [--sizes 1 4]

`None` is each adjoint's default for `max_steps=4096` (90 checkpoints, so about
10 of the 100 steps are recomputed); 128 stores every step. If ours gains on RCA
as checkpoints fall (more recomputation, but run in the cheap steps' nested loops),
the gap lies in the control of each reversed step, not in the steps themselves.

The same for the loops alone (`control` rows): 100 steps of `x <- a sin(x) + 0.01`
on a scalar, `max_steps=4096`, the gradient with respect to `a`, ours against
equinox's checkpointed loop (the loop under RCA) at 90 and 8 checkpoints, and the
number of while loops in each compiled gradient. Writes
`benchmarks/results/small_solve_checkpoints.json` (milliseconds per gradient,
medians of `--rounds` rounds after a warm-up call).

With `--profile`, instead: each adjoint's scalar gradient (default checkpoints)
traced by `jax.profiler` over 20 calls, and per gradient the profiler's events,
the threads they ran on, and the calls of XLA:CPU's concurrent thunk executor
(`ThunkExecutor::Execute`: a while body whose thunks it runs as a dataflow graph
on a thread pool, rather than in sequence on the calling thread).
"""

import argparse
import collections
import glob
import gzip
import json
import pathlib
import tempfile

import diffrax
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import interleaved_medians, write_results
from small_solves import solve

import boundedloop as bl
from boundedloop.diffrax import CheckpointedAdjoint


ADJOINTS = {
    "RCA": diffrax.RecursiveCheckpointAdjoint,
    "ours": CheckpointedAdjoint,
}
CHECKPOINTS = {"RCA": (None, 128), "ours": (None, 128, 8, 2)}


def gradient(adjoint):
    def loss(y0, a):
        return jnp.sum(solve(y0, a, adjoint, diffrax.Tsit5(), True) ** 2)

    return jax.jit(jax.grad(loss, argnums=1))


def control_gradient(kind, checkpoints):
    def final(a):
        def body(carry):
            x, i = carry
            return jnp.sin(x) * a + 0.01, i + 1

        init, options = (jnp.array(0.5), jnp.array(0)), dict(max_steps=4096)
        if kind == "equinox":
            options.update(kind="checkpointed")
        loop = eqxi.while_loop if kind == "equinox" else bl.while_loop
        return loop(
            lambda c: c[1] < 100, body, init, checkpoints=checkpoints, **options
        )[0]

    return jax.jit(jax.grad(final))


def profile(rows):
    """Trace each adjoint's scalar gradient; a row of counts per adjoint."""
    a, y0 = jnp.array([0.7, 0.3]), jnp.linspace(0.5, 1.5, 1)
    for name, adjoint in ADJOINTS.items():
        fn = gradient(adjoint())
        jax.block_until_ready(fn(y0, a))
        with tempfile.TemporaryDirectory() as where:
            with jax.profiler.trace(where, create_perfetto_trace=True):
                for _ in range(20):
                    jax.block_until_ready(fn(y0, a))
            (path,) = glob.glob(f"{where}/**/perfetto_trace.json.gz", recursive=True)
            trace = json.load(gzip.open(path))
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        names = collections.Counter(e["name"] for e in events)
        row = dict(
            adjoint=name,
            events_per_gradient=len(events) / 20,
            threads=len({e.get("tid") for e in events}),
            executor_calls_per_gradient=names["ThunkExecutor::Execute"] / 20,
        )
        rows.append(row)
        print(row, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1])
    parser.add_argument("--profile", action="store_true")
    results = pathlib.Path(__file__).parent / "results"
    parser.add_argument("--out", default=results / "small_solve_checkpoints.json")
    args = parser.parse_args()
    a = jnp.array([0.7, 0.3])
    rows = []
    if args.profile:
        profile(rows)
        out = pathlib.Path(args.out)
        write_results(out.with_name(out.stem + "_profile.json"), rows=rows)
        return
    for size in args.sizes:
        y0 = jnp.linspace(0.5, 1.5, size)
        fns = {
            f"{name} {c}": gradient(ADJOINTS[name](checkpoints=c))
            for name, counts in CHECKPOINTS.items()
            for c in counts
        }
        for fn in fns.values():  # warm-up
            jax.block_until_ready(fn(y0, a))
        med = interleaved_medians(fns, {k: (y0, a) for k in fns}, args.rounds)
        base = med["RCA None"]
        for key, seconds in med.items():
            name, c = key.split(" ")
            row = dict(state=size, adjoint=name, checkpoints=c, ms=1e3 * seconds)
            rows.append({**row, "over_rca": seconds / base})
            print(
                f"state {size}  {key:10s} {1e3 * seconds:.4f} ms  {seconds / base:.3f}"
            )
    fns = {
        f"{k} {c}": control_gradient(k, c) for k in ("equinox", "ours") for c in (90, 8)
    }
    a = jnp.array(0.9)
    for fn in fns.values():
        jax.block_until_ready(fn(a))
    med = interleaved_medians(fns, {k: (a,) for k in fns}, args.rounds)
    for key, seconds in med.items():
        name, c = key.split(" ")
        loops = fns[key].lower(a).compile().as_text().count(" while(")
        row = dict(state="control", adjoint=name, checkpoints=c, ms=1e3 * seconds)
        rows.append(
            {**row, "over_equinox": seconds / med[f"equinox {c}"], "loops": loops}
        )
        print(f"control  {key:11s} {1e3 * seconds:.4f} ms  {loops} while loops")
    write_results(args.out, rounds=args.rounds, rows=rows)


if __name__ == "__main__":
    main()
