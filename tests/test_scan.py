"""`bl.scan` and `bl.fori_loop` against `lax.scan` / `lax.fori_loop`."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import boundedloop as bl
from boundedloop._schedule import (
    gradient_body_evaluations,
    offline_placement,
    optimal_placement_costs,
    placement_cost,
)

from .helpers import Counter, tree_allclose


W = jnp.array([[0.8, -0.3], [0.4, 0.9]])


def f(carry, x):
    h, t = carry
    h = jnp.tanh(W @ h + x)
    return (h, t + 1), h * 2.0


XS = jnp.linspace(-1.0, 1.0, 26).reshape(13, 2)
H0 = jnp.array([0.1, -0.2])


@pytest.mark.parametrize("checkpoints", [1, 2, 3, 13, None])
def test_scan_values_and_gradients(checkpoints):
    def loss(h, xs, scan):
        (h, t), ys = scan(f, (h, 0), xs)
        return jnp.sum(h) + jnp.sum(ys**2), (h, t, ys)

    ours = lambda f_, init, xs: bl.scan(f_, init, xs, checkpoints=checkpoints)  # noqa: E731
    (v, aux), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(H0, XS, ours)
    (vr, auxr), gr = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        H0, XS, lax.scan
    )
    assert tree_allclose(aux, auxr) and tree_allclose(v, vr)
    assert tree_allclose(g, gr)


def test_scan_without_xs_and_empty():
    carry, ys = bl.scan(lambda c, _: (c * 2.0, c), jnp.array(1.0), length=4)
    carry_r, ys_r = lax.scan(lambda c, _: (c * 2.0, c), jnp.array(1.0), length=4)
    assert tree_allclose((carry, ys), (carry_r, ys_r))
    carry, ys = bl.scan(lambda c, x: (c + x, x), jnp.array(1.0), jnp.zeros((0,)))
    assert float(carry) == 1.0 and ys.shape == (0,)
    with pytest.raises(ValueError, match="length"):
        bl.scan(lambda c, x: (c, x), 0.0, None)


def test_fori_loop():
    body = lambda i, v: jnp.sin(v) * i.astype(jnp.float32) + 0.1  # noqa: E731
    got = jax.grad(lambda v: bl.fori_loop(2, 9, body, v, checkpoints=2))(0.3)
    expected = jax.grad(lambda v: lax.fori_loop(2, 9, body, v))(0.3)
    assert tree_allclose(got, expected)
    with pytest.raises(TypeError, match="Python int"):
        jax.jit(lambda n: bl.fori_loop(0, n, body, 0.3))(3)


def test_offline_placement_is_optimal():
    for c in [1, 2, 3, 4, 6, 8]:
        best = optimal_placement_costs(400, c)
        for n in range(1, 401):
            assert placement_cost(offline_placement(n, c), n, c) == best[n]


@pytest.mark.parametrize("n,c", [(10, 2), (30, 3), (57, 4), (100, 8)])
def test_scan_body_evaluations_are_optimal(n, c):
    counter = Counter()

    def g(h, x):
        counter(x)
        return jnp.sin(h) + 0.01 * x.astype(jnp.float32), None

    def loss(h):
        return bl.scan(g, h, jnp.arange(n), checkpoints=c)[0]

    jax.block_until_ready(jax.jit(jax.grad(loss))(0.5))
    assert counter.count == 2 * n + optimal_placement_costs(n, c)[n]
    # and never worse than the online placement of a while loop
    assert counter.count <= gradient_body_evaluations(n, c)
