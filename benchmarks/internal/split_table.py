"""`checkpoints=16` on `headline.py`'s workload (n=256 of 1024): the
recomputation's split read from a listed table of every split against computed
from binomial coefficients (`_cost_model.lists_splits`, patched one way or the
other while each variant traces): cold compiles in shuffled rounds beside
equinox's checkpointed loop, then the gradient's time, interleaved. Internal: it
patches the package's cost model.

    python benchmarks/internal/split_table.py [--rounds 15] [--out FILE]   (on the TPU)

Result: `benchmarks/results/memory_curve_compile_tpu_4d0f910.json`, its
`split_experiment` (taken at 41a287b, where the chip computed every split).
"""

import argparse
import pathlib
import random
import statistics
import sys
import time

import jax

from boundedloop._sweeps import _cost_model


sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
from _common import (  # noqa: E402
    forget_compiles,
    interleaved,
    interleaved_medians,
    temp_bytes,
    write_json,
)
from _format import load, nbytes, page, seconds, table  # noqa: E402
from headline import workload  # noqa: E402
from memory_curve import COMPILES, make  # noqa: E402


N, MAX_STEPS = 256, 1024
RULES = {"listed": lambda *args, **kw: True, "computed": lambda *args, **kw: False}
KINDS = {"listed": "boundedloop", "computed": "boundedloop", "equinox": "equinox"}


def compiled(label, W, x):
    """`label`'s gradient, traced with its rule for the split, compiled."""
    original = _cost_model.lists_splits
    _cost_model.lists_splits = RULES.get(label, original)
    try:
        fn = make(KINDS[label], N, MAX_STEPS, checkpoints=16)
        return fn.lower(W, x, N).compile()
    finally:
        _cost_model.lists_splits = original


def split_table_table() -> str:
    """Per rule, the compile over equinox's (wall, process), the gradient's time
    and temp memory, from `COMPILES`' `split_experiment`."""
    found = load(COMPILES)["split_experiment"]
    body = [
        [f"split {label}", f"{found['compile'][label]['wall']:.2f}"]
        + [f"{found['compile'][label]['process']:.2f}", seconds(found["grad"][label])]
        + [nbytes(found["temp_bytes"][label])]
        for label in RULES
    ]
    header = ["`checkpoints=16`, n=256 of 1024", "compile, x equinox's wall"]
    header += ["process", "gradient", "temp memory"]
    return page(table(header, body))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="B=64, D=256")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    W, x = workload(*((64, 256) if args.small else (512, 4096)))

    def cold(label):
        def call():
            forget_compiles()
            wall, cpu = time.perf_counter(), time.process_time()
            compiled(label, W, x)
            return time.perf_counter() - wall, time.process_time() - cpu

        return call

    calls = {label: cold(label) for label in KINDS}
    for call in calls.values():  # warm-up: imports, first traces
        call()
    samples = interleaved(calls, args.rounds, rng=random.Random(2))
    compile_rows = {}
    for label, got in samples.items():
        row = {"wall_s": statistics.median(t[0] for t in got)}
        for j, clock in enumerate(["wall", "process"]):
            row[clock] = statistics.median(
                t[j] / e[j] for t, e in zip(got, samples["equinox"])
            )
        compile_rows[label] = row
        print(label, row, flush=True)
    fns = {label: compiled(label, W, x) for label in RULES}
    temps = {}
    for label, fn in fns.items():
        jax.block_until_ready(fn(W, x, N))
        temps[label] = temp_bytes(fn)
        print(label, "temp", temps[label], flush=True)
    grad = interleaved_medians(fns, {k: (W, x, N) for k in fns}, 20, shuffle=True)
    print("grad", grad, flush=True)
    if args.out:
        found = dict(compile=compile_rows, grad=grad, temp_bytes=temps)
        write_json(args.out, dict(found, rounds=args.rounds))


if __name__ == "__main__":
    main()
