"""Reverse over reverse and reverse over forward: `grad(grad)`, `jacrev(jacrev)`,
`jacrev(jacfwd)`, `grad` of `jvp` and of `linearize`, gradient penalties, under
`vmap`, with buffers, through `bl.scan` / `bl.fori_loop` and nested loops, against
the same transforms of a `lax.scan` over the known trip count; and what they cost
(body evaluations, memory flat in `max_steps`), and third order."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import boundedloop as bl

from .helpers import Counter, on_host, scan_loop, tree_allclose
from .schedule_reference import gradient_body_evaluations


W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
X0 = jnp.array([0.3, -0.2, 0.5])
V = jnp.array([0.7, -1.1, 0.4])


def make_body(w):
    def body(carry):
        x, i, limit = carry
        return jnp.tanh(w @ x + 0.1), i + 1, limit

    return body


def ours(x, w, limit, *, max_steps=12, checkpoints=3):
    init = (x, jnp.array(0), jnp.asarray(limit, jnp.int32))
    return bl.while_loop(
        lambda c: c[1] < c[2],
        make_body(w),
        init,
        max_steps=max_steps,
        checkpoints=checkpoints,
    )[0]


def reference(x, w, trips):
    return scan_loop(make_body(w), (x, jnp.array(0), jnp.array(0)), trips)[0]


def loss_of(f):
    return lambda x, w, n: jnp.sum(f(x, w, n) ** 2) + jnp.sum(f(x, w, n))


# Each is `loss -> g(x, w, n)`, a second derivative in reverse over something.
def grad_of_grad(loss):
    inner = jax.grad(loss)
    return jax.grad(lambda x, w, n: jnp.sum(jnp.sin(inner(x, w, n))), argnums=(0, 1))


def gradient_penalty(loss):
    """`grad_w |grad_x loss|^2`, as a Lipschitz penalty is trained."""
    inner = jax.grad(loss)
    return jax.grad(lambda x, w, n: jnp.sum(inner(x, w, n) ** 2), argnums=1)


def input_gradient_penalty(loss):
    """`grad_x |grad_w loss|^2`."""
    inner = jax.grad(loss, argnums=1)
    return jax.grad(lambda x, w, n: jnp.sum(inner(x, w, n) ** 2))


def jacrev_jacrev(loss):
    return jax.jacrev(jax.jacrev(loss, argnums=(0, 1)), argnums=(0, 1))


def jacrev_jacfwd(loss):
    return jax.jacrev(jax.jacfwd(loss, argnums=(0, 1)), argnums=(0, 1))


def grad_of_jvp(loss):
    def tangent(x, w, n):
        return jax.jvp(lambda x, w: loss(x, w, n), (x, w), (V, 0.3 * W))[1]

    return jax.grad(tangent, argnums=(0, 1))


def grad_of_linearize(loss):
    def tangent(x, w, n):
        return jax.linearize(lambda x: loss(x, w, n), x)[1](V)

    return jax.grad(tangent, argnums=(0, 1))


TRANSFORMS = {
    "grad_grad": grad_of_grad,
    "gradient_penalty": gradient_penalty,
    "input_gradient_penalty": input_gradient_penalty,
    "jacrev_jacrev": jacrev_jacrev,
    "jacrev_jacfwd": jacrev_jacfwd,
    "grad_jvp": grad_of_jvp,
    "grad_linearize": grad_of_linearize,
}

# (checkpoints, max_steps): fewer checkpoints than steps, every step stored, and a
# bound below the trip count; each run at trip limits inside, at zero and past the
# bound. The default run takes five transforms on the first (`grad_linearize`, the
# derivative of a linearized loop at its point, is the default run's only test of
# `loop_tangent`'s JVP rule); `-m slow` the whole grid.
CONFIGS = [(3, 12), (None, 8), (2, 6)]
LIMITS = [7, 0, 15]
GRID = [
    pytest.param(
        transform,
        *config,
        marks=() if config == CONFIGS[0] and transform in QUICK else pytest.mark.slow,
    )
    for QUICK in [
        ("grad_grad", "gradient_penalty", "grad_jvp", "grad_linearize", "jacrev_jacfwd")
    ]
    for transform in sorted(TRANSFORMS)
    for config in CONFIGS
]


@functools.cache
def compiled(transform, checkpoints, max_steps):
    f = functools.partial(ours, max_steps=max_steps, checkpoints=checkpoints)
    return jax.jit(TRANSFORMS[transform](loss_of(f)))


@pytest.mark.parametrize("transform, checkpoints, max_steps", GRID)
def test_second_order_matches_scan(transform, checkpoints, max_steps):
    for limit in LIMITS:
        got = compiled(transform, checkpoints, max_steps)(X0, W, limit)
        trips = min(limit, max_steps)
        expected = on_host(TRANSFORMS[transform](loss_of(reference)))(X0, W, trips)
        assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6), limit


@pytest.mark.parametrize(
    "transform", ["grad_grad", pytest.param("jacrev_jacfwd", marks=pytest.mark.slow)]
)
def test_second_order_under_vmap(transform):
    """Each element stops at its own step; `w` is shared (its derivative summed)."""
    limits = jnp.array([4, 9, 0])
    xs = jnp.stack([X0, -X0, 0.5 * X0])
    loss = loss_of(functools.partial(ours, max_steps=10, checkpoints=2))
    batch = lambda x, w, n: jnp.sum(jax.vmap(loss, (0, None, 0))(x, w, n))  # noqa: E731
    got = jax.jit(TRANSFORMS[transform](batch))(xs, W, limits)
    per = [
        on_host(TRANSFORMS[transform](loss_of(reference)))(xs[b], W, int(limits[b]))
        for b in range(3)
    ]
    # the second derivatives of a sum over elements, each its own
    if transform == "grad_grad":
        expected = (jnp.stack([p[0] for p in per]), sum(p[1] for p in per))
        assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
    else:
        assert tree_allclose(got[1][1], sum(p[1][1] for p in per), rtol=1e-5)
    # and vmap of the second derivative
    one = TRANSFORMS[transform](loss)
    got = jax.jit(jax.vmap(one, (0, None, 0)))(xs, W, limits)
    for b in range(3):
        assert tree_allclose(jax.tree.map(lambda v: v[b], got), per[b], rtol=1e-5)


def _buffer_loop(set_row, loop):
    """A trajectory buffer: row `i` written every step, the previous row read."""

    def f(x, w, n):
        def body(c):
            y, traj, i = c
            prev = jnp.where(i > 0, traj[jnp.maximum(i - 1, 0)], y)
            new = jnp.tanh(w @ prev + 0.1 * y)
            return 0.9 * y + 0.1 * new, set_row(traj, i, new), i + 1

        init = (x, jnp.zeros((8, 3)), jnp.array(0))
        y, traj, _ = loop(lambda c: c[2] < n, body, init)
        return jnp.sum(traj**2) + jnp.sum(y)

    return f


def test_second_order_with_buffers():
    def ours_loop(cond, body, init):
        return bl.while_loop(
            cond, body, init, max_steps=8, checkpoints=2, buffers=lambda c: c[1]
        )

    def ref_loop(n):
        return lambda cond, body, init: scan_loop(body, init, n)

    f = _buffer_loop(lambda b, i, v: b.at[i].set(v), ours_loop)
    for transform in ["grad_grad"]:
        got = jax.jit(TRANSFORMS[transform](lambda x, w, n: f(x, w, n)))(X0, W, 6)
        ref = _buffer_loop(lambda b, i, v: b.at[i].set(v), ref_loop(6))
        expected = on_host(TRANSFORMS[transform](ref))(X0, W, 6)
        assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6), transform


def test_second_order_through_scan_and_fori_loop():
    def by_scan(x, w, n):
        del n
        step = lambda x, _: (jnp.tanh(w @ x + 0.1), None)  # noqa: E731
        return bl.scan(step, x, length=7, checkpoints=2)[0]

    def by_fori(x, w, n):
        del n
        return bl.fori_loop(0, 7, lambda i, x: jnp.tanh(w @ x + 0.1), x, checkpoints=3)

    for f in [by_scan, by_fori]:
        got = jax.jit(grad_of_grad(loss_of(f)))(X0, W, 7)
        expected = on_host(grad_of_grad(loss_of(reference)))(X0, W, 7)
        assert tree_allclose(got, expected, rtol=1e-5)


@pytest.mark.slow
def test_second_order_nested_loops():
    def nested(inner_loop, outer_loop):
        def f(x, w, n):
            def outer_body(c):
                y, i = c
                z, _ = inner_loop(
                    lambda c: c[1] < 3, lambda c: (jnp.sin(w @ c[0]), c[1] + 1), (y, 0)
                )
                return 0.5 * y + 0.5 * z, i + 1

            return outer_loop(lambda c: c[1] < n, outer_body, (x, 0))[0]

        return f

    def ours_loop(cond, body, init):
        return bl.while_loop(cond, body, init, max_steps=6, checkpoints=2)

    def ref_loop(steps):
        return lambda cond, body, init: scan_loop(body, init, steps)

    f = nested(ours_loop, ours_loop)
    ref = nested(ref_loop(3), ref_loop(4))
    got = jax.jit(grad_of_grad(loss_of(f)))(X0, W, 4)
    expected = on_host(grad_of_grad(loss_of(ref)))(X0, W, 4)
    assert tree_allclose(got, expected, rtol=1e-5)


@pytest.mark.slow
def test_stop_gradient_in_the_body():
    def f(x, w, n):
        def body(c):
            x, i = c
            return jnp.tanh(lax.stop_gradient(w) @ x + 0.1 * jnp.sum(w) * x), i + 1

        return bl.while_loop(
            lambda c: c[1] < n, body, (x, 0), max_steps=9, checkpoints=2
        )[0]

    def ref(x, w, n):
        def body(c):
            x, i = c
            return jnp.tanh(lax.stop_gradient(w) @ x + 0.1 * jnp.sum(w) * x), i + 1

        return scan_loop(body, (x, 0), n)[0]

    got = jax.jit(grad_of_grad(loss_of(f)))(X0, W, 6)
    expected = on_host(grad_of_grad(loss_of(ref)))(X0, W, 6)
    assert tree_allclose(got, expected, rtol=1e-5)


def test_body_evaluations_and_memory():
    """`grad(grad)` makes `3G - n` body evaluations (`G` the gradient's), and the
    gradient, `jax.hessian` and `jvp(grad)` make `G` as before; the compiled
    temporary memory of `grad(grad)` does not grow with `max_steps`."""
    counter = Counter()
    n, checkpoints = 25, 4

    def f(x, w, max_steps=64):
        def body(c):
            counter()
            return jnp.tanh(w @ c[0] + 0.1), c[1] + 1

        out = bl.while_loop(
            lambda c: c[1] < n,
            body,
            (x, 0),
            max_steps=max_steps,
            checkpoints=checkpoints,
        )
        return jnp.sum(out[0] ** 2)

    def count(fn, *args):
        counter.reset()
        jax.block_until_ready(fn(*args))
        return counter.count

    g = jax.grad(f)
    evals = gradient_body_evaluations(n, checkpoints)
    assert count(jax.jit(g), X0, W) == evals
    assert count(jax.jit(jax.hessian(f)), X0, W) == evals
    hvp = jax.jit(lambda x, v: jax.jvp(lambda x: g(x, W), (x,), (v,)))
    assert count(hvp, X0, V) == evals

    def gg(x, w, max_steps=64):
        inner = jax.grad(functools.partial(f, max_steps=max_steps))
        return jax.grad(lambda x: jnp.sum(inner(x, w) ** 2))(x)

    assert count(jax.jit(gg), X0, W) == 3 * evals - n

    def temp(max_steps):
        fn = jax.jit(functools.partial(gg, max_steps=max_steps))
        return fn.lower(X0, W).compile().memory_analysis().temp_size_in_bytes

    assert temp(4096) <= 1.1 * temp(64)


def test_third_order():
    """Forward over anything works; a third reverse pass raises a clear error."""
    f = functools.partial(ours, limit=5, max_steps=8, checkpoints=2)
    loss = lambda x: jnp.sum(f(x, W) ** 2)  # noqa: E731
    ref = lambda x: jnp.sum(reference(x, W, 5) ** 2)  # noqa: E731

    def grad_grad(h):
        return jax.grad(lambda x: jnp.sum(jax.grad(h)(x) ** 2))

    for third in [lambda h: jax.jacfwd(grad_grad(h))]:
        got = jax.jit(third(loss))(X0)
        assert tree_allclose(got, on_host(third(ref))(X0), rtol=1e-4, atol=1e-5)
    for third in [lambda h: jax.grad(lambda x: jnp.sum(grad_grad(h)(x)))]:
        with pytest.raises(RuntimeError, match="third order"):
            third(loss)(X0)


def _product_with_rule(twist):
    """`y -> (y0 y1, y0 y1)` with the custom derivative `(y1, twist y0)`: the true
    one at `twist == 1`, the derivative of no function otherwise."""

    @jax.custom_jvp
    def pair(y):
        return jnp.stack([y[0] * y[1], y[0] * y[1]])

    @pair.defjvp
    def rule(primals, tangents):
        (y,), (dy,) = primals, tangents
        d = y[1] * dy[0] + twist * y[0] * dy[1]
        return pair(y), jnp.stack([d, d])

    return pair


# the true rule (1.0) is what every other test here checks: in the long profile
@pytest.mark.parametrize("twist", [pytest.param(1.0, marks=pytest.mark.slow), 2.0])
def test_non_conservative_custom_jvp(twist):
    """The caveat `docs/guides/forward-mode.md` states: reverse over reverse assumes
    a symmetric Hessian. With a non-conservative rule, `jax.hessian` still equals
    JAX's on an unrolled loop and `jacrev(jacrev)` is its transpose."""
    pair = _product_with_rule(twist)

    def body(carry):
        y, i = carry
        return y + 0.1 * jnp.sin(pair(y)), i + 1

    def unrolled(y):
        carry = (y, 0)
        for _ in range(5):
            carry = body(carry)
        return jnp.sum(carry[0] ** 2)

    def loop(y):
        out = bl.while_loop(
            lambda c: c[1] < 5, body, (y, 0), max_steps=8, checkpoints=2
        )
        return jnp.sum(out[0] ** 2)

    y0 = jnp.array([0.4, -0.7])
    hessian = jax.hessian(unrolled)(y0)
    assert tree_allclose(jax.hessian(loop)(y0), hessian, rtol=1e-5)
    assert tree_allclose(jax.jacrev(jax.jacrev(unrolled))(y0), hessian, rtol=1e-5)
    reverse_over_reverse = jax.jacrev(jax.jacrev(loop))(y0)
    assert tree_allclose(reverse_over_reverse, hessian.T, rtol=1e-5)
    symmetric = tree_allclose(hessian, hessian.T, rtol=1e-3)
    assert symmetric == (twist == 1.0)


def test_the_first_order_stands_alone(monkeypatch):
    """`LoopJVP` without `ReverseOverAnything`'s hooks: the same gradient (and
    Hessian, forward over reverse); only a second reverse pass fails, in JAX's
    own rule for `lax.while_loop`, which is what the hooks are for."""
    import boundedloop._autodiff as autodiff
    from boundedloop._autodiff._loop_jvp import LoopJVP

    loss = loss_of(ours)
    grad = jax.grad(loss, argnums=(0, 1))
    hessian = jax.hessian(loss)
    expected = grad(X0, W, 7), hessian(X0, W, 7)
    monkeypatch.setattr(autodiff, "ReverseOverAnything", LoopJVP)
    assert tree_allclose((grad(X0, W, 7), hessian(X0, W, 7)), expected)
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not"):
        grad_of_grad(loss)(X0, W, 7)
