"""Where a TPU's XLA compile of the headline gradient goes (issue 53).

    python benchmarks/probes/tpu_compile_parts.py passes scan equinox plain nested
    python benchmarks/probes/tpu_compile_parts.py pieces

`passes`: each structure's gradient (`cheap_structure.headline`, or `lax.scan` over
the 256 steps) compiled once plainly and once dumping the HLO after every pass
(`xla_dump_hlo_pass_re`). libtpu logs no pass timings, so the dumps' modification
times apportion the compile: the time to each dump is charged to the pass that wrote
it, and the time after the last HLO dump is the backend's code generation. Also the
optimized program's while loops, copies and fusions; the program is written to
`$OUT/hlo_<kind>.txt`.

`pieces`: XLA compile (median of 7, after `jax.clear_caches()`, interleaved) of
programs holding one piece of the gradient each: the step `tanh(x @ W)` at
512 x 4096 by 4096 x 4096, its VJP, a loop of the step, a loop of the VJP
accumulating `W`'s cotangent, and a loop of scalar bookkeeping.
"""

import collections
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cheap_structure  # noqa: E402
import headline  # noqa: E402


B, D = 512, 4096


def lower(kind):
    if kind != "scan":
        return cheap_structure.lower(cheap_structure.headline, kind)[0]
    grad = jax.jit(jax.grad(headline.loss_fn("scan", 256, 1024, 16)))
    return grad.lower(*headline.workload(B, D), 256)


def passes(kinds):
    out = os.environ.get("OUT", tempfile.gettempdir())
    for kind in kinds:
        t = time.perf_counter()
        compiled = lower(kind).compile()
        plain_s = time.perf_counter() - t
        text = compiled.as_text()
        copies = len(re.findall(r"= \S+ copy\(", text))
        print(
            f"{kind} compile {plain_s:.2f} s; whiles {text.count(' while(')}, copies "
            f"{copies}, fusions {text.count(' fusion(')}",
            flush=True,
        )
        with open(os.path.join(out, f"hlo_{kind}.txt"), "w") as f:
            f.write(text)
        dump = tempfile.mkdtemp()
        lowered = lower(kind)
        t0 = time.time()
        lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_pass_re": ".*"})
        t1 = time.time()
        files = sorted(  # the HLO dumps; a CPU also dumps its kernels' LLVM IR
            (os.stat(os.path.join(dump, f)).st_mtime, f)
            for f in os.listdir(dump)
            if f.endswith(".txt")
        )
        per_pass, per_pipeline, prev = collections.Counter(), collections.Counter(), t0
        for mtime, name in files:
            m = re.search(r"\.\d{4}\.([^.]+)\.(.+)\.txt$", name)
            pipeline, label = (m.group(1), m.group(2)) if m else ("module", name)
            per_pass[f"{pipeline}:{label}"] += mtime - prev
            per_pipeline[pipeline] += mtime - prev
            prev = mtime
        shutil.rmtree(dump, ignore_errors=True)
        print(
            f"  dumped compile {t1 - t0:.2f} s, {len(files)} dumps, the first after "
            f"{files[0][0] - t0:.2f} s, the last {t1 - files[-1][0]:.2f} s before the end"
        )
        print(
            "  pipelines:",
            ", ".join(f"{k} {v:.2f}" for k, v in per_pipeline.most_common(8)),
        )
        print(
            "  passes:",
            ", ".join(f"{k} {v:.2f}" for k, v in per_pass.most_common(6)),
            flush=True,
        )


def pieces(repeats=7):
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, D), jnp.float32)
    n = jax.ShapeDtypeStruct((), jnp.int32)

    def step(x, w):
        return jnp.tanh(x @ w)

    def vjp(x, w, g):
        return jax.vjp(step, x, w)[1](g)

    def loop_of_step(x, w, n):
        return lax.fori_loop(0, n, lambda i, x: step(x, w), x)

    def loop_of_vjp(x, w, n):
        def body(i, carry):
            g, dw = carry
            dx, d = vjp(x, w, g)
            return dx, dw + d

        return lax.fori_loop(0, n, body, (x, jnp.zeros((D, D))))

    def scalar_loop(x, w, n):
        body = lambda i, c: (c[0] + 1, jnp.maximum(c[1], i) * 3 % 7)  # noqa: E731
        return lax.fori_loop(0, n, body, (n, n))

    programs = {
        "trivial (x + 1)": (lambda x: x + 1, (x,)),
        "step": (step, (x, w)),
        "vjp of the step": (vjp, (x, w, x)),
        "loop of the step": (loop_of_step, (x, w, n)),
        "loop of the vjp": (loop_of_vjp, (x, w, n)),
        "loop of scalars": (scalar_loop, (x, w, n)),
    }
    times = {k: [] for k in programs}
    for r in range(repeats + 1):  # the first is a warm-up
        for name, (fn, args) in programs.items():
            jax.clear_caches()
            lowered = jax.jit(fn).lower(*args)
            t = time.perf_counter()
            lowered.compile()
            if r:
                times[name].append(time.perf_counter() - t)
    for name, v in times.items():
        print(
            f"{name:18s} {statistics.median(v):.3f} s (min {min(v):.3f}, max {max(v):.3f})"
        )


if __name__ == "__main__":
    pieces() if sys.argv[1] == "pieces" else passes(sys.argv[2:])
