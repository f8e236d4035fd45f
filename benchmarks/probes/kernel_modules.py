"""What XLA's CPU compile time follows (issue 53): the kernels it compiles. The
gradient of `cpu_kernels.py`'s workload (a 64-element `tanh(W @ x + b)`, n=256 of
max_steps=1024, 16 checkpoints) through ours, with the reverse sweep nested (what
this cheap step gets) and plain (what a costly step gets), through `lax.scan` over
the 256 steps, and through Enzyme-JAX's binomial checkpointing of the same loop
written as a counter loop (`enzyme_ad`, when installed; set up by
`benchmarks/enzyme_peer.py`). For each: XLA compile (the median of 7, each
after `jax.clear_caches()`, the programs interleaved), while loops, fusions, and the
kernel modules XLA compiles to machine code, counted in a dump of the compile
(`--xla_dump_to`, in a subprocess): one per distinct fused computation, with
identical ones shared, plus one per dot. Scalar computations (loop conditions,
lone scalar operations) are counted apart.

    python benchmarks/probes/kernel_modules.py
"""

import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
from cpu_kernels import ARGS, N, ours, scan

from boundedloop._sweeps import _cost_model


sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import enzyme_peer  # noqa: E402  (benchmarks/, where the set-up lives)


KINDS = ["ours, nested", "ours, plain", "lax.scan", "Enzyme-JAX"]


def gradient(kind: str):
    """`kind`'s gradient function (the structure forced for ours), or None."""
    if kind == "lax.scan":
        return jax.grad(scan)
    if kind == "Enzyme-JAX":
        loss = enzyme_peer.enzyme_loss()  # the same workload, the same arguments
        return None if loss is None else jax.grad(loss)
    return jax.grad(ours)


def forced(kind: str):
    """Force our reverse sweep's structure for `kind` (the rule otherwise)."""
    if kind == "ours, plain":
        _cost_model.is_cheap = lambda body: False


def modules(kind: str) -> tuple[int, int]:
    """(kernel modules, scalar modules) of `kind`'s compiled gradient."""
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={folder}")
        subprocess.run(
            [sys.executable, __file__, "--compile-only", kind], env=env, check=True
        )
        # the gradient's own module, named after the function differentiated
        name = {"lax.scan": "scan", "Enzyme-JAX": "loss"}.get(kind, "ours")
        main = glob.glob(f"{folder}/*.jit_{name}.*ir-no-opt.ll")
        kernels = sum("kernel_module" in f for f in main)
        scalars = sum("__compute_module" in f for f in main)
    return kernels, scalars


def compile_once(fn):
    jax.clear_caches()
    lowered = jax.jit(fn).lower(*ARGS)
    start = time.perf_counter()
    compiled = lowered.compile()
    return time.perf_counter() - start, compiled.as_text()


def main():
    kinds = [k for k in KINDS if gradient(k) is not None]
    rule = _cost_model.is_cheap
    seconds, texts = {k: [] for k in kinds}, {}
    for _ in range(7):
        for kind in kinds:
            forced(kind)
            try:
                s, texts[kind] = compile_once(gradient(kind))
            finally:
                _cost_model.is_cheap = rule
            seconds[kind].append(s)
    print(f"# {N} steps of max_steps 1024, 16 checkpoints; jax {jax.__version__}")
    print(
        "| gradient | XLA compile (s) | over lax.scan | while loops | fusions "
        "| kernel modules | scalar modules |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    scan_s = statistics.median(seconds["lax.scan"])
    for kind in kinds:
        s = statistics.median(seconds[kind])
        text = texts[kind]
        kernels, scalars = modules(kind)
        print(
            f"| {kind} | {s:.3f} | {s / scan_s:.2f} | {text.count(' while(')} "
            f"| {text.count(' fusion(')} | {kernels} | {scalars} |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile-only"]:
        forced(sys.argv[2])
        jax.jit(gradient(sys.argv[2])).lower(*ARGS).compile()
    else:
        main()
