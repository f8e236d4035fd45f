"""The AD wrapper: a custom VJP tying the forward and reverse sweeps together.

Undifferentiated, the loop is `plain_sweep` and does no checkpoint work. Under
reverse mode the forward pass is `checkpointed_sweep` and the backward pass is
`reverse_sweep`. Gradients flow to the initial carry and to every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves).
Integer and boolean leaves get no cotangent.
"""

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from ._carry import Layout, TracedLoop
from ._forward import checkpointed_sweep, plain_sweep, PLANNING_HORIZON
from ._reverse import reverse_sweep
from ._step import float_part, is_float, make_step_vjp


class LoopConfig(eqx.Module):
    """The static description of one loop."""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    # the loop always takes `max_steps` steps (a scan): plan checkpoints offline
    known_length: bool = eqx.field(static=True, default=False)


def _loop(diff, nondiff, config):
    (body, x, bufs), (cond, checked) = diff, nondiff
    return TracedLoop(body, cond, checked, x, bufs, config.layout)


@eqx.filter_custom_vjp
def checkpointed_loop(diff, nondiff, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. `diff = (body, x, bufs)`: the
    closure-converted body and the initial arrays; `nondiff = (cond, checked_body)`.
    Returns the final `(x, bufs)`."""
    loop = _loop(diff, nondiff, config)
    return plain_sweep(loop, config.max_steps, loop.checked_body is not None)


@checkpointed_loop.def_fwd
def _loop_fwd(perturbed, diff, nondiff, config: LoopConfig):
    del perturbed
    loop = _loop(diff, nondiff, config)
    checked = loop.checked_body is not None
    return checkpointed_sweep(
        loop, config.max_steps, config.checkpoints, checked, config.known_length
    )


def _zeros_where_none(ct, like):
    return jtu.tree_map(
        lambda c, x: c if c is not None or x is None else jnp.zeros_like(x),
        float_part(ct),
        float_part(like),
        is_leaf=lambda v: v is None,
    )


@checkpointed_loop.def_bwd
def _loop_bwd(tape, ct_final, perturbed, diff, nondiff, config: LoopConfig):
    del nondiff
    body, x, bufs = diff
    body_perturbed = perturbed[0]
    wanted = jtu.tree_map(lambda p, leaf: p and is_float(leaf), body_perturbed, body)
    step_vjp, apply_updates, ct_body_zero = make_step_vjp(body, config.layout, wanted)
    ct_x, ct_bufs = ct_final
    max_steps = config.max_steps
    ct_body, ct_x, ct_bufs = reverse_sweep(
        step_vjp,
        apply_updates,
        tape,
        _zeros_where_none(ct_x, x),
        _zeros_where_none(ct_bufs, bufs),
        ct_body_zero,
        config.checkpoints,
        PLANNING_HORIZON,
        every_step_stored=max_steps is not None and config.checkpoints >= max_steps,
    )
    return ct_body, ct_x, ct_bufs
