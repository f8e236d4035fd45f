"""`stats=True`: the steps a loop took, and whether it ran out of steps, read
without changing the carry; against a Python loop (`python_while`), under `jit`,
`vmap`, `grad` and `jvp`, through `LoopModule.run` and `bl.Loop`, with buffers and
with an outer loop's buffers."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import boundedloop as bl

from .helpers import (
    Halving,
    on_host,
    python_while,
    scan_loop,
    tree_allclose,
    tree_equal,
)


MAX_STEPS = 6
# trip counts below, at and above `max_steps`
TRIPS = [0, 3, MAX_STEPS, MAX_STEPS + 1, 50]
X = jnp.array([0.3, -0.4])


def body(carry):
    x, i = carry
    return jnp.sin(x) * 1.1 + 0.2, i + 1


def loop(x, n, *, stats, max_steps=MAX_STEPS, checkpoints=2):
    """Takes `min(n, max_steps)` steps; runs out of steps when `n > max_steps`."""
    return bl.while_loop(
        lambda c: c[1] < n,
        body,
        (x, jnp.array(0)),
        max_steps=max_steps,
        checkpoints=checkpoints,
        stats=stats,
    )


def loss(x, n, *, stats):
    out = loop(x, n, stats=stats)
    if stats:  # the stats as `has_aux`
        final, loop_stats = out
        return jnp.sum(final[0] ** 2), loop_stats
    return jnp.sum(out[0] ** 2)


@functools.cache
def compiled(kind: str, stats: bool):
    """One jitted function per kind; the trip count `n` is traced."""
    forward = functools.partial(loop, stats=stats)
    grad = jax.grad(functools.partial(loss, stats=stats), has_aux=stats)
    fn = {
        "forward": forward,
        "vmap": jax.vmap(forward),
        "grad": grad,
        "vmap_grad": jax.vmap(grad),
    }[kind]
    return jax.jit(fn)


def expected_stats(n, max_steps=MAX_STEPS):
    """The reference: steps taken by the Python loop, and whether it ran out."""
    cond = lambda c: c[1] < n  # noqa: E731
    final, steps = python_while(cond, body, (X, 0), max_steps)
    reached = max_steps is not None and steps == max_steps and bool(cond(final))
    return steps, reached


@pytest.mark.parametrize("n", TRIPS)
def test_steps_against_a_python_loop(n):
    final, stats = compiled("forward", True)(X, jnp.array(n))
    assert isinstance(stats, bl.LoopStats)
    assert stats.num_steps.dtype == jnp.int32 and stats.num_steps.shape == ()
    assert stats.max_steps_reached.dtype == bool and stats.max_steps_reached.shape == ()
    steps, reached = expected_stats(n)
    assert int(stats.num_steps) == steps == min(n, MAX_STEPS)
    assert bool(stats.max_steps_reached) == reached == (n > MAX_STEPS)
    # the carry is the loop's without stats, bit for bit
    assert tree_equal(final, compiled("forward", False)(X, jnp.array(n)))


def test_vmap_each_element_counts_its_own_steps():
    xs = jnp.stack([X * (k + 1) for k in range(len(TRIPS))])
    ns = jnp.array(TRIPS)
    final, stats = compiled("vmap", True)(xs, ns)
    assert isinstance(stats, bl.LoopStats)
    assert stats.num_steps.tolist() == [expected_stats(n)[0] for n in TRIPS]
    assert stats.max_steps_reached.tolist() == [expected_stats(n)[1] for n in TRIPS]
    assert tree_equal(final, compiled("vmap", False)(xs, ns))


@pytest.mark.parametrize("n", [0, 3, MAX_STEPS, 50])
def test_grad_is_unchanged(n):
    grad, stats = compiled("grad", True)(X, jnp.array(n))
    assert tree_allclose(grad, compiled("grad", False)(X, jnp.array(n)))
    trips = min(n, MAX_STEPS)
    reference = lambda x: jnp.sum(scan_loop(body, (x, 0), trips)[0] ** 2)  # noqa: E731
    assert tree_allclose(grad, on_host(jax.grad(reference))(X))
    assert int(stats.num_steps) == trips
    assert bool(stats.max_steps_reached) == (n > MAX_STEPS)


def test_vmap_grad():
    xs = jnp.stack([X, -X, 2 * X])
    ns = jnp.array([1, MAX_STEPS, 30])
    grads, stats = compiled("vmap_grad", True)(xs, ns)
    assert tree_allclose(grads, compiled("vmap_grad", False)(xs, ns))
    assert stats.num_steps.tolist() == [1, MAX_STEPS, MAX_STEPS]
    assert stats.max_steps_reached.tolist() == [False, False, True]


def test_jvp():
    def tangent(stats):
        def f(x, n):
            out = loop(x, n, stats=stats)
            return out[0][0] if stats else out[0]

        return jax.jit(lambda x, n: jax.jvp(lambda x: f(x, n), (x,), (x,)))

    for n in [3, 50]:
        assert tree_allclose(
            tangent(True)(X, jnp.array(n)), tangent(False)(X, jnp.array(n))
        )


def test_zero_max_steps_and_unbounded():
    for n in [0, 1]:
        final, stats = loop(X, jnp.array(n), stats=True, max_steps=0)
        assert tree_equal(final, loop(X, jnp.array(n), stats=False, max_steps=0))
        assert int(stats.num_steps) == 0
        assert bool(stats.max_steps_reached) == (n == 1) == expected_stats(n, 0)[1]
    # no bound: never out of steps
    final, stats = loop(X, jnp.array(9), stats=True, max_steps=None)
    assert int(final[1]) == int(stats.num_steps) == 9
    assert stats.max_steps_reached.dtype == bool and not bool(stats.max_steps_reached)


def test_loop_module_run():
    run = bl.filter_jit(lambda m, x, k: m.run(x, max_steps=k, stats=True))
    module = Halving(0.1)
    # 1 -> 1/16 takes four steps: cut short at three, ends by itself at four
    for max_steps, steps, reached in [(3, 3, True), (4, 4, False), (10, 4, False)]:
        final, stats = run(module, jnp.array(1.0), max_steps)
        assert float(final) == 0.5**steps
        assert int(stats.num_steps) == steps
        assert bool(stats.max_steps_reached) == reached
    assert float(module.run(jnp.array(1.0), max_steps=3)) == 0.125  # stats off


def test_loop_grad_through_a_closure():
    """`bl.Loop` of a closure over an array: the gradient with respect to that array
    is unchanged, and the stats come back as `has_aux`."""
    w = jnp.array(0.9)

    def make(w):
        return bl.Loop(lambda c: c[1] < 4, lambda c: (jnp.sin(w * c[0]), c[1] + 1))

    @bl.filter_jit
    @functools.partial(bl.filter_grad, has_aux=True)
    def with_stats(loop, x):
        (x, _), stats = loop.run((x, 0), max_steps=MAX_STEPS, stats=True)
        return x, stats

    @bl.filter_jit
    @bl.filter_grad
    def without(loop, x):
        return loop.run((x, 0), max_steps=MAX_STEPS)[0]

    grads, stats = with_stats(make(w), jnp.array(0.5))
    assert int(stats.num_steps) == 4 and not bool(stats.max_steps_reached)
    assert tree_allclose(grads, without(make(w), jnp.array(0.5)))


def test_buffers_see_the_users_carry():
    """`buffers=` (and the body) receive the user's carry, not the counted one."""
    seen = []

    def buffers(carry):
        seen.append(type(carry))
        return carry["ys"]

    def step(c):
        ys = c["ys"].at[c["i"]].set(c["x"])
        return {"x": jnp.cos(c["x"]), "ys": ys, "i": c["i"] + 1}

    def run(x, n, stats):
        init = {"x": x, "ys": jnp.zeros((MAX_STEPS, 2)), "i": jnp.array(0)}
        return bl.while_loop(
            lambda c: c["i"] < n,
            step,
            init,
            max_steps=MAX_STEPS,
            checkpoints=2,
            buffers=buffers,
            stats=stats,
        )

    def value(x, n, stats):
        out = run(x, n, stats)
        out = out[0] if stats else out
        return jnp.sum(jnp.sin(out["ys"])) + jnp.sum(out["x"] ** 2)

    f = jax.jit(lambda x, n: (run(x, n, True), jax.grad(value)(x, n, True)))
    g = jax.jit(lambda x, n: (run(x, n, False), jax.grad(value)(x, n, False)))
    for n in [2, 50]:
        ((out, stats), grad), (expected, expected_grad) = f(X, n), g(X, n)
        assert tree_equal(out, expected)
        assert tree_allclose(grad, expected_grad)
        assert int(stats.num_steps) == min(n, MAX_STEPS)
    assert seen and all(t is dict for t in seen)


OUTER, INNER = 4, 3


def nested(x, n_outer, n_inner, stats):
    """An outer loop whose body runs an inner loop that writes the outer loop's
    buffer (lent to it through its carry); the inner loops' steps are summed."""

    def outer_body(c):
        x, buf, t, total = c

        def inner_body(ic):
            y, b, j = ic
            return jnp.sin(y), b.at[t, j].set(y), j + 1

        out = bl.while_loop(
            lambda ic: ic[2] < n_inner,
            inner_body,
            (x, buf, jnp.array(0)),
            max_steps=INNER,
            stats=stats,
        )
        if stats:
            (y, buf, _), inner_stats = out
            total = total + inner_stats.num_steps
        else:
            y, buf, _ = out
        return 0.9 * y, buf, t + 1, total

    init = (x, jnp.zeros((OUTER, INNER)), jnp.array(0), jnp.array(0))
    x, buf, _, total = bl.while_loop(
        lambda c: c[2] < n_outer,
        outer_body,
        init,
        max_steps=OUTER,
        checkpoints=2,
        buffers=lambda c: c[1],
    )
    return jnp.sum(x**2) + jnp.sum(jnp.sin(buf)), total


def test_inner_loop_with_stats_writes_the_outer_buffer():
    def compiled(stats):
        fn = functools.partial(nested, stats=stats)
        return jax.jit(jax.value_and_grad(fn, has_aux=True))

    f, g = compiled(True), compiled(False)
    x = jnp.array(0.7)
    for n_outer, n_inner in [(2, 1), (3, 5), (9, 3)]:
        (value, total), grad = f(x, n_outer, n_inner)
        (expected, _), expected_grad = g(x, n_outer, n_inner)
        assert tree_allclose((value, grad), (expected, expected_grad))
        assert int(total) == min(n_outer, OUTER) * min(n_inner, INNER)


@pytest.mark.parametrize(
    "bad_body",
    [
        lambda c: (c[0].astype(jnp.int32), c[1] + 1),  # a dtype changes
        lambda c: (c[0], c[1] + 1, c[1]),  # the structure changes
    ],
)
def test_errors_name_the_users_carry(bad_body):
    """A bad body's error is the same with stats as without: it names the user's
    carry, not the counted one."""
    messages = []
    for stats in [False, True]:
        with pytest.raises((TypeError, ValueError)) as info:
            bl.while_loop(
                lambda c: c[1] < 3, bad_body, (X, 0), max_steps=4, stats=stats
            )
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_stats_are_a_module():
    _, stats = loop(X, jnp.array(2), stats=True)
    assert isinstance(stats, eqx.Module)
    assert set(stats.__dataclass_fields__) == {"num_steps", "max_steps_reached"}


def test_with_max_steps_check():
    """The stats and `bl.max_steps_check` see the same thing."""
    with bl.max_steps_check():
        with pytest.raises(Exception, match="reached max_steps=6"):
            loop(X, jnp.array(50), stats=True)
    with bl.max_steps_check(warn=True):
        with pytest.warns(UserWarning, match="reached max_steps=6"):
            _, stats = loop(X, jnp.array(50), stats=True)
    assert bool(stats.max_steps_reached)
