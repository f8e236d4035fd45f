"""The loop's derivatives. Imports `_sweeps`, `_tracing` and `_runtime`.

Undifferentiated, the loop (`differentiable_loop`, here) is `plain_sweep`; its JVP
rule binds `loop_jvp_p` (`_jvp_primitive.py`). Which transform runs which sweep:
`docs/architecture.md`, "What a gradient runs through" and "The primitives".
"""

import equinox as eqx
import jax.tree_util as jtu

from .._runtime._leaves import fill
from .._runtime._shard_map import vary_everywhere
from .._sweeps._forward_sweeps import plain_sweep
from .._tracing._loop import LoopConfig, Perturbed, TracedLoop
from .._tracing._perturbation import has_tangent, perturbed_leaves
from ._jvp_primitive import loop_jvp
from ._second_order import ReverseOverAnything


@eqx.filter_custom_jvp
def differentiable_loop(loop: TracedLoop, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. Returns the final `(x, bufs)`."""
    # inside `shard_map`, everything varies across devices from here on
    return plain_sweep(vary_everywhere(loop), config)


@differentiable_loop.def_jvp
def _differentiable_loop_jvp(primals, tangents):
    loop, config = primals
    loop = vary_everywhere(loop)
    # which of (body, init, bufs)'s leaves have a tangent, and those tangents
    t_diff = tangents[0].differentiable()
    wanted = jtu.tree_map(lambda _, t: t is not None, loop.differentiable(), t_diff)
    t_in = jtu.tree_leaves(t_diff)
    if not t_in:  # only the predicate's arrays are perturbed
        out = plain_sweep(loop, config)
        return out, jtu.tree_map(lambda _: None, out)
    t_body, t_init, t_bufs = t_diff
    perturbed = perturbed_leaves(
        loop.body,
        has_tangent(t_body),
        Perturbed(tuple(has_tangent(t_init)), tuple(has_tangent(t_bufs))),
        loop.layout,
    )
    # only perturbed leaves get tangents (see `_perturbation`)
    jvp = ReverseOverAnything(loop, config, wanted, perturbed, differentiable_loop)
    parts = jvp.parts
    results = loop_jvp(parts.leaves, t_in, jvp.spec())
    out = jtu.tree_unflatten(parts.out_def, results[: parts.out_def.num_leaves])
    t_out = results[parts.out_def.num_leaves :]
    return out, jtu.tree_unflatten(parts.out_def, fill(parts.out_perturbed, t_out))
