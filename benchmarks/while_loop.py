"""The foundation benchmark: the adaptive MLP, 8 steps taken, at max_steps 8 .. 4096,
every loop side by side in one process; prints the docs' tables of ratios.

    python benchmarks/while_loop.py [--out benchmarks/results/while_loop.json]
"""

import argparse
import functools
import statistics

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import (
    compile_time,
    count_evals,
    fori_cond_loop,
    interleaved,
    mlp,
    mlp_weights,
    nested_scan_loop,
    temp_bytes,
    timed,
    write_results,
)
from _format import index, load, nbytes, page, table
from jax import lax

import boundedloop as bl


TRIPS = 8
CHECKPOINTS = 8
MEMORY_BUDGET = 8 * 2**30  # bytes of compiled temporaries we are willing to run


def loop_fn(kind, max_steps, checkpoints, lib=bl):
    """`(cond, body, init) -> final` for each implementation (ours from `lib`)."""
    steps, every = dict(max_steps=max_steps), dict(checkpoints=checkpoints)
    return {
        "boundedloop": functools.partial(lib.while_loop, **steps, **every),
        "boundedloop (default checkpoints)": functools.partial(bl.while_loop, **steps),
        "equinox checkpointed": functools.partial(
            eqxi.while_loop, **steps, kind="checkpointed", **every
        ),
        "equinox bounded": functools.partial(eqxi.while_loop, **steps, kind="bounded"),
        "nested scan+cond": functools.partial(nested_scan_loop, **steps),
        "fori_loop+cond": functools.partial(fori_cond_loop, **steps),
        "lax.scan (ideal)": lambda c, b, i: lax.scan(
            lambda v, _: (b(v), None), i, length=TRIPS
        )[0],
        "lax.while_loop": lambda c, b, i: lax.while_loop(c, b, i),
    }[kind]


def make(kind, max_steps, checkpoints, counter=None, lib=bl):
    run = loop_fn(kind, max_steps, checkpoints, lib)

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
    fns = {"forward_s": compile_time(forward, weights, x)[1]}
    if not forward_only:
        row["grad_compile_s"], compiled = compile_time(grad_x, weights, x)
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


def time_interleaved(entries, weights, x, rounds):
    """Each row's medians, timed `interleaved` (every loop sees the same machine
    load). Calls slower than 20 ms (the baselines whose gradients touch gigabytes)
    are timed after the rounds, so as not to slow whatever runs after them."""
    fast, slow = {}, {}
    for i, (row, fns) in enumerate(entries):
        for key, fn in fns.items():
            call = functools.partial(timed, fn, weights, x)
            (slow if call() > 0.02 else fast)[(i, key)] = call
    samples = interleaved(fast, rounds)
    for k, call in slow.items():
        samples[k] = [call() for _ in range(2 if call() > 0.5 else 5)]
    for (i, key), times in samples.items():
        entries[i][0][key] = statistics.median(times)


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

    def ratio(a, b, key="grad_x_s"):
        a, b = a[key], b[key]
        return "OOM" if a is None or b is None else round(a / b, 3)

    summary = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        first, last = mine[0], mine[-1]
        s = {"kind": kind, "grad_last_over_first": ratio(last, first)}
        s["grad_over_ideal_first"] = ratio(first, ideal)
        s["grad_over_ideal_last"] = ratio(last, ideal)
        s["gradw_over_ideal_last"] = ratio(last, ideal, "grad_w_s")
        s["forward_over_while_last"] = ratio(last, plain, "forward_s")
        s["compile_last_over_first"] = ratio(last, first, "grad_compile_s")
        s["temp_bytes"] = " / ".join(str(r["grad_temp_bytes"]) for r in mine)
        s["evals"] = " / ".join(str(r["body_evals_per_grad"]) for r in mine)
        summary.append(s)
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
    """`data` (or the file's), its sizes, and its rows by (kind, max_steps)."""
    data = data or load("while_loop.json")
    sizes = sorted({r["max_steps"] for r in data["rows"]})
    return data, sizes, index(data["rows"], "kind", "max_steps")


def while_loop_table(data=None) -> str:
    """Time ratios, then memory and evaluations by `max_steps` (performance page)."""
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

    grads = ["loop", f"grad {last} / {first}", f"grad / ideal @{first}"]
    grads += [f"grad / ideal @{last}", f"grad_w / ideal @{last}"]
    keys = ["grad_last_over_first", "grad_over_ideal_first", "grad_over_ideal_last"]
    forward = ["loop", f"forward / `lax.while_loop` @{last}"]
    forward += [f"gradient compile time {last} / {first}"]
    return page(
        f"Adaptive MLP, 8 steps taken, checkpoints={data['checkpoints']}; ratios "
        f"within one run. The ideal, `lax.scan` over exactly the 8 steps: gradient "
        f"{data['ideal']['grad_x_s'] * 1e3:.2f} ms; `lax.while_loop` forward "
        f"{data['lax_while_loop']['forward_s'] * 1e3:.2f} ms. OOM: the gradient "
        "did not fit in memory. Gradient time, ratios (grad: with respect to `x`; "
        "grad_w: with respect to the weights):",
        table(grads, columns(*keys, "gradw_over_ideal_last")),
        "Forward (undifferentiated) time over `lax.while_loop`'s, and the gradient's "
        "compile time, ratios:",
        table(forward, columns("forward_over_while_last", "compile_last_over_first")),
        "Compiled temporary memory of the gradient, by `max_steps`:",
        by_size("grad_temp_bytes", nbytes),
        "Body evaluations in one gradient (-: not run, out of memory), by `max_steps`:",
        by_size("body_evals_per_grad", lambda v: "-" if v is None else str(v)),
    )


def why_while_loop_table() -> str:
    """A row per loop: is the gradient flat in `max_steps` (the why page)."""
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
