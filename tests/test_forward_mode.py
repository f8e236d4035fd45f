"""Forward mode and second order through the checkpointed loop: `jax.jvp`,
`jax.jacfwd`, `jax.linearize`, `jax.jacrev` and `jax.hessian` against the same
transforms of a `lax.scan` over the known trip count."""

import functools

import jax
import jax.numpy as jnp
import pytest

import boundedloop as bl

from .helpers import Counter, on_host, scan_loop, tree_allclose
from .schedule_reference import gradient_body_evaluations


W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
X0 = jnp.array([0.3, -0.2, 0.5])
V = jnp.array([0.7, -1.1, 0.4])


def step(w, x):
    return jnp.tanh(w @ x + 0.1)


def make_body(w):
    def body(carry):
        x, i, limit = carry
        return step(w, x), i + 1, limit

    return body


def cond(carry):
    return carry[1] < carry[2]


def ours(x, w, limit, *, max_steps, checkpoints):
    init = (x, jnp.array(0), jnp.asarray(limit, jnp.int32))
    out = bl.while_loop(
        cond, make_body(w), init, max_steps=max_steps, checkpoints=checkpoints
    )
    return out[0]


def reference(x, w, trips):
    init = (x, jnp.array(0), jnp.array(0))
    return scan_loop(make_body(w), init, trips)[0]


CASES = [
    # (checkpoints, max_steps, limit): checkpoints below, at and above the trip
    # count; max_steps below, at and above the natural trip count
    (1, 10, 6),
    (2, 10, 7),
    (3, 20, 11),
    (8, 8, 8),
    (None, 12, 5),
    (4, 5, 9),
    (3, 10, 0),
]


@functools.cache
def transforms(checkpoints, max_steps):
    """The compiled transforms of one loop; the trip limit is traced."""
    f = functools.partial(ours, max_steps=max_steps, checkpoints=checkpoints)
    loss = lambda x, w, limit: jnp.sum(f(x, w, limit) ** 2)  # noqa: E731
    return {
        "jvp": jax.jit(
            lambda x, w, lim, v, dw: jax.jvp(lambda x, w: f(x, w, lim), (x, w), (v, dw))
        ),
        "jacfwd": jax.jit(jax.jacfwd(f, argnums=(0, 1))),
        "jacrev": jax.jit(jax.jacrev(f, argnums=(0, 1))),
        "hessian": jax.jit(jax.hessian(loss, argnums=(0, 1))),
        "hvp": jax.jit(
            lambda x, w, lim, v: jax.jvp(
                lambda x: jax.grad(loss)(x, w, lim), (x,), (v,)
            )
        ),
    }


def ref_loss(x, w, trips):
    return jnp.sum(reference(x, w, trips) ** 2)


@pytest.mark.parametrize("checkpoints, max_steps, limit", CASES)
def test_transforms_match_scan(checkpoints, max_steps, limit):
    fs = transforms(checkpoints, max_steps)
    n = min(limit, max_steps)
    dw = 0.1 * W.T
    ref = functools.partial(reference, trips=n)

    out, t_out = fs["jvp"](X0, W, limit, V, dw)
    ref_out, ref_t = on_host(lambda: jax.jvp(ref, (X0, W), (V, dw)))()
    assert tree_allclose(out, ref_out)
    assert tree_allclose(t_out, ref_t)

    ref_jac = on_host(jax.jacfwd(ref, argnums=(0, 1)))(X0, W)
    assert tree_allclose(fs["jacfwd"](X0, W, limit), ref_jac)
    assert tree_allclose(fs["jacrev"](X0, W, limit), ref_jac)

    ref_hess = on_host(jax.hessian(ref_loss, argnums=(0, 1)))(X0, W, n)
    assert tree_allclose(fs["hessian"](X0, W, limit), ref_hess, rtol=1e-4, atol=1e-5)

    g, hv = fs["hvp"](X0, W, limit, V)
    ref_g, ref_hv = on_host(
        lambda: jax.jvp(lambda x: jax.grad(ref_loss)(x, W, n), (X0,), (V,))
    )()
    assert tree_allclose(g, ref_g)
    assert tree_allclose(hv, ref_hv, rtol=1e-4, atol=1e-5)


def test_linearize_matches_scan():
    f = functools.partial(ours, limit=7, max_steps=12, checkpoints=3)
    out, f_lin = jax.linearize(f, X0, W)
    ref_out, ref_lin = on_host(jax.linearize)(
        functools.partial(reference, trips=7), X0, W
    )
    assert tree_allclose(out, ref_out)
    dw = 0.2 * jnp.ones_like(W)
    assert tree_allclose(f_lin(V, dw), on_host(ref_lin)(V, dw))
    assert tree_allclose(jax.jit(f_lin)(V, dw), on_host(ref_lin)(V, dw))
    # the transpose of the linearized loop is the reverse sweep
    ct = jnp.array([1.0, -2.0, 0.5])
    assert tree_allclose(
        jax.linear_transpose(f_lin, V, dw)(ct),
        on_host(lambda ct: jax.linear_transpose(ref_lin, V, dw)(ct))(ct),
    )


@pytest.mark.parametrize("checkpoints", [2, None])
def test_vmap_of_forward_mode(checkpoints):
    """Each element stops at its own step and gets its own tangent and Hessian."""
    limits = jnp.array([0, 3, 9])
    xs = jnp.stack([X0, -X0, 0.5 * X0])
    vs = jnp.stack([V, 2 * V, -V])
    f = functools.partial(ours, max_steps=10, checkpoints=checkpoints)

    t_out = jax.jit(
        jax.vmap(lambda x, lim, v: jax.jvp(lambda x: f(x, W, lim), (x,), (v,))[1])
    )(xs, limits, vs)
    hess = jax.jit(jax.vmap(jax.hessian(lambda x, lim: jnp.sum(f(x, W, lim) ** 2))))(
        xs, limits
    )
    # nested vmaps: jacrev is a vmap over cotangents inside the vmap over elements
    jac = jax.jit(jax.vmap(jax.jacrev(lambda x, lim: f(x, W, lim))))(xs, limits)
    for k in range(3):
        n = int(limits[k])
        ref = functools.partial(reference, w=W, trips=n)
        ref_t = on_host(lambda x, v: jax.jvp(ref, (x,), (v,))[1])(xs[k], vs[k])
        assert tree_allclose(t_out[k], ref_t)
        assert tree_allclose(jac[k], on_host(jax.jacfwd(ref))(xs[k]))
        ref_h = on_host(jax.hessian(lambda x: jnp.sum(ref(x) ** 2)))(xs[k])
        assert tree_allclose(hess[k], ref_h, rtol=1e-4, atol=1e-5)


def test_jvp_of_vmap_with_unbatched_tangent():
    limits = jnp.array([2, 6])
    f = functools.partial(ours, max_steps=8, checkpoints=2)
    batched = lambda w: jax.vmap(lambda lim: f(X0, w, lim))(limits)  # noqa: E731
    dw = 0.3 * W
    _, t_out = jax.jvp(batched, (W,), (dw,))
    for k, n in enumerate([2, 6]):
        ref = functools.partial(reference, X0, trips=n)
        ref_t = on_host(lambda: jax.jvp(ref, (W,), (dw,))[1])()
        assert tree_allclose(t_out[k], ref_t)


def test_scan_forward_mode():
    def f(x, w):
        def body(c, a):
            c = step(w, c) * a
            return c, jnp.sum(c)

        return bl.scan(body, x, jnp.linspace(0.5, 1.5, 9), checkpoints=3)

    def ref(x, w):
        def body(c, a):
            c = step(w, c) * a
            return c, jnp.sum(c)

        return jax.lax.scan(body, x, jnp.linspace(0.5, 1.5, 9))

    ref_t = on_host(lambda: jax.jvp(ref, (X0, W), (V, W))[1])()
    assert tree_allclose(jax.jvp(f, (X0, W), (V, W))[1], ref_t)
    ref_jac = on_host(jax.jacfwd(ref))(X0, W)
    assert tree_allclose(jax.jit(jax.jacfwd(f))(X0, W), ref_jac)
    loss = lambda x: jnp.sum(f(x, W)[1] ** 2)  # noqa: E731
    ref_loss_ = lambda x: jnp.sum(ref(x, W)[1] ** 2)  # noqa: E731
    ref_h = on_host(jax.hessian(ref_loss_))(X0)
    assert tree_allclose(jax.jit(jax.hessian(loss))(X0), ref_h, rtol=1e-4, atol=1e-5)


class Decay(bl.LoopModule):
    w: jax.Array
    limit: int

    def cond(self, carry):
        return carry[1] < self.limit

    def body(self, carry):
        x, i = carry
        return step(self.w, x), i + 1


def test_loop_module_forward_mode():
    def f(w, x):
        module = Decay(w, 6)
        return module.run((x, jnp.array(0)), max_steps=10, checkpoints=2)[0]

    def ref(w, x):
        return reference(x, w, 6)

    _, t_out = bl.filter_jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(W, X0, 0.1 * W, V)
    ref_t = on_host(lambda: jax.jvp(ref, (W, X0), (0.1 * W, V))[1])()
    assert tree_allclose(t_out, ref_t)
    hess = bl.filter_jit(jax.hessian(lambda x: jnp.sum(f(W, x) ** 2)))(X0)
    ref_h = on_host(jax.hessian(lambda x: jnp.sum(ref(W, x) ** 2)))(X0)
    assert tree_allclose(hess, ref_h, rtol=1e-4, atol=1e-5)


def test_forward_mode_with_buffers():
    rows = 6

    def body(carry):
        x, buf, i, n = carry
        prev = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], x)
        new = step(W, prev) * x
        return x, buf.at[i].set(new), i + 1, n

    def f(x, buf0):
        init = (x, buf0, jnp.array(0), jnp.array(4))
        out = bl.while_loop(
            lambda c: c[2] < c[3],
            body,
            init,
            max_steps=rows,
            checkpoints=2,
            buffers=lambda c: c[1],
        )
        return out[1]

    def ref(x, buf0):
        # the same body: a `Buffer` and an array share `buf[i]` and `.at[i].set`
        return scan_loop(body, (x, buf0, jnp.array(0), jnp.array(4)), 4)[1]

    buf0 = jnp.zeros((rows, 3))
    t_buf = jnp.ones((rows, 3))
    _, t_out = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(X0, buf0, V, t_buf)
    _, ref_t = on_host(lambda: jax.jvp(ref, (X0, buf0), (V, t_buf)))()
    assert tree_allclose(t_out, ref_t)
    jac = jax.jit(jax.jacfwd(f))(X0, buf0)
    assert tree_allclose(jac, on_host(jax.jacrev(ref))(X0, buf0))
    loss = lambda x: jnp.sum(f(x, buf0) ** 2)  # noqa: E731
    ref_l = lambda x: jnp.sum(ref(x, buf0) ** 2)  # noqa: E731
    ref_h = on_host(jax.hessian(ref_l))(X0)
    assert tree_allclose(jax.jit(jax.hessian(loss))(X0), ref_h, rtol=1e-4, atol=1e-5)


def test_forward_mode_is_one_pass():
    """`jax.jvp` and `jax.jacfwd` take each step once, primal and tangent together
    (as `lax.while_loop`'s JVP does); `jax.linearize` and `jax.grad` run the
    checkpointed forward instead, whether the loop is jitted, under `jax.checkpoint`
    or neither."""
    counter = Counter()

    def body(carry):
        x, i, limit = carry
        counter()
        return step(W, x), i + 1, limit

    def f(x):
        init = (x, jnp.array(0), jnp.array(7))
        return bl.while_loop(cond, body, init, max_steps=64, checkpoints=2)[0]

    def loss(x):
        return jnp.sum(f(x))

    def count(fn, *args):
        counter.reset()
        jax.block_until_ready(fn(*args))
        return counter.count

    assert count(jax.jit(lambda x, v: jax.jvp(f, (x,), (v,))), X0, V) == 7
    assert count(jax.jit(jax.jacfwd(f)), X0) == 7
    assert count(lambda x, v: jax.jvp(f, (x,), (v,)), X0, V) == 7
    # linearize: the checkpointed forward, then the tangent loop replays the steps
    assert count(lambda x, v: jax.linearize(f, x)[1](v), X0, V) == 14
    # grad linearizes and transposes: the checkpointed forward and the reverse sweep
    evals = gradient_body_evaluations(7, 2)
    assert count(jax.jit(jax.grad(loss)), X0) == evals
    assert count(jax.grad(jax.jit(loss)), X0) == evals
    ref = on_host(jax.grad(lambda x: jnp.sum(reference(x, W, 7))))(X0)
    for g in (jax.grad(jax.jit(loss)), jax.jit(jax.grad(jax.checkpoint(loss)))):
        assert tree_allclose(g(X0), ref, rtol=1e-5, atol=1e-6)


def test_forward_over_forward():
    """`jacfwd(jacfwd(f))`: the JVP rule of the loop's tangent primitive."""
    f = functools.partial(ours, w=W, limit=6, max_steps=10, checkpoints=2)
    ref = functools.partial(reference, w=W, trips=6)
    hess = jax.jit(jax.jacfwd(jax.jacfwd(lambda x: jnp.sum(f(x) ** 2))))(X0)
    ref_hess = on_host(jax.hessian(lambda x: jnp.sum(ref(x) ** 2)))(X0)
    assert tree_allclose(hess, ref_hess, rtol=1e-4, atol=1e-5)


DT = 0.1


def solver_body(nondiff, w):
    """A solver-like step: the time `t` and step size `dt` are scalars the step
    guards from differentiation with `nondiff` (diffrax uses
    `equinox.internal.nondifferentiable`), next to a differentiated scalar `y`."""

    def body(carry):
        t, y, dt = carry
        return nondiff(t) + dt, y + nondiff(dt) * jnp.tanh(w * y), dt

    return body


@pytest.mark.parametrize("checkpoints", [1, 3, None])
def test_second_order_with_nondifferentiable_scalars(checkpoints):
    """`t`, `y` and `dt` are scalars of one dtype, stored in the checkpoints next
    to each other; only `y` is differentiated. Under `jax.hessian` the stored
    checkpoints get tangents, and `t` and `dt` must come back from them without
    one: `nondifferentiable` raises on any tangent that is not symbolically zero."""
    from equinox.internal import nondifferentiable

    def run(w, y0):
        init = (jnp.array(0.0), y0, jnp.array(DT))
        out = bl.while_loop(
            lambda c: c[0] < 1.0 - DT / 2,
            solver_body(nondifferentiable, w),
            init,
            max_steps=50,
            checkpoints=checkpoints,
        )
        return out[1]

    def ref(w, y0):
        init = (jnp.array(0.0), y0, jnp.array(DT))
        return scan_loop(solver_body(jax.lax.stop_gradient, w), init, 10)[1]

    args = (jnp.array(0.7), jnp.array(0.3))
    v = (jnp.array(1.0), jnp.array(-0.5))
    assert tree_allclose(run(*args), on_host(ref)(*args))
    for transform in [
        lambda f: jax.grad(f, argnums=(0, 1)),
        lambda f: lambda *a: jax.jvp(f, a, v),
        lambda f: jax.hessian(f, argnums=(0, 1)),
        lambda f: jax.jit(jax.hessian(f, argnums=(0, 1))),
        lambda f: lambda *a: jax.jvp(jax.grad(f, argnums=(0, 1)), a, v),
    ]:
        assert tree_allclose(transform(run)(*args), on_host(transform(ref))(*args))
