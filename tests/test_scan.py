"""`bl.scan` and `bl.fori_loop` against `lax.scan` / `lax.fori_loop`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import boundedloop as bl
from boundedloop._sweeps._schedule import offline_placement

from .helpers import Counter, on_host, tree_allclose
from .schedule_reference import (
    gradient_body_evaluations,
    optimal_placement_costs,
    placement_cost,
)


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
    (vr, auxr), gr = on_host(
        lambda h, xs: jax.value_and_grad(loss, (0, 1), has_aux=True)(h, xs, lax.scan)
    )(H0, XS)
    assert tree_allclose(aux, auxr) and tree_allclose(v, vr)
    assert tree_allclose(g, gr)


def test_scan_without_xs_and_empty():
    carry, ys = bl.scan(lambda c, _: (c * 2.0, c), jnp.array(1.0), length=4)
    carry_r, ys_r = on_host(
        lambda: lax.scan(lambda c, _: (c * 2.0, c), jnp.array(1.0), length=4)
    )()
    assert tree_allclose((carry, ys), (carry_r, ys_r))
    carry, ys = bl.scan(lambda c, x: (c + x, x), jnp.array(1.0), jnp.zeros((0,)))
    assert float(carry) == 1.0 and ys.shape == (0,)
    with pytest.raises(ValueError, match="length"):
        bl.scan(lambda c, x: (c, x), 0.0, None)


def test_fori_loop():
    body = lambda i, v: jnp.sin(v) * i.astype(jnp.float32) + 0.1  # noqa: E731
    got = jax.grad(lambda v: bl.fori_loop(2, 9, body, v, checkpoints=2))(0.3)
    expected = on_host(jax.grad(lambda v: lax.fori_loop(2, 9, body, v)))(0.3)
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


def _types(tree):
    """Each leaf's value, dtype and weak type."""
    return jax.tree.map(
        lambda a: (a.tolist(), a.dtype, a.weak_type), tree, is_leaf=eqx.is_array
    )


WEAK_CASES = {
    # a Python-float carry that the body makes float32 (issue 39)
    "float_init": (lambda c, x: (c + x, c), 0.0),
    "weak_carry": (lambda c, x: (c + 1.0, c), 0.0),
    "python_float_y": (lambda c, x: (c + x, 1.0), jnp.float32(0)),
    "python_int_y": (lambda c, x: (c + x, 2), jnp.float32(0)),
    # promoted from int to float32, and traced again, as `lax.scan` does
    "int_init": (lambda c, x: (c + x, c), 0),
    "none_y": (lambda c, x: (c + x, None), jnp.float32(0)),
}


@pytest.mark.parametrize("length", [3, 0])
@pytest.mark.parametrize("case", WEAK_CASES)
def test_python_numbers_match_lax_scan(case, length):
    """Results, dtypes and weak types as `lax.scan` gives them, and `f` traced as
    often as `lax.scan` traces it (once, and twice where a weakly typed initial
    value is promoted)."""
    fn, init = WEAK_CASES[case]
    xs = jnp.arange(float(length))
    calls = []

    def counted(c, x):
        calls.append(None)
        return fn(c, x)

    results = {}
    for name, scan in [("lax", lax.scan), ("bl", bl.scan)]:
        calls.clear()
        run = jax.jit(lambda xs: scan(counted, init, xs))
        # the `lax` reference on the host: XLA on a TPU miscompiles some `lax` loops
        results[name] = (on_host(run) if name == "lax" else run)(xs)
        results[name + "_traces"] = len(calls)
    assert _types(results["bl"]) == _types(results["lax"])
    assert results["bl_traces"] == results["lax_traces"]


def test_f_is_traced_once():
    """Under `jit` (and `grad`), `f` is traced once, as by `lax.scan`; with
    `buffers` in the carry twice (once for the shape of `y`)."""
    calls = []

    def g(c, x):
        calls.append(None)
        return jnp.sin(c) + x, c * 2.0

    def loss(h, scan):
        c, ys = scan(g, h, XS[:, 0])
        return c + jnp.sum(ys)

    jax.jit(jax.grad(loss), static_argnums=1).lower(0.5, bl.scan)
    assert len(calls) == 1
    calls.clear()
    jax.jit(
        lambda b: bl.scan(
            lambda c, x: ((g(c[0], x)[0], c[1].at[0].set(x)), c[0]),
            (0.5, b),
            XS[:1, 0],
            buffers=lambda c: c[1],
        )
    ).lower(jnp.zeros(2))
    assert len(calls) == 2


def test_y_must_be_arrays():
    with pytest.raises(TypeError, match="`y`"):
        bl.scan(lambda c, x: (c, "text"), 0.0, XS)
    with pytest.raises(TypeError, match="pair"):
        bl.scan(lambda c, x: c, 0.0, XS)


def test_xs_inside_shard_map():
    """Reading `xs` inside `shard_map` (it failed on the type of the read's dummy)."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("data")

    def per_device(x):
        c, ys = bl.scan(lambda c, x: (c * x, c), x[0, 0], x[0], checkpoints=2)
        return (c + ys.sum())[None]

    def loss(f):
        return lambda x: jnp.sum(f(x))

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)
    x = jnp.linspace(0.9, 1.2, 4)[None]
    got = jax.jit(jax.grad(loss(sharded)))(x)
    assert tree_allclose(got, jax.jit(jax.grad(loss(per_device)))(x))
