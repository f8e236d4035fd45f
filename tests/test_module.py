"""`LoopModule`, `Loop` and the filtered transforms."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest

import boundedloop as bl

from .helpers import on_host, scan_loop, tree_allclose


class Decay(bl.LoopModule):
    rate: jax.Array
    offset: jax.Array
    steps: int
    label: str
    activation: object

    def cond(self, carry):
        return carry[1] < self.steps

    def body(self, carry):
        x, i = carry
        return self.activation(x * self.rate + self.offset), i + 1


def make_decay(steps=5, activation=jnp.tanh):
    return Decay(jnp.array([0.9, 1.1]), jnp.array(0.1), steps, "decay", activation)


def reference(module, x, trips):
    return scan_loop(module.body, (x, 0), trips)[0]


X = jnp.array([0.4, -0.3])


def test_missing_body_is_an_error_at_construction():
    class NoBody(bl.LoopModule):
        scale: float

    with pytest.raises(TypeError, match="body"):
        NoBody(1.0)


def test_filtered_transforms_are_equinox():
    assert bl.filter_jit is eqx.filter_jit
    assert bl.filter_grad is eqx.filter_grad
    assert bl.filter_value_and_grad is eqx.filter_value_and_grad
    assert bl.filter_vmap is eqx.filter_vmap


def test_mixed_fields_under_filter_jit_and_retracing():
    @bl.filter_jit
    @eqx.debug.assert_max_traces(max_traces=2)
    def run(module, x):
        return module.run((x, 0), max_steps=16, checkpoints=3)[0]

    module = make_decay()
    out = run(module, X)
    assert tree_allclose(out, on_host(reference)(module, X, 5))
    # new array values: no retrace
    module2 = eqx.tree_at(lambda m: m.rate, module, jnp.array([0.5, 0.7]))
    assert tree_allclose(run(module2, X), on_host(reference)(module2, X, 5))
    # a static field changes: exactly one more trace
    module3 = make_decay(steps=7)
    assert tree_allclose(run(module3, X), on_host(reference)(module3, X, 7))
    with pytest.raises(RuntimeError):
        run(make_decay(activation=jnp.sin), X)


@pytest.mark.parametrize("checkpoints", [1, 2, 8])
def test_gradients_wrt_fields_match_scan(checkpoints):
    module = make_decay()

    @bl.filter_jit
    @bl.filter_grad
    def grad(module, x):
        return jnp.sum(module.run((x, 0), max_steps=9, checkpoints=checkpoints)[0])

    @eqx.filter_grad
    def grad_ref(module, x):
        return jnp.sum(reference(module, x, 5))

    assert tree_allclose(grad(module, X), on_host(grad_ref)(module, X))


def test_vmap_over_modules():
    rates = jnp.array([[0.9, 1.1], [0.5, 0.2], [1.3, -0.4]])
    modules = eqx.filter_vmap(lambda r: Decay(r, jnp.array(0.1), 5, "decay", jnp.tanh))(
        rates
    )

    def loss(m):
        return jnp.sum(m.run((X, 0), max_steps=8, checkpoints=2)[0])

    grads = bl.filter_vmap(bl.filter_grad(loss))(modules)
    for b in range(3):
        one = Decay(rates[b], jnp.array(0.1), 5, "decay", jnp.tanh)
        expected = on_host(eqx.filter_grad(lambda m: jnp.sum(reference(m, X, 5))))(one)
        assert tree_allclose(grads.rate[b], expected.rate)
        assert tree_allclose(grads.offset[b], expected.offset)


class MLPStep(bl.LoopModule):
    mlp: eqx.nn.MLP
    tol: float = 0.05

    def cond(self, carry):
        return jnp.max(jnp.abs(carry[0])) > self.tol

    def body(self, carry):
        x, i = carry
        return 0.5 * x + 0.1 * self.mlp(x), i + 1


def test_nested_module_field(getkey):
    module = MLPStep(eqx.nn.MLP(2, 2, 8, 2, key=getkey()))
    x0 = jnp.array([1.0, -2.0])
    out = module.run((x0, 0), max_steps=64, checkpoints=4)
    trips = int(out[1])
    assert 0 < trips < 64

    grads = bl.filter_grad(
        lambda m: jnp.sum(m.run((x0, 0), max_steps=64, checkpoints=4)[0])
    )(module)
    expected = on_host(
        eqx.filter_grad(lambda m: jnp.sum(scan_loop(m.body, (x0, 0), trips)[0]))
    )(module)
    assert tree_allclose(grads, expected, rtol=1e-4, atol=1e-6)


def test_loop_wraps_partial_closure_and_bound_method():
    def body(scale, carry):
        x, i = carry
        return jnp.sin(x) * scale, i + 1

    def cond(limit, carry):
        return carry[1] < limit

    loop = bl.Loop(jtu.Partial(cond, 4), jtu.Partial(body, jnp.array(1.3)))
    # the Partial's array is a traced leaf; its int stays static
    leaves = jtu.tree_leaves(eqx.filter(loop, eqx.is_array))
    assert len(leaves) == 1

    @bl.filter_jit
    @bl.filter_grad
    def grad(loop, x):
        return jnp.sum(loop.run((x, 0), max_steps=10, checkpoints=2)[0])

    g = grad(loop, X)
    expected = on_host(
        jax.grad(lambda s: jnp.sum(scan_loop(lambda c: body(s, c), (X, 0), 4)[0]))
    )(jnp.array(1.3))
    assert tree_allclose(g.body_fun.args[0], expected)

    module = make_decay()
    bound = bl.Loop(module.cond, module.body)
    expected = on_host(reference)(module, X, 5)
    assert tree_allclose(bound.run((X, 0), max_steps=9)[0], expected)
    # plain closures work too (and are static)
    closure = bl.Loop(lambda c: c[1] < 3, lambda c: (c[0] * 2.0, c[1] + 1))
    assert tree_allclose(
        bl.filter_jit(lambda lp, x: lp.run((x, 0), max_steps=5)[0])(closure, X), X * 8.0
    )


def test_loop_buffers_method_calls_buffers():
    carry = (jnp.zeros(4), X, 0)
    loop = bl.Loop(lambda c: c[2] < 3, lambda c: c, buffers=lambda c: c[0])
    assert loop.buffers(carry) is carry[0]
    assert bl.Loop(lambda c: c[2] < 3, lambda c: c).buffers(carry) is None


def test_loop_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        bl.Loop(lambda c: True, 3)


class TwoStepsPerStep(bl.Loop):
    """A `Loop` whose subclass overrides `body`."""

    def body(self, carry):
        return self.body_fun(self.body_fun(carry))


def test_loop_subclass_overrides_are_run():
    """`Loop.run` is `LoopModule.run`: it runs the subclass's `body` (issue 39)."""
    loop = TwoStepsPerStep(lambda c: c[1] < 2, lambda c: (c[0] * 2.0, c[1] + 1))
    # one step of the overridden body doubles twice
    out = loop.run((jnp.array(2.0), 0), max_steps=1)
    assert float(out[0]) == 8.0 and int(out[1]) == 2
    assert bl.Loop.run is bl.LoopModule.run


def closure_loop(w, b, limit=3):
    """A `Loop` of closures over arrays, as a user writes one: `w` in a nested helper,
    `b` in a default argument, `limit` a static int."""

    def scale(x):
        return jnp.sin(x * w)

    def body(carry, b=b):
        x, i = carry
        return scale(x) + b, i + 1

    return bl.Loop(lambda c: c[1] < limit, body)


W_CLOSED, B_CLOSED = jnp.array([0.9, 1.2]), jnp.array(0.3)


@pytest.mark.parametrize("checkpoints", [1, 3])
def test_arrays_a_closure_captures_get_gradients(checkpoints):
    """Arrays captured by the functions given to `bl.Loop` are leaves of the loop:
    `bl.filter_grad` differentiates them (issue 39: they silently got none)."""

    @bl.filter_jit
    @bl.filter_grad
    def grad(loop, x):
        return jnp.sum(loop.run((x, 0), max_steps=8, checkpoints=checkpoints)[0] ** 2)

    g = grad(closure_loop(W_CLOSED, B_CLOSED), X)

    def reference_loss(w, b):
        body = closure_loop(w, b).body_fun
        return jnp.sum(scan_loop(body, (X, 0), 3)[0] ** 2)

    expected = jax.grad(reference_loss, argnums=(0, 1))(W_CLOSED, B_CLOSED)
    assert len(jtu.tree_leaves(g)) == 2
    # by name: `w` through the helper `scale` the body calls, `b` a default argument
    closure = g.body_fun.closure
    assert tree_allclose((closure["scale"].closure["w"], closure["b"]), expected)


def test_closure_arrays_are_traced_not_baked_in():
    """A loop rebuilt around new arrays reuses the compiled program; a static value
    in the closure is part of the cache key; a mutable value a closure captures
    without arrays is shared, not copied."""
    calls = []

    @bl.filter_jit
    @eqx.debug.assert_max_traces(max_traces=2)
    def run(loop, x):
        calls.append(None)
        return loop.run((x, 0), max_steps=8)[0]

    for w in [W_CLOSED, -W_CLOSED]:
        expected = scan_loop(closure_loop(w, B_CLOSED).body_fun, (X, 0), 3)[0]
        assert tree_allclose(run(closure_loop(w, B_CLOSED), X), expected)
    expected = scan_loop(closure_loop(W_CLOSED, B_CLOSED).body_fun, (X, 0), 5)[0]
    assert tree_allclose(run(closure_loop(W_CLOSED, B_CLOSED, limit=5), X), expected)
    assert len(calls) == 2
    seen = []
    loop = bl.Loop(lambda c: c[1] < 1, lambda c: (seen.append(1), c)[1])
    loop.run((X, 0), max_steps=2)
    assert seen


def test_partials_and_recursive_closures():
    """A `functools.partial` over arrays is differentiated too; a recursive closure
    over arrays, whose inner calls could not be, is an error naming it."""

    def body(w, carry):
        return carry[0] * w, carry[1] + 1

    loop = bl.Loop(lambda c: c[1] < 2, functools.partial(body, jnp.array(2.0)))
    g = bl.filter_grad(lambda lp, x: jnp.sum(lp.run((x, 0), max_steps=4)[0]))(loop, X)
    assert tree_allclose(jtu.tree_leaves(g)[0], 2 * 2.0 * jnp.sum(X))

    w = jnp.array(1.1)

    def power(x, k):
        return x if k == 0 else power(x * w, k - 1)

    with pytest.raises(TypeError, match="power"):
        bl.Loop(lambda c: c[1] < 2, lambda c: (power(c[0], 2), c[1] + 1))


def test_gradient_reads_a_closure_by_name():
    """The gradient of a `Loop` has the loop's structure, and a closure's arrays are
    keyed by the names the closure uses: `g.body_fun.closure["A"]` is dL/dA, and a
    captured `jax.tree_util.Partial` keeps its `.args` and `.keywords` (issue 54)."""
    A = jnp.array([[0.9, 0.2], [-0.1, 0.8]])
    mix = jtu.Partial(
        lambda b, x, *, shift: b * x + shift, jnp.array(0.5), shift=jnp.array(0.1)
    )

    def step(A, mix, x):
        return jnp.tanh(A @ x) + mix(x)

    def body(carry):  # closes over `A` and `mix`
        x, i = carry
        return step(A, mix, x), i + 1

    @bl.filter_jit
    @bl.filter_grad
    def grad(loop, x):
        return jnp.sum(loop.run((x, 0), max_steps=10, checkpoints=2)[0] ** 2)

    g = grad(bl.Loop(lambda c: c[1] < 4, body), X)

    def unrolled(A, mix):  # the same loss, as a Python loop of the known 4 steps
        x = X
        for _ in range(4):
            x = step(A, mix, x)
        return jnp.sum(x**2)

    d_A, d_mix = jax.grad(unrolled, argnums=(0, 1))(A, mix)
    closure = g.body_fun.closure
    assert set(closure) == {"A", "mix"}
    assert tree_allclose(closure["A"], d_A)
    assert tree_allclose(closure["mix"].args[0], d_mix.args[0])
    assert tree_allclose(closure["mix"].keywords["shift"], d_mix.keywords["shift"])
    # the repr says which array is which
    assert "'A': f32[2,2]" in repr(g) and "'mix'" in repr(g)


def test_keyword_only_default_arrays_are_hoisted():
    """An array in a keyword-only default is a leaf too, keyed by its name."""

    def body(carry, *, w=jnp.array(2.0)):
        return carry[0] * w, carry[1] + 1

    loop = bl.Loop(lambda c: c[1] < 2, body)
    g = bl.filter_grad(lambda lp, x: jnp.sum(lp.run((x, 0), max_steps=4)[0]))(loop, X)
    assert tree_allclose(g.body_fun.closure["w"], 2 * 2.0 * jnp.sum(X))


def test_a_function_field_capturing_arrays_warns():
    """A plain closure in a field is static to Equinox: under `bl.filter_grad` of the
    module its arrays get no gradient, silently but for this warning, which names the
    field and the captured name and points at the user's line. A closure over traced
    arrays (a module built inside `jax.grad`) is differentiated, and not warned of."""

    class Scaled(bl.LoopModule):
        f: Callable

        def cond(self, carry):
            return carry[1] < 3

        def body(self, carry):
            x, i = carry
            return self.f(x), i + 1

    def make(a):
        return Scaled(lambda x: x * a)

    def run(m):
        return m.run((jnp.array(1.0), 0), max_steps=5)[0]

    with pytest.warns(UserWarning, match=r"`Scaled.f` .* captures arrays \(`a`\)") as w:
        bl.filter_grad(run)(make(jnp.array(2.0)))
    assert w[0].filename == __file__
    assert jax.grad(lambda a: run(make(a)))(jnp.array(2.0)) == 12.0  # no warning
