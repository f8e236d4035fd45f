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

import functools

import optimistix as optx

from ._while_loop import while_loop


__all__ = ["CheckpointedAdjoint"]


def _equinox_while_loop(
    cond_fun, body_fun, init_val, *, max_steps, checkpoints=None, buffers=None, **_
):
    """`equinox.internal.while_loop`'s signature, as optimistix calls it."""
    return while_loop(
        cond_fun,
        body_fun,
        init_val,
        max_steps=max_steps,
        checkpoints=checkpoints,
        buffers=buffers,
    )


class CheckpointedAdjoint(optx.AbstractAdjoint):
    """Differentiate through the iterations of an optimistix solve, on
    `bl.while_loop`.

    **Arguments:**

    - `checkpoints`: copies of the solver's state kept for the reverse sweep;
      `None` takes `bl.while_loop`'s default for the solve's `max_steps`.
    """

    checkpoints: int | None = None

    def apply(self, primal_fn, rewrite_fn, inputs, tags):
        del rewrite_fn, tags
        loop = functools.partial(_equinox_while_loop, checkpoints=self.checkpoints)
        return primal_fn(inputs + (loop,))
