"""diffrax's `diffeqsolve` (Tsit5, PID controller at 1e-5, SaveAt(t1)) through
`boundedloop.diffrax.CheckpointedAdjoint` against diffrax's own adjoints, in one
process, on the `WORKLOADS` (`neural`, `long`, `wide`): gradient with respect to the
field's parameters, `jax.jvp` and `jax.jacfwd` against `ForwardMode`. Per row: time
(interleaved medians after a warm-up), trace + lower and XLA compile seconds (with
`--compile-repeats` above 1, medians of interleaved compiles from cleared caches
after the first), temp bytes; prints a table of ratios.

    python benchmarks/diffrax_adjoint.py [--workload neural|long|wide] [--rounds 20]
        [--compile-repeats 1] [--modes grad jvp jacfwd] [--adjoints ...]
        [--out benchmarks/results/diffrax_adjoint_<workload>.json]
"""

import argparse
import collections
import functools
import random
import statistics

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from _common import (
    cold_compile_parts,
    compile_parts,
    interleaved,
    interleaved_medians,
    temp_bytes,
    write_json,
)
from _format import index, load, milliseconds, nbytes, page, table

from boundedloop.diffrax import CheckpointedAdjoint


Workload = collections.namedtuple("Workload", "state width depth rotation t1 max_steps")
WORKLOADS = {
    "neural": Workload(8, 64, 2, 4.5, 10.0, 4096),
    "long": Workload(2, 16, 1, 20.0, 150.0, 16384),
    "wide": Workload(200_000, 0, 0, 0.0, 5.0, 256),
}
STATE, WIDTH, DEPTH, ROTATION, T1, MAX_STEPS = WORKLOADS["neural"]


def use(workload: Workload):
    """Make `workload` the one the functions below build."""
    global STATE, WIDTH, DEPTH, ROTATION, T1, MAX_STEPS
    STATE, WIDTH, DEPTH, ROTATION, T1, MAX_STEPS = workload


class Field(eqx.Module):
    mlp: eqx.nn.MLP
    rotation: jax.Array

    def __call__(self, t, y, args):
        return self.mlp(y) + self.rotation @ y


class Linear(eqx.Module):
    k: jax.Array

    def __call__(self, t, y, args):
        return -self.k * y + 3.0 * (jnp.roll(y, 1) - jnp.roll(y, -1))


def make_field():
    if WIDTH == 0:
        return Linear(jnp.array(1.3))
    mlp = eqx.nn.MLP(
        STATE, STATE, WIDTH, DEPTH, activation=jnp.tanh, key=jax.random.key(0)
    )
    angle = jnp.eye(STATE, k=1) - jnp.eye(STATE, k=-1)
    return Field(mlp, ROTATION * angle)


def solve(field, y0, adjoint):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        0.0,
        T1,
        0.1,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
        saveat=diffrax.SaveAt(t1=True),
        adjoint=adjoint,
        max_steps=MAX_STEPS,
    )


def loss(field, y0, adjoint):
    return jnp.sum(solve(field, y0, adjoint).ys ** 2)


def recompile(cases, rows, repeats, rng):
    """Compiles every case `repeats` times more, `interleaved` and each from cleared
    caches; each row's times become the medians of those compiles (the first
    compile, a warm-up, is left out)."""
    if repeats < 1:
        return
    calls = {
        k: functools.partial(cold_compile_parts, f, *a) for k, (f, a) in cases.items()
    }
    for key, parts in interleaved(calls, repeats, rng).items():
        rows[key]["trace_lower_s"] = statistics.median(p[0] for p in parts)
        rows[key]["compile_s"] = statistics.median(p[1] for p in parts)
        rows[key]["compile_repeats"] = repeats
        print(key, "trace+lower s:", " ".join(f"{p[0]:.2f}" for p in parts))
        print(key, "compile s:", " ".join(f"{p[1]:.2f}" for p in parts), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="neural")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--adjoints", nargs="+", help="as the rows name them (all)")
    repeats = "compiles from cleared caches, interleaved; above 1, the first left out"
    parser.add_argument("--compile-repeats", type=int, default=1, help=repeats)
    args = parser.parse_args()
    use(WORKLOADS[args.workload])
    out = args.out or f"benchmarks/results/diffrax_adjoint_{args.workload}.json"
    field, y0 = make_field(), jnp.linspace(-1.0, 1.0, STATE)
    params, static = eqx.partition(field, eqx.is_inexact_array)
    stats = solve(field, y0, diffrax.RecursiveCheckpointAdjoint()).stats
    steps = int(stats["num_steps"])

    def ys(adjoint):
        return lambda y0: solve(field, y0, adjoint).ys

    def make(mode, adjoint):
        """The measured function of `mode` through `adjoint`, and its arguments."""
        if mode == "grad":
            grad = jax.grad(lambda p, y0: loss(eqx.combine(p, static), y0, adjoint))
            return grad, (params, y0)
        if mode == "jvp":
            return lambda y0, v: jax.jvp(ys(adjoint), (y0,), (v,))[1], (y0, y0)
        return jax.jacfwd(ys(adjoint)), (y0,)

    recursive = diffrax.RecursiveCheckpointAdjoint
    # a budget of what diffrax's default adjoint's program holds
    fn, fn_args = make("grad", recursive())
    same = temp_bytes(compile_parts(fn, *fn_args)[2])
    adjoints = {
        "RecursiveCheckpointAdjoint()": recursive(),
        "RecursiveCheckpointAdjoint(16)": recursive(checkpoints=16),
        "CheckpointedAdjoint()": CheckpointedAdjoint(),
        "CheckpointedAdjoint(16)": CheckpointedAdjoint(checkpoints=16),
        "CheckpointedAdjoint(store all)": CheckpointedAdjoint(checkpoints=MAX_STEPS),
        "CheckpointedAdjoint(memory=RCA's)": CheckpointedAdjoint(memory=same),
        "ForwardMode()": diffrax.ForwardMode(),
        "DirectAdjoint()": diffrax.DirectAdjoint(),
    }
    measured = [("grad", name) for name in list(adjoints)[:6]]
    measured += [("jvp", "ForwardMode()"), ("jvp", "CheckpointedAdjoint()")]
    if args.workload != "wide":
        measured += [("jacfwd", "ForwardMode()"), ("jacfwd", "CheckpointedAdjoint()")]
    if args.workload == "neural":  # its compile grows with max_steps
        measured.append(("grad", "DirectAdjoint()"))
    cases = {
        (mode, name): make(mode, adjoints[name])
        for mode, name in measured
        if mode in args.modes and name in (args.adjoints or [name])
    }
    compiled, rows = {}, {}
    for key, (fn, fn_args) in cases.items():
        trace_s, compile_s, exe = compile_parts(fn, *fn_args)
        jax.block_until_ready(exe(*fn_args))
        compiled[key] = exe
        rows[key] = dict(mode=key[0], adjoint=key[1], trace_lower_s=trace_s)
        rows[key].update(compile_s=compile_s, temp_bytes=temp_bytes(exe))
        said = f"trace+lower {trace_s:.2f} s, compile {compile_s:.2f} s"
        print(key, said, flush=True)
    rng = random.Random(0)
    recompile(cases, rows, args.compile_repeats - 1, rng)
    fn_args = {key: case[1] for key, case in cases.items()}
    for key, s in interleaved_medians(compiled, fn_args, args.rounds, rng=rng).items():
        rows[key]["ms"] = 1e3 * s
    print(
        f"\n{args.workload} ODE {WORKLOADS[args.workload]}, {steps} steps taken, "
        f"max_steps={MAX_STEPS}; medians of {args.rounds} interleaved rounds; ratios "
        "to diffrax's adjoint for the mode (RecursiveCheckpointAdjoint() for grad, "
        "ForwardMode() for jvp/jacfwd).\n"
    )
    header = ["mode", "adjoint", "ms", "ratio", "trace+lower s", "compile s"]
    header += ["compile ratio", "(trace+compile) ratio", "temp bytes"]
    cells = []
    for row in rows.values():
        b = rows[(row["mode"], BASE[row["mode"]])]
        total = row["trace_lower_s"] + row["compile_s"]
        cells.append(
            [row["mode"], row["adjoint"], f"{row['ms']:.2f}"]
            + [f"{row['ms'] / b['ms']:.2f}", f"{row['trace_lower_s']:.2f}"]
            + [f"{row['compile_s']:.2f}", f"{row['compile_s'] / b['compile_s']:.2f}"]
            + [f"{total / (b['trace_lower_s'] + b['compile_s']):.2f}"]
            + [row["temp_bytes"]]
        )
    print("\n".join(table(header, cells, left=2)))
    parameters = dict(workload=args.workload, **WORKLOADS[args.workload]._asdict())
    results = dict(**parameters, rounds=args.rounds)
    results.update(compile_repeats=args.compile_repeats, steps=steps)
    write_json(out, {**results, "rows": list(rows.values())})


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------

OURS, RCA = "CheckpointedAdjoint", "RecursiveCheckpointAdjoint"
# diffrax's own adjoint for each mode: the ratios are to its time
BASE = {"grad": f"{RCA}()", "jvp": "ForwardMode()", "jacfwd": "ForwardMode()"}
MODES = tuple(BASE)
# the comparisons of `diffrax_summary_table`: row label -> (mode, ours, theirs)
SUMMARY = {
    "`grad`, defaults": ("grad", f"{OURS}()", f"{RCA}()"),
    "`grad`, 16 checkpoints each": ("grad", f"{OURS}(16)", f"{RCA}(16)"),
    "`grad`, ours storing every step": ("grad", f"{OURS}(store all)", f"{RCA}()"),
    "`jvp`": ("jvp", f"{OURS}()", "ForwardMode()"),
    "`jacfwd`": ("jacfwd", f"{OURS}()", "ForwardMode()"),
}


def load_run(workload: str) -> dict:
    """`diffrax_adjoint_<workload>.json`, rows by (mode, adjoint) in `MODES` order."""
    run = load(f"diffrax_adjoint_{workload}.json")
    rows = sorted(run["rows"], key=lambda r: MODES.index(r["mode"]))
    return {**run, "rows": index(rows, "mode", "adjoint")}


def ratios(rows: dict) -> dict:
    """Each row's time and trace + compile time over its mode's `BASE` adjoint's."""

    def compiling(r):
        return r["trace_lower_s"] + r["compile_s"]

    found = {}
    for key, r in rows.items():
        base = rows[(r["mode"], BASE[r["mode"]])]
        found[key] = (r["ms"] / base["ms"], compiling(r) / compiling(base))
    return found


def adjoint_name(adjoint: str, max_steps: int) -> str:
    """How the docs name an adjoint of the results."""
    if adjoint == "CheckpointedAdjoint(store all)":
        return f"`CheckpointedAdjoint({max_steps})` (every step)"
    return f"`{adjoint}`"


def diffrax_table(workload: str) -> str:
    """One workload: each mode and adjoint, time and ratios (the diffrax guide)."""
    run = load_run(workload)
    rows, max_steps = run["rows"], run["max_steps"]
    to_base = ratios(rows)
    cells = [
        [f"`{mode}`", adjoint_name(adjoint, max_steps), milliseconds(r["ms"])]
        + [f"{ratio:.2f}" for ratio in to_base[(mode, adjoint)]]
        + [nbytes(r["temp_bytes"])]
        for (mode, adjoint), r in rows.items()
    ]
    ours, theirs = (rows[("grad", f"{who}(16)")]["ms"] for who in (OURS, RCA))
    header = ["mode", "adjoint", "time", "ratio", "trace + compile ratio"]
    repeats = run.get("compile_repeats", 1) - 1  # compiles after a warm-up, if any
    compiles = f", compile times medians of {repeats} interleaved compiles from cleared"
    compiles = f"{compiles} caches after a warm-up" if repeats > 0 else ""
    return page(
        f"{run['steps']} steps of `max_steps={max_steps}`; medians of {run['rounds']} "
        f"interleaved rounds{compiles} "
        f"(`benchmarks/results/diffrax_adjoint_{workload}.json`):",
        table([*header, "temp memory"], cells, left=2),
        "At the same checkpoint count, `CheckpointedAdjoint(16)` takes "
        f"{ours / theirs:.2f} times `RecursiveCheckpointAdjoint(16)`'s time "
        f"({milliseconds(ours)} against {milliseconds(theirs)}).",
    )


def diffrax_summary_table() -> str:
    """The `SUMMARY` ratios, a column per workload (the why page)."""
    runs = {workload: load_run(workload) for workload in WORKLOADS}

    def ratio(rows, mode, ours, theirs):
        if (mode, ours) not in rows or (mode, theirs) not in rows:
            return "-"
        return f"{rows[(mode, ours)]['ms'] / rows[(mode, theirs)]['ms']:.2f}"

    cells = [["steps taken", *(run["steps"] for run in runs.values())]]
    for label, compared in SUMMARY.items():
        cells.append([label, *(ratio(run["rows"], *compared) for run in runs.values())])
    return page(table(["workload", *runs], cells))


if __name__ == "__main__":
    main()
