"""In-place buffers: gradient time per step for a loop that writes one row of an
(M, 256) float32 buffer per step, M = 256, 1024, 4096, side by side with equinox's
checkpointed loop (with and without `buffers=`) and with the array carried normally.

    python benchmarks/buffers.py [--quick] [--out benchmarks/results/buffers.json]
"""

import argparse
import json
import pathlib

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import compile_time, median_time, temp_bytes

import boundedloop as bl


WIDTH = 256
CHECKPOINTS = 16


def make(kind, rows):
    use_buffers = kind.endswith("buffers")

    def loss(scale, v0):
        def body(carry):
            v, buf, i = carry
            v = jnp.tanh(v * scale + 0.01)
            return v, buf.at[i].set(v), i + 1

        init = (v0, jnp.zeros((rows, WIDTH)), jnp.array(0))
        cond = lambda c: c[2] < rows  # noqa: E731
        buffers = (lambda c: c[1]) if use_buffers else None
        if kind.startswith("boundedloop"):
            out = bl.while_loop(
                cond,
                body,
                init,
                max_steps=rows,
                checkpoints=CHECKPOINTS,
                buffers=buffers,
            )
        else:
            out = eqxi.while_loop(
                cond,
                body,
                init,
                max_steps=rows,
                kind="checkpointed",
                checkpoints=CHECKPOINTS,
                buffers=buffers,
            )
        return jnp.sum(out[1] ** 2)

    return jax.grad(loss, argnums=(0, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/buffers.json")
    args = parser.parse_args()
    sizes = [256, 1024] if args.quick else [256, 1024, 4096]
    kinds = [
        "boundedloop buffers",
        "boundedloop carried",
        "equinox buffers",
        "equinox carried",
    ]
    scale, v0 = jnp.array(1.1), jnp.linspace(-1.0, 1.0, WIDTH)
    rows_out = []
    for kind in kinds:
        for m in sizes:
            _, compiled = compile_time(make(kind, m), scale, v0)
            t = median_time(compiled, scale, v0, reps=3, min_time=0.2)
            row = {
                "kind": kind,
                "rows": m,
                "grad_s": t,
                "per_step_us": t / m * 1e6,
                "temp_bytes": temp_bytes(compiled),
                "buffer_bytes": m * WIDTH * 4,
            }
            rows_out.append(row)
            print(row, flush=True)
    print()
    print(
        f"Gradient of an M-step loop writing one row of an (M, {WIDTH}) float32 buffer "
        f"per step, checkpoints={CHECKPOINTS}; ratios within this run."
    )
    print()
    print(
        "| loop | "
        + " | ".join(f"us/step M={m}" for m in sizes)
        + f" | per-step {sizes[-1]}/{sizes[0]} | temp memory / buffer size at M={sizes[-1]} |"
    )
    print("|---|" + "---:|" * (len(sizes) + 2))
    for kind in kinds:
        mine = [r for r in rows_out if r["kind"] == kind]
        per = [r["per_step_us"] for r in mine]
        print(
            f"| {kind} | "
            + " | ".join(f"{p:.1f}" for p in per)
            + f" | {per[-1] / per[0]:.2f} | {mine[-1]['temp_bytes'] / mine[-1]['buffer_bytes']:.2f} |"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
