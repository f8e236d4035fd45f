"""Whether the reverse sweep's loops for cheap steps pay on a workload, with the
structure forced each way: the headline's gradient (`headline.py`'s workload at
`n=256`, `max_steps=1024`, 16 checkpoints) nested, with the nested reverse loop
but the plain recomputation (a candidate, not a rule), plain and, as
the reference, equinox's checkpointed loop; diffrax's neural ODE
(`diffrax_adjoint.py`) nested and plain. XLA compile of fresh traces
(`jax.clear_caches()` before each; wall and process time), the variants
interleaved in a shuffled order each repetition, after one warm-up repetition; then
the gradient's time, interleaved the same way. The chip's compile time drifts by up
to a factor of 1.5 over a run, so the table pools runs and compares each variant's
compiles with equinox's of the same repetition:

    python benchmarks/cheap_structure.py [--workloads headline neural] [--kinds ...]
        [--repeats 8] [--rounds 5] [--out benchmarks/results/cheap_structure_<platform>.json]

appends a run to the results file; `structure_table` pools every run of it.
"""

import argparse
import contextlib
import functools
import json
import pathlib
import random
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from _common import clear_caches
from _format import load, page, table

import boundedloop as bl
from boundedloop._sweeps import _cost_model, _reverse_sweep


IS_CHEAP, RECOMPUTE = _cost_model.is_cheap, _reverse_sweep.recompute
SHARES_ONE_STEP = _cost_model.shares_one_step
# the costly step's two structures: the plain reverse sweep, and one loop
ONE_LOOP = {"plain": lambda body: False, "driver": lambda body: True}
FORCED = {
    "nested": lambda body: True,
    "plain": lambda body: False,
    "reverse_only": lambda body: True,
    "driver": lambda body: False,
}


def plain_recompute(sweep, end, stack):
    """The recomputation as for steps that are not cheap."""
    return RECOMPUTE(sweep._replace(cheap_steps=False), end, stack)


def headline(kind: str, batch: int = 512, width: int = 4096, n=256, max_steps=1024):
    """The headline's gradient (`headline.py`'s loss), `kind` of loop, and its
    arguments."""
    import headline

    loss = headline.loss_fn(
        "equinox" if kind == "equinox" else "boundedloop", n, max_steps, 16
    )
    return jax.jit(jax.grad(loss)), (*headline.workload(batch, width), n)


headline_long = functools.partial(headline, n=2048, max_steps=4096)


def neural(kind: str):
    """diffrax's neural ODE's gradient through ours (`kind` is forced by `lower`)."""
    import diffrax_adjoint

    field, y0 = diffrax_adjoint.make_field(), jnp.ones(diffrax_adjoint.STATE)
    adjoint = bl.diffrax.CheckpointedAdjoint()
    grad = eqx.filter_grad(lambda f: diffrax_adjoint.loss(f, y0, adjoint))
    return eqx.filter_jit(grad), (field,)


WORKLOADS = {
    "headline": (headline, ["nested", "reverse_only", "plain", "driver", "equinox"]),
    "headline_long": (headline_long, ["nested", "plain", "driver"]),
    "neural": (neural, ["nested", "plain"]),
}


@contextlib.contextmanager
def forced(kind: str):
    """While in it, loops are lowered with the reverse sweep's structure `kind` (a
    key of `FORCED`; any other: as `_cost_model.is_cheap` rules)."""
    _cost_model.is_cheap = FORCED.get(kind, IS_CHEAP)
    if kind == "reverse_only":
        _reverse_sweep.recompute = plain_recompute
    _cost_model.shares_one_step = ONE_LOOP.get(kind, SHARES_ONE_STEP)
    try:
        yield
    finally:
        _cost_model.is_cheap, _reverse_sweep.recompute = IS_CHEAP, RECOMPUTE
        _cost_model.shares_one_step = SHARES_ONE_STEP


def lower(make, kind):
    """`make(kind)`'s function lowered with the structure `kind` names forced."""
    fn, args = make(kind)
    with forced(kind):
        return fn.lower(*args), args


def whiles(compiled) -> int:
    compiled = getattr(compiled, "compiled", compiled)  # equinox's wrapper
    return compiled.as_text().count(" while(")


def measure(make, kinds: list, repeats: int, rounds: int) -> dict:
    compiles, cpu, exes = {k: [] for k in kinds}, {k: [] for k in kinds}, {}
    for r in range(repeats + 1):  # the first is a warm-up
        random.Random(r).shuffle(kinds)
        for kind in kinds:
            clear_caches()
            lowered, args = lower(make, kind)
            t0, cpu0 = time.perf_counter(), time.process_time()
            exes[kind] = lowered.compile(), args
            if r:
                compiles[kind].append(time.perf_counter() - t0)
                cpu[kind].append(time.process_time() - cpu0)
    times = {k: [] for k in kinds}
    for r in range(rounds + 1):
        random.Random(100 + r).shuffle(kinds)
        for kind in kinds:
            exe, args = exes[kind]
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*args))
            if r:
                times[kind].append(time.perf_counter() - t0)
    return {
        kind: dict(
            compiles=compiles[kind],
            compile_cpu_s=cpu[kind],
            grad_s=statistics.median(times[kind]),
            whiles=whiles(exes[kind][0]),
        )
        for kind in sorted(kinds)
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=None, help="of those below")
    parser.add_argument("--batch", type=int, default=512, help="the headline's B")
    parser.add_argument("--width", type=int, default=4096, help="the headline's D")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", default=None, help="what tree this run measures")
    args = parser.parse_args()
    platform = jax.default_backend()
    out = pathlib.Path(
        args.out or f"benchmarks/results/cheap_structure_{platform}.json"
    )
    results = json.loads(out.read_text()) if out.exists() else {"runs": []}
    run = dict(platform=platform, device=str(jax.devices()[0]), jax=jax.__version__)
    run.update(repeats=args.repeats, rounds=args.rounds, workloads={})
    run.update(batch=args.batch, width=args.width)
    if args.variant:
        run.update(variant=args.variant)
    for name in args.workloads:
        kinds = [k for k in WORKLOADS[name][1] if k in (args.kinds or LABELS)]
        make = WORKLOADS[name][0]
        if name.startswith("headline"):
            make = functools.partial(make, batch=args.batch, width=args.width)
        run["workloads"][name] = measure(make, kinds, args.repeats, args.rounds)
        print(name, json.dumps(run["workloads"][name]), flush=True)
    results["runs"].append(run)
    out.write_text(json.dumps(results, indent=1) + "\n")


# the structure `_cost_model.is_cheap` picks on a TPU: the headline's step has few
# equations but `2**34` work (at least `HEAVY_WORK`), the neural ODE's many
# equations on 64-element arrays
TPU_PICKS = {"headline": "driver", "headline_long": "driver", "neural": "plain"}
LABELS = {
    "nested": "nested",
    "plain": "plain",
    "reverse_only": "nested reverse, plain recomputation",
    "driver": "one loop (driver)",
    "equinox": "equinox checkpointed",
}


def paired_over_equinox(found: list, kind: str, key: str = "compiles") -> str:
    """The median ratio of `kind`'s compiles to equinox's of the same repetitions
    (`key`: wall time, or "compile_cpu_s", process time, where runs recorded it)."""
    ratios = [
        a / b
        for f in found
        if kind in f and key in f[kind] and "equinox" in f
        for a, b in zip(f[kind][key], f["equinox"][key])
    ]
    return f"{statistics.median(ratios):.2f} ({len(ratios)})" if ratios else "-"


def structure_table(platform: str = "tpu") -> str:
    """Each workload's variants over every run of the results file: gradient time
    (median of the runs' medians), XLA compile (median of every compile), its ratio
    to plain's and the median of its ratios to equinox's compile in the same
    repetition, the while loops."""
    runs = load(f"cheap_structure_{platform}.json")["runs"]
    cells = []
    for workload in WORKLOADS:
        found = [r["workloads"][workload] for r in runs if workload in r["workloads"]]
        if not found:  # a workload this results file has no run of
            continue
        kinds = [k for k in LABELS if any(k in f for f in found)]
        pooled = {
            k: [c for f in found if k in f for c in f[k]["compiles"]] for k in kinds
        }
        base = statistics.median(pooled["plain"])
        for kind in kinds:
            grads = [f[kind]["grad_s"] for f in found if kind in f]
            cells.append(
                [
                    workload,
                    LABELS[kind]
                    + (" (a TPU's)" if TPU_PICKS[workload] == kind else ""),
                    f"{1e3 * statistics.median(grads):.1f} ms",
                    f"{statistics.median(pooled[kind]):.2f} s",
                    f"{statistics.median(pooled[kind]) / base:.2f}",
                    paired_over_equinox(found, kind),
                    paired_over_equinox(found, kind, "compile_cpu_s"),
                    len(pooled[kind]),
                    next(f[kind]["whiles"] for f in found if kind in f),
                ]
            )
    header = ["workload", "reverse sweep", "gradient", "XLA compile", "over plain"]
    header += ["over equinox, paired", "process time over equinox, paired"]
    header += ["compiles", "while loops"]
    return page(
        f"On one {runs[0]['device']} ({len(runs)} runs of "
        "`benchmarks/cheap_structure.py`, `benchmarks/results/"
        f"cheap_structure_{platform}.json`): the gradient with the reverse sweep's "
        "structure forced; gradient time the median of the runs' medians, XLA "
        "compile the median of every compile of the runs (wall time); paired: the "
        "median of its ratios to equinox's compile of the same repetition (wall "
        "time, and the process's CPU time where runs recorded it, the steadier "
        "measure: on the chip its median deviation is 3 to 5% of the median, "
        "against 7 to 10% for wall time), with the count of pairs.",
        table(header, cells, left=2),
    )


if __name__ == "__main__":
    main()
