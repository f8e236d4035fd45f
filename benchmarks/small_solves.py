"""Small and undifferentiated diffrax solves, where fixed costs and compile time
dominate (issue 30, items 3 and 4): `CheckpointedAdjoint()` against
`RecursiveCheckpointAdjoint()` in one process. Compile: trace + lower and XLA compile
of a forward solve and its gradient (`Tsit5`, and `Kvaerno5`'s nested loops) on `y'
= -a0 y + a1`, each from cleared caches, interleaved; fixed cost: the gradient of a
100-step `Tsit5` solve, states of 1 to 64, interleaved medians. The results record
`XLA_FLAGS`: a CPU compiles a while loop into one kernel only under
`xla_cpu_small_while_loop_byte_threshold` (the performance page raises it).

    python benchmarks/small_solves.py [--rounds 200] [--compiles 5]
        [--out benchmarks/results/small_solves.json]
"""

import argparse
import os
import random
import statistics

import diffrax
import jax
import jax.numpy as jnp
from _common import cold_compile_parts, interleaved, interleaved_medians, write_results
from _format import load, page, seconds, table

from boundedloop.diffrax import CheckpointedAdjoint


ADJOINTS = {"RCA": diffrax.RecursiveCheckpointAdjoint, "ours": CheckpointedAdjoint}


def field(t, y, a):
    return -a[0] * y + a[1]


def solve(y0, a, adjoint, solver, constant_steps, steps=100, dt=0.01):
    """`field`'s solution at `t1`: `steps` constant steps of `dt`, or with a PID
    controller on `t` in [0, 3]."""
    if constant_steps:
        dt0, controller, t1 = dt, diffrax.ConstantStepSize(), steps * dt
    else:
        dt0, controller, t1 = 0.1, diffrax.PIDController(rtol=1e-5, atol=1e-5), 3.0
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        solver,
        0.0,
        t1,
        dt0,
        y0,
        args=a,
        stepsize_controller=controller,
        adjoint=adjoint,
        saveat=diffrax.SaveAt(t1=True),
        max_steps=4096,
    ).ys


def make(name, solver_cls, grad, constant_steps=False):
    """A fresh function (a new closure each call, so `jax.jit` has no cache)."""
    adjoint, solver = ADJOINTS[name](), solver_cls()

    def forward(y0, a):
        return solve(y0, a, adjoint, solver, constant_steps)

    if grad:
        return jax.grad(lambda y0, a: jnp.sum(forward(y0, a) ** 2), argnums=1)
    return forward


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--compiles", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/small_solves.json")
    args = parser.parse_args()
    a = jnp.array([0.7, 0.3])
    results = {"compile": {}, "fixed_cost": {}}

    print("## Compile (trace + lower, XLA compile; seconds, medians)\n")
    print("| solve | RCA | ours | ours / RCA (total) |")
    print("|---|---:|---:|---:|")
    rng = random.Random(0)
    for solver_cls in (diffrax.Tsit5, diffrax.Kvaerno5):
        for grad in (False, True):
            y0 = jnp.ones(4)
            calls = {
                k: lambda k=k: cold_compile_parts(make(k, solver_cls, grad), y0, a)
                for k in ADJOINTS
            }
            samples = interleaved(calls, args.compiles, rng)
            med = {
                k: tuple(statistics.median(p) for p in zip(*v))
                for k, v in samples.items()
            }
            label = f"{solver_cls.__name__} {'gradient' if grad else 'forward'}"
            ratio = sum(med["ours"]) / sum(med["RCA"])
            results["compile"][label] = {**med, "ratio": ratio}
            cells = " | ".join(f"{med[k][0]:.2f} + {med[k][1]:.2f}" for k in med)
            print(f"| {label} | {cells} | {ratio:.2f} |")

    print("\n## Gradient of a 100-step constant-step Tsit5 solve (ms, medians)\n")
    print("| state | RCA | ours | ours / RCA |")
    print("|---:|---:|---:|---:|")
    for size in (1, 2, 4, 64):
        y0 = jnp.linspace(0.5, 1.5, size)
        fns = {k: jax.jit(make(k, diffrax.Tsit5, True, True)) for k in ADJOINTS}
        for fn in fns.values():  # warm-up
            jax.block_until_ready(fn(y0, a))
        med = interleaved_medians(fns, {k: (y0, a) for k in fns}, args.rounds)
        ratio = med["ours"] / med["RCA"]
        results["fixed_cost"][size] = {**med, "ratio": ratio}
        ms = f"{1e3 * med['RCA']:.3f} | {1e3 * med['ours']:.3f}"
        print(f"| {size} | {ms} | {ratio:.2f} |")
    xla_flags = os.environ.get("XLA_FLAGS", "")
    write_results(args.out, rounds=args.rounds, xla_flags=xla_flags, **results)


# --- the docs' table (`benchmarks/internal/tables.py` writes it) ------------------------


def small_solves_table() -> str:
    """The fixed cost by state size, XLA's CPU loop limit at its default and raised."""
    runs = [load("small_solves.json"), load("small_solves_hoisted.json")]

    def cells(cell):
        return [seconds(cell["RCA"]), seconds(cell["ours"]), f"{cell['ratio']:.2f}"]

    rows = [
        [size, *(c for run in runs for c in cells(run["fixed_cost"][size]))]
        for size in runs[0]["fixed_cost"]
    ]
    header = ["state", "RCA, default limit", "ours", "ratio"]
    header += ["RCA, 65536 bytes", "ours", "ratio"]
    return page(table(header, rows, left=0))


if __name__ == "__main__":
    main()
