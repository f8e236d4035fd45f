"""Why the 5.4 GB row of the headline (n=256 of 1024, every step in the forward
sweep's ring) is slower than `lax.scan`: on the chip the scan's forward step is
two fusions, its product writing the residuals into their rows in place, and
ours is three and a copy (`docs/design-notes.md`, "Where the last 4.4 ms of the
5.4 GB row go"). Variants, each with the large fusions of its compiled forward
step counted and its gradient timed, interleaved:

- `as is`: `memory=5.4e9`;
- `no reduce_precision`: the same, traced with `jax.checkpoint`'s partial
  evaluation inserting no `reduce_precision` after the residuals' producers
  (`jax._src.ad_checkpoint._insert_reduce_precision`, patched to return its
  jaxpr: a probe, not a change to ship);
- `lax.scan`, the reference.

Internal: it patches a JAX private function.

    python benchmarks/internal/ring_fusion.py [--small] [--rounds 20] [--out FILE]
"""

import argparse
import contextlib
import pathlib
import re
import sys

import jax
from jax._src import ad_checkpoint


sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
from _common import interleaved_medians, temp_bytes, write_json  # noqa: E402
from headline import workload  # noqa: E402
from memory_curve import make  # noqa: E402


N, MAX_STEPS = 256, 1024


@contextlib.contextmanager
def no_reduce_precision():
    original = ad_checkpoint._insert_reduce_precision
    ad_checkpoint._insert_reduce_precision = lambda jaxpr, num_res: jaxpr
    try:
        yield
    finally:
        ad_checkpoint._insert_reduce_precision = original


def step_fusions(hlo: str) -> list[int]:
    """Per while body that writes a stacked array with `dynamic-update-slice`
    (a forward step writing its residuals), the number of fusions and copies
    whose result has at least 2**20 elements."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    found = []
    for block in re.split(r"\n(?=\S)", hlo):
        head = re.match(r"%?([\w.\-]+)", block)
        if (
            not head
            or head.group(1) not in names
            or "dynamic-update-slice" not in block
        ):
            continue
        large = 0
        for shape, op in re.findall(
            r"= \(?([a-z0-9]+\[[\d,]*\])[^=]*? (fusion|copy)\(", block
        ):
            dims = [int(d) for d in re.findall(r"\d+", shape.split("[")[1])]
            size = 1
            for d in dims:
                size *= d
            large += size >= 2**20
        found.append(large)
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="B=64, D=256")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    B, D = (64, 256) if args.small else (512, 4096)
    W, x = workload(B, D)
    memory = int(5.4e9 * (B * D) / (512 * 4096))
    variants = {
        "as is": (contextlib.nullcontext, "boundedloop", dict(memory=memory)),
        "no reduce_precision": (
            no_reduce_precision,
            "boundedloop",
            dict(memory=memory),
        ),
        "lax.scan": (contextlib.nullcontext, "scan", {}),
    }
    fns, rows = {}, []
    for label, (context, kind, kw) in variants.items():
        with context():
            fns[label] = make(kind, N, MAX_STEPS, **kw).lower(W, x, N).compile()
        hlo = fns[label].as_text()
        rows.append(
            dict(
                variant=label,
                temp_bytes=temp_bytes(fns[label]),
                large_ops_per_forward_body=step_fusions(hlo),
                reduce_precision=hlo.count(" reduce-precision("),
            )
        )
    reference = fns["lax.scan"](W, x, N)
    for row in rows:
        got = fns[row["variant"]](W, x, N)
        row["max_abs_difference_from_scan"] = float(abs(got - reference).max())
    times = interleaved_medians(
        fns, {k: (W, x, N) for k in fns}, args.rounds, shuffle=True
    )
    for row in rows:
        row["grad_s"] = times[row["variant"]]
        print(row, flush=True)
    if args.out:
        write_json(args.out, dict(B=B, D=D, device=str(jax.devices()[0]), rows=rows))


if __name__ == "__main__":
    main()
