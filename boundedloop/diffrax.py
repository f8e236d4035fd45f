"""`CheckpointedAdjoint`: diffrax's `diffeqsolve` on `bl.while_loop`.

Needs the optional extra `diffrax` (`pip install -e ".[diffrax]"` in a checkout).

```python
from boundedloop.diffrax import CheckpointedAdjoint

sol = diffrax.diffeqsolve(..., adjoint=CheckpointedAdjoint())
```

One adjoint for every mode: `jax.grad` (checkpointed reverse sweep), `jax.jvp` and
`jax.jacfwd` (forward mode), and `jax.hessian` (forward over reverse).
"""

import functools

import diffrax
import equinox as eqx
import jax
import jax.tree_util as jtu

from ._while_loop import while_loop


__all__ = ["CheckpointedAdjoint"]


def _bl_while_loop(
    cond_fun, body_fun, init_val, *, max_steps, buffers=None, checkpoints=None, **_
):
    """`equinox.internal.while_loop`'s signature, as diffrax calls it."""
    return while_loop(
        cond_fun,
        body_fun,
        init_val,
        max_steps=max_steps,
        checkpoints=checkpoints,
        buffers=buffers,
    )


_inner_loop = jax.named_call(_bl_while_loop, name="inner-loop")
_outer_loop = jax.named_call(_bl_while_loop, name="outer-loop")


def _stage_loops_bounded(solver):
    """`solver` with the Runge-Kutta stage loops (fixed length) on `"bounded"`
    loops where they were left to the default: the default (equinox's checkpointed
    loop) has no forward mode, and `"lax"` no reverse mode."""

    def bounded(s):
        if isinstance(s, diffrax.AbstractRungeKutta) and s.scan_kind is None:
            return eqx.tree_at(
                lambda s: s.scan_kind, s, "bounded", is_leaf=lambda v: v is None
            )
        return s

    is_rk = lambda s: isinstance(s, diffrax.AbstractRungeKutta)  # noqa: E731
    return jtu.tree_map(bounded, solver, is_leaf=is_rk)


class CheckpointedAdjoint(diffrax.AbstractAdjoint):
    """Differentiate `diffrax.diffeqsolve` through `bl.while_loop`: checkpointed
    reverse mode with near-optimal recomputation, forward mode and forward-over-
    reverse second derivatives, all through this one adjoint.

    The solver's stepping loop and its save loop (`SaveAt(ts=...)`, which writes
    into the stepping loop's output buffers) run on `bl.while_loop`. The Runge-Kutta
    stage loop inside each step has a fixed length; it runs as a `"bounded"` loop
    (`scan_kind`) unless the solver sets its own `scan_kind`.

    **Arguments:**

    - `checkpoints`: copies of the solver state the backward pass may hold, as
        `bl.while_loop`'s `checkpoints`. `None` picks its default from
        `max_steps` (16 for `max_steps=4096`, and 16 for `max_steps=None`).
    """

    checkpoints: int | None = None

    def loop(
        self,
        *,
        terms,
        saveat,
        init_state,
        max_steps,
        throw,
        passed_solver_state,
        passed_controller_state,
        solver,
        **kwargs,
    ):
        del throw, passed_solver_state, passed_controller_state
        if diffrax._adjoint.is_unsafe_sde(terms):
            raise ValueError(
                "`adjoint=CheckpointedAdjoint()` does not support "
                "`UnsafeBrownianPath`. Consider using `adjoint=ForwardMode()` "
                "instead."
            )
        return self._loop(
            terms=terms,
            saveat=saveat,
            init_state=init_state,
            max_steps=max_steps,
            solver=_stage_loops_bounded(solver),
            inner_while_loop=_inner_loop,
            outer_while_loop=functools.partial(
                _outer_loop, checkpoints=self.checkpoints
            ),
            **kwargs,
        )
