"""Many cheap steps (the ODE-solver regime): explicit Euler on `x' = tanh(W x + b)`,
state width 32, dt = 0.01, exactly n steps, and the gradient of `sum(x_n**2)` with
respect to (W, b, x0). Side by side in one process: `bl.while_loop` with 16
checkpoints and storing every step, equinox's checkpointed loop with 16, and the
ideal, a `lax.scan` over exactly n steps that stores every residual.

    python benchmarks/cheap_steps.py [--quick] [--rounds 20] [--out FILE] > benchmarks/results/cheap_steps.txt
    python benchmarks/cheap_steps.py --smoke   # tiny sizes, checks that it runs

The loops' cond is `i < n` with n a traced argument (the compiled program does not
depend on it) and max_steps = n. Times are medians over rounds run round-robin, in a
shuffled order, after a warm-up; body evaluations per gradient are counted with
`jax.debug.callback` in a separate compile. Writes JSON (not in --smoke mode unless
--out is given) and prints a markdown table.
"""

import argparse

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    compile_time,
    EULER_DT,
    euler_step,
    EvalCounter,
    interleaved_medians,
    temp_bytes,
    WhileIterationCounter,
    write_results,
)
from _format import index, load, page, seconds, table
from jax import lax

import boundedloop as bl


WIDTH = 32
DT = EULER_DT
CHECKPOINTS = 16
IDEAL = "lax.scan (ideal)"
KINDS = [
    f"boundedloop checkpoints={CHECKPOINTS}",
    "boundedloop store all",
    f"equinox checkpointed checkpoints={CHECKPOINTS}",
    IDEAL,
]


def make(kind, n, counter=None):
    """The gradient, `(W, b, x0, steps) -> (dW, db, dx0)`, of `sum(x_n**2)` for one
    loop. `steps` (a traced int, equal to `n`) is what the loops' cond compares
    against; `n` is the static bound (and the scan's length)."""

    def loss(w, b, x0, steps):
        body = euler_step(w, b, counter)

        cond = lambda c: c[1] < steps  # noqa: E731
        init = (x0, jnp.array(0))
        if kind == f"boundedloop checkpoints={CHECKPOINTS}":
            out = bl.while_loop(cond, body, init, max_steps=n, checkpoints=CHECKPOINTS)
        elif kind == "boundedloop store all":
            out = bl.while_loop(cond, body, init, max_steps=n, checkpoints=n)
        elif kind == f"equinox checkpointed checkpoints={CHECKPOINTS}":
            out = eqxi.while_loop(
                cond,
                body,
                init,
                max_steps=n,
                kind="checkpointed",
                checkpoints=CHECKPOINTS,
            )
        elif kind == IDEAL:
            out = lax.scan(lambda c, _: (body(c), None), init, length=n)[0]
        else:
            raise ValueError(kind)
        return jnp.sum(out[0] ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))


def count_evals(kind, n, args):
    """(body evaluations, while-loop iterations) in one gradient."""
    counter = EvalCounter()
    with WhileIterationCounter() as control:
        counted = jax.jit(make(kind, n, counter))
        jax.block_until_ready(counted(*args))
    counter.count = control.count = 0
    jax.block_until_ready(counted(*args))
    return counter.count, control.count


def max_abs_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only n = 1000")
    parser.add_argument(
        "--smoke", action="store_true", help="n = 50, 100 and 2 rounds: checks it runs"
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--out",
        default=None,
        help="JSON output (default benchmarks/results/cheap_steps.json; none with --smoke)",
    )
    args = parser.parse_args()
    if args.smoke:
        sizes, rounds = [50, 100], 2
    else:
        sizes, rounds = ([1000] if args.quick else [1000, 10000]), args.rounds
    out = args.out
    if out is None and not args.smoke:
        out = "benchmarks/results/cheap_steps.json"

    kw, kb, kx = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(kw, (WIDTH, WIDTH)) / np.sqrt(WIDTH)
    b = 0.1 * jax.random.normal(kb, (WIDTH,))
    x0 = jax.random.normal(kx, (WIDTH,))

    rows, fns, fn_args = [], {}, {}
    for n in sizes:
        a = (w, b, x0, jnp.array(n, dtype=jnp.int32))
        reference = None
        for kind in KINDS:
            ct, compiled = compile_time(make(kind, n), *a)
            grads = jax.block_until_ready(compiled(*a))  # warm-up
            if kind == IDEAL:
                reference = grads
            evals, control = count_evals(kind, n, a)
            row = {
                "kind": kind,
                "n": n,
                "grad_compile_s": ct,
                "grad_temp_bytes": temp_bytes(compiled),
                "body_evals_per_grad": evals,
                "control_iterations": control,
                "_grads": grads,
            }
            rows.append(row)
            fns[(kind, n)], fn_args[(kind, n)] = compiled, a
            print("compiled", kind, n, flush=True)
        for row in rows:
            if row["n"] == n:
                row["max_abs_diff_vs_ideal"] = max_abs_diff(
                    row.pop("_grads"), reference
                )

    medians = interleaved_medians(fns, fn_args, rounds)
    for row in rows:
        row["grad_s"] = medians[(row["kind"], row["n"])]
    for row in rows:
        ideal = next(r for r in rows if r["kind"] == IDEAL and r["n"] == row["n"])
        row["grad_over_ideal"] = row["grad_s"] / ideal["grad_s"]
        row["evals_over_2n"] = row["body_evals_per_grad"] / (2 * row["n"])
        print(row, flush=True)

    print()
    print(
        f"Euler steps x + {DT} * tanh(W x + b), width {WIDTH}, exactly n steps "
        f"(max_steps = n); gradient of sum(x_n**2) w.r.t. (W, b, x0); "
        f"medians of {rounds} interleaved rounds; ratios within this run."
    )
    print()
    print(
        "| loop | n | grad ms | over ideal | body evals | evals / 2n | "
        "while iterations | iterations / evals | temp bytes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        # `lax.scan` is not a `lax.while_loop`: its iterations are not counted
        control = row["control_iterations"] if row["kind"] != IDEAL else None
        ratio = "" if control is None else f"{control / row['body_evals_per_grad']:.2f}"
        print(
            f"| {row['kind']} | {row['n']} | {1e3 * row['grad_s']:.3f} | "
            f"{row['grad_over_ideal']:.2f} | {row['body_evals_per_grad']} | "
            f"{row['evals_over_2n']:.2f} | {control or ''} | {ratio} | "
            f"{row['grad_temp_bytes']} |"
        )
    print()
    print("| loop | n | compile s | max abs diff vs ideal |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['kind']} | {row['n']} | {row['grad_compile_s']:.2f} | "
            f"{row['max_abs_diff_vs_ideal']:.1e} |"
        )
    if out:
        write_results(
            out,
            width=WIDTH,
            dt=DT,
            checkpoints=CHECKPOINTS,
            rounds=rounds,
            rows=rows,
        )


# --- the docs' table (`benchmarks/internal/tables.py` writes it) ------------------------


def cheap_steps_table() -> str:
    """Many cheap steps: gradient time of ours, equinox's, ours storing every step
    and the ideal scan, for each `n` (the why page)."""
    data = load("cheap_steps.json")
    c, by = data["checkpoints"], index(data["rows"], "kind", "n")
    rows = []
    for n in sorted({r["n"] for r in data["rows"]}):
        ours = by[(f"boundedloop checkpoints={c}", n)]
        theirs = by[(f"equinox checkpointed checkpoints={c}", n)]
        every = by[("boundedloop store all", n)]
        rows.append(
            [
                n,
                f"{seconds(ours['grad_s'])} ({ours['grad_over_ideal']:.2f}x ideal)",
                f"{seconds(theirs['grad_s'])} ({theirs['grad_over_ideal']:.3g}x)",
                f"{theirs['grad_s'] / ours['grad_s']:.2g}",
                f"{seconds(every['grad_s'])} ({every['grad_over_ideal']:.2f}x)",
                seconds(by[(IDEAL, n)]["grad_s"]),
            ]
        )
    header = ["n", "bl.while_loop", "equinox checkpointed", "equinox / ours"]
    header += ["bl.while_loop storing every step", "ideal `lax.scan`"]
    return page(table(header, rows, left=0))


if __name__ == "__main__":
    main()
