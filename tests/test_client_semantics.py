"""What a client such as diffrax relies on: `lax.while_loop`'s dtypes and weak types,
a loop with no bound and no choices made, and the edges of the arguments."""

import equinox.internal as eqxi
import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax import lax

import boundedloop as bl

from .helpers import on_host, python_while, scan_loop, tree_allclose


# (initial carry, body): lax decides dtype and weak type of each result leaf
WEAK_TYPE_CASES = {
    "python_int_and_float": ((0, 1.0), lambda c: (c[0] + 1, c[1] * 2)),
    "python_complex": (1j, lambda c: c * 2),
    "float16_body": (1.0, lambda c: c * jnp.float16(2)),
    "bfloat16_body": (1.0, lambda c: c * jnp.bfloat16(2)),
    "int_promoted_to_float": (0, lambda c: c + 0.5),
    "weak_in_strong_out": (0, lambda c: c + jnp.int32(1)),
    "strong_in_weak_out": (jnp.int32(0), lambda c: 1),
    "weak_array_kept": ((jnp.array(0), 2), lambda c: (c[0] + 1, c[1] - 1)),
    "mixed_with_array": (
        (jnp.zeros(2), 0, 0.5),
        lambda c: (c[0] + c[2], c[1] + 1, c[2] * 0.5),
    ),
}


def _ours(init, body, max_steps=3):
    return bl.while_loop(lambda c: False, body, init, max_steps=max_steps)


@pytest.mark.parametrize("promotion", ["standard", "strict"])
@pytest.mark.parametrize("name", sorted(WEAK_TYPE_CASES))
def test_output_types_equal_lax(name, promotion):
    init, body = WEAK_TYPE_CASES[name]
    with jax.numpy_dtype_promotion(promotion):
        expected = jax.eval_shape(lambda: lax.while_loop(lambda c: False, body, init))
        for max_steps in [0, 3]:
            got = jax.eval_shape(lambda: _ours(init, body, max_steps))
            assert got == expected, (max_steps, got, expected)


def test_weak_types_under_grad_vmap_and_values():
    def run(loop, x):
        def body(c):
            n, t, y = c
            return n + 1, t + 0.5, y * 0.9

        return loop(lambda c: c[0] < 4, body, (0, 0.0, x))

    def ours(cond, body, init):
        return bl.while_loop(cond, body, init, max_steps=10, checkpoints=2)

    x = jnp.array([1.0, 2.0])
    got, expected = run(ours, x), on_host(lambda x: run(lax.while_loop, x))(x)
    assert tree_allclose(got, expected)
    assert [jax.typeof(v) for v in got] == [jax.typeof(v) for v in expected]
    # the counter stays weakly typed, so strict promotion accepts this
    with jax.numpy_dtype_promotion("strict"):
        n = got[0] - 1 + jnp.int32(1)
    assert int(n) == 4
    g = jax.grad(lambda x: jnp.sum(run(ours, x)[2]))(x)
    assert jnp.allclose(g, 0.9**4)
    batched = jax.vmap(lambda x: run(ours, x))(jnp.stack([x, x]))
    assert batched[0].tolist() == [4, 4]


def _unbounded(x, limit):
    def body(c):
        y, i = c
        return jnp.sin(y) * 1.2 + 0.1, i + 1

    return bl.while_loop(lambda c: c[1] < limit, body, (x, 0), max_steps=None)


def _reference(x, trips):
    return scan_loop(lambda c: (jnp.sin(c[0]) * 1.2 + 0.1, c[1] + 1), (x, 0), trips)


@pytest.mark.parametrize("limit", [0, 5, 40])
def test_no_bound_and_no_checkpoints_just_works(limit):
    x = jnp.array([0.3, -0.7])
    loss = lambda f: lambda x: jnp.sum(f(x)[0] ** 2)  # noqa: E731
    ours = loss(lambda x: _unbounded(x, limit))
    ref = loss(lambda x: _reference(x, limit))
    assert tree_allclose(_unbounded(x, limit), on_host(_reference)(x, limit))
    assert tree_allclose(jax.jit(jax.grad(ours))(x), on_host(jax.grad(ref))(x))
    ref_jvp = on_host(lambda x: jax.jvp(ref, (x,), (x,)))(x)
    assert tree_allclose(jax.jvp(ours, (x,), (x,)), ref_jvp)
    xs = jnp.stack([x, 2 * x])
    ref_grads = on_host(jax.vmap(jax.grad(ref)))(xs)
    assert tree_allclose(jax.vmap(jax.grad(ours))(xs), ref_grads)


def test_max_steps_beyond_int32():
    x = jnp.array(0.5)
    got = jax.jit(lambda x: _bounded(x, 7, 2**40))(x)
    expected, steps = python_while(
        lambda c: c[1] < 7, lambda c: (jnp.cos(c[0]), c[1] + 1), (x, 0), None
    )
    assert steps == 7 and tree_allclose(got, expected)
    assert jnp.allclose(
        jax.grad(lambda x: _bounded(x, 7, 2**31)[0])(x),
        on_host(
            jax.grad(
                lambda x: scan_loop(lambda c: (jnp.cos(c[0]), c[1] + 1), (x, 0), 7)[0]
            )
        )(x),
    )


def _bounded(x, limit, max_steps, checkpoints=None):
    return bl.while_loop(
        lambda c: c[1] < limit,
        lambda c: (jnp.cos(c[0]), c[1] + 1),
        (x, 0),
        max_steps=max_steps,
        checkpoints=checkpoints,
    )


@pytest.mark.parametrize("max_steps", [64, None])
@pytest.mark.parametrize("checkpoints", [1000, 10**6])
def test_huge_checkpoint_counts_trace_promptly(max_steps, checkpoints):
    x = jnp.array(0.5)
    f = jax.jit(jax.grad(lambda x: _bounded(x, 9, max_steps, checkpoints)[0]))
    ref = on_host(
        jax.grad(lambda x: scan_loop(lambda c: (jnp.cos(c[0]), c[1] + 1), (x, 0), 9)[0])
    )
    assert jnp.allclose(f(x), ref(x))


def _guarded_loop(y0, w, max_steps=50, checkpoints=3):
    """A time variable and a step size that do not depend on `y0` or `w`, guarded
    as diffrax guards them."""

    def body(c):
        t, y, dt, unrelated = c
        y = y + eqxi.nondifferentiable(dt) * jnp.tanh(w * y)
        t = eqxi.nondifferentiable(t) + dt
        return t, y, dt * 1.01, unrelated * 0.5

    init = (0.0, y0, 0.1, jnp.ones(1000))
    cond = lambda c: c[0] < 1.0  # noqa: E731
    if max_steps is None:  # the reference: a scan over the known trip count
        n = int(python_while(cond, body, init, None)[1])
        return lax.scan(lambda c, _: (body(c), None), init, length=n)[0]
    return bl.while_loop(cond, body, init, max_steps=max_steps, checkpoints=checkpoints)


def _guarded_loss(max_steps):
    return lambda y0, w: jnp.sum(_guarded_loop(y0, w, max_steps)[1] ** 2)


Y0, W_SCALAR = jnp.array([0.5, -0.3]), jnp.array(1.2)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.grad(f, argnums=(0, 1))(Y0, W_SCALAR),
        lambda f: jax.jvp(f, (Y0, W_SCALAR), (Y0, W_SCALAR)),
        lambda f: jax.hessian(f)(Y0, W_SCALAR),
        lambda f: jax.vmap(jax.grad(f), in_axes=(0, None))(
            jnp.stack([Y0, -Y0]), W_SCALAR
        ),
    ],
)
def test_only_perturbed_leaves_are_differentiated(transform):
    # `nondifferentiable` raises if its argument gets a tangent
    expected = on_host(lambda: transform(_guarded_loss(None)))()
    assert tree_allclose(transform(_guarded_loss(50)), expected, rtol=1e-5)


def _while_carry_shapes(jaxpr, scope: str) -> list:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while" and scope in str(eqn.source_info.name_stack):
            out += [tuple(v.aval.shape) for v in eqn.outvars]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _while_carry_shapes(sub, scope)
    return out


def test_reverse_sweep_carries_cotangents_of_perturbed_leaves_only():
    grad = jax.grad(_guarded_loss(50), argnums=(0, 1))
    shapes = _while_carry_shapes(jax.make_jaxpr(grad)(Y0, W_SCALAR).jaxpr, "reverse")
    assert (2,) in shapes  # the cotangent of `y`
    # `unrelated` is floating but not perturbed: only its checkpoints are carried
    assert (1000,) not in shapes
    assert (3, 1000) in shapes


def _scratch_loss(checkpoints, reads_scratch=False):
    """A loop with a scratch leaf, as a solver's stage value: perturbed (the body
    writes it from `x`) but never read by the body (unless `reads_scratch`)."""

    def loss(x0, w, n):
        def body(c):
            x, scratch, i = c
            new_x = jnp.tanh(w * x) + 0.1 * x
            if reads_scratch:
                new_x = new_x + 0.0 * scratch
            return new_x, jnp.sin(x) * w, i + 1

        init = (x0, jnp.cos(x0), 0)
        x, scratch, _ = bl.while_loop(
            lambda c: c[2] < n,
            body,
            init,
            max_steps=12,
            checkpoints=checkpoints,
        )
        return jnp.sum(x**2) + jnp.sum(scratch * jnp.arange(1.0, 4.0))

    return loss


@pytest.mark.parametrize("checkpoints", [2, 5, 12])
def test_unread_leaves_are_not_carried_and_get_exact_cotangents(checkpoints):
    x0, w = jnp.array([0.3, -0.2, 0.5]), jnp.array(1.3)
    loss = _scratch_loss(checkpoints)

    def reference(x0, w, n):
        x, scratch = x0, jnp.cos(x0)
        for _ in range(n):
            x, scratch = jnp.tanh(w * x) + 0.1 * x, jnp.sin(x) * w
        return jnp.sum(x**2) + jnp.sum(scratch * jnp.arange(1.0, 4.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for n in [0, 1, 2, 7, 12]:
        expected = jax.grad(reference, argnums=(0, 1))(x0, w, n)
        assert tree_allclose(grad(x0, w, n), expected, rtol=1e-5), n
    # under vmap each element stops at its own step (0 steps included)
    ns = jnp.array([0, 3, 9])
    batched = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))
    for k, n in enumerate([0, 3, 9]):
        expected = jax.grad(reference, argnums=(0, 1))(x0, w, n)
        got = jax.tree.map(lambda g: g[k], batched(x0, w, ns))
        assert tree_allclose(got, expected, rtol=1e-5), n

    # the scratch leaf's cotangent is not carried (it is once the body reads it)
    def reverse_carries(loss):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(x0, w, 5).jaxpr
        return _while_carry_shapes(jaxpr, "reverse").count((3,))

    assert reverse_carries(loss) < reverse_carries(
        _scratch_loss(checkpoints, reads_scratch=True)
    )


def _solver_like(y0, w, n_steps, stage_loop):
    """The shape of diffrax's carry: a step loop over many int/bool/float leaves and
    two output buffers, each step running a stage loop that writes a stage buffer
    `fs` and reads all of it (`fs[...]`)."""
    stages = 3
    a = jnp.array([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.25, 0.25, 0.0]])

    def step(c):
        t, y, dt, n, made_jump, ts, ys, save_index = c
        fs0 = jnp.zeros((stages,) + y.shape)

        def stage(sc):
            fs, k = sc
            y_k = y + dt * jnp.tensordot(a[k], fs[...], axes=1)
            return fs.at[k].set(jnp.tanh(w * y_k)), k + 1

        fs, _ = stage_loop(stage, (fs0, 0), stages)
        y = y + dt * jnp.sum(fs[...], axis=0) / stages
        ts = ts.at[save_index].set(t + dt)
        ys = ys.at[save_index].set(y)
        return (t + dt, y, dt * 1.1, n + 1, ~made_jump, ts, ys, save_index + 1)

    init = (0.0, y0, 0.05, 0, False, jnp.zeros(8), jnp.zeros((8, 2)), 0)
    return step, init, n_steps


def _solver_like_loss(y0, w, limit):
    def stage_loop(stage, init, n):
        return bl.scan(
            lambda c, _: (stage(c), None), init, length=n, buffers=lambda c: c[0]
        )[0]

    step, init, _ = _solver_like(y0, w, limit, stage_loop)
    out = bl.while_loop(
        lambda c: c[3] < limit,
        step,
        init,
        max_steps=8,
        checkpoints=3,
        buffers=lambda c: (c[5], c[6]),
    )
    return jnp.sum(out[6] ** 2) + jnp.sum(out[1])


def _solver_like_reference(y0, w, limit):
    def stage_loop(stage, init, n):
        return scan_loop(stage, init, n)

    step, init, _ = _solver_like(y0, w, limit, stage_loop)
    out = scan_loop(step, init, limit)
    return jnp.sum(out[6] ** 2) + jnp.sum(out[1])


def test_grad_of_vmap_with_a_solver_shaped_carry():
    """`jax.grad(jax.vmap(...))` of a loop shaped like diffrax's `diffeqsolve`."""
    ys0, w = jnp.array([[0.3, -0.4], [1.0, 0.2]]), jnp.array(1.3)
    limits = jnp.array([5, 2])

    def batched(loss):
        return lambda ys0, w: jnp.sum(
            jax.vmap(loss, in_axes=(0, None, 0))(ys0, w, limits)
        )

    got = jax.jit(jax.grad(batched(_solver_like_loss), argnums=(0, 1)))(ys0, w)
    expected = [
        on_host(jax.grad(_solver_like_reference, argnums=(0, 1)))(
            ys0[b], w, int(limits[b])
        )
        for b in range(2)
    ]
    assert tree_allclose(got[0], jnp.stack([e[0] for e in expected]), rtol=1e-5)
    assert tree_allclose(got[1], expected[0][1] + expected[1][1], rtol=1e-5)
