"""The AD wrapper: a custom VJP tying the forward and reverse sweeps together.

Undifferentiated, the loop is `plain_sweep` and does no checkpoint work. Under
reverse mode the forward pass is `checkpointed_sweep` and the backward pass is
`reverse_sweep`. Gradients flow to the initial carry and to every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves).
Integer and boolean leaves get no cotangent.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._forward import PLANNING_HORIZON, checkpointed_sweep, plain_sweep
from ._reverse import reverse_sweep


class LoopConfig(eqx.Module):
    """The static description of one loop."""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)


def is_float(x) -> bool:
    """Leaves that get cotangents. Inside a custom VJP a weakly typed Python float
    the body closed over may arrive as a bare `float`, so count those too."""
    return eqx.is_inexact_array(x) or isinstance(x, float | complex)


def _float_part(tree):
    return eqx.filter(tree, is_float)


def make_step_vjp(body, wanted):
    """`(x, ct_x') -> (ct_body, ct_x)` for one step `x' = body(x)`.

    `ct_body` covers the leaves of `body` where `wanted` (a pytree of bools shaped
    like `body`) is true; `ct_x` covers the floating leaves of `x`. Leaving the
    others out matters: a weight matrix nobody asked about would otherwise get a
    full-size cotangent accumulated every step.
    """
    diff_body, static_body = eqx.partition(body, wanted)

    def step_vjp(x, ct):
        diff_x, static_x = eqx.partition(x, is_float)

        def f(db, dx):
            return _float_part(eqx.combine(db, static_body)(eqx.combine(dx, static_x)))

        _, pullback = jax.vjp(f, diff_body, diff_x)
        return pullback(ct)

    return step_vjp, jtu.tree_map(jnp.zeros_like, diff_body)


@eqx.filter_custom_vjp
def checkpointed_loop(body_and_init, cond, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. `body_and_init = (body, init)`, where `body`
    and `cond` are closure-converted and `init` holds arrays only."""
    body, init = body_and_init
    return plain_sweep(body, cond, init, config.max_steps)


@checkpointed_loop.def_fwd
def _loop_fwd(perturbed, body_and_init, cond, config: LoopConfig):
    del perturbed
    body, init = body_and_init
    final, tape = checkpointed_sweep(
        body, cond, init, config.max_steps, config.checkpoints
    )
    return final, tape


@checkpointed_loop.def_bwd
def _loop_bwd(tape, ct_final, perturbed, body_and_init, cond, config: LoopConfig):
    del cond
    body, init = body_and_init
    body_perturbed, _ = perturbed
    wanted = jtu.tree_map(lambda p, x: p and is_float(x), body_perturbed, body)
    step_vjp, ct_body_zero = make_step_vjp(body, wanted)
    ct_final = jtu.tree_map(
        lambda ct, x: ct if ct is not None or x is None else jnp.zeros_like(x),
        _float_part(ct_final),
        _float_part(init),
        is_leaf=lambda x: x is None,
    )
    ct_body, ct_init = reverse_sweep(
        body,
        step_vjp,
        tape,
        ct_final,
        ct_body_zero,
        config.checkpoints,
        PLANNING_HORIZON,
    )
    return ct_body, ct_init
