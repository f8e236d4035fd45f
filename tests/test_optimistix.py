"""`boundedloop.optimistix.CheckpointedAdjoint` against optimistix's own
`RecursiveCheckpointAdjoint` (reverse mode) and itself (forward mode)."""

import jax
import jax.numpy as jnp
import pytest

optx = pytest.importorskip("optimistix")

from boundedloop.optimistix import CheckpointedAdjoint  # noqa: E402

from .helpers import tree_allclose  # noqa: E402


def _rosenbrock(y, a):
    return jnp.sum(a * (y[1:] - y[:-1] ** 2) ** 2 + (1 - y[:-1]) ** 2)


SOLVERS = {
    "bfgs": optx.BFGS(rtol=1e-6, atol=1e-6),
    "nonlinear_cg": optx.NonlinearCG(rtol=1e-6, atol=1e-6),
    "gradient_descent": optx.GradientDescent(learning_rate=1e-3, rtol=1e-6, atol=1e-6),
}


def _loss(a, adjoint, solver):
    sol = optx.minimise(
        _rosenbrock,
        solver,
        jnp.array([-1.0, 1.5, 0.5]),
        args=a,
        adjoint=adjoint,
        max_steps=40,
        throw=False,
    )
    return jnp.sum(sol.value**2)


@pytest.mark.parametrize("name", list(SOLVERS))
def test_minimise_gradient_matches_recursive_checkpoint_adjoint(name):
    a, solver = jnp.float32(3.0), SOLVERS[name]
    ours = jax.grad(_loss)(a, CheckpointedAdjoint(), solver)
    theirs = jax.grad(_loss)(a, optx.RecursiveCheckpointAdjoint(), solver)
    assert tree_allclose(ours, theirs, rtol=1e-4)
    # forward mode, which `RecursiveCheckpointAdjoint` cannot do
    assert tree_allclose(
        jax.jacfwd(_loss)(a, CheckpointedAdjoint(), solver), ours, rtol=1e-3
    )
