"""`bl.while_loop` against `lax.while_loop` (values) and `lax.scan` (gradients)."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import boundedloop as bl
from boundedloop._sweeps import _cost_model
from boundedloop._sweeps._schedule import offline_placement

from .helpers import (
    Counter,
    equal_to_host,
    on_host,
    python_while,
    scan_loop,
    tree_allclose,
    tree_equal,
)
from .schedule_reference import gradient_body_evaluations, placement_cost


W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])


def body(carry):
    x, step, limit = carry
    return jnp.tanh(W @ x + 0.1), step + 1, limit


def cond(carry):
    _, step, limit = carry
    return step < limit


def init(x, limit):
    return x, jnp.array(0), jnp.asarray(limit, jnp.int32)


X0 = jnp.array([0.3, -0.2, 0.5])


@functools.cache
def grad_fn(max_steps, checkpoints):
    """One compiled gradient per (max_steps, checkpoints); the trip count is traced."""

    def loss(x, w, limit):
        def _body(carry):
            x, step, limit = carry
            return jnp.tanh(w @ x + 0.1), step + 1, limit

        out = bl.while_loop(
            cond,
            _body,
            init(x, limit),
            max_steps=max_steps,
            checkpoints=checkpoints,
        )
        return jnp.sum(out[0] ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def reference_grad(x, w, trips):
    def loss(x, w):
        def _body(carry):
            x, step, limit = carry
            return jnp.tanh(w @ x + 0.1), step + 1, limit

        return jnp.sum(scan_loop(_body, init(x, 0), trips)[0] ** 2)

    return on_host(jax.grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("max_steps", [0, 1, 5, 8, 13, 40])
@pytest.mark.parametrize("limit", [0, 1, 4, 8, 20])
def test_forward_matches_lax(max_steps, limit):
    out = bl.while_loop(cond, body, init(X0, limit), max_steps=max_steps)
    trips = min(limit, max_steps)
    expected = on_host(
        lambda: lax.while_loop(
            lambda c: (c[1] < trips) & cond(c), body, init(X0, limit)
        )
    )()
    assert equal_to_host(out, expected)
    assert int(out[1]) == trips
    expected_py, steps = python_while(cond, body, init(X0, limit), max_steps)
    assert steps == trips
    assert tree_allclose(out, expected_py)


def test_forward_matches_lax_under_jit():
    f = jax.jit(lambda x: bl.while_loop(cond, body, init(x, 7), max_steps=100))
    expected = on_host(lambda: lax.while_loop(cond, body, init(X0, 7)))()
    assert equal_to_host(f(X0), expected)


# by default, per `max_steps`, counts below, at and above it, and the default;
# each case crosses trip counts 0 to 20 with them (`-m slow`: the whole grid)
QUICK_GRID = {(3, 1), (3, 8), (3, None), (8, 2), (8, 8), (13, 3), (13, None)}
QUICK_GRID |= {(30, 1), (30, 2), (30, 8)}


@pytest.mark.parametrize(
    "checkpoints, max_steps",
    [
        pytest.param(
            checkpoints,
            max_steps,
            marks=() if (max_steps, checkpoints) in QUICK_GRID else pytest.mark.slow,
        )
        for max_steps in [3, 8, 13, 30]
        for checkpoints in [1, 2, 3, 8, None]
    ],
)
def test_gradient_matches_scan(checkpoints, max_steps):
    f = grad_fn(max_steps, checkpoints)
    for limit in [0, 1, 2, 3, 5, 8, 9, 13, 20]:
        trips = min(limit, max_steps)
        got = f(X0, W, limit)
        expected = reference_grad(X0, W, trips)
        assert tree_allclose(got, expected), (limit, got, expected)


def _while_loops(jaxpr) -> int:
    return sum(
        (eqn.primitive.name == "while")
        + sum(map(_while_loops, jax.extend.core.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


@pytest.mark.parametrize("one_loop", [False, True], ids=["plain", "one loop"])
def test_costly_bodies_get_compact_reverse_sweeps(monkeypatch, one_loop):
    """Bodies whose steps are not cheap (see `_cost_model`) are reversed one step per
    iteration with one recomputation loop, whose last store event advances to the
    end of the segment, or, costlier still, in one loop that shares one evaluation of
    the step between advancing and reversing (fewer loops and copies of the step to
    compile): the same schedule, so the same body evaluations, and the same
    gradients, batched too."""
    counter = Counter()

    def gradient():  # a new function each time: traced afresh
        def loss(x, w, limit, checkpoints):
            def _body(carry):
                x, step, limit = carry
                counter()
                return jnp.tanh(w @ x + 0.1), step + 1, limit

            out = bl.while_loop(
                cond, _body, init(x, limit), max_steps=30, checkpoints=checkpoints
            )
            return jnp.sum(out[0] ** 2)

        return jax.grad(loss, argnums=(0, 1))

    def loops():
        return _while_loops(
            jax.make_jaxpr(gradient(), static_argnums=3)(X0, W, 5, 3).jaxpr
        )

    fast = loops()
    monkeypatch.setattr(_cost_model, "SMALL_BODY", 0)
    monkeypatch.setattr(_cost_model, "LIGHT_WORK", 0)
    monkeypatch.setattr(_cost_model, "shares_one_step", lambda body: False)
    # the reverse's three fewer; the forward's loops are the same
    plain = loops()
    assert plain == fast - 3
    monkeypatch.setattr(_cost_model, "shares_one_step", lambda body: one_loop)
    if one_loop:
        # fewer still where the split is arithmetic, as on a TPU (a CPU's split of a
        # small loop is a loop, in each of the two branches that look it up)
        monkeypatch.setattr(_cost_model, "runs_in_order", lambda *args: False)
        monkeypatch.setattr(_cost_model, "shares_one_step", lambda body: False)
        plain = loops()
        monkeypatch.setattr(_cost_model, "shares_one_step", lambda body: True)
        assert loops() < plain
    for checkpoints in [1, 2, 3, 8]:
        f = jax.jit(gradient(), static_argnums=3)
        for limit in [0, 1, 5, 13, 30]:
            counter.reset()
            got = jax.block_until_ready(f(X0, W, limit, checkpoints))
            assert counter.count == gradient_body_evaluations(limit, checkpoints)
            assert tree_allclose(got, reference_grad(X0, W, limit)), limit
        limits = jnp.array([0, 3, 11, 6, 1])
        batched = jax.vmap(f, in_axes=(None, None, 0, None))(X0, W, limits, checkpoints)
        for b in range(len(limits)):
            expected = reference_grad(X0, W, int(limits[b]))
            assert tree_allclose(jax.tree.map(lambda g: g[b], batched), expected)


def test_a_heavy_step_gets_one_loop_on_a_tpu(monkeypatch):
    """A step of few equations and much work (a 4 x 512 by 512 x 512 product) gets
    the reverse sweep as one loop on a TPU and the plain one elsewhere
    (`_cost_model.shares_one_step`): two loops fewer than the plain sweep's, five
    fewer than the nested one's; either way its gradient matches `lax.scan`'s over
    the trip count."""
    w = jax.random.normal(jax.random.key(0), (512, 512)) / 24
    x0 = jax.random.normal(jax.random.key(1), (4, 512))

    def loss(w, x, n, scan_length=None):
        def body(c):
            return c[0] + 1, jnp.tanh(c[1] @ w)

        if scan_length is not None:
            return jnp.sum(scan_loop(body, (0, x), scan_length)[1] ** 2)
        out = bl.while_loop(
            lambda c: c[0] < n, body, (0, x), max_steps=16, checkpoints=3
        )
        return jnp.sum(out[1] ** 2)

    def rule(cheap, one_loop):
        monkeypatch.setattr(_cost_model, "is_cheap", cheap)
        monkeypatch.setattr(_cost_model, "shares_one_step", one_loop)

    def loops(*rules):  # a new function each time: traced afresh
        rule(*rules)
        grad = jax.grad(lambda *args: loss(*args))
        return _while_loops(jax.make_jaxpr(grad)(w, x0, 5).jaxpr)

    cheap, one_loop = _cost_model.is_cheap, _cost_model.shares_one_step
    on_tpu = functools.partial(one_loop, backend="tpu")
    nested = loops(lambda body: True, lambda body: False)
    plain = loops(lambda body: False, lambda body: False)
    on_cpu = functools.partial(one_loop, backend="cpu")
    assert loops(cheap, on_tpu) == plain - 2 == nested - 5
    assert loops(cheap, on_cpu) == plain
    for shares in [on_tpu, on_cpu]:
        rule(cheap, shares)
        f = jax.jit(jax.grad(lambda *args: loss(*args)))
        for n in [0, 1, 5, 11, 16]:
            reference = jax.grad(functools.partial(loss, scan_length=n))
            expected = on_host(reference)(w, x0, n)
            assert tree_allclose(f(w, x0, n), expected, rtol=1e-4, atol=1e-5), n


@pytest.mark.parametrize("checkpoints", [1, 3, None])
def test_gradient_unbounded(checkpoints):
    """`max_steps=None` with `checkpoints=None` takes the documented default."""
    f = grad_fn(None, checkpoints)
    for limit in [0, 1, 7, 30]:
        assert tree_allclose(f(X0, W, limit), reference_grad(X0, W, limit))


def test_vmap_per_element_trip_counts():
    limits = jnp.array([0, 3, 11, 6, 1])
    xs = jnp.stack([X0 * s for s in [1.0, -0.5, 0.3, 2.0, 0.7]])
    for checkpoints in [1, 3, 16]:
        f = grad_fn(16, checkpoints)
        got = jax.vmap(f, in_axes=(0, None, 0))(xs, W, limits)
        for b in range(len(limits)):
            expected = reference_grad(xs[b], W, int(limits[b]))
            assert tree_allclose(got[0][b], expected[0])
            assert tree_allclose(got[1][b], expected[1])


def test_vmap_forward_matches_lax():
    limits = jnp.array([0, 3, 11, 6])
    xs = jnp.stack([X0 * s for s in [1.0, -0.5, 0.3, 2.0]])

    def ours(x, limit):
        return bl.while_loop(cond, body, init(x, limit), max_steps=8)

    def theirs(x, limit):
        return lax.while_loop(lambda c: (c[1] < 8) & cond(c), body, init(x, limit))

    expected = on_host(jax.vmap(theirs))(xs, limits)
    assert equal_to_host(jax.vmap(ours)(xs, limits), expected)


def test_vmap_schedule_is_not_batched():
    """The step counter and checkpoint bookkeeping stay unbatched under vmap."""

    def loss(x):
        out = bl.while_loop(
            lambda x: x[0] < 5.0, lambda x: x + 1.0, x, max_steps=64, checkpoints=4
        )
        return jnp.sum(out**2)

    xs = jnp.stack([X0, X0 - 3.0])
    text = str(jax.make_jaxpr(jax.vmap(jax.grad(loss)))(xs))
    # the only integers are the shared counters/positions (i32[] and i32[4]) and
    # the per-element trip counts (i32[2]); nothing of shape i32[2,4]
    assert "i32[4]" in text and "i32[2]" in text
    assert "i32[2,4]" not in text
    got = jax.vmap(jax.grad(loss))(xs)
    expected = jnp.stack(
        [
            jax.grad(lambda x: jnp.sum((x + 5.0) ** 2))(X0),
            jax.grad(lambda x: jnp.sum((x + 8.0) ** 2))(X0 - 3.0),
        ]
    )
    assert tree_allclose(got, expected)


def test_gradient_wrt_closed_over_and_python_float():
    def loss(scale, x):
        def _body(c):
            x, i = c
            return jnp.sin(x) * scale, i + 1

        out = bl.while_loop(
            lambda c: c[1] < 6, _body, (x, 0), max_steps=50, checkpoints=2
        )
        return jnp.sum(out[0])

    def ref(scale, x):
        return jnp.sum(
            scan_loop(lambda c: (jnp.sin(c[0]) * scale, c[1] + 1), (x, 0), 6)[0]
        )

    for scale in [1.2, jnp.array(1.2)]:
        got = jax.grad(loss, argnums=(0, 1))(scale, X0)
        assert tree_allclose(got, on_host(jax.grad(ref, argnums=(0, 1)))(scale, X0))


def test_integer_bool_none_and_static_leaves():
    def _body(c):
        return {
            "x": c["x"] * 1.5,
            "i": c["i"] + 1,
            "flag": ~c["flag"],
            "nothing": None,
            "name": c["name"],
        }

    def loss(x):
        carry = {"x": x, "i": 0, "flag": jnp.array(True), "nothing": None, "name": "a"}
        out = bl.while_loop(lambda c: c["i"] < 4, _body, carry, max_steps=9)
        assert out["name"] == "a" and out["nothing"] is None
        return jnp.sum(out["x"]), out

    (value, out), grad = jax.value_and_grad(loss, has_aux=True)(X0)
    assert tree_allclose(grad, jnp.full(3, 1.5**4))
    assert int(out["i"]) == 4 and bool(out["flag"])


def test_steps_past_the_end_do_not_poison_gradients():
    def _body(c):
        x, i, n = c
        # finite for the steps taken, NaN/inf for any step past the natural end
        return jnp.where(i >= n, jnp.nan, jnp.log(x) * 2.0), i + 1, n

    def loss(x, n):
        out = bl.while_loop(
            lambda c: c[1] < c[2], _body, (x, 0, n), max_steps=10, checkpoints=3
        )
        return out[0]

    ref = jax.grad(
        lambda x: scan_loop(
            lambda c: (jnp.log(c[0]) * 2.0, c[1] + 1, c[2]), (x, 0, 0), 2
        )[0]
    )
    xs, ns = jnp.array([3.0, 4.0, 5.0]), jnp.array([2, 2, 2])
    got = jax.vmap(jax.grad(loss))(xs, ns)
    assert np.all(np.isfinite(got))
    assert tree_allclose(got, on_host(jax.vmap(ref))(xs))
    ns = jnp.array([1, 3, 2])
    got = jax.vmap(jax.grad(loss))(xs, ns)
    assert np.all(np.isfinite(got))


def test_value_and_grad_and_jacrev():
    def f(x):
        return bl.while_loop(cond, body, init(x, 5), max_steps=10, checkpoints=2)[0]

    def g(x):
        return scan_loop(body, init(x, 5), 5)[0]

    assert tree_allclose(jax.jacrev(f)(X0), on_host(jax.jacrev(g))(X0))
    v1, g1 = jax.value_and_grad(lambda x: jnp.sum(f(x)))(X0)
    v2, g2 = on_host(jax.value_and_grad(lambda x: jnp.sum(g(x))))(X0)
    assert tree_allclose((v1, g1), (v2, g2))


def test_unbounded_gradient_stores_where_the_rule_says():
    """With no bound the forward decides its stores as it runs: the compiled loop
    stores where `forward_placement` says (its body evaluations match the model's),
    the gradient is right, and the evaluations stay near the optimum."""
    counter = Counter()
    w = jnp.array([[0.9, -0.4], [0.2, 0.8]])

    def body(carry):
        x, i, n = carry
        counter()
        return jnp.tanh(w @ x + 0.1), i + 1, n

    def loss(x, n, slots):
        init = (x, jnp.array(0), n)
        out = bl.while_loop(
            lambda c: c[1] < c[2], body, init, max_steps=None, checkpoints=slots
        )
        return jnp.sum(out[0] ** 2)

    def reference(x, n):
        init = (x, jnp.array(0), jnp.array(n))
        return jnp.sum(scan_loop(body, init, n)[0] ** 2)

    x = jnp.array([0.3, -0.5])
    for slots in (3, 6):
        grad = jax.jit(jax.grad(loss), static_argnums=2)
        for n in (20, 40, 100, 300):
            counter.reset()
            g = jax.block_until_ready(grad(x, jnp.array(n), slots))
            assert counter.count == gradient_body_evaluations(n, slots)
            optimum = 2 * n + placement_cost(offline_placement(n, slots), n, slots)
            assert counter.count <= 1.06 * optimum
            counter.reset()
            expected = on_host(jax.grad(reference))(x, n)
            assert tree_allclose(g, expected, rtol=1e-5, atol=1e-6)


def _solver_like_step(carry):
    """A step carrying many scalars of several dtypes, as a solver state does."""
    y, t, dt, scale, n, accepted, done = carry
    y = y + dt * jnp.tanh(W @ y) * scale
    return (
        y,
        t + dt,
        dt * (1.0 + 0.05 * jnp.sum(y)),
        scale * 0.99,
        n + 1,
        accepted + (jnp.sum(y) > 0).astype(jnp.int32),
        n + 1 >= 6,
    )


def test_scalar_leaves_are_stored_packed_and_loaded_exactly():
    """Checkpoint storage packs the carry's integer and boolean scalars that share a
    dtype into one array, so that a store writes one array per dtype; loading gives
    every leaf back with its dtype and shape. Floating scalars keep arrays of their
    own, so that each keeps its own tangent under forward over reverse."""
    from boundedloop._sweeps import _checkpoint_store

    carry = (X0, jnp.float32(0.5), jnp.float32(0.25), jnp.int32(3), jnp.array(True))
    carry = carry + (jnp.ones((1, 2)), jnp.float32(-1.5), jnp.int32(-4), jnp.uint8(2))
    carry = carry + (jnp.array(False),)
    storage = _checkpoint_store.empty(carry, 4)
    # a dtype with a single scalar (uint8 here) is not packed
    assert sorted(storage.packed) == ["bool", "int32"]
    assert storage.packed["int32"].shape == (4, 2)
    packed = [a is None for a in storage.arrays]
    assert packed == [False] * 3 + [True] * 2 + [False] * 2 + [True, False, True]
    stored = _checkpoint_store.store(storage, 2, carry)
    loaded = _checkpoint_store.load(stored, 2)
    assert tree_equal(loaded, carry)
    assert [(v.dtype, v.shape) for v in loaded] == [(v.dtype, v.shape) for v in carry]
    # a store that is not due leaves the row as it was
    kept = _checkpoint_store.store(
        stored, 2, jax.tree.map(jnp.zeros_like, carry), when=False
    )
    assert tree_equal(_checkpoint_store.load(kept, 2), carry)


@pytest.mark.parametrize("checkpoints", [1, 2, 3, 5, 8])
def test_gradient_through_a_carry_of_many_scalars(checkpoints):
    """Gradients through differentiated scalar leaves (time, step size, scale)
    packed next to integer and boolean ones, across trip counts and checkpoint
    counts that cross each other, with `vmap`."""

    def loss(f):
        def run(y0, dt, scale):
            carry = (y0, jnp.float32(0.0), dt, scale, jnp.int32(0), jnp.int32(0))
            out = f(carry + (jnp.array(False),))
            y, t, dt, scale = out[:4]
            return jnp.sum(y**2) + t * scale + dt

        return run

    def ours(carry):
        return bl.while_loop(
            lambda c: ~c[6],
            _solver_like_step,
            carry,
            max_steps=8,
            checkpoints=checkpoints,
        )

    args = (X0, jnp.float32(0.1), jnp.float32(1.2))
    expected = on_host(
        jax.grad(loss(lambda c: scan_loop(_solver_like_step, c, 6)), (0, 1, 2))
    )
    got = jax.jit(jax.grad(loss(ours), (0, 1, 2)))
    assert tree_allclose(got(*args), expected(*args))
    ys = jnp.stack([X0, -X0, 2 * X0])
    batched = jax.vmap(got, in_axes=(0, None, None))(ys, *args[1:])
    for b in range(3):
        want = expected(ys[b], *args[1:])
        assert tree_allclose(jax.tree.map(lambda g: g[b], batched), want)


def _keyed_carry(x, key, limit=10, s=0.5):
    # two typed keys (scalars of one extended dtype) next to a float32 scalar
    carry = (key, jax.random.key(7), x, jnp.float32(s), jnp.zeros(20))
    return carry + (jnp.array(0), jnp.int32(limit))


def _keyed_step(carry):
    key, other, x, s, buf, i, limit = carry
    key, sub = jax.random.split(key)
    other, sub2 = jax.random.split(other)
    x = x * (1.0 + 0.1 * jax.random.normal(sub, x.shape)) + s
    s = s * jax.random.uniform(sub2, minval=0.5, maxval=1.0)
    return key, other, x, s, buf.at[i].set(jnp.sum(x)), i + 1, limit


def _keyed_cond(carry):
    return carry[5] < carry[6]


def _key_data(tree):
    """`tree` with its typed PRNG keys as their raw `uint32` data, to compare."""
    is_key = lambda v: jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended)  # noqa: E731
    return jax.tree.map(lambda v: jax.random.key_data(v) if is_key(v) else v, tree)


BUFFERS = {"no buffers": None, "buffers": lambda c: c[4]}


@pytest.mark.parametrize(
    "buffers",
    [
        pytest.param(b, id=name, marks=pytest.mark.slow if b is not None else ())
        for name, b in BUFFERS.items()
    ],
)
def test_typed_prng_keys_in_the_carry(buffers):
    """New-style typed keys (`jax.random.key`) are carried as by `lax.while_loop`:
    forward values bit for bit, under `vmap`, and gradients with respect to the
    floating leaves equal to `lax.scan`'s with fewer checkpoints than steps (typed
    keys are stored in their own arrays, never packed with other scalars); the keys
    get no tangents."""
    key = jax.random.key(0)

    def ours(carry, checkpoints=3):
        return bl.while_loop(
            _keyed_cond,
            _keyed_step,
            carry,
            max_steps=20,
            checkpoints=checkpoints,
            buffers=buffers,
        )

    expected = on_host(
        lambda key: lax.while_loop(_keyed_cond, _keyed_step, _keyed_carry(X0, key))
    )(key)
    out = ours(_keyed_carry(X0, key))
    assert out[0].dtype == key.dtype and out[1].dtype == key.dtype
    assert equal_to_host(_key_data(out), _key_data(expected))

    keys = jax.random.split(jax.random.key(1), 3)
    xs, limits = jnp.stack([X0, -X0, 2 * X0]), jnp.array([3, 10, 7])
    got = jax.vmap(lambda x, k, n: ours(_keyed_carry(x, k, n)))(xs, keys, limits)
    theirs = lambda x, k, n: lax.while_loop(  # noqa: E731
        _keyed_cond, _keyed_step, _keyed_carry(x, k, n)
    )
    expected = on_host(jax.vmap(theirs))(xs, keys, limits)
    assert equal_to_host(_key_data(got), _key_data(expected))

    def loss(run):
        def f(x, s, key):
            out = run(_keyed_carry(x, key, s=s))
            return jnp.sum(out[2] ** 2) + out[3] + jnp.sum(out[4] ** 2)

        return jax.grad(f, (0, 1))

    reference = on_host(loss(lambda c: scan_loop(_keyed_step, c, 10)))
    s = jnp.float32(0.5)
    for checkpoints in [1, 3]:
        got = jax.jit(loss(functools.partial(ours, checkpoints=checkpoints)))
        assert tree_allclose(got(X0, s, key), reference(X0, s, key))
    batched = jax.vmap(loss(ours), in_axes=(0, None, 0))(xs, s, keys)
    for b in range(3):
        want = reference(xs[b], s, keys[b])
        assert tree_allclose(jax.tree.map(lambda g: g[b], batched), want)

    _, tangents = jax.jvp(lambda x: ours(_keyed_carry(x, key)), (X0,), (jnp.ones(3),))
    assert tangents[0].dtype == tangents[1].dtype == jax.dtypes.float0
    assert tangents[2].dtype == jnp.float32


def test_typed_keys_are_stored_unpacked():
    """Checkpoint storage keeps each typed key leaf in its own stacked array (an
    extended dtype cannot be packed with others) and loads it back exactly."""
    from boundedloop._sweeps import _checkpoint_store

    keys = jax.random.split(jax.random.key(3), 2)
    carry = (keys[0], jnp.int32(5), keys[1], jnp.int32(-2), keys)
    storage = _checkpoint_store.empty(carry, 4)
    assert sorted(storage.packed) == ["int32"]
    assert [a is None for a in storage.arrays] == [False, True, False, True, False]
    assert storage.arrays[0].dtype == keys.dtype and storage.arrays[4].shape == (4, 2)
    stored = _checkpoint_store.store(storage, 1, carry)
    assert tree_equal(_key_data(_checkpoint_store.load(stored, 1)), _key_data(carry))
    other = (keys[1], jnp.int32(0), keys[0], jnp.int32(1), keys[::-1])
    kept = _checkpoint_store.store(stored, 1, other, when=jnp.array(False))
    assert tree_equal(_key_data(_checkpoint_store.load(kept, 1)), _key_data(carry))
