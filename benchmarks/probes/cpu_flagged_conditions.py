"""Would XLA's CPU compile fewer kernels if our loops carried their condition? (issue
53, target 2; a negative result.) Every loop the sweeps build (`varying_while_loop`)
rewritten so that its body computes the condition on its new carry and the loop's
condition only reads that flag, on the 64-element gradient of
`cpu_cheap_structures.py`, nested and plain, against `lax.scan`: XLA compile (median
of 5, interleaved after a warm-up), kernels (fusions), gradient time (median of 30).

    python benchmarks/probes/cpu_flagged_conditions.py

At 6f5dc95, alone on the 2-core CPU (`benchmarks/results/cpu_cheap_structures_session46.txt`):
nested 0.341 s (2.95x scan's) with 57 kernels, flagged 0.449 s (3.89x) with 66;
plain 0.264 s (2.29x) with 43, flagged 0.306 s (2.65x) with 48; gradients equal.
The condition's kernel does not go away: it moves into the body and the loop's
initial value, and the compile grows by more than the kernels do.
"""

import os
import statistics
import sys

import jax.numpy as jnp
from jax import lax

from boundedloop._runtime import _shard_map


sys.path[:0] = [
    os.path.dirname(__file__),
    os.path.join(os.path.dirname(__file__), ".."),
]
import cpu_cheap_structures as c  # noqa: E402
from _common import interleaved_compiles, interleaved_medians  # noqa: E402


ORIG = lax.while_loop


def flagged(cond_fun, body_fun, init_val):
    """`lax.while_loop`, its condition computed in the body and carried."""

    def body(s):
        _, v = s
        v = body_fun(v)
        return cond_fun(v), v

    _, out = ORIG(lambda s: s[0], body, (cond_fun(init_val), init_val))
    return out


class FlaggedLax:
    """`lax`, its `while_loop` flagged."""

    def __getattr__(self, k):
        return flagged if k == "while_loop" else getattr(lax, k)


def lower(kind):
    flag = kind.endswith("+flag")
    if flag:
        _shard_map.lax = FlaggedLax()
    try:
        return c.lower(kind.replace("+flag", ""))
    finally:
        _shard_map.lax = lax


def main():
    kinds = ["nested", "nested+flag", "plain", "plain+flag", "scan"]
    comp, exes = interleaved_compiles(lower, kinds, repeats=5)
    times = interleaved_medians(exes, {k: (c.W, c.X0, c.N) for k in kinds}, rounds=30)
    ref = exes["scan"](c.W, c.X0, c.N)
    s = statistics.median(comp["scan"])
    for k in sorted(kinds):
        txt = exes[k].as_text()
        m = statistics.median(comp[k])
        print(
            f"{k:12s} compile {m:.3f} s ({m / s:.2f}x scan)  kernels {txt.count(' fusion(')}  whiles {txt.count(' while(')}  grad {1e3 * times[k]:.3f} ms  off {float(jnp.max(jnp.abs(exes[k](c.W, c.X0, c.N) - ref))):.1e}"
        )


if __name__ == "__main__":
    main()
