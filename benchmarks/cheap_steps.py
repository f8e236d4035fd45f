"""Many cheap steps (the ODE-solver regime): exactly n Euler steps `x + 0.01 tanh(W x
+ b)` (width 32, n = 1000 and 10000, cond `i < n` on a traced n, max_steps = n). The
gradient through ours (16 checkpoints, and storing every step), equinox's
checkpointed loop and the ideal `lax.scan`; `--forward-mode`: `jax.jvp` and
`jax.jacfwd` of ours against `lax.while_loop`. Interleaved medians after a warm-up;
body evaluations and loop iterations counted by callback in another compile.

    python benchmarks/cheap_steps.py [--rounds 20] [--out FILE] > benchmarks/results/cheap_steps.txt
    python benchmarks/cheap_steps.py --forward-mode [--rounds 30] [--out FILE] > benchmarks/results/forward_mode.txt

writes `benchmarks/results/cheap_steps.json` (`forward_mode.json`).
"""

import argparse

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    compile_time,
    count_evals,
    EULER_DT as DT,
    euler_step,
    interleaved_medians,
    max_abs_diff,
    temp_bytes,
    write_results,
)
from _format import index, load, page, seconds, table
from jax import lax

import boundedloop as bl


WIDTH = 32
CHECKPOINTS = 16
IDEAL = "lax.scan (ideal)"
REFERENCE = "lax.while_loop"
OURS, EVERY = f"boundedloop checkpoints={CHECKPOINTS}", "boundedloop store all"
KINDS = [OURS, EVERY, f"equinox checkpointed checkpoints={CHECKPOINTS}", IDEAL]
FORWARD_KINDS = [OURS, EVERY, REFERENCE]
MODES = ["jvp", "jacfwd"]
# each mode's results: what its rows name the compile time, body evaluations,
# difference from the last kind's result, time, and time over the last kind's
KEYS = {
    "grad": ("grad_compile_s", "body_evals_per_grad", "max_abs_diff_vs_ideal")
    + ("grad_s", "grad_over_ideal"),
    "forward": ("compile_s", "evals", "max_abs_diff", "s", "over_reference"),
}


def final_state(kind, n, w, b, x0, steps, counter=None):
    """x_n of the loop `kind`, its cond `i < steps` (traced, equal to `n`)."""
    body = euler_step(w, b, counter)
    cond = lambda c: c[1] < steps  # noqa: E731
    init = (x0, jnp.array(0))
    if kind.startswith("boundedloop"):
        checkpoints = CHECKPOINTS if kind == OURS else n
        out = bl.while_loop(cond, body, init, max_steps=n, checkpoints=checkpoints)
    elif kind.startswith("equinox checkpointed"):
        out = eqxi.while_loop(
            cond, body, init, max_steps=n, kind="checkpointed", checkpoints=CHECKPOINTS
        )
    elif kind == IDEAL:
        out = lax.scan(lambda c, _: (body(c), None), init, length=n)[0]
    elif kind == REFERENCE:
        out = lax.while_loop(cond, body, init)
    else:
        raise ValueError(kind)
    return out[0]


def make(kind, mode, n, counter=None):
    """`grad`: `(W, b, x0, steps) -> (dW, db, dx0)` of `sum(x_n**2)`; `jvp`,
    `jacfwd`: `(W, b, x0, v, steps) ->` that of x_n with respect to x0."""

    def final(w, b, x0, steps):
        return final_state(kind, n, w, b, x0, steps, counter)

    if mode == "grad":
        return jax.grad(lambda *a: jnp.sum(final(*a) ** 2), argnums=(0, 1, 2))
    if mode == "jvp":
        return lambda w, b, x0, v, steps: jax.jvp(
            lambda x: final(w, b, x, steps), (x0,), (v,)
        )
    return lambda w, b, x0, v, steps: jax.jacfwd(lambda x: final(w, b, x, steps))(x0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-mode", action="store_true", help="jvp and jacfwd")
    parser.add_argument("--rounds", type=int, default=None, help="20, or 30 forward")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    forward = args.forward_mode
    what = "forward" if forward else "grad"
    modes, kinds = (MODES, FORWARD_KINDS) if forward else (["grad"], KINDS)
    rounds = args.rounds or (30 if forward else 20)
    compile_key, evals_key, diff_key, time_key, over_key = KEYS[what]
    name = "forward_mode" if forward else "cheap_steps"
    out = args.out or f"benchmarks/results/{name}.json"

    w, b, x0, *v = jax.random.split(jax.random.key(0), 4 if forward else 3)
    w = jax.random.normal(w, (WIDTH, WIDTH)) / np.sqrt(WIDTH)
    b = 0.1 * jax.random.normal(b, (WIDTH,))
    x0 = jax.random.normal(x0, (WIDTH,))
    v = [jax.random.normal(k, (WIDTH,)) for k in v]

    rows, fns, fn_args = [], {}, {}
    for n in [1000, 10000]:
        a = (w, b, x0, *v, jnp.array(n, dtype=jnp.int32))
        for mode in modes:
            results = {}
            for kind in kinds:
                ct, compiled = compile_time(make(kind, mode, n), *a)
                results[kind] = jax.block_until_ready(compiled(*a))  # warm-up
                counted = count_evals(
                    lambda c: make(kind, mode, n, c), a, control=not forward
                )
                row = {"kind": kind, "mode": mode, "n": n, compile_key: ct}
                if forward:
                    row[evals_key] = counted
                else:
                    del row["mode"]
                    row["grad_temp_bytes"] = temp_bytes(compiled)
                    row[evals_key], row["control_iterations"] = counted
                rows.append(row)
                key = (kind, mode, n)
                fns[key], fn_args[key] = compiled, a
                print("compiled", kind, mode, n, flush=True)
            for row in rows[-len(kinds) :]:
                row[diff_key] = max_abs_diff(results[row["kind"]], results[kinds[-1]])

    medians = interleaved_medians(fns, fn_args, rounds)
    for row in rows:
        row[time_key] = medians[(row["kind"], row.get("mode", "grad"), row["n"])]
    by = {(r["kind"], r.get("mode"), r["n"]): r for r in rows}
    for row in rows:
        base = by[(kinds[-1], row.get("mode"), row["n"])]
        row[over_key] = row[time_key] / base[time_key]
        if forward:
            row["compile_over_reference"] = row["compile_s"] / base["compile_s"]
        else:
            row["evals_over_2n"] = row["body_evals_per_grad"] / (2 * row["n"])
        print(row, flush=True)

    jvp = f"jvp (one tangent) and jacfwd ({WIDTH} tangents) w.r.t. x0"
    measured = jvp if forward else "gradient of sum(x_n**2) w.r.t. (W, b, x0)"
    print(
        f"\nEuler steps x + {DT} * tanh(W x + b), width {WIDTH}, exactly n steps "
        f"(max_steps = n); {measured}; medians of {rounds} interleaved rounds; "
        "ratios within this run.\n"
    )
    header = ["loop", "mode", "n", "ms", f"over {kinds[-1]}", "body evals"]
    header += ["compile s", "max abs diff"]
    if not forward:  # `lax.scan` is no `lax.while_loop`: not counted
        header += ["while iterations", "temp bytes"]
    cells = [
        [row["kind"], row.get("mode", "grad"), row["n"], f"{1e3 * row[time_key]:.3f}"]
        + [f"{row[over_key]:.2f}", row[evals_key], f"{row[compile_key]:.2f}"]
        + [f"{row[diff_key]:.1e}"]
        + ([] if forward else [row["control_iterations"], row["grad_temp_bytes"]])
        for row in rows
    ]
    print("\n".join(table(header, cells, left=2)))
    parameters = {} if forward else dict(width=WIDTH, dt=DT, checkpoints=CHECKPOINTS)
    write_results(out, **parameters, rounds=rounds, rows=rows)


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------


def cheap_steps_table() -> str:
    """Gradient time of each loop against the ideal scan, by `n` (the why page)."""
    data = load("cheap_steps.json")
    c, by = data["checkpoints"], index(data["rows"], "kind", "n")
    rows = []
    for n in sorted({r["n"] for r in data["rows"]}):
        ours = by[(f"boundedloop checkpoints={c}", n)]
        theirs = by[(f"equinox checkpointed checkpoints={c}", n)]
        every = by[("boundedloop store all", n)]
        rows.append(
            [n, f"{seconds(ours['grad_s'])} ({ours['grad_over_ideal']:.2f}x ideal)"]
            + [f"{seconds(theirs['grad_s'])} ({theirs['grad_over_ideal']:.3g}x)"]
            + [f"{theirs['grad_s'] / ours['grad_s']:.2g}"]
            + [f"{seconds(every['grad_s'])} ({every['grad_over_ideal']:.2f}x)"]
            + [seconds(by[(IDEAL, n)]["grad_s"])]
        )
    header = ["n", "bl.while_loop", "equinox checkpointed", "equinox / ours"]
    header += ["bl.while_loop storing every step", "ideal `lax.scan`"]
    return page(table(header, rows, left=0))


def forward_mode_table() -> str:
    """Forward-mode time over `lax.while_loop`'s, by loop and `n` (the why page)."""
    rows = load("forward_mode.json")["rows"]
    by = index(rows, "kind", "mode", "n")
    kinds = [k for k in dict.fromkeys(r["kind"] for r in rows) if k != REFERENCE]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    names = {
        k: k.replace("boundedloop", "bl.while_loop,").replace(
            "store all", "storing every step"
        )
        for k in kinds
    }
    cells = [
        [names[kind], n]
        + [f"{by[(kind, mode, n)]['over_reference']:.2f}" for mode in modes]
        for kind in kinds
        for n in sorted({r["n"] for r in rows})
    ]
    return page(table(["loop", "n", *(f"`jax.{mode}`" for mode in modes)], cells))


if __name__ == "__main__":
    main()
