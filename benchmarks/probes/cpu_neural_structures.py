"""diffrax's neural ODE gradient (`diffrax_adjoint.py`'s workload) on a CPU with our
reverse sweep as the rule picks it and forced plain, nested and as one loop, against
`RecursiveCheckpointAdjoint()` (issue 53, target 2: compile at most 0.8 times
diffrax's). XLA compile (median of `R` compiles from cleared caches, interleaved after
a warm-up; and the median of the ratios to diffrax's of the same repetition), while
loops, gradient time (median of 10 interleaved rounds), and the largest difference
from diffrax's gradient.

    R=6 python benchmarks/probes/cpu_neural_structures.py

The loop diffrax runs through our adjoint has buffers, which keep its sweep plain
even where the one loop is forced (`_recompute.make_sweep`); results with that guard
lifted by hand are in `benchmarks/results/cpu_neural_structures_session46.txt`.
"""

import os
import statistics
import sys

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp

from boundedloop._sweeps import _cost_model
from boundedloop.diffrax import CheckpointedAdjoint


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import diffrax_adjoint as workload  # noqa: E402
from _common import interleaved_compiles, interleaved_medians  # noqa: E402


IS_CHEAP, SHARES_ONE_STEP = _cost_model.is_cheap, _cost_model.shares_one_step
FORCED = {  # (is_cheap, shares_one_step); "rule": as the cost model decides
    "rule": (IS_CHEAP, SHARES_ONE_STEP),
    "plain": (lambda body: False, lambda body, backend=None: False),
    "nested": (lambda body: True, lambda body, backend=None: False),
    "one loop": (lambda body: False, lambda body, backend=None: True),
}
KINDS = ["RCA", *FORCED]


def lowered(kind, field, y0):
    """`kind`'s gradient of the neural ODE's loss, lowered."""
    rca = kind == "RCA"
    adjoint = diffrax.RecursiveCheckpointAdjoint() if rca else CheckpointedAdjoint()
    if not rca:
        _cost_model.is_cheap, _cost_model.shares_one_step = FORCED[kind]
    try:
        grad = eqx.filter_grad(lambda f: workload.loss(f, y0, adjoint))
        return eqx.filter_jit(grad).lower(field)
    finally:
        _cost_model.is_cheap, _cost_model.shares_one_step = IS_CHEAP, SHARES_ONE_STEP


def main():
    field, y0 = workload.make_field(), jnp.linspace(-1.0, 1.0, workload.STATE)
    compiles, exes = interleaved_compiles(
        lambda kind: lowered(kind, field, y0), KINDS, int(os.environ.get("R", "6"))
    )
    times = interleaved_medians(exes, {k: (field,) for k in KINDS}, rounds=10)
    reference = jax.tree.leaves(exes["RCA"](field))
    print(
        "| gradient | XLA compile | over diffrax's | paired | while loops | time | off diffrax's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        c = statistics.median(compiles[kind])
        paired = statistics.median(
            a / b for a, b in zip(compiles[kind], compiles["RCA"])
        )
        text = getattr(exes[kind], "compiled", exes[kind]).as_text()
        leaves = jax.tree.leaves(exes[kind](field))
        off = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves, reference))
        print(
            f"| {kind} | {c:.3f} s | {c / statistics.median(compiles['RCA']):.2f} "
            f"| {paired:.2f} | {text.count(' while(')} "
            f"| {1e3 * times[kind]:.2f} ms | {off:.1e} |"
        )


if __name__ == "__main__":
    main()
