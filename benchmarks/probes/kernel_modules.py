"""What XLA's CPU compile time follows (issue 53): the kernels it compiles. The
gradient of `cpu_kernels.py`'s workload (a 64-element `tanh(W @ x + b)`, n=256 of
max_steps=1024, 16 checkpoints) through ours, with the reverse sweep nested (what
this cheap step gets) and plain (what a costly step gets), through `lax.scan` over
the 256 steps, and through Enzyme-JAX's binomial checkpointing of the same loop
written as a counter loop (`enzyme_ad`, when installed; set up as
`../shared/peers/enzyme.md` says). For each: XLA compile (the median of 7, each
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
import jax.numpy as jnp
from cpu_kernels import ARGS, B, N, ours, scan
from jax import lax

from boundedloop._sweeps import _cost_model


KINDS = ["ours, nested", "ours, plain", "lax.scan", "Enzyme-JAX"]


def enzyme(slots: int = 16):
    """The loss through Enzyme's checkpointed loop, or None without `enzyme_ad`."""
    try:
        from enzyme_ad.jax import hlo_call
    except ImportError:
        return None
    from jax.interpreters import mlir
    from jaxlib.mlir import ir

    def counter_loop(w, x0, n):
        def body(c):
            return c[0] + 1, jnp.tanh(w @ c[1] + B)

        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x0))[1]

    with mlir.make_ir_context():
        module = ir.Module.parse(jax.jit(counter_loop).lower(*ARGS).as_text())
        loops = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if inner.operation.name == "stablehlo.while":
                            loops.append(inner.operation)
                        walk(inner.operation)

        walk(module.operation)
        (loop,) = loops
        loop.attributes["enzyme.enable_checkpointing"] = ir.BoolAttr.get(True)
        loop.attributes["enzyme.binomial_checkpointing"] = ir.UnitAttr.get()
        i64 = ir.IntegerType.get_signless(64)
        loop.attributes["enzyme.checkpoint_period"] = ir.IntegerAttr.get(i64, slots)
        source = str(module)

    def loss(w, x0, n):
        out = hlo_call(w, x0, n, source=source, passes="lower-enzymexla-math")
        return jnp.sum(out[0] if isinstance(out, (tuple, list)) else out)

    return loss


def gradient(kind: str):
    """`kind`'s gradient function (the structure forced for ours), or None."""
    if kind == "lax.scan":
        return jax.grad(scan)
    if kind == "Enzyme-JAX":
        loss = enzyme()
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
