"""diffrax's `diffeqsolve` on `boundedloop.diffrax.CheckpointedAdjoint` against
diffrax's own adjoints, side by side in one process.

    python benchmarks/diffrax_adjoint.py [--workload neural|long] [--rounds 20] [--out FILE]

Workloads (Tsit5 with a PID controller at rtol = atol = 1e-5, SaveAt(t1), gradient
with respect to the vector field's parameters):

- `neural`: a neural ODE, an MLP of width 64 and depth 2 on a state of 8 plus a
  rotation term of rate 4.5, t in [0, 10] (about 110 steps), max_steps 4096;
- `long`: a small one, an MLP of width 16 on a state of 2 plus a rotation of rate 20,
  t in [0, 150] (about 7900 steps), max_steps 16384;
- `wide`: a large state, `y' = -k y + 3 (roll(y, 1) - roll(y, -1))` on 200000
  elements (width 0 means this linear field, with `k` as its parameter), t in
  [0, 5], max_steps 256;
  no `jacfwd` (200000 columns).

Reported per adjoint: gradient time (medians of interleaved rounds after warm-up),
trace + lower and XLA compile times separately, compiled temporary memory, steps
taken; and `jax.jvp` / `jax.jacfwd` time against `ForwardMode`. Prints markdown
tables; ratios are within this run.
"""

import argparse
import json
import pathlib
import random
import statistics
import time
from typing import NamedTuple

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from _common import temp_bytes

from boundedloop.diffrax import CheckpointedAdjoint


class Workload(NamedTuple):
    state: int
    width: int
    depth: int
    rotation: float
    t1: float
    max_steps: int


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
    sol = diffrax.diffeqsolve(
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
    return sol


def loss(field, y0, adjoint):
    return jnp.sum(solve(field, y0, adjoint).ys ** 2)


def compile_parts(fn, *args):
    """(trace + lower seconds, XLA compile seconds, compiled)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, compiled


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="neural")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    use(WORKLOADS[args.workload])
    if args.out is None:
        args.out = f"benchmarks/results/diffrax_adjoint_{args.workload}.json"
    field, y0 = make_field(), jnp.linspace(-1.0, 1.0, STATE)
    params, static = eqx.partition(field, eqx.is_inexact_array)
    steps = int(
        solve(field, y0, diffrax.RecursiveCheckpointAdjoint()).stats["num_steps"]
    )

    def grad_of(adjoint):
        return lambda p, y0: jax.grad(
            lambda p: loss(eqx.combine(p, static), y0, adjoint)
        )(p)

    def jvp_of(adjoint):
        return lambda y0, v: jax.jvp(
            lambda y0: solve(field, y0, adjoint).ys, (y0,), (v,)
        )[1]

    def jacfwd_of(adjoint):
        return lambda y0: jax.jacfwd(lambda y0: solve(field, y0, adjoint).ys)(y0)

    cases = {
        ("grad", "RecursiveCheckpointAdjoint()"): (
            grad_of(diffrax.RecursiveCheckpointAdjoint()),
            (params, y0),
        ),
        ("grad", "RecursiveCheckpointAdjoint(16)"): (
            grad_of(diffrax.RecursiveCheckpointAdjoint(checkpoints=16)),
            (params, y0),
        ),
        ("grad", "CheckpointedAdjoint()"): (
            grad_of(CheckpointedAdjoint()),
            (params, y0),
        ),
        ("grad", "CheckpointedAdjoint(16)"): (
            grad_of(CheckpointedAdjoint(checkpoints=16)),
            (params, y0),
        ),
        ("grad", "CheckpointedAdjoint(store all)"): (
            grad_of(CheckpointedAdjoint(checkpoints=MAX_STEPS)),
            (params, y0),
        ),
        ("jvp", "ForwardMode()"): (jvp_of(diffrax.ForwardMode()), (y0, y0)),
        ("jvp", "CheckpointedAdjoint()"): (jvp_of(CheckpointedAdjoint()), (y0, y0)),
    }
    if args.workload != "wide":
        cases[("jacfwd", "ForwardMode()")] = (jacfwd_of(diffrax.ForwardMode()), (y0,))
        cases[("jacfwd", "CheckpointedAdjoint()")] = (
            jacfwd_of(CheckpointedAdjoint()),
            (y0,),
        )
    if args.workload == "neural":  # its compile grows with max_steps
        cases[("grad", "DirectAdjoint()")] = (
            grad_of(diffrax.DirectAdjoint()),
            (params, y0),
        )
    compiled, rows = {}, {}
    for key, (fn, fn_args) in cases.items():
        trace_s, compile_s, exe = compile_parts(fn, *fn_args)
        jax.block_until_ready(exe(*fn_args))
        compiled[key] = (exe, fn_args)
        rows[key] = dict(
            mode=key[0],
            adjoint=key[1],
            trace_lower_s=trace_s,
            compile_s=compile_s,
            temp_bytes=temp_bytes(exe),
            samples=[],
        )
        print(
            key, f"trace+lower {trace_s:.2f} s, compile {compile_s:.2f} s", flush=True
        )
    order = list(compiled)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for key in order:
            exe, fn_args = compiled[key]
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*fn_args))
            rows[key]["samples"].append(time.perf_counter() - t0)
    for row in rows.values():
        row["ms"] = 1e3 * statistics.median(row.pop("samples"))
    base = {
        "grad": rows[("grad", "RecursiveCheckpointAdjoint()")],
        "jvp": rows[("jvp", "ForwardMode()")],
        "jacfwd": rows.get(("jacfwd", "ForwardMode()")),
    }
    print()
    print(
        f"{args.workload} ODE {WORKLOADS[args.workload]}, {steps} steps taken, max_steps={MAX_STEPS}; medians of "
        f"{args.rounds} interleaved rounds; ratios to diffrax's adjoint for the mode "
        "(RecursiveCheckpointAdjoint() for grad, ForwardMode() for jvp/jacfwd)."
    )
    print()
    print(
        "| mode | adjoint | ms | ratio | trace+lower s | compile s | "
        "(trace+compile) ratio | temp bytes |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows.values():
        b = base[row["mode"]]
        total = row["trace_lower_s"] + row["compile_s"]
        print(
            f"| {row['mode']} | {row['adjoint']} | {row['ms']:.2f} | "
            f"{row['ms'] / b['ms']:.2f} | {row['trace_lower_s']:.2f} | "
            f"{row['compile_s']:.2f} | "
            f"{total / (b['trace_lower_s'] + b['compile_s']):.2f} | "
            f"{row['temp_bytes']} |"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": steps, "rows": list(rows.values())}, indent=1))


if __name__ == "__main__":
    main()
