"""`CheckpointedAdjoint`: optimistix's iterative solves on `bl.while_loop`.

Needs the optional extra `optimistix` (`pip install -e ".[optimistix]"` in a
checkout).

```python
from boundedloop.optimistix import CheckpointedAdjoint

sol = optx.minimise(fn, solver, y0, adjoint=CheckpointedAdjoint())
```

Differentiates through the solver's iterations, as
`optx.RecursiveCheckpointAdjoint` does, in every mode: `jax.grad`, `jax.jvp`,
`jax.jacfwd` and `jax.hessian`. Built on optimistix's public hook
(`optx.AbstractAdjoint.apply` hands the solve its while loop).
"""

import optimistix as optx

from ._api._arguments import check_checkpoints
from ._api._equinox_signature import (
    equinox_default_checkpoints,
    equinox_style_while_loop,
)


__all__ = ["CheckpointedAdjoint"]


class CheckpointedAdjoint(optx.AbstractAdjoint):
    """Differentiate through the iterations of an optimistix solve, on
    `bl.while_loop`: checkpointed reverse mode, forward mode and forward-over-reverse
    second derivatives, all through this one adjoint.

    A drop-in for `optx.RecursiveCheckpointAdjoint`, for the same problems: solves
    stopped early, bilevel problems, differentiating through an optimiser's steps,
    where the implicit function theorem (`optx.ImplicitAdjoint`) does not apply.

    **Arguments:**

    - `checkpoints`: copies of the solver's state the reverse sweep may hold, as
        `bl.while_loop`'s `checkpoints`. `None` gives the memory budget of
        `RecursiveCheckpointAdjoint`'s default for the solve's `max_steps` (about
        `sqrt(2 * max_steps)`), or `bl.while_loop`'s own default where `max_steps`
        is `None`.
    """

    checkpoints: int | None = None

    def __check_init__(self):
        # a bad count is reported where it is given, not at the solve
        if self.checkpoints is not None:
            check_checkpoints(
                self.checkpoints, None, "boundedloop.optimistix.CheckpointedAdjoint"
            )

    def apply(self, primal_fn, rewrite_fn, inputs, tags):
        """optimistix's hook: run the solve (`primal_fn`) with our loop.

        **Arguments:** as `optx.AbstractAdjoint.apply`; `rewrite_fn` and `tags`
        serve implicit differentiation and are unused here.

        **Returns:** what `primal_fn` returns.
        """
        del rewrite_fn, tags

        def loop(cond_fun, body_fun, init_val, *, max_steps, **kwargs):
            checkpoints = equinox_default_checkpoints(self.checkpoints, max_steps)
            return equinox_style_while_loop(
                cond_fun,
                body_fun,
                init_val,
                max_steps=max_steps,
                checkpoints=checkpoints,
                **kwargs,
            )

        return primal_fn(inputs + (loop,))
