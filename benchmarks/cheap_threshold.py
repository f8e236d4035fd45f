"""Where the reverse sweep's nested loops for cheap steps stop paying: the gradient of
`x <- tanh(x @ W)` at growing work per step, with the nested structure forced on and
forced off (`_cost_model.is_cheap`), side by side in one process.

    python benchmarks/cheap_threshold.py [--rounds 15] [--sizes BxWxN ...] [--out FILE] > benchmarks/results/cheap_threshold.txt
    python benchmarks/cheap_threshold.py --loop-steps [--out FILE] > benchmarks/results/cheap_threshold_loop_steps.txt

A state of shape (batch, width), `max_steps=4096`, 16 checkpoints, `n` steps (a
traced counter), gradient with respect to `W`. Reported per size: the work per step
(`_cost_model.work`: a product's multiply-adds counted twice), gradient time (medians
of interleaved rounds after warm-up) and XLA compile time (median of 3) with each
structure, and the while loops each compiled program has. `HEAVY_WORK` in
`boundedloop/_cost_model.py` is chosen from these figures on a CPU; on a TPU
(`cheap_threshold_tpu.txt`, and `--sizes` up to the headline's step in
`cheap_threshold_large_tpu.txt`, `cheap_threshold_recheck_tpu.txt` and
`cheap_threshold_2e33_tpu.txt`) the nested structure ran faster at every size, but
compiled slower (`cheap_structure.py` measures that against equinox's), and the
limit holds there too. `--sizes 64x512x256 ...` replaces `SIZES`; `--reverse-only`
adds a third structure, the nested reverse loop with the plain recomputation
(`cheap_structure.py`'s candidate; `cheap_threshold_reverse_only_tpu.txt`).

`--loop-steps`: steps that run a loop of their own, under `is_cheap` ("nested": many
light equations are cheap, loop or not) and a candidate rule that session 35
measured and did not land ("rule": not when a loop runs among them), side by side: diffrax's `Tsit5` on `y' =
-a0 y + a1` at a constant step (gradient time) and with a PID controller (gradient
time and XLA compile, `small_solves.py`'s compile workload), `Kvaerno5` with a PID
controller, and a few equations around a `fori_loop` of 2 and 7 iterations (cheap
under both rules: the control). Every compile is of a fresh trace
(`jax.clear_caches()`: diffrax's solve is itself jitted, and would be reused).
"""

import argparse
import random
import statistics
import time

import diffrax
import jax
import jax.extend.core
import jax.numpy as jnp
from _common import interleaved_medians, write_results
from cheap_structure import forced
from jax import lax
from small_solves import solve

import boundedloop as bl
from boundedloop._sweeps import _cost_model


SIZES = [  # (batch, width, n)
    (1, 32, 1000),
    (1, 64, 1000),
    (1, 128, 1000),
    (1, 256, 1000),
    (2, 256, 1000),
    (4, 256, 500),
    (8, 256, 500),
    (64, 256, 256),
]


def compiled(structure: str, batch: int, width: int, n: int):
    w = jax.random.normal(jax.random.key(0), (width, width)) / jnp.sqrt(width)
    x = jax.random.normal(jax.random.key(1), (batch, width))

    def loss(w, x, n):
        def body(c):
            return c[0] + 1, jnp.tanh(c[1] @ w)

        final = bl.while_loop(
            lambda c: c[0] < n, body, (0, x), max_steps=4096, checkpoints=16
        )
        return jnp.mean(final[1] ** 2)

    with forced(structure):
        lowered = jax.jit(jax.grad(loss)).lower(w, x, n)
    t0 = time.perf_counter()
    exe = lowered.compile()
    return exe, (w, x, n), time.perf_counter() - t0


LOOPS = {"while", "scan", "boundedloop_loop_jvp", "boundedloop_loop_tangent"}


def has_loop(jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr inside it) runs a loop, ours included."""
    return any(
        e.primitive.name in LOOPS
        or any(map(has_loop, jax.extend.core.jaxprs_in_params(e.params)))
        for e in jaxpr.eqns
    )


IS_CHEAP = _cost_model.is_cheap  # the rule itself, while a test patches it


def unless_loop(body) -> bool:
    """The candidate rule: as `is_cheap`, but many light equations are not cheap
    when a loop runs among them (a diffrax step's stages)."""
    n = _cost_model.equations(body.jaxpr)
    if n <= _cost_model.SMALL_BODY:
        return IS_CHEAP(body)
    return IS_CHEAP(body) and not has_loop(body.jaxpr)


LOOP_RULES = {"nested": IS_CHEAP, "rule": unless_loop}


def diffrax_loss(solver, steps, size, pid):
    y0 = jnp.linspace(0.5, 1.5, size)
    adjoint = bl.diffrax.CheckpointedAdjoint()

    def loss(a):
        ys = solve(y0, a, adjoint, solver(), not pid, steps, dt=1e-3)
        return jnp.sum(ys**2)

    return loss, (jnp.array([0.7, 0.3]),)


def inner_loop_loss(iterations, n=1000, width=32):
    w = jax.random.normal(jax.random.key(0), (width, width)) / 6

    def loss(w, x0):
        def body(c):
            def inner(_, x):
                return x + 0.01 / iterations * jnp.tanh(w @ x)

            return lax.fori_loop(0, iterations, inner, c[0]), c[1] + 1

        final = bl.while_loop(
            lambda c: c[1] < n, body, (x0, 0), max_steps=n, checkpoints=16
        )
        return jnp.sum(final[0] ** 2)

    return loss, (w, jnp.ones(width))


LOOP_WORKLOADS = {
    "Tsit5, 1000 constant steps, state 4": lambda: diffrax_loss(
        diffrax.Tsit5, 1000, 4, False
    ),
    "Tsit5, 3000 constant steps, state 4": lambda: diffrax_loss(
        diffrax.Tsit5, 3000, 4, False
    ),
    "Tsit5, 1000 constant steps, state 64": lambda: diffrax_loss(
        diffrax.Tsit5, 1000, 64, False
    ),
    "Tsit5, PID, state 4": lambda: diffrax_loss(diffrax.Tsit5, 0, 4, True),
    "Kvaerno5, PID, state 4": lambda: diffrax_loss(diffrax.Kvaerno5, 0, 4, True),
    "fori_loop of 2 in the step, width 32": lambda: inner_loop_loss(2),
    "fori_loop of 7 in the step, width 32": lambda: inner_loop_loss(7),
}


def loop_steps(rounds: int, compiles: int = 3) -> list:
    """Each `LOOP_WORKLOADS` gradient under each of `LOOP_RULES`."""
    rows = []
    for label, make in LOOP_WORKLOADS.items():
        exes, compile_s, whiles = {}, {k: [] for k in LOOP_RULES}, {}
        for _ in range(compiles):
            for name, rule in LOOP_RULES.items():
                jax.clear_caches()
                loss, fn_args = make()
                original, _cost_model.is_cheap = _cost_model.is_cheap, rule
                try:
                    lowered = jax.jit(jax.grad(loss)).lower(*fn_args)
                finally:
                    _cost_model.is_cheap = original
                t0 = time.perf_counter()
                exe = lowered.compile()
                compile_s[name].append(time.perf_counter() - t0)
                exes[name], whiles[name] = exe, exe.as_text().count(" while(")
        for exe in exes.values():  # warm-up
            jax.block_until_ready(exe(*fn_args))
        med = interleaved_medians(exes, {k: fn_args for k in exes}, rounds)
        row = {"workload": label}
        for name in LOOP_RULES:
            row[f"{name}_grad_ms"] = 1e3 * med[name]
            row[f"{name}_compile_s"] = statistics.median(compile_s[name])
            row[f"{name}_whiles"] = whiles[name]
        row["rule_over_nested"] = med["rule"] / med["nested"]
        rows.append(row)
        print(row, flush=True)
    print(
        f"\nGradients; medians of {rounds} interleaved rounds after warm-up; XLA "
        f"compile: median of {compiles} fresh traces.\n"
    )
    print(
        "| step | nested ms | rule ms | rule / nested | nested compile s "
        "| rule compile s | while loops |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['nested_grad_ms']:.2f} | {r['rule_grad_ms']:.2f} "
            f"| {r['rule_over_nested']:.3f} | {r['nested_compile_s']:.3f} "
            f"| {r['rule_compile_s']:.3f} | {r['nested_whiles']} / {r['rule_whiles']} |"
        )
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--loop-steps", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=None,
        metavar="BxWxN",
        help="batch x width x steps, e.g. 64x512x256 (default: SIZES)",
    )
    parser.add_argument(
        "--reverse-only",
        action="store_true",
        help="also the nested reverse loop with the plain recomputation",
    )
    args = parser.parse_args()
    if args.loop_steps:
        rows = loop_steps(args.rounds)
        out = args.out or "benchmarks/results/cheap_threshold_loop_steps.json"
        write_results(out, rounds=args.rounds, rows=rows)
        return
    args.out = args.out or "benchmarks/results/cheap_threshold.json"
    rows = []
    sizes = SIZES
    if args.sizes:
        sizes = [tuple(map(int, size.split("x"))) for size in args.sizes]
    structures = ["nested", "plain"] + (["reverse_only"] if args.reverse_only else [])
    for batch, width, n in sizes:
        exes, compile_s = {}, {k: [] for k in structures}
        for _ in range(3):
            for name in structures:
                exe, fn_args, seconds = compiled(name, batch, width, n)
                exes[name] = (exe, fn_args)
                compile_s[name].append(seconds)
        samples = {k: [] for k in exes}
        order = list(exes)
        for r in range(args.rounds + 1):
            random.Random(r).shuffle(order)
            for name in order:
                exe, fn_args = exes[name]
                t0 = time.perf_counter()
                jax.block_until_ready(exe(*fn_args))
                if r:  # the first round warms up
                    samples[name].append(time.perf_counter() - t0)
        row = dict(batch=batch, width=width, n=n, work=2 * batch * width * width)
        for name, (exe, _) in exes.items():
            row[f"{name}_grad_ms"] = 1e3 * statistics.median(samples[name])
            row[f"{name}_compile_s"] = statistics.median(compile_s[name])
            row[f"{name}_whiles"] = exe.as_text().count(" while(")
        for name in structures[1:]:
            row[f"{name}_over_nested"] = row[f"{name}_grad_ms"] / row["nested_grad_ms"]
        rows.append(row)
        print(row, flush=True)
    print(
        "\nGradient of tanh(x @ W), 16 checkpoints, max_steps 4096; medians of "
        f"{args.rounds} interleaved rounds; compile: median of 3.\n"
    )
    print(
        "| batch x width | work per step | nested ms | plain ms | plain / nested "
        "| nested compile s | plain compile s | while loops |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['batch']} x {r['width']} | {r['work']} | {r['nested_grad_ms']:.2f} "
            f"| {r['plain_grad_ms']:.2f} | {r['plain_over_nested']:.3f} "
            f"| {r['nested_compile_s']:.3f} | {r['plain_compile_s']:.3f} "
            f"| {r['nested_whiles']} / {r['plain_whiles']} |"
        )
    if args.reverse_only:
        print(
            "\n| batch x width | nested reverse, plain recomputation: ms | / nested "
            "| compile s | while loops |\n|---|---:|---:|---:|---:|"
        )
        for r in rows:
            print(
                f"| {r['batch']} x {r['width']} | {r['reverse_only_grad_ms']:.2f} "
                f"| {r['reverse_only_over_nested']:.3f} "
                f"| {r['reverse_only_compile_s']:.3f} | {r['reverse_only_whiles']} |"
            )
    write_results(args.out, rounds=args.rounds, rows=rows)


if __name__ == "__main__":
    main()
