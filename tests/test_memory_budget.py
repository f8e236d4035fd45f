"""`memory=`: a budget split between carry copies and a tape of the last steps'
residuals. Gradients against `lax.scan` over the steps taken, across budgets that
cross the carry's size, the tape row's and the whole loop's; body evaluations
against `bl.memory_plan`; the transforms composed with a budget; the errors."""

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import boundedloop as bl
from boundedloop._api import _memory_plan
from boundedloop._sweeps import _cost_model, _tape

from .helpers import on_host, tree_allclose


@pytest.fixture(autouse=True)
def _costly_steps(monkeypatch, request):
    """This file's small steps are cheap, and a budget stores a cheap step every step
    where it can rather than taping it: here they are planned as costly ones, so
    that the tape's paths are what is tested (`test_cheap_steps_are_stored` aside)."""
    if "cheap" not in request.node.name:
        for module in (_tape, _memory_plan):
            monkeypatch.setattr(module, "is_cheap", lambda body: False)
            monkeypatch.setattr(module, "stores_before_taping", lambda body: False)


D, MAX_STEPS = 6, 24
# a count of checkpoints that a budget keeps beside a tape of 7 rows
SLOTS_BESIDE_TAPE = 9
W0 = jnp.asarray(np.random.default_rng(0).normal(size=(D, D)) / 2, jnp.float32)
X0 = jnp.linspace(0.1, 1.0, D, dtype=jnp.float32)
# one copy of the carry `(x, i)`, and one tape row (`bl.memory_plan` below)
CARRY = 4 * D + 4


def _step(w, x):
    return jnp.sin(x @ w) + 0.1 * x


def _body(w, counter=None):
    def body(c):
        x, i = c
        if counter is not None:
            # on the step's data: XLA on a TPU may move a callback without operands
            jax.debug.callback(lambda _: counter(), x[0])
        return _step(w, x), i + 1

    return body


def _loss(w, x0, n, counter=None, **kwargs):
    x, _ = bl.while_loop(
        lambda c: c[1] < n, _body(w, counter), (x0, 0), max_steps=MAX_STEPS, **kwargs
    )
    return jnp.sum(x**3)


@on_host
def _reference(w, x0, n):
    x = lax.scan(lambda x, _: (_step(w, x), None), x0, length=n)[0]
    return jnp.sum(x**3)


@functools.cache
def _gradient(memory):
    # compiled once per budget; `n` is traced (the loop's trip count is data)
    return jax.jit(jax.grad(lambda w, x0, n: _loss(w, x0, n, memory=memory), (0, 1)))


def _plan(memory, n=MAX_STEPS, counter=None):
    """`_loss`'s plan (with a `counter`, its body has an effect, and its tape keeps
    every residual: `_tape.TapedStep.policy`)."""
    return bl.memory_plan(
        lambda c: c[1] < n,
        _body(W0, counter),
        (X0, 0),
        max_steps=MAX_STEPS,
        memory=memory,
    )


ROW = _plan(10**6).tape_step_bytes
BUDGETS = [
    CARRY,  # one copy, nothing taped
    3 * CARRY,
    SLOTS_BESIDE_TAPE * CARRY + 7 * ROW + CARRY - 1,  # short of every step: blocks
    4 * CARRY + 4 * ROW,  # blocks of 2 steps, few checkpoints
    CARRY + MAX_STEPS * ROW,  # every step taped: a stored scan
    "1 MiB",
]


def test_plan_splits_the_budget():
    """Within the budget; everything taped when every step fits; otherwise the
    fewest checkpoints whose blocks cover `max_steps` (the rest of the budget as
    tape rows), else half of it a tape of blocks; all checkpoints below two rows."""
    for memory in BUDGETS:
        plan = _plan(memory)
        budget = 2**20 if memory == "1 MiB" else memory
        assert plan.bytes <= budget
        assert plan.bytes == (
            plan.checkpoints * plan.checkpoint_bytes
            + plan.tape_steps * plan.tape_step_bytes
        )
    stored = _plan(CARRY + MAX_STEPS * ROW)
    assert (stored.checkpoints, stored.tape_steps) == (1, MAX_STEPS)
    assert _plan(3 * CARRY).tape_steps == 0
    memory = SLOTS_BESIDE_TAPE * CARRY + 7 * ROW + CARRY - 1
    short = _plan(memory)
    c, rows = short.checkpoints, short.tape_steps
    assert c * rows >= MAX_STEPS  # blocks a checkpoint apart cover the loop
    assert (c - 1) * CARRY + -(-MAX_STEPS // (c - 1)) * ROW > memory  # fewest
    assert rows == (memory - c * CARRY) // ROW
    # stored a block apart, each block starts at a checkpoint: nothing is advanced;
    # the forward sweep tapes the last block in a ring, which is not evaluated again
    for n in [1, 11, 17, MAX_STEPS]:
        last_block = n - (n - 1) // rows * rows
        assert short.body_evaluations(n) == 2 * n - last_block
    uncovered = 4 * CARRY + 4 * ROW
    assert _plan(uncovered).tape_steps == (uncovered // 2) // ROW
    assert _plan(CARRY + ROW).tape_steps == 0  # below two rows
    assert _plan(CARRY).checkpoint_bytes == CARRY


@settings(max_examples=8, deadline=None)
@given(memory=st.sampled_from(BUDGETS), n=st.integers(0, MAX_STEPS))
def test_gradient_and_evaluations_match_the_plan(memory, n):
    """Every budget: the gradient of `lax.scan` over the `n` steps taken, and as
    many body evaluations as the plan says (each taped step evaluated once)."""
    got = _gradient(memory)(W0, X0, n)
    assert tree_allclose(got, jax.grad(_reference, (0, 1))(W0, X0, n), rtol=1e-4)
    count = []
    jax.grad(_loss, (0, 1))(W0, X0, n, lambda: count.append(1), memory=memory)
    jax.effects_barrier()  # every callback delivered (a TPU's arrive late)
    plan = _plan(memory, n, counter=lambda: None)
    assert len(count) == plan.body_evaluations(n)
    if plan.tape_steps == MAX_STEPS:
        assert len(count) == n  # a stored scan: no step evaluated twice


# blocks reached by advances; blocks a checkpoint apart, the last in the forward
# sweep's ring; every step taped
@pytest.mark.parametrize(
    "memory",
    [4 * CARRY + 4 * ROW, SLOTS_BESIDE_TAPE * CARRY + 7 * ROW + CARRY - 1, "1 MiB"],
)
def test_transforms_compose_with_a_budget(memory):
    """vmap over the trip count, `jax.hessian`, `grad` of `grad`, `grad` of `jvp`
    and `jacfwd` through a taped loop equal them through `lax.scan`. (`grad` of
    `grad` once read the first-order tape with another step's residuals.)"""
    ours = functools.partial(_loss, memory=memory)
    ns = jnp.array([0, 3, 9, MAX_STEPS])

    def masked(w, x0, n):  # the reference with a batched trip count
        def body(x, i):
            return jnp.where(i < n, _step(w, x), x), None

        return jnp.sum(lax.scan(body, x0, jnp.arange(MAX_STEPS))[0] ** 3)

    def grad_grad(f):
        return jax.grad(lambda x0: jnp.sum(jax.grad(f)(W0, x0, 7) ** 2))(X0)

    def grad_jvp(f):
        def jvp(x0):
            return jax.jvp(lambda x: f(W0, x, 7), (x0,), (jnp.ones(D),))[1]

        return jax.grad(jvp)(X0)

    cases = [
        (
            lambda f: jax.vmap(jax.grad(f), (None, None, 0))(W0, X0, ns),
            on_host(masked),
        ),
        (lambda f: jax.hessian(f, 1)(W0, X0, 7), _reference),
        (grad_grad, _reference),
        (grad_jvp, _reference),
        (lambda f: jax.jacfwd(f, 1)(W0, X0, 7), _reference),
    ]
    for transform, reference in cases:
        assert tree_allclose(transform(ours), transform(reference), rtol=1e-4)


def test_cheap_steps_are_stored():
    """A cheap step, with a budget for `max_steps` copies of the carry, is stored
    every step (each reversed step evaluated once more), not taped."""
    plan = _plan(MAX_STEPS * CARRY)
    assert (plan.checkpoints, plan.tape_steps) == (MAX_STEPS, 0)
    assert plan.body_evaluations(9) == 18
    got = jax.grad(_loss, (0, 1))(W0, X0, 9, memory=MAX_STEPS * CARRY)
    assert tree_allclose(got, jax.grad(_reference, (0, 1))(W0, X0, 9), rtol=1e-4)


def test_cheap_steps_on_a_tpu_are_stored_where_a_tape_fits(monkeypatch):
    """On a TPU a step lighter than `_cost_model.HEAVY_WORK` is stored every step
    where `max_steps` copies fit, even where every step's residuals would fit too
    (`_cost_model.stores_before_taping`); a heavy one, or any on a CPU, is taped."""
    on_tpu = functools.partial(_cost_model.stores_before_taping, backend="tpu")
    for module in (_tape, _memory_plan):
        monkeypatch.setattr(module, "stores_before_taping", on_tpu)
    plan = _plan("1 MiB")
    assert (plan.checkpoints, plan.tape_steps) == (MAX_STEPS, 0)
    assert plan.body_evaluations(9) == 18
    got = jax.grad(_loss, (0, 1))(W0, X0, 9, memory="1 MiB")
    assert tree_allclose(got, jax.grad(_reference, (0, 1))(W0, X0, 9), rtol=1e-4)

    def jaxpr_of(width):
        w = jnp.ones((width, width))
        return SimpleNamespace(jaxpr=jax.make_jaxpr(lambda x: w @ x)(w[0]).jaxpr)

    assert on_tpu(jaxpr_of(D))
    assert not on_tpu(jaxpr_of(1024))  # 2**20 multiply-adds
    assert not _cost_model.stores_before_taping(jaxpr_of(D), backend="cpu")


def test_scan_with_every_step_taped_is_a_stored_scan():
    count = []

    def loss(x0):
        def f(x, _):
            jax.debug.callback(lambda _: count.append(1), x[0])
            return _step(W0, x), x[0]

        x, ys = bl.scan(f, x0, length=9, memory="1 MiB")
        return jnp.sum(x**3) + jnp.sum(ys)

    def reference(x0):
        x, ys = lax.scan(lambda x, _: (_step(W0, x), x[0]), x0, length=9)
        return jnp.sum(x**3) + jnp.sum(ys)

    assert tree_allclose(jax.grad(loss)(X0), on_host(jax.grad(reference))(X0))
    jax.effects_barrier()
    assert len(count) == 9


def test_buffers_with_a_budget():
    """A loop writing a trajectory buffer and reading its last row: buffers are never
    taped, and the gradient is the unrolled loop's."""

    def loss(w, n, memory):
        def body(c):
            x, ys, i = c
            prev = jnp.where(i > 0, ys[jnp.maximum(i - 1, 0)], x)
            x = _step(w, prev)
            return x, ys.at[i].set(x), i + 1

        init = (X0, jnp.zeros((MAX_STEPS, D)), 0)
        _, ys, _ = bl.while_loop(
            lambda c: c[2] < n,
            body,
            init,
            max_steps=MAX_STEPS,
            memory=memory,
            buffers=lambda c: c[1],
        )
        return jnp.sum(jnp.sin(ys))

    def unrolled(w, n):
        x, rows = X0, []
        for _ in range(n):
            x = _step(w, x)
            rows.append(x)
        ys = jnp.zeros((MAX_STEPS, D))
        if rows:
            ys = ys.at[:n].set(jnp.stack(rows))
        return jnp.sum(jnp.sin(ys))

    for memory in [3 * CARRY, 6 * CARRY + 8 * ROW, "1 MiB"]:
        for n in [0, 5, MAX_STEPS]:
            got = jax.grad(loss)(W0, n, memory)
            assert tree_allclose(got, on_host(jax.grad(unrolled))(W0, n), rtol=1e-4)


@pytest.mark.parametrize(
    "memory, checkpoints, error, match",
    [
        (100, 4, ValueError, "`memory` or `checkpoints`, not both"),
        (CARRY - 1, None, ValueError, f"cannot hold one copy.*takes {CARRY} bytes"),
        ("2 parsecs", None, TypeError, "a number of bytes"),
        (True, None, TypeError, "a number of bytes"),
        (0, None, ValueError, "memory > 0"),
    ],
)
def test_budget_errors(memory, checkpoints, error, match):
    with pytest.raises(error, match=match):
        _loss(W0, X0, 3, memory=memory, checkpoints=checkpoints)


@pytest.mark.parametrize(
    "text, expected",
    [("2 GiB", 2 * 2**30), ("500MB", 500 * 10**6), ("1.5 kB", 1500), ("64", 64)],
)
def test_budget_units(text, expected):
    from boundedloop._api._arguments import check_memory

    assert check_memory(text, None, "test") == expected


def test_adapters_refuse_both():
    pytest.importorskip("diffrax")
    pytest.importorskip("optimistix")
    from boundedloop.diffrax import CheckpointedAdjoint as DiffraxAdjoint
    from boundedloop.optimistix import CheckpointedAdjoint as OptimistixAdjoint

    for adjoint in [DiffraxAdjoint, OptimistixAdjoint]:
        with pytest.raises(ValueError, match="not both"):
            adjoint(checkpoints=4, memory="1 GiB")
        adjoint(memory="1 GiB")


def test_unbounded_loop_with_a_budget():
    """`max_steps=None`: no full tape is possible, so blocks from half the budget."""

    def loss(w, x0, n):
        def body(c):
            return _step(w, c[0]), c[1] + 1

        init = (x0, 0)
        x, _ = bl.while_loop(
            lambda c: c[1] < n, body, init, max_steps=None, memory=3 * CARRY + 4 * ROW
        )
        return jnp.sum(x**3)

    for n in [5, 40]:
        got = jax.grad(loss, (0, 1))(W0, X0, n)
        assert tree_allclose(got, jax.grad(_reference, (0, 1))(W0, X0, n), rtol=1e-4)


def test_tape_keeps_inputs_of_elementwise_operations():
    """A row of `tanh(y @ W)`'s tape holds `y` and `y @ W` (two arrays of the
    carry's size), not `tanh`'s result too: the pullback computes it again. A body
    with an effect keeps all three, so that the effect runs once per evaluation."""
    y, w = jnp.ones((2, 4)), jnp.full((4, 4), 0.3)

    def body(c):  # differentiated in `w` too, which needs `y`
        return c[0] + 1, jnp.tanh(c[1] @ w)

    def body_with_effect(c):
        jax.debug.callback(lambda _: None, c[1][0, 0])
        return body(c)

    def row(body):
        plan = bl.memory_plan(
            lambda c: c[0] < 5, body, (0, y), max_steps=8, memory="1 MiB"
        )
        return plan.tape_step_bytes

    assert row(body) == 2 * y.nbytes
    assert row(body_with_effect) == 3 * y.nbytes
    got = jax.grad(lambda y: _tanh_loss(body, y, memory="1 MiB"))(y)
    expected = jax.grad(lambda y: _tanh_loss(body, y, checkpoints=8))(y)
    assert tree_allclose(got, expected, rtol=1e-5)


def _tanh_loss(body, y, **kwargs):
    return jnp.sum(
        bl.while_loop(lambda c: c[0] < 5, body, (0, y), max_steps=8, **kwargs)[1]
    )
