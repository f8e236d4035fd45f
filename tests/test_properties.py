"""Property tests: random trip counts, bounds, checkpoint counts and carries."""

import equinox as eqx
import jax
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

import boundedloop as bl

from .helpers import scan_loop, tree_allclose


def body(carry):
    x, d, i = carry
    return (
        jnp.sin(x) * 1.2 + 0.05 * i.astype(jnp.float32),
        {"a": d["a"] * 0.9 + jnp.sum(x), "flag": ~d["flag"]},
        i + 1,
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    trips=st.integers(0, 20),
    max_steps=st.integers(1, 24),
    checkpoints=st.one_of(st.none(), st.integers(1, 9)),
    width=st.integers(1, 3),
    vmapped=st.booleans(),
)
def test_loop_matches_scan(trips, max_steps, checkpoints, width, vmapped):
    x0 = jnp.linspace(-0.5, 0.7, width)
    init = (x0, {"a": jnp.array(0.3), "flag": jnp.array(False)}, jnp.array(0))

    def ours(init, limit):
        return bl.while_loop(
            lambda c: c[2] < limit,
            body,
            init,
            max_steps=max_steps,
            checkpoints=checkpoints,
        )

    def loss(f, init, *args):
        x, d, _ = f(init, *args)
        return jnp.sum(x**2) + d["a"]

    n = min(trips, max_steps)
    ref_value = scan_loop(body, init, n)
    ref_grad = eqx.filter_grad(lambda i: loss(lambda c: scan_loop(body, c, n), i))(init)
    if vmapped:
        limits = jnp.array([trips, max(trips - 3, 0)])
        inits = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), init)
        grads = jax.vmap(eqx.filter_grad(lambda i, lim: loss(ours, i, lim)))(
            inits, limits
        )
        grad = jax.tree_util.tree_map(lambda g: g[0], grads)
        value = jax.tree_util.tree_map(lambda v: v[0], jax.vmap(ours)(inits, limits))
    else:
        value = ours(init, trips)
        grad = eqx.filter_grad(lambda i: loss(ours, i, trips))(init)
    assert tree_allclose(value, ref_value)
    assert tree_allclose(grad, ref_grad)
