"""In-place buffers: gradient time per step of a loop writing one row of an (M, 256)
float32 buffer per step, M = 256, 1024, 4096, ours and equinox's checkpointed loop,
with `buffers=` and with the array carried.

    python benchmarks/buffers.py [--out benchmarks/results/buffers.json]
"""

import argparse
import functools

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import compile_time, median_time, temp_bytes, write_json
from _format import index, load, page, seconds, table

import boundedloop as bl


WIDTH = 256
CHECKPOINTS = 16


def make(kind, rows, lib=bl):
    """The gradient of the loop `kind` of `rows` steps (ours from `lib`)."""
    use_buffers = kind.endswith("buffers")

    def loss(scale, v0):
        def body(carry):
            v, buf, i = carry
            v = jnp.tanh(v * scale + 0.01)
            return v, buf.at[i].set(v), i + 1

        equinox = functools.partial(eqxi.while_loop, kind="checkpointed")
        loop = lib.while_loop if kind.startswith("boundedloop") else equinox
        out = loop(
            lambda c: c[2] < rows,
            body,
            (v0, jnp.zeros((rows, WIDTH)), jnp.array(0)),
            max_steps=rows,
            checkpoints=CHECKPOINTS,
            buffers=(lambda c: c[1]) if use_buffers else None,
        )
        return jnp.sum(out[1] ** 2)

    return jax.grad(loss, argnums=(0, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/buffers.json")
    args = parser.parse_args()
    sizes = [256, 1024, 4096]
    kinds = ["boundedloop buffers", "boundedloop carried"]
    kinds += ["equinox buffers", "equinox carried"]
    scale, v0 = jnp.array(1.1), jnp.linspace(-1.0, 1.0, WIDTH)
    rows_out = []
    for kind in kinds:
        for m in sizes:
            _, compiled = compile_time(make(kind, m), scale, v0)
            t = median_time(compiled, scale, v0, reps=3, min_time=0.2)
            row = dict(kind=kind, rows=m, width=WIDTH, checkpoints=CHECKPOINTS)
            row.update(grad_s=t, per_step_us=t / m * 1e6)
            row.update(temp_bytes=temp_bytes(compiled), buffer_bytes=m * WIDTH * 4)
            rows_out.append(row)
            print(row, flush=True)
    print()
    print(buffers_table(rows_out), end="")
    write_json(args.out, rows_out)


# --- the docs' tables (`benchmarks/internal/tables.py` writes them) ---------------------

# how `docs/why-boundedloop.md` names the loops, in its order
WHY_BUFFER_NAMES = {
    "boundedloop buffers": "bl.while_loop, buffers=",
    "equinox buffers": "equinox checkpointed, buffers=",
    "boundedloop carried": "bl.while_loop, array carried",
    "equinox carried": "equinox checkpointed, array carried",
}


def _by_size(rows: list[dict]):
    """`rows` by (kind, M), and the sizes M in order."""
    return index(rows, "kind", "rows"), sorted({r["rows"] for r in rows})


def _per_step(by: dict, kind: str, sizes: list) -> list[str]:
    return [f"{by[(kind, m)]['per_step_us']:.1f}" for m in sizes]


def _in_buffers(row: dict) -> float:
    """Compiled temporary memory, in buffer sizes."""
    return row["temp_bytes"] / row["buffer_bytes"]


def ours_against_equinox(rows: list[dict]) -> dict:
    """At the largest M, with `buffers` and with the array `carried`: (our row,
    equinox's, our time per step over theirs, each one's temp memory in buffers)."""
    by, sizes = _by_size(rows)
    found = {}
    for how in ("buffers", "carried"):
        pair = [by[(f"{who} {how}", sizes[-1])] for who in ("boundedloop", "equinox")]
        ratio = pair[0]["per_step_us"] / pair[1]["per_step_us"]
        found[how] = (*pair, ratio, [round(_in_buffers(r), 1) for r in pair])
    return found


def buffers_table(rows: list[dict] | None = None) -> str:
    """Time per step and memory by M (the performance page); of `rows` or the file's."""
    rows = load("buffers.json") if rows is None else rows
    by, sizes = _by_size(rows)
    first, last = sizes[0], sizes[-1]
    cells = [
        [kind, *_per_step(by, kind, sizes)]
        + [f"{by[(kind, last)]['per_step_us'] / by[(kind, first)]['per_step_us']:.2f}"]
        + [f"{_in_buffers(by[(kind, last)]):.2f}"]
        for kind in dict.fromkeys(r["kind"] for r in rows)
    ]
    header = ["loop", *(f"us/step M={m}" for m in sizes), f"per-step {last}/{first}"]
    header.append(f"temp memory / buffer size at M={last}")
    return page(
        f"Gradient of an M-step loop writing one row of an (M, {rows[0]['width']}) "
        f"float32 buffer per step, checkpoints={rows[0]['checkpoints']}; ratios "
        "within this run.",
        table(header, cells),
    )


def why_buffers_table() -> str:
    """Ours and equinox's side by side, and the why page's two comparisons."""
    rows = load("buffers.json")
    by, sizes = _by_size(rows)
    last = sizes[-1]
    cells = [
        [name, *_per_step(by, kind, sizes), f"{_in_buffers(by[(kind, last)]):.2f}"]
        for kind, name in WHY_BUFFER_NAMES.items()
    ]
    header = ["loop", f"us/step, M = {sizes[0]}", *(f"M = {m}" for m in sizes[1:])]
    header.append(f"temp memory / buffer size, M = {last}")
    said = []
    for how, (ours, theirs, ratio, (mine, other)) in ours_against_equinox(rows).items():
        memory = f"{mine:g} buffer sizes of temporary memory"
        memory += ", as equinox's does" if mine == other else f" to equinox's {other:g}"
        said.append(
            f"- {'With buffers' if how == 'buffers' else 'Carrying the array'}, at "
            f"`M = {last}` ours takes {ratio:.2f} times equinox's time per step "
            f"({ours['per_step_us']:.1f} us against {theirs['per_step_us']:.1f}; "
            f"{seconds(ours['grad_s'])} against {seconds(theirs['grad_s'])} for the "
            f"whole gradient) and holds {memory}."
        )
    return page(table(header, cells), said)


if __name__ == "__main__":
    main()
