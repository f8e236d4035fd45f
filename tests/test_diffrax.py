"""`boundedloop.diffrax.CheckpointedAdjoint` against diffrax's own adjoints:
`RecursiveCheckpointAdjoint` for reverse mode, `ForwardMode` for forward mode and
`DirectAdjoint` for second derivatives."""

import functools
import math
import os
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

from .helpers import on_host, rounding_spread, tree_allclose


diffrax = pytest.importorskip("diffrax")
lx = pytest.importorskip("lineax")

from boundedloop._api._equinox_signature import equinox_default_checkpoints  # noqa: E402
from boundedloop.diffrax import CheckpointedAdjoint  # noqa: E402


Y0 = jnp.array([1.0, 2.0])
ARGS = jnp.array(1.5)
RCA = diffrax.RecursiveCheckpointAdjoint()


def _vector_field(t, y, args):
    return -y * args + jnp.sin(t)


def solve(y0, args, adjoint, saveat=None, solver=None, max_steps=64):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_vector_field),
        diffrax.Tsit5() if solver is None else solver,
        0.0,
        1.0,
        0.1,
        y0,
        args=args,
        saveat=diffrax.SaveAt(t1=True) if saveat is None else saveat,
        stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-4),
        adjoint=adjoint,
        max_steps=max_steps,
    )
    return jnp.sum(sol.ys**2)


SAVEATS = {
    "t1": diffrax.SaveAt(t1=True),
    "ts": diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)),
    "steps": diffrax.SaveAt(steps=True),
    "t0_t1_ts": diffrax.SaveAt(t0=True, t1=True, ts=jnp.array([0.3, 0.7])),
}


@functools.cache
def _grad(adjoint, saveat, solver, max_steps=64):
    loss = functools.partial(
        solve,
        adjoint=adjoint,
        saveat=SAVEATS[saveat],
        solver=solver,
        max_steps=max_steps,
    )
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


# every `SaveAt` with an explicit solver at crossing checkpoint counts, and an
# implicit solver (its root finds are loops of their own) at two. In CI each `SaveAt`
# once, the checkpoint counts in turn (every count at least once), and the implicit
# solver once; the rest of the grid is slow (`python -m pytest -m slow`)
QUICK = {"steps": None, "t0_t1_ts": 2, "t1": 64, "ts": None}
CASES = [
    pytest.param(
        saveat,
        diffrax.Tsit5(),
        checkpoints,
        marks=() if QUICK[saveat] == checkpoints else pytest.mark.slow,
    )
    for saveat in sorted(SAVEATS)
    for checkpoints in [None, 2, 64]
] + [
    pytest.param("t1", diffrax.Kvaerno5(), None, marks=pytest.mark.slow),
    ("ts", diffrax.Kvaerno5(), 3),
]


@pytest.mark.parametrize("saveat, solver, checkpoints", CASES)
def test_reverse_mode_matches_recursive_checkpoint_adjoint(saveat, solver, checkpoints):
    ours = _grad(CheckpointedAdjoint(checkpoints), saveat, solver)(Y0, ARGS)
    reference = _grad(RCA, saveat, solver)
    expected = on_host(reference)(Y0, ARGS)
    # On another backend the adaptive controller can accept other steps, and the
    # gradient of every step's output (`steps`) moves by 0.027 (about 1%) when `Y0`
    # and `ARGS` move by one ulp on the CPU itself: allow twice the reference's own
    # spread (the other saves move by at most 4e-4)
    tol = (
        {}
        if jax.default_backend() == "cpu"
        else {"atol": 2 * rounding_spread(reference, Y0, ARGS)}
    )
    assert tree_allclose(ours, expected, rtol=1e-4, **tol)


def test_max_steps_none_and_vmap():
    ours = _grad(CheckpointedAdjoint(), "t1", diffrax.Tsit5(), max_steps=None)
    expected = on_host(_grad(RCA, "t1", diffrax.Tsit5()))(Y0, ARGS)
    assert tree_allclose(ours(Y0, ARGS), expected, rtol=1e-4)
    ys0 = jnp.stack([Y0, -0.5 * Y0])

    def batched(adjoint):
        per = lambda y0: solve(y0, ARGS, adjoint, SAVEATS["ts"])  # noqa: E731
        return jax.grad(lambda ys0: jnp.sum(jax.vmap(per)(ys0)))(ys0)

    expected = on_host(lambda: batched(RCA))()
    assert tree_allclose(batched(CheckpointedAdjoint()), expected, rtol=1e-4)


@pytest.mark.parametrize("saveat", ["t1", "ts"])
def test_forward_mode_matches_forward_mode_adjoint(saveat):
    def f(adjoint):
        return lambda y0: solve(y0, ARGS, adjoint, SAVEATS[saveat])

    ours, ref = f(CheckpointedAdjoint()), f(diffrax.ForwardMode())
    ref_jvp = on_host(lambda: jax.jvp(ref, (Y0,), (Y0,)))()
    assert tree_allclose(jax.jvp(ours, (Y0,), (Y0,)), ref_jvp)
    ref_jac = on_host(jax.jacfwd(ref))(Y0)
    assert tree_allclose(jax.jacfwd(ours)(Y0), ref_jac, rtol=1e-5)


def test_hessian_matches_direct_adjoint():
    def f(adjoint):
        return lambda y0, args: solve(y0, args, adjoint)

    ours = jax.hessian(f(CheckpointedAdjoint()), argnums=(0, 1))(Y0, ARGS)
    ref = on_host(jax.hessian(f(diffrax.DirectAdjoint()), argnums=(0, 1)))(Y0, ARGS)
    assert tree_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception):  # RecursiveCheckpointAdjoint has no forward mode
        jax.hessian(f(RCA))(Y0, ARGS)


def test_sde_with_virtual_brownian_tree():
    def f(adjoint):
        def loss(y0):
            bm = diffrax.VirtualBrownianTree(
                0.0, 1.0, tol=1e-3, shape=(2,), key=jax.random.key(0)
            )
            terms = diffrax.MultiTerm(
                diffrax.ODETerm(lambda t, y, a: -y),
                diffrax.ControlTerm(
                    lambda t, y, a: lx.DiagonalLinearOperator(0.1 * y), bm
                ),
            )
            sol = diffrax.diffeqsolve(
                terms,
                diffrax.Euler(),
                0.0,
                1.0,
                0.05,
                y0,
                adjoint=adjoint,
                max_steps=64,
            )
            return jnp.sum(sol.ys)

        return loss

    expected = on_host(jax.grad(f(RCA)))(Y0)
    assert tree_allclose(jax.grad(f(CheckpointedAdjoint()))(Y0), expected, rtol=1e-5)


def test_events_and_throw():
    def f(adjoint):
        def loss(y0):
            event = diffrax.Event(lambda t, y, args, **kw: y[0] - 0.5)
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, args: -y),
                diffrax.Tsit5(),
                0.0,
                5.0,
                0.1,
                y0,
                event=event,
                adjoint=adjoint,
                max_steps=64,
            )
            return jnp.sum(sol.ys)

        return loss

    expected = on_host(jax.grad(f(RCA)))(Y0)
    assert tree_allclose(jax.grad(f(CheckpointedAdjoint()))(Y0), expected, rtol=1e-5)
    with pytest.raises(Exception, match="maximum number of solver steps"):
        solve(Y0, ARGS, CheckpointedAdjoint(), max_steps=2)


def _our_loops(jaxpr) -> int:
    """How many `bl.while_loop` forward sweeps the program has."""
    count = 0
    for eqn in jaxpr.eqns:
        name = str(eqn.source_info.name_stack)
        count += eqn.primitive.name == "while" and "boundedloop_forward" in name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _our_loops(sub)
    return count


def test_stage_loops_run_on_boundedloop():
    from diffrax._solver import runge_kutta

    before = runge_kutta.eqxi
    jaxpr = jax.make_jaxpr(lambda y0: solve(y0, ARGS, CheckpointedAdjoint()))(Y0)
    assert runge_kutta.eqxi is before  # the lookup is put back after the trace
    assert _our_loops(jaxpr.jaxpr) == 2  # the stepping loop and the stage loop
    # a solver that chooses its own stage loop keeps it
    own = diffrax.Tsit5(scan_kind="bounded")
    jaxpr = jax.make_jaxpr(
        lambda y0: solve(y0, ARGS, CheckpointedAdjoint(), solver=own)
    )(Y0)
    assert _our_loops(jaxpr.jaxpr) == 1


def test_default_checkpoints_match_recursive_checkpoint_adjoint():
    """`checkpoints=None` takes `RecursiveCheckpointAdjoint()`'s memory budget:
    equinox's own default for the same `max_steps`, and bl's default with no bound."""
    for max_steps in [1, 2, 3, 10, 100, 4096, 16384, 10**6]:
        equinox_default = (
            1
            if max_steps == 1
            else math.floor(-1.5 + math.sqrt(2 * max_steps + 0.25)) + 1
        )
        assert equinox_default_checkpoints(None, max_steps) == equinox_default
    assert (
        equinox_default_checkpoints(None, None) is None
    )  # bl.while_loop's own default
    assert equinox_default_checkpoints(7, 4096) == 7


# Issue 28: `jax.grad` of a sum over `jax.vmap` of a solve, as a user training on
# batches writes it; before the batching fix, 7 of these 16 crashed (every
# `SaveAt(t1=True)` among them), with four different internal errors.
BATCH_Y0 = jnp.array([1.0, 2.0, 3.0])
BATCH_T1 = jnp.array([1.0, 0.95, 1.1])
CONTROLLERS = {
    "constant": diffrax.ConstantStepSize(),
    "pid": diffrax.PIDController(rtol=1e-5, atol=1e-5),
}
BATCH_SAVEATS = {
    "t1": diffrax.SaveAt(t1=True),
    "t0_t1": diffrax.SaveAt(t0=True, t1=True),
    "ts": diffrax.SaveAt(ts=jnp.linspace(0.0, 0.9, 4)),
    "steps": diffrax.SaveAt(steps=True),
}


def _decay(t, y, a):
    return -a * y


@functools.cache
def _batch_grad(adjoint, controller, saveat, t1_batched):
    def solve_one(a, y0, t1):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(_decay),
            diffrax.Tsit5(),
            0.0,
            t1,
            0.1,
            y0,
            args=a,
            stepsize_controller=CONTROLLERS[controller],
            saveat=BATCH_SAVEATS[saveat],
            adjoint=adjoint,
            max_steps=32,
        )
        return jnp.sum(sol.ys)

    def loss(a):
        t1 = BATCH_T1 if t1_batched else 1.0
        per = jax.vmap(solve_one, in_axes=(None, 0, 0 if t1_batched else None))
        return jnp.sum(per(a, BATCH_Y0, t1))

    return jax.grad(loss)


# one of the 16 runs by default (diffrax's default `SaveAt`); `-m slow` runs all
_QUICK_BATCH_CASES = {
    ("pid", "t1", True),  # broadcast_in_dim broadcast_dimensions must have length ...
}
BATCH_CASES = [
    pytest.param(
        controller,
        saveat,
        t1_batched,
        id=f"{controller}-{saveat}-{'y0_t1' if t1_batched else 'y0'}",
        marks=()
        if (controller, saveat, t1_batched) in _QUICK_BATCH_CASES
        else pytest.mark.slow,
    )
    for controller in sorted(CONTROLLERS)
    for saveat in sorted(BATCH_SAVEATS)
    for t1_batched in [False, True]
]


@pytest.mark.parametrize("controller, saveat, t1_batched", BATCH_CASES)
def test_grad_of_vmap_matches_recursive_checkpoint_adjoint(
    controller, saveat, t1_batched
):
    a = jnp.array(0.7)
    ours = _batch_grad(CheckpointedAdjoint(), controller, saveat, t1_batched)(a)
    expected = on_host(_batch_grad(RCA, controller, saveat, t1_batched))(a)
    assert tree_allclose(ours, expected, rtol=1e-5)


@pytest.mark.slow
def test_grad_of_vmap_neural_vector_field():
    """Issue 28's reproducer: a neural vector field closed over, `SaveAt(t1)`."""
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(4, 4, 16, 2, activation=jnp.tanh, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)

    def loss(params, y0, adjoint):
        m = eqx.combine(params, static)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: m(y)),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
            max_steps=64,
            adjoint=adjoint,
        )
        return jnp.sum(sol.ys**2)

    y0 = jnp.array([0.5, -0.3, 0.2, 0.1])
    ys = jnp.stack([y0, 0.5 * y0, -y0])

    def batch_grad(adjoint):
        per = jax.vmap(lambda z, p: loss(p, z, adjoint), in_axes=(0, None))
        return jax.grad(lambda p, y: jnp.sum(per(y, p)), argnums=(0, 1))(params, ys)

    ours = batch_grad(CheckpointedAdjoint())
    expected = on_host(lambda: batch_grad(RCA))()
    assert tree_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_grad_of_grad_matches_direct_adjoint():
    """diffrax issue 332: `jax.grad` of `jax.grad` of `diffeqsolve`, with adaptive
    steps. `DirectAdjoint` is the reference."""

    def f(y0, args, adjoint):
        return solve(y0, args, adjoint, max_steps=32)

    def second(adjoint):
        mixed = jax.grad(lambda y: jax.grad(f, argnums=1)(y, ARGS, adjoint))
        return jax.jit(mixed)(Y0)

    expected = on_host(lambda: second(diffrax.DirectAdjoint()))()
    assert tree_allclose(second(CheckpointedAdjoint(3)), expected, rtol=1e-5)


@pytest.mark.parametrize("solver", [diffrax.Tsit5(), diffrax.Kvaerno5()])
def test_vector_field_traced_as_often_as_under_rca(solver):
    """Tracing is paid at every compile: a vector field is traced as many times as
    under `RecursiveCheckpointAdjoint` (3 for `Tsit5`, 4 for `Kvaerno5`), though
    the stage loop reads its buffer, forward and gradient."""

    def traces(adjoint, differentiate):
        count = []

        def field(t, y, args):
            count.append(1)
            return _vector_field(t, y, args)

        def loss(y0):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(field),
                solver,
                0.0,
                1.0,
                0.1,
                y0,
                args=ARGS,
                stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-4),
                adjoint=adjoint,
                max_steps=64,
            )
            return jnp.sum(sol.ys)

        jax.make_jaxpr(jax.grad(loss) if differentiate else loss)(Y0)
        return len(count)

    for differentiate in (False, True):
        assert traces(CheckpointedAdjoint(), differentiate) == traces(
            RCA, differentiate
        )


_TYPECHECKED_SOLVE = """
import jax, jax.numpy as jnp
from jaxtyping import install_import_hook
with install_import_hook("diffrax", "beartype.beartype"):
    import diffrax
from boundedloop.diffrax import CheckpointedAdjoint

def loss(a, adjoint):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: -args * y), diffrax.Tsit5(), 0.0, 1.0,
        0.1, jnp.array([1.0, 2.0]), args=a,
        saveat=diffrax.SaveAt(ts=jnp.linspace(0, 1, 4)), adjoint=adjoint)
    return jnp.sum(sol.ys)

ours = jax.grad(loss)(1.5, CheckpointedAdjoint())
theirs = jax.grad(loss)(1.5, diffrax.RecursiveCheckpointAdjoint())
assert jnp.allclose(ours, theirs, rtol=1e-5), (ours, theirs)
"""


def test_gradient_under_diffrax_runtime_type_checks():
    """diffrax type-checked at run time (jaxtyping's import hook with beartype, as
    its own tests run): a solve that saves into buffers differentiates with our
    adjoint, as with `RecursiveCheckpointAdjoint`. In a process of its own, since
    the hook applies only to a first import of diffrax."""
    pytest.importorskip("beartype")
    done = subprocess.run(
        [sys.executable, "-c", _TYPECHECKED_SOLVE],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("saveat", ["t1", "ts"])
def test_stage_loops_and_save_only_loops_carry_no_buffer_check(saveat):
    """diffrax's Runge-Kutta stage loop reads its own stages as diffrax writes
    them, and the stepping loop writes its saves (at `ts`, through an inner save
    loop it lends them to) and reads none: by default neither's gradient holds a
    buffer check (the stage loop's check cost a 100-step Tsit5 gradient 1.10
    times)."""
    grad = _grad(CheckpointedAdjoint(), saveat, diffrax.Tsit5())
    jaxpr = jax.make_jaxpr(grad)(Y0, ARGS)
    assert "boundedloop_raise_if" not in str(jaxpr)


@pytest.mark.parametrize("memory", ["2 kB", "1 MB"])
def test_memory_budget_matches_recursive_checkpoint_adjoint(memory, monkeypatch):
    """`CheckpointedAdjoint(memory=...)`: a budget for blocks of taped steps (2 kB)
    and one that tapes every step (1 MB) give RCA's gradient. (The solver's step is
    cheap, and a budget would store it every step: planned here as a costly one, so
    that the tape is what is tested.)"""
    from boundedloop._sweeps import _tape

    monkeypatch.setattr(_tape, "is_cheap", lambda body: False)
    monkeypatch.setattr(_tape, "stores_before_taping", lambda body: False)
    ours = _grad(CheckpointedAdjoint(memory=memory), "ts", diffrax.Tsit5())(Y0, ARGS)
    expected = on_host(_grad(RCA, "ts", diffrax.Tsit5()))(Y0, ARGS)
    assert tree_allclose(ours, expected, rtol=1e-5, atol=1e-6)
