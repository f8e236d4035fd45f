"""The foundation benchmark: the adaptive-MLP workload, 8 steps taken, at max_steps
8 .. 4096, for every loop side by side in one process.

    python benchmarks/while_loop.py [--out benchmarks/results/while_loop.json]

Writes JSON and prints the docs' tables of ratios (taken within this one run).
"""

import argparse
import random
import statistics
import time

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import (
    compile_time,
    count_evals,
    fori_cond_loop,
    mlp,
    mlp_weights,
    nested_scan_loop,
    temp_bytes,
    write_results,
)
from _format import index, load, nbytes, page, table
from jax import lax

import boundedloop as bl


TRIPS = 8
CHECKPOINTS = 8
MEMORY_BUDGET = 8 * 2**30  # bytes of compiled temporaries we are willing to run


def loop_fn(kind, max_steps, checkpoints):
    """`(cond, body, init) -> final` for each implementation."""
    if kind == "boundedloop":
        return lambda c, b, i: bl.while_loop(
            c, b, i, max_steps=max_steps, checkpoints=checkpoints
        )
    if kind == "boundedloop (default checkpoints)":
        return lambda c, b, i: bl.while_loop(c, b, i, max_steps=max_steps)
    if kind == "equinox checkpointed":
        return lambda c, b, i: eqxi.while_loop(
            c, b, i, max_steps=max_steps, kind="checkpointed", checkpoints=checkpoints
        )
    if kind == "equinox bounded":
        return lambda c, b, i: eqxi.while_loop(
            c, b, i, max_steps=max_steps, kind="bounded"
        )
    if kind == "nested scan+cond":
        return lambda c, b, i: nested_scan_loop(c, b, i, max_steps)
    if kind == "fori_loop+cond":
        return lambda c, b, i: fori_cond_loop(c, b, i, max_steps)
    if kind == "lax.scan (ideal)":
        return lambda c, b, i: lax.scan(lambda v, _: (b(v), None), i, length=TRIPS)[0]
    if kind == "lax.while_loop":
        return lambda c, b, i: lax.while_loop(c, b, i)
    raise ValueError(kind)


def make(kind, max_steps, checkpoints, counter=None):
    run = loop_fn(kind, max_steps, checkpoints)

    def forward(w, x):
        def body(carry):
            x, step = carry
            if counter is not None:
                counter(step)
            return mlp(w, x), step + 1

        return jnp.sum(run(lambda c: c[1] < TRIPS, body, (x, jnp.array(0)))[0])

    return forward, jax.grad(forward, argnums=1), jax.grad(forward, argnums=0)


def prepare(kind, max_steps, checkpoints, weights, x, forward_only=False):
    """Compile everything for one (implementation, max_steps); count evaluations."""
    forward, grad_x, grad_w = make(kind, max_steps, checkpoints)
    row = {"kind": kind, "max_steps": max_steps}
    _, compiled = compile_time(forward, weights, x)
    fns = {"forward_s": compiled}
    if not forward_only:
        ct, compiled = compile_time(grad_x, weights, x)
        row["grad_compile_s"] = ct
        row["grad_temp_bytes"] = temp_bytes(compiled)
        if row["grad_temp_bytes"] > MEMORY_BUDGET:
            # compiled, but running it would exhaust this machine's memory
            row.update(grad_x_s=None, grad_w_s=None, body_evals_per_grad=None)
        else:
            fns["grad_x_s"] = compiled
            fns["grad_w_s"] = compile_time(grad_w, weights, x)[1]
            row["body_evals_per_grad"] = count_evals(
                lambda c: make(kind, max_steps, checkpoints, c)[1], (weights, x)
            )
    return row, fns


def fn_slow(fn, weights, x):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(weights, x))
    return time.perf_counter() - t0 > 0.5


def time_interleaved(entries, weights, x, rounds):
    """Median times, measured round-robin in a shuffled order so that every
    implementation sees the same machine load. Calls slower than 20 ms (the
    baselines whose gradients touch gigabytes) are timed outside the rounds, so
    that they do not slow down whatever runs after them."""
    fast, slow = [], []
    for row, fns in entries:
        for key, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(weights, x))
            (slow if time.perf_counter() - t0 > 0.02 else fast).append((row, key, fn))
    samples = {(id(row), key): [] for row, key, _ in fast + slow}
    order = random.Random(0)
    for _ in range(rounds):
        order.shuffle(fast)
        for row, key, fn in fast:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(weights, x))
            samples[(id(row), key)].append(time.perf_counter() - t0)
    for row, key, fn in slow:
        for _ in range(2 if fn_slow(fn, weights, x) else 5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(weights, x))
            samples[(id(row), key)].append(time.perf_counter() - t0)
    for row, key, _ in fast + slow:
        row[key] = statistics.median(samples[(id(row), key)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/while_loop.json")
    args = parser.parse_args()
    max_steps_list = [8, 64, 256, 1024, 4096]
    kinds = list(WHY_LOOP_NAMES)
    weights = mlp_weights()
    x = jnp.array([0.5])
    entries = [
        prepare("lax.scan (ideal)", TRIPS, None, weights, x),
        prepare("lax.while_loop", None, None, weights, x, forward_only=True),
    ]
    for kind in kinds:
        for m in max_steps_list:
            entries.append(prepare(kind, m, CHECKPOINTS, weights, x))
            print("compiled", kind, m, flush=True)
    time_interleaved(entries, weights, x, rounds=30)
    ideal, plain = entries[0][0], entries[1][0]
    rows = [row for row, _ in entries[2:]]
    for row in rows:
        print(row, flush=True)

    def ratio(a, b):
        return "OOM" if a is None or b is None else round(a / b, 3)

    summary = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        first, last = mine[0], mine[-1]
        summary.append(
            {
                "kind": kind,
                "grad_last_over_first": ratio(last["grad_x_s"], first["grad_x_s"]),
                "grad_over_ideal_first": ratio(first["grad_x_s"], ideal["grad_x_s"]),
                "grad_over_ideal_last": ratio(last["grad_x_s"], ideal["grad_x_s"]),
                "gradw_over_ideal_last": ratio(last["grad_w_s"], ideal["grad_w_s"]),
                "forward_over_while_last": ratio(last["forward_s"], plain["forward_s"]),
                "compile_last_over_first": ratio(
                    last["grad_compile_s"], first["grad_compile_s"]
                ),
                "temp_bytes": " / ".join(str(r["grad_temp_bytes"]) for r in mine),
                "evals": " / ".join(str(r["body_evals_per_grad"]) for r in mine),
            }
        )
    data = dict(checkpoints=CHECKPOINTS, ideal=ideal, lax_while_loop=plain)
    write_results(args.out, **data, rows=rows, summary=summary)
    print(while_loop_table({**data, "rows": rows, "summary": summary}))


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------

# how `docs/why-boundedloop.md` names the loops
WHY_LOOP_NAMES = {
    "boundedloop": "bl.while_loop",
    "boundedloop (default checkpoints)": "bl.while_loop, default checkpoints",
    "equinox checkpointed": "equinox checkpointed",
    "equinox bounded": "equinox bounded",
    "nested scan+cond": "nested lax.scan + lax.cond",
    "fori_loop+cond": "lax.fori_loop + lax.cond",
}


def _results(data=None):
    """`data` (by default `while_loop.json`'s), its `max_steps` in order, and its
    rows by (kind, max_steps)."""
    data = data or load("while_loop.json")
    sizes = sorted({r["max_steps"] for r in data["rows"]})
    return data, sizes, index(data["rows"], "kind", "max_steps")


def while_loop_table(data=None) -> str:
    """The gradient-time benchmark as narrow tables: time ratios, then memory and
    body evaluations for each `max_steps` (the performance page); of `data`, by
    default `while_loop.json`'s."""
    data, sizes, by = _results(data)
    first, last, summary = sizes[0], sizes[-1], data["summary"]

    def columns(*keys):
        return [[s["kind"], *(s[k] for k in keys)] for s in summary]

    def by_size(key, write):
        rows = [
            [s["kind"], *(write(by[(s["kind"], m)].get(key)) for m in sizes)]
            for s in summary
        ]
        return table(["loop", *map(str, sizes)], rows)

    return page(
        f"Adaptive MLP, 8 steps taken, checkpoints={data['checkpoints']}; ratios "
        f"within one run. The ideal, `lax.scan` over exactly the 8 steps: gradient "
        f"{data['ideal']['grad_x_s'] * 1e3:.2f} ms; `lax.while_loop` forward "
        f"{data['lax_while_loop']['forward_s'] * 1e3:.2f} ms. OOM: the gradient "
        "did not fit in memory. Gradient time, ratios (grad: with respect to `x`; "
        "grad_w: with respect to the weights):",
        table(
            ["loop", f"grad {last} / {first}", f"grad / ideal @{first}"]
            + [f"grad / ideal @{last}", f"grad_w / ideal @{last}"],
            columns(
                "grad_last_over_first",
                "grad_over_ideal_first",
                "grad_over_ideal_last",
                "gradw_over_ideal_last",
            ),
        ),
        "Forward (undifferentiated) time over `lax.while_loop`'s, and the gradient's "
        "compile time, ratios:",
        table(
            ["loop", f"forward / `lax.while_loop` @{last}"]
            + [f"gradient compile time {last} / {first}"],
            columns("forward_over_while_last", "compile_last_over_first"),
        ),
        "Compiled temporary memory of the gradient, by `max_steps`:",
        by_size("grad_temp_bytes", nbytes),
        "Body evaluations in one gradient (-: not run, out of memory), by `max_steps`:",
        by_size("body_evals_per_grad", lambda v: "-" if v is None else str(v)),
    )


def why_while_loop_table() -> str:
    """The same benchmark, one row per loop: is the gradient flat in `max_steps`
    (the why page)."""
    data, sizes, by = _results()
    first, last = sizes[0], sizes[-1]

    def ratio(v):
        return "out of memory" if v == "OOM" else v

    rows = [
        [WHY_LOOP_NAMES[s["kind"]]]
        + [ratio(s["grad_last_over_first"]), ratio(s["grad_over_ideal_last"])]
        + [by[(s["kind"], last)]["grad_temp_bytes"]]
        for s in data["summary"]
    ]
    header = ["loop", f"gradient time, max_steps {last} / {first}"]
    header += [f"gradient / ideal at {last}", f"temp memory at {last} (bytes)"]
    return page(table(header, rows))


if __name__ == "__main__":
    main()
