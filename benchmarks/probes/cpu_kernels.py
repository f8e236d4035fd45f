"""Where the CPU gradient's kernels are (issue 53): the optimized program of the
gradient of a 64-element `tanh(W @ x + b)` loop (n=256 of max_steps=1024, 16
checkpoints) and of `lax.scan` over the 256 steps, with XLA compile time, the
number of while loops, and per computation (each while body, `main`) the number of
fusions (a kernel each, for LLVM) and the while loops it runs.

    python benchmarks/probes/cpu_kernels.py
"""

import re
import time

import jax
import jax.numpy as jnp
from jax import lax

import boundedloop as bl


D, N, MAX, C = 64, 256, 1024, 16
W = jax.random.normal(jax.random.key(0), (D, D)) / 16
B = jnp.full((D,), 0.01)
ARGS = (W, jnp.ones(D), jnp.int32(N))


def ours(w, x0, n):
    def body(c):
        x, i, n = c
        return jnp.tanh(w @ x + B), i + 1, n

    init = (x0, 0, n)
    out = bl.while_loop(lambda c: c[1] < c[2], body, init, max_steps=MAX, checkpoints=C)
    return jnp.sum(out[0])


def scan(w, x0, n):
    del n
    return jnp.sum(lax.scan(lambda x, _: (jnp.tanh(w @ x + B), None), x0, length=N)[0])


def computations(text: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif cur and line.strip() == "}":
            cur = None
        elif cur:
            comps[cur].append(line)
    return comps


def main():
    for name, fn in [("lax.scan", scan), ("boundedloop", ours)]:
        lowered = jax.jit(jax.grad(fn)).lower(*ARGS)
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
        comps = computations(compiled.as_text())
        rows = []
        for c, lines in comps.items():
            fusions = sum(1 for line in lines if re.search(r"= \S+ fusion\(", line))
            whiles = [
                re.search(r"body=%?([\w.\-]+)", line).group(1)
                for line in lines
                if " while(" in line
            ]
            tanh = sum(1 for line in lines if "tanh" in line and " fusion(" in line)
            if fusions and not c.startswith(("fused", "wrapped")):
                rows.append((fusions, c, whiles, tanh))
        total = sum(r[0] for r in rows)
        loops = sum(len(r[2]) for r in rows)
        print(
            f"{name}: XLA compile {seconds:.2f} s, {loops} while loops, {total} fusions"
        )
        for fusions, c, whiles, tanh in sorted(rows, reverse=True):
            print(
                f"  {fusions:3d} fusions, {tanh} with the step's tanh  {c}  runs {whiles}"
            )


if __name__ == "__main__":
    main()
