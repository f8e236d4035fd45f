"""`boundedloop.optimistix.CheckpointedAdjoint` against optimistix's own
`RecursiveCheckpointAdjoint` (reverse mode) and itself (forward mode)."""

import jax
import jax.numpy as jnp
import pytest


optx = pytest.importorskip("optimistix")

from boundedloop.optimistix import CheckpointedAdjoint  # noqa: E402

from .helpers import tree_allclose  # noqa: E402


RCA = optx.RecursiveCheckpointAdjoint()


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
    theirs = jax.grad(_loss)(a, RCA, solver)
    assert tree_allclose(ours, theirs, rtol=1e-4)
    # forward mode, which `RecursiveCheckpointAdjoint` cannot do
    assert tree_allclose(
        jax.jacfwd(_loss)(a, CheckpointedAdjoint(), solver), ours, rtol=1e-3
    )


def _residual(y, a):
    return jnp.stack([y[0] ** 2 + a * y[1] - 2.0, jnp.sin(y[0]) + y[1] ** 3 - a])


def _solve(kind, solver, adjoint, a):
    y0 = jnp.array([0.7, 0.4])
    kw = dict(args=a, adjoint=adjoint, max_steps=64, throw=False)
    if kind == "least_squares":
        sol = optx.least_squares(_residual, solver, y0, **kw)
    elif kind == "root_find":
        sol = optx.root_find(_residual, solver, y0, **kw)
    else:
        sol = optx.fixed_point(lambda y, a: 0.5 * jnp.cos(a * y), solver, y0, **kw)
    return jnp.sum(sol.value**2)


CASES = {
    "gauss_newton": ("least_squares", optx.GaussNewton(rtol=1e-6, atol=1e-6)),
    "levenberg_marquardt": (
        "least_squares",
        optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6),
    ),
    "dogleg": ("least_squares", optx.Dogleg(rtol=1e-6, atol=1e-6)),
    "newton": ("root_find", optx.Newton(rtol=1e-6, atol=1e-6)),
    "fixed_point": ("fixed_point", optx.FixedPointIteration(rtol=1e-6, atol=1e-6)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_solves_gradient_and_forward_mode(name):
    kind, solver = CASES[name]
    a = jnp.float32(1.3)
    grad = jax.grad(_solve, argnums=3)
    ours = grad(kind, solver, CheckpointedAdjoint(), a)
    assert tree_allclose(ours, grad(kind, solver, RCA, a), rtol=1e-4)
    forward = jax.jacfwd(_solve, argnums=3)(kind, solver, CheckpointedAdjoint(), a)
    assert tree_allclose(forward, ours, rtol=1e-3)


@pytest.mark.parametrize("name", ["gauss_newton", "fixed_point"])
def test_vmap_of_grad(name):
    # (Dogleg's vmap(grad) fails inside lineax with RecursiveCheckpointAdjoint too)
    kind, solver = CASES[name]
    batch = jnp.array([1.1, 1.3])
    grad = jax.grad(_solve, argnums=3)
    ours = jax.vmap(grad, in_axes=(None, None, None, 0))(
        kind, solver, CheckpointedAdjoint(), batch
    )
    for b in range(2):
        expected = grad(kind, solver, RCA, batch[b])
        assert tree_allclose(ours[b], expected, rtol=1e-4)
