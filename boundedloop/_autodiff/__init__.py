"""The loop's derivatives. Imports `_sweeps`, `_tracing` and `_runtime`.

Undifferentiated, the loop (`differentiable_loop`, here) is `plain_sweep` and
does no checkpoint work. Its JVP rule binds one primitive, `loop_jvp_p`
(`_jvp_primitive.py`), that returns the outputs and their tangents, and that JAX
evaluates or splits as the transform requires. The rooms, by what a reader is looking for:

- `jax.jvp`, `jax.jacfwd` (forward mode): `loop_jvp_p`'s implementation evaluates
  `LoopJVP.one_pass` (`_loop_jvp.py`), the JVP of `plain_sweep`, one sweep with
  each step's value and tangent together.
- `jax.linearize`, and so `jax.grad`, `jax.vjp`, `jax.jacrev`: `loop_jvp_p`'s
  partial-evaluation rules (`_jvp_primitive.py`) run `LoopJVP.staged`
  (`checkpointed_sweep` now) and stage the tangent as one linear primitive,
  `loop_tangent_p` (`_tangent_primitive.py`). Applied, it is the JVP of `replay_sweep`
  (the same steps again from the initial carry); transposed, `reverse_sweep` over
  the checkpoints (`_reverse_sweep.py`).
- `jax.hessian`, `jvp` of `grad` (forward over reverse): forward mode through the
  checkpointed and reverse sweeps, which `lax.while_loop` supports.
- `grad` of `grad`, `grad` of `jvp`, penalties (reverse over anything):
  `_second_order.py`. The sweeps sit behind `_second_order.linearizable`: one
  pass when evaluated, and, when linearized, a `loop_tangent` whose transpose is a
  forward-over-reverse product, so no loop is ever reversed twice.
- `vmap` of any of these: `loop_jvp_p`'s and `loop_tangent_p`'s batching rules.

Tangents and cotangents exist for the initial carry and for every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves), and
only for those that are actually perturbed: JAX passes symbolic zeros for the rest, so
a weight matrix nobody differentiates costs nothing. Integer and boolean leaves get
none. Arrays the predicate closes over get none (it is piecewise constant).
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
