"""The buffer checks' cost by error path: off, the host callback (main), NaN-poisoned
outputs (no callback), and no error path (the check's state computed and dropped).
Each variant compiled after jax.clear_caches(), then timed interleaved."""

import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax


sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
from buffer_checks import make_matvec
from regression import make_buffers

import boundedloop as bl
from boundedloop._runtime import _checks


callback = _checks._error_if


def nan_path(flag, *operands, msg, n_details):
    leaves = operands[n_details:]
    return [
        jnp.where(flag, jnp.nan, v) if jnp.issubdtype(v.dtype, jnp.inexact) else v
        for v in leaves
    ]


def no_path(flag, *operands, msg, n_details):
    return list(lax.optimization_barrier((flag, list(operands[n_details:])))[1])


VARIANTS = {"callback": callback, "nan": nan_path, "none": no_path}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
cases = []
for rows in (256, 4096):
    cases.append(
        (
            f"M-row {rows}",
            make_buffers(bl, rows),
            (jnp.array(1.1), jnp.linspace(-1.0, 1.0, 256)),
        )
    )
for w in (64, 256, 1024):
    fn, args, _ = make_matvec(w)
    cases.append((f"matvec {w}", fn, args))
for label, fn, args in cases:
    compiled = {}
    jax.clear_caches()
    compiled["off"] = fn.lower(*args).compile()
    for name, path in VARIANTS.items():
        _checks._error_if = path
        jax.clear_caches()
        with bl.buffer_checks():
            compiled[name] = fn.lower(*args).compile()
        _checks._error_if = callback
    calls = {k: c.as_text().count("custom-call") for k, c in compiled.items()}
    for c in compiled.values():
        for _ in range(3):
            jax.block_until_ready(c(*args))
    times = {k: [] for k in compiled}
    for _ in range(rounds):
        for k in random.sample(list(compiled), len(compiled)):
            s = time.perf_counter()
            jax.block_until_ready(compiled[k](*args))
            times[k].append(time.perf_counter() - s)
    off = statistics.median(times["off"])
    ratios = {
        k: round(statistics.median([a / b for a, b in zip(times[k], times["off"])]), 3)
        for k in compiled
        if k != "off"
    }
    print(label, f"off {off * 1e3:.3f} ms", ratios, "custom-calls", calls, flush=True)
