"""optimistix solves (the `PROBLEMS`: BFGS, Levenberg-Marquardt, Newton, fixed point)
differentiated three ways in one process: `boundedloop.optimistix.CheckpointedAdjoint()`
("ours"), `RecursiveCheckpointAdjoint()` ("RCA", the same unrolled derivative on
equinox's loop) and `ImplicitAdjoint()` ("implicit", the default). Per problem: the
jitted gradient and `jax.jacfwd` (RCA has none), interleaved medians after a warm-up,
and the gradient's trace + lower + compile (a fresh function each time), medians.

    python benchmarks/optimistix_adjoint.py [--rounds 100] [--compiles 5]
        [--out benchmarks/results/optimistix_adjoint.json]
"""

import argparse
import random
import statistics

import jax
import jax.numpy as jnp
import optimistix as optx
from _common import compile_time, interleaved, interleaved_medians, write_results
from _format import load, page, seconds, table

from boundedloop.optimistix import CheckpointedAdjoint


ADJOINTS = {
    "ours": CheckpointedAdjoint,
    "RCA": optx.RecursiveCheckpointAdjoint,
    "implicit": optx.ImplicitAdjoint,
}
FORWARD = ("ours", "implicit")  # RCA has no forward mode
TOL = dict(rtol=1e-5, atol=1e-5)


def rosenbrock(y, a):
    valley = a[0] * (y[1:] - y[:-1] ** 2) ** 2 + (a[1] - y[:-1]) ** 2
    return jnp.sum(valley) + 0.1 * a[0] * jnp.sum(y)


def fit_residuals(y, a):
    t = jnp.linspace(0.0, 1.0, 32)
    data = a[0] * jnp.exp(-a[1] * t) + 0.1 * jnp.sin(7 * t)
    return y[0] * jnp.exp(-y[1] * t) + y[2] * t - data


def coupled(y, a):
    return y + 0.3 * jnp.tanh(jnp.roll(y, 1)) - a[0] * jnp.cos(a[1] * jnp.arange(8.0))


def contraction(y, a):
    return 0.5 * jnp.cos(a[0] * y + a[1] * jnp.roll(y, 1))


LM, FIXED_POINT = optx.LevenbergMarquardt(**TOL), optx.FixedPointIteration(**TOL)
PROBLEMS = {
    "BFGS, Rosenbrock (16)": (optx.minimise, rosenbrock, optx.BFGS(**TOL), 16),
    "Levenberg-Marquardt, fit (3 of 32)": (optx.least_squares, fit_residuals, LM, 3),
    "Newton, root (8)": (optx.root_find, coupled, optx.Newton(**TOL), 8),
    "fixed point (8)": (optx.fixed_point, contraction, FIXED_POINT, 8),
}


def make_loss(problem, name):
    """A fresh loss (a new closure each call, so `jax.jit` has no cache)."""
    solve, fn, solver, size = PROBLEMS[problem]
    adjoint = ADJOINTS[name]()
    y0 = jnp.linspace(0.1, 0.9, size)

    def loss(a):
        sol = solve(fn, solver, y0, args=a, adjoint=adjoint, throw=False)
        return jnp.sum(sol.value**2)

    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--compiles", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/optimistix_adjoint.json")
    args = parser.parse_args()
    a = jnp.array([1.3, 0.9])
    rng = random.Random(0)
    results = {}
    for problem in PROBLEMS:
        solve, fn, solver, size = PROBLEMS[problem]
        sol = solve(fn, solver, jnp.linspace(0.1, 0.9, size), args=a, throw=False)
        steps, result = int(sol.stats["num_steps"]), int(sol.result._value)
        grads = {k: jax.jit(jax.grad(make_loss(problem, k))) for k in ADJOINTS}
        forwards = {k: jax.jit(jax.jacfwd(make_loss(problem, k))) for k in FORWARD}
        values = {k: fn(a) for k, fn in {**grads, **forwards}.items()}  # warm-up
        agree = float(jnp.max(jnp.abs(values["ours"] - values["RCA"])))
        grad_ms = interleaved_medians(grads, {k: (a,) for k in grads}, args.rounds)
        fwd_ms = interleaved_medians(forwards, {k: (a,) for k in forwards}, args.rounds)
        calls = {
            k: lambda k=k: compile_time(jax.grad(make_loss(problem, k)), a)[0]
            for k in ADJOINTS
        }
        samples = interleaved(calls, args.compiles, rng)
        compile_s = {k: statistics.median(v) for k, v in samples.items()}
        row = dict(steps=steps, result=result, ours_minus_rca_max_abs=agree)
        row.update(gradient_seconds=grad_ms, jacfwd_seconds=fwd_ms)
        row["compile_seconds"] = compile_s
        results[problem] = row
        print(problem, row, flush=True)
    write_results(args.out, rounds=args.rounds, compiles=args.compiles, **results)
    print(optimistix_adjoint_table(results))


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------


def optimistix_adjoint_table(data=None) -> str:
    """Gradient, `jacfwd` and compile by adjoint (the optimistix guide)."""
    data = data or load("optimistix_adjoint.json")
    per_call, forward_and_compile = [], []
    for problem, row in data.items():
        if not (isinstance(row, dict) and "steps" in row):
            continue  # the machine's description
        grad, fwd, comp = (
            row[k] for k in ("gradient_seconds", "jacfwd_seconds", "compile_seconds")
        )
        per_call.append(
            [problem, row["steps"]]
            + [seconds(grad[k]) for k in ADJOINTS]
            + [f"{grad['ours'] / grad['RCA']:.2f}"]
        )
        forward_and_compile.append(
            [problem, *(seconds(fwd[k]) for k in FORWARD)]
            + [f"{comp[k]:.2f} s" for k in ADJOINTS]
            + [f"{comp['ours'] / comp['RCA']:.2f}"]
        )
    header = ["problem (unknowns)", "`jacfwd`, ours", "`jacfwd`, implicit"]
    header += ["compile, ours", "RCA", "implicit", "ours / RCA"]
    per_call_header = ["problem (unknowns)", "steps", "ours", "RCA", "implicit"]
    return page(
        "Gradient, per call:",
        table([*per_call_header, "ours / RCA"], per_call),
        "`jax.jacfwd` per call (RCA has none), and the gradient's compile:",
        table(header, forward_and_compile),
    )


if __name__ == "__main__":
    main()
