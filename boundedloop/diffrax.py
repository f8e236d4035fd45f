"""`CheckpointedAdjoint`: diffrax's `diffeqsolve` on `bl.while_loop`.

Needs the optional extra `diffrax` (`pip install -e ".[diffrax]"` in a checkout).

```python
from boundedloop.diffrax import CheckpointedAdjoint

sol = diffrax.diffeqsolve(..., adjoint=CheckpointedAdjoint())
```

One adjoint for every mode: `jax.grad` (checkpointed reverse sweep), `jax.jvp` and
`jax.jacfwd` (forward mode), and `jax.hessian` (forward over reverse).
"""

import contextlib
import functools
import threading

import diffrax
import equinox as eqx
import jax
import jax.tree_util as jtu
from diffrax._solver import runge_kutta as _runge_kutta

from ._api._arguments import check_checkpoints, check_memory
from ._api._equinox_signature import (
    equinox_default_checkpoints,
    equinox_style_while_loop,
)


__all__ = ["CheckpointedAdjoint"]


_inner_loop = jax.named_call(equinox_style_while_loop, name="inner-loop")
_outer_loop = jax.named_call(equinox_style_while_loop, name="outer-loop")


# The `scan_kind` this adjoint gives Runge-Kutta solvers that leave it unset: their
# stage loops then run on `bl.while_loop` (see `_stage_loops_on_boundedloop`).
_STAGE_KIND = "boundedloop"


def _with_stage_kind(solver):
    """`solver` with its Runge-Kutta stage loops routed to `bl.while_loop`, where the
    solver leaves `scan_kind` unset (a solver that sets it keeps its choice)."""

    def route(s):
        if isinstance(s, diffrax.AbstractRungeKutta) and s.scan_kind is None:
            return eqx.tree_at(
                lambda s: s.scan_kind, s, _STAGE_KIND, is_leaf=lambda v: v is None
            )
        return s

    is_rk = lambda s: isinstance(s, diffrax.AbstractRungeKutta)  # noqa: E731
    return jtu.tree_map(route, solver, is_leaf=is_rk)


class _StageLoops:
    """`equinox.internal` as diffrax's Runge-Kutta module sees it while a solve is
    traced: stage loops of kind `_STAGE_KIND` run on `bl.while_loop` (with a
    checkpoint per stage), everything else is equinox's."""

    def __init__(self, eqxi):
        self._eqxi = eqxi

    def __getattr__(self, name):
        return getattr(self._eqxi, name)

    def while_loop(self, cond_fun, body_fun, init_val, *, kind, **kwargs):
        if kind != _STAGE_KIND:
            return self._eqxi.while_loop(
                cond_fun, body_fun, init_val, kind=kind, **kwargs
            )
        # diffrax's stage loop reads its own stages as they are written: checking
        # its buffers cost a 100-step Tsit5 gradient 1.10 times, and finds nothing
        kwargs = dict(kwargs, checked=False)
        return equinox_style_while_loop(cond_fun, body_fun, init_val, **kwargs)


_patching = threading.RLock()


@contextlib.contextmanager
def _stage_loops_on_boundedloop():
    """While tracing a solve: diffrax takes only `scan_kind` strings for its stage
    loops, so the loop itself is swapped in where the Runge-Kutta module looks it up
    (and put back after; one thread at a time)."""
    with _patching:
        original = _runge_kutta.eqxi
        _runge_kutta.eqxi = _StageLoops(original)
        try:
            yield
        finally:
            _runge_kutta.eqxi = original


class CheckpointedAdjoint(diffrax.AbstractAdjoint):
    """Differentiate `diffrax.diffeqsolve` through `bl.while_loop`: checkpointed
    reverse mode with near-optimal recomputation, forward mode and forward-over-
    reverse second derivatives, all through this one adjoint.

    The solver's stepping loop and its save loop (`SaveAt(ts=...)`, which writes
    into the stepping loop's output buffers) run on `bl.while_loop`, and so does the
    Runge-Kutta stage loop inside each step, unless the solver sets its own
    `scan_kind`.

    **Arguments:**

    - `checkpoints`: copies of the solver state the backward pass may hold, as
        `bl.while_loop`'s `checkpoints`. `None` gives the memory budget of
        `diffrax.RecursiveCheckpointAdjoint()`'s default, the fewest `c` with
        `(c + 1)(c + 2) / 2 > max_steps` (90 for `max_steps=4096`), so that switching
        adjoints keeps the memory and the recomputation; with `max_steps=None`
        (which `RecursiveCheckpointAdjoint()` refuses) it is `bl.while_loop`'s
        default, 16.
    - `memory`: instead of `checkpoints`, a budget in bytes for the stepping loop's
        reverse sweep (an `int`, or a string such as `"2 GiB"`), as
        `bl.while_loop`'s `memory`: copies of the solver state and a tape of step
        residuals (`bl.memory_plan` says what it buys).
    """

    checkpoints: int | None = None
    memory: int | str | None = None

    def __check_init__(self):
        # a bad count or budget is reported where it is given, not at the solve
        name = "boundedloop.diffrax.CheckpointedAdjoint"
        check_memory(self.memory, self.checkpoints, name)
        if self.checkpoints is not None:
            check_checkpoints(self.checkpoints, None, name)

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
        with _stage_loops_on_boundedloop():
            return self._loop(
                terms=terms,
                saveat=saveat,
                init_state=init_state,
                max_steps=max_steps,
                solver=_with_stage_kind(solver),
                inner_while_loop=_inner_loop,
                outer_while_loop=functools.partial(
                    _outer_loop,
                    checkpoints=None
                    if self.memory is not None
                    else equinox_default_checkpoints(self.checkpoints, max_steps),
                    memory=self.memory,
                ),
                **kwargs,
            )
