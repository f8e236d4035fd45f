"""`boundedloop.optimistix.CheckpointedAdjoint` against optimistix's own unrolled
adjoint, `RecursiveCheckpointAdjoint`: its gradients for reverse mode, its
`jax.jacrev` for forward mode (which it cannot do), and for second derivatives its
`jax.hessian` (forward over reverse), finite differences of its gradient and
forward-over-forward through the same iterations on `lax.while_loop`."""

import contextlib
import functools
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from .client_suites.optimistix_plugin import lax_unrolled_adjoint
from .helpers import on_host, tree_allclose


optx = pytest.importorskip("optimistix")
diffrax = pytest.importorskip("diffrax")

from boundedloop.diffrax import CheckpointedAdjoint as DiffraxAdjoint  # noqa: E402
from boundedloop.optimistix import CheckpointedAdjoint  # noqa: E402


RCA = optx.RecursiveCheckpointAdjoint()
OURS = CheckpointedAdjoint()


def _rosenbrock(y, a):
    # tilted by `a[0]`, so that the minimiser depends on both parameters
    valley = a[0] * (y[1:] - y[:-1] ** 2) ** 2 + (a[1] - y[:-1]) ** 2
    return jnp.sum(valley) + 0.1 * a[0] * jnp.sum(y)


def _residual(y, a):
    # nearly linear, so that Chord (one Jacobian, at y0) converges too
    return y + 0.25 * jnp.tanh(y[::-1]) - a * jnp.array([1.0, -0.5])


TOL = dict(rtol=1e-6, atol=1e-6)
# name: (problem, solver, max_steps)
CASES = {
    "bfgs": ("minimise", optx.BFGS(**TOL), 40),
    "nonlinear_cg": ("minimise", optx.NonlinearCG(**TOL), 40),
    "gradient_descent": ("minimise", optx.GradientDescent(1e-3, **TOL), 40),
    "gauss_newton": ("least_squares", optx.GaussNewton(**TOL), 32),
    "levenberg_marquardt": ("least_squares", optx.LevenbergMarquardt(**TOL), 32),
    "dogleg": ("least_squares", optx.Dogleg(**TOL), 32),
    "newton": ("root_find", optx.Newton(**TOL), 32),
    "chord": ("root_find", optx.Chord(**TOL), 32),
    "bisection": ("bisection", optx.Bisection(**TOL), 64),
    "fixed_point": ("fixed_point", optx.FixedPointIteration(**TOL), 64),
}
Y0 = {
    "minimise": jnp.array([-1.0, 1.5, 0.5]),
    "least_squares": jnp.array([0.7, 0.4]),
    "root_find": jnp.array([0.7, 0.4]),
    "bisection": jnp.array(1.0),
    "fixed_point": jnp.array([0.7, 0.4]),
}
A = jnp.array([1.3, 0.9])


def _solution(name, adjoint, a, y0=None, *, solver=None, max_steps="case", throw=False):
    """The solve of case `name` (with another `solver` of its kind if given): its
    `optx.Solution`."""
    problem, case_solver, default_max_steps = CASES[name]
    solver = case_solver if solver is None else solver
    y0 = Y0[problem] if y0 is None else y0
    kw = dict(
        args=a,
        adjoint=adjoint,
        max_steps=default_max_steps if max_steps == "case" else max_steps,
        throw=throw,
    )
    if problem == "minimise":
        return optx.minimise(_rosenbrock, solver, y0, **kw)
    if problem == "least_squares":
        return optx.least_squares(_residual, solver, y0, **kw)
    if problem == "root_find":
        return optx.root_find(_residual, solver, y0, **kw)
    if problem == "bisection":
        fn = lambda y, a: y**3 - a[0] * y - a[1]  # noqa: E731
        return optx.root_find(fn, solver, y0, options=dict(lower=0.0, upper=3.0), **kw)
    fixed = lambda y, a: 0.5 * jnp.cos(a * y)  # noqa: E731
    return optx.fixed_point(fixed, solver, y0, **kw)


def _loss(name, adjoint, a, y0=None, **kwargs):
    return jnp.sum(_solution(name, adjoint, a, y0, **kwargs).value ** 2)


@functools.cache
def _grad(name, adjoint, **kwargs):
    """A jitted gradient of `_loss` in `a`, shared between tests."""
    return jax.jit(jax.grad(functools.partial(_loss, name, adjoint, **kwargs)))


# each kind of problem by default, a second minimiser and least-squares solver too;
# the rest with `-m slow`
QUICK_SOLVERS = {"bfgs", "gradient_descent", "levenberg_marquardt", "newton"}
QUICK_SOLVERS |= {"bisection", "fixed_point"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in QUICK_SOLVERS else pytest.mark.slow)
        for n in CASES
    ],
)
def test_gradient_and_forward_mode_match_recursive_checkpoint_adjoint(name):
    ours = _grad(name, OURS)(A)
    theirs = on_host(_grad(name, RCA))(A)
    assert tree_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
    # forward mode, which `RecursiveCheckpointAdjoint` cannot do, against its jacrev
    forward = jax.jacfwd(functools.partial(_loss, name, OURS))(A)
    assert tree_allclose(forward, theirs, rtol=1e-3, atol=1e-6)
    if name == "bisection":
        # the iterates are midpoints of an interval that does not depend on `a`: the
        # unrolled derivative is zero with either adjoint (`ImplicitAdjoint`'s is not)
        assert tree_allclose(ours, jnp.zeros(2))
    else:
        assert jnp.max(jnp.abs(ours)) > 1e-2


# BFGS for exactly 8 steps (no tolerance stops it: a smooth function of `a`), and
# Newton to convergence
HESSIAN_CASES = {
    "bfgs_8_steps": ("bfgs", optx.BFGS(rtol=0.0, atol=0.0), 8),
    "newton": ("newton", CASES["newton"][1], 32),
}


@pytest.mark.parametrize(
    "case", [pytest.param("bfgs_8_steps", marks=pytest.mark.slow), "newton"]
)
def test_hessian(case):
    name, solver, max_steps = HESSIAN_CASES[case]

    def loss(adjoint, a):
        return _loss(name, adjoint, a, solver=solver, max_steps=max_steps)

    ours = jax.hessian(functools.partial(loss, OURS))(A)
    exact = on_host(
        jax.jacfwd(jax.jacfwd(functools.partial(loss, lax_unrolled_adjoint())))
    )(A)
    assert tree_allclose(ours, exact, rtol=1e-3, atol=1e-4)
    # `RecursiveCheckpointAdjoint` does forward over reverse too (not forward alone)
    theirs = on_host(jax.hessian(functools.partial(loss, RCA)))(A)
    assert tree_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    # central differences of `RecursiveCheckpointAdjoint`'s gradient
    eps = 1e-2
    grad = on_host(jax.jit(jax.grad(functools.partial(loss, RCA))))
    columns = [(grad(A + eps * e) - grad(A - eps * e)) / (2 * eps) for e in jnp.eye(2)]
    assert tree_allclose(ours, jnp.stack(columns, axis=1), rtol=3e-2, atol=3e-2)


# (max_steps, checkpoints): one checkpoint, more checkpoints than steps, the default;
# the rest of the grid is slow
MAX_STEPS_CASES = [(5, 1), (5, 8), (12, None)] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [(5, None), (12, 1), (12, 3)]
]


@pytest.mark.parametrize("max_steps, checkpoints", MAX_STEPS_CASES)
def test_max_steps_reached(max_steps, checkpoints):
    # BFGS needs about 20 steps here: the solve stops at `max_steps` (result
    # `nonlinear_max_steps_reached`), and the gradient is that of its first steps
    ours = CheckpointedAdjoint(checkpoints=checkpoints)
    theirs = optx.RecursiveCheckpointAdjoint(checkpoints=checkpoints)
    sol = _solution("bfgs", ours, A, max_steps=max_steps)
    assert sol.result == optx.RESULTS.nonlinear_max_steps_reached
    assert sol.stats["num_steps"] == max_steps
    assert tree_allclose(
        _grad("bfgs", ours, max_steps=max_steps)(A),
        on_host(_grad("bfgs", theirs, max_steps=max_steps))(A),
        rtol=1e-4,
    )


def test_unbounded_solve():
    # `max_steps=None`: `RecursiveCheckpointAdjoint` needs `checkpoints` then; ours
    # takes `bl.while_loop`'s default
    ours = _grad("bfgs", OURS, max_steps=None)
    theirs = _grad("bfgs", optx.RecursiveCheckpointAdjoint(checkpoints=4))
    assert tree_allclose(ours(A), on_host(theirs)(A), rtol=1e-4)


def test_throw():
    converged = _grad("newton", OURS, throw=True)(A)
    assert tree_allclose(converged, _grad("newton", OURS)(A))
    for adjoint in [OURS, RCA]:
        with pytest.raises(Exception, match="maximum number of steps was reached"):
            jax.block_until_ready(_grad("bfgs", adjoint, max_steps=5, throw=True)(A))


QUICK_VMAP = {("gauss_newton", "args"), ("fixed_point", "both")}
# each solver kind once in CI, batched in `args` or in both; the rest of the grid
# is slow (`python -m pytest -m slow`)
VMAP_CASES = [
    pytest.param(
        name,
        batched,
        marks=() if (name, batched) in QUICK_VMAP else pytest.mark.slow,
    )
    for name in ["bfgs", "gauss_newton", "fixed_point"]
    for batched in ["args", "y0", "both"]
]


@pytest.mark.parametrize("name, batched", VMAP_CASES)
def test_vmap(name, batched):
    # against the same transforms of `RecursiveCheckpointAdjoint`: batched linear
    # algebra rounds differently from one element at a time (1e-4 for BFGS)
    y0 = Y0[CASES[name][0]]
    in_axes = (0 if batched != "y0" else None, 0 if batched != "args" else None)
    a = jnp.stack([A, A * 1.1, A * 0.9]) if in_axes[0] == 0 else A
    y0 = jnp.stack([y0, y0 * 0.9, y0 * 1.1]) if in_axes[1] == 0 else y0

    def grad_of_vmap(adjoint):
        loss = jax.vmap(functools.partial(_loss, name, adjoint), in_axes=in_axes)
        return jax.grad(lambda a, y0: jnp.sum(loss(a, y0)), argnums=(0, 1))(a, y0)

    def vmap_of_grad(adjoint):
        grad = jax.grad(functools.partial(_loss, name, adjoint), argnums=(0, 1))
        return jax.vmap(grad, in_axes=in_axes)(a, y0)

    for transforms in [grad_of_vmap, vmap_of_grad]:
        expected = on_host(lambda: transforms(RCA))()
        assert tree_allclose(transforms(OURS), expected, rtol=1e-5, atol=1e-6)


def _implicit_ode(a, optx_adjoint, diffrax_adjoint):
    """An ODE whose vector field solves a nonlinear equation: `y' = -z` where
    `z + z**3 / 3 = a * y` (Newton, differentiated through its iterations)."""

    def vector_field(t, y, a):
        del t
        fn = lambda z, rhs: z + z**3 / 3 - rhs  # noqa: E731
        newton = optx.Newton(rtol=1e-6, atol=1e-6)
        sol = optx.root_find(
            fn, newton, y, args=a * y, adjoint=optx_adjoint, throw=False
        )
        return -sol.value

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.array([1.0, 0.5]),
        args=a,
        adjoint=diffrax_adjoint,
        max_steps=32,
    )
    return jnp.sum(sol.ys**2)


def test_solve_inside_a_diffrax_vector_field():
    a = jnp.float32(1.5)
    ours = jax.grad(_implicit_ode)(a, OURS, DiffraxAdjoint())
    theirs = on_host(jax.grad(_implicit_ode))(
        a, RCA, diffrax.RecursiveCheckpointAdjoint()
    )
    assert tree_allclose(ours, theirs, rtol=1e-4)
    forward = jax.jacfwd(_implicit_ode)(a, OURS, DiffraxAdjoint())
    assert tree_allclose(forward, theirs, rtol=1e-3)


def test_default_checkpoints_are_recursive_checkpoint_adjoints(monkeypatch):
    import boundedloop.optimistix

    given = []

    def record(*args, checkpoints, **kwargs):
        given.append(checkpoints)
        return real(*args, checkpoints=checkpoints, **kwargs)

    real = boundedloop.optimistix.equinox_style_while_loop
    monkeypatch.setattr(boundedloop.optimistix, "equinox_style_while_loop", record)
    for adjoint, max_steps in [(OURS, 32), (CheckpointedAdjoint(3), 32), (OURS, None)]:
        # a function of its own, so that no earlier trace is reused
        fn = lambda y, a: y - a  # noqa: E731
        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        jax.eval_shape(
            lambda a: optx.root_find(
                fn, solver, a, a, adjoint=adjoint, max_steps=max_steps
            ),
            A,
        )
    # 7: the fewest c with (c + 1)(c + 2) / 2 > 32, equinox's default
    assert given == [7, 3, None]


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the guide prints the host CPU's figures, and its derivatives follow the "
    "step at which BFGS stops: on a TPU v5e that is step 23, not 29 (as on the host "
    "at the next float32 above `a = 1`), and XLA's TPU compiler aborts on its "
    "`jax.hessian` besides; see benchmarks/optimistix_trip_count.py and the "
    "limitations page",
)
def test_guide_example_prints_what_it_says():
    guide = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "optimistix.md"
    code = re.search(r"```python\n(.*?)```", guide.read_text(), re.S).group(1)
    said = re.search(r"# prints\n# (.*)\n", code.replace("; prints", "\n# prints"))
    expected = [float(x) for x in re.findall(r"-?\d+\.\d+", said.group(1))]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(guide), "exec"), {})
    got = [float(x) for x in re.findall(r"-?\d+\.\d+", printed.getvalue())]
    assert tree_allclose(jnp.array(got), jnp.array(expected), rtol=1e-5)


@pytest.mark.parametrize("adjoint", [CheckpointedAdjoint, DiffraxAdjoint])
def test_bad_checkpoints_are_refused_where_given(adjoint):
    with pytest.raises(ValueError, match="checkpoints >= 1"):
        adjoint(checkpoints=0)
    with pytest.raises(TypeError, match="positive int or None"):
        adjoint(checkpoints=2.5)
