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

from ._api._arguments import check_checkpoints, check_memory
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
    - `memory`: instead of `checkpoints`, a budget in bytes for the reverse sweep (an
        `int`, or a string such as `"2 GiB"`), as `bl.while_loop`'s `memory`.
    """

    checkpoints: int | None = None
    memory: int | str | None = None

    def __check_init__(self):
        # a bad count or budget is reported where it is given, not at the solve
        name = "boundedloop.optimistix.CheckpointedAdjoint"
        check_memory(self.memory, self.checkpoints, name)
        if self.checkpoints is not None:
            check_checkpoints(self.checkpoints, None, name)

    def apply(self, primal_fn, rewrite_fn, inputs, tags):
        """optimistix's hook: run the solve (`primal_fn`) with our loop.

        **Arguments:** as `optx.AbstractAdjoint.apply`; `rewrite_fn` and `tags`
        serve implicit differentiation and are unused here.

        **Returns:** what `primal_fn` returns.
        """
        del rewrite_fn, tags

        def loop(cond_fun, body_fun, init_val, *, max_steps, **kwargs):
            checkpoints = None
            if self.memory is None:
                checkpoints = equinox_default_checkpoints(self.checkpoints, max_steps)
            return equinox_style_while_loop(
                cond_fun,
                body_fun,
                init_val,
                max_steps=max_steps,
                checkpoints=checkpoints,
                memory=self.memory,
                **kwargs,
            )

        return primal_fn(inputs + (loop,))
