"""Loops in loops: a `bl.while_loop` in the body of another and in `bl.scan`'s body,
with data-dependent trip counts, against nested `lax.scan` references over the known
trip counts: runtime trip counts, parameters closed over by the inner body,
checkpoint combinations, per-step inner trip counts, vmap, and inner loops that
read and write the outer loop's buffers."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import boundedloop as bl

from .helpers import copies_in_while_bodies, on_host, tree_allclose


X0 = jnp.array([0.3, -0.2, 0.5])
W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
OUTER_MAX, INNER_MAX = 6, 4


def inner_step(w):
    return lambda x: jnp.tanh(w @ x + 0.1)


def outer_step(x, y):
    return 0.8 * y + 0.2 * jnp.sin(x)


def ours_while_in_while(outer_checkpoints, inner_checkpoints):
    def run(x, w, n_outer, n_inner):
        def inner(x):
            return bl.while_loop(
                lambda c: c[1] < n_inner,
                lambda c: (inner_step(w)(c[0]), c[1] + 1),
                (x, jnp.array(0)),
                max_steps=INNER_MAX,
                checkpoints=inner_checkpoints,
            )[0]

        return bl.while_loop(
            lambda c: c[1] < n_outer,
            lambda c: (outer_step(c[0], inner(c[0])), c[1] + 1),
            (x, jnp.array(0)),
            max_steps=OUTER_MAX,
            checkpoints=outer_checkpoints,
        )[0]

    return run


def scan_n(f, x, n):
    return lax.scan(lambda c, _: (f(c), None), x, length=n)[0]


def nested_scan(x, w, n_outer, n_inner):
    """The reference: `lax.scan` of `lax.scan`, over the known trip counts."""
    inner = lambda x: scan_n(inner_step(w), x, n_inner)  # noqa: E731
    return scan_n(lambda x: outer_step(x, inner(x)), x, n_outer)


def loss(run):
    return lambda x, w, *n: jnp.sum(run(x, w, *n) ** 2)


@functools.cache
def reference_grad(n_outer, n_inner):
    value = lambda x, w: loss(nested_scan)(x, w, n_outer, n_inner)  # noqa: E731
    return on_host(jax.jit(jax.value_and_grad(value, argnums=(0, 1))))


@functools.cache
def grad_while_in_while(outer_checkpoints, inner_checkpoints):
    run = ours_while_in_while(outer_checkpoints, inner_checkpoints)
    return jax.jit(jax.value_and_grad(loss(run), argnums=(0, 1)))


@pytest.mark.parametrize("checkpoints", [(1, 1), (2, None), (None, 3)])
def test_while_in_while(checkpoints):
    f = grad_while_in_while(*checkpoints)
    for n_outer, n_inner in [(0, 2), (3, 0), (4, 3), (9, 5), (6, 4)]:
        trips = min(n_outer, OUTER_MAX), min(n_inner, INNER_MAX)
        got = f(X0, W, jnp.array(n_outer), jnp.array(n_inner))
        expected = reference_grad(*trips)(X0, W)
        assert tree_allclose(got, expected), (n_outer, n_inner)


def test_while_in_while_under_vmap():
    """Each element with its own outer and inner trip counts."""
    f = jax.vmap(grad_while_in_while(2, 1), in_axes=(0, None, 0, 0))
    xs = jnp.stack([X0, -X0, 0.5 * X0])
    n_outer, n_inner = jnp.array([5, 0, 2]), jnp.array([1, 3, 9])
    values, (g_x, g_w) = f(xs, W, n_outer, n_inner)
    for b in range(3):
        trips = min(int(n_outer[b]), OUTER_MAX), min(int(n_inner[b]), INNER_MAX)
        expected = reference_grad(*trips)(xs[b], W)
        assert tree_allclose((values[b], (g_x[b], g_w[b])), expected), b


# ---- a while loop inside `bl.scan`: the inner trip count comes from `xs` ----------

COUNTS = jnp.array([2, 0, 4, 7, 1])  # inner trip counts, one per outer step
SCALES = jnp.array([0.5, -1.0, 0.3, 1.2, 0.8])


def scan_body(w, inner_checkpoints):
    def f(c, xt):
        n, scale = xt
        y = bl.while_loop(
            lambda d: d[1] < n,
            lambda d: (inner_step(w)(d[0]) * scale, d[1] + 1),
            (c, jnp.array(0)),
            max_steps=INNER_MAX,
            checkpoints=inner_checkpoints,
        )[0]
        c = outer_step(c, y)
        return c, jnp.sum(y**3)

    return f


@functools.cache
def grad_while_in_scan(outer_checkpoints, inner_checkpoints):
    def value(x, w, scales, counts):
        c, ys = bl.scan(
            scan_body(w, inner_checkpoints),
            x,
            (counts, scales),
            checkpoints=outer_checkpoints,
        )
        return jnp.sum(c**2) + jnp.sum(jnp.cos(ys))

    return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2)))


def reference_while_in_scan(x, w, scales, *, counts):
    """`lax.scan` over the outer steps; each inner loop a `lax.scan` of its known
    length. The lengths differ per step, so the outer scan runs over runs of steps
    with one inner length each (here: one step each)."""
    ys = []
    for t, n in enumerate(counts):
        trips = min(n, INNER_MAX)

        def f(c, scale, trips=trips):
            y = scan_n(lambda d: inner_step(w)(d) * scale, c, trips)
            return outer_step(c, y), jnp.sum(y**3)

        x, y = lax.scan(f, x, scales[t : t + 1])
        ys.append(y)
    return jnp.sum(x**2) + jnp.sum(jnp.cos(jnp.concatenate(ys)))


@functools.cache
def reference_scan_grad(counts):
    value = functools.partial(reference_while_in_scan, counts=counts)
    return on_host(jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2))))


@pytest.mark.parametrize("checkpoints", [(1, 3), (None, 1), (2, None)])
def test_while_in_scan(checkpoints):
    f = grad_while_in_scan(*checkpoints)
    for counts in [COUNTS, jnp.array([0, 0, 9, 3, 4])]:
        got = f(X0, W, SCALES, counts)
        expected = reference_scan_grad(tuple(counts.tolist()))(X0, W, SCALES)
        assert tree_allclose(got, expected), counts


# An inner loop writes rows of the outer loop's buffer, as diffrax's save loop does.
ROWS, N_IN, WIDTH = 16, 3, 2


def _shared_buffer_loss(outer, inner, rows=ROWS, width=WIDTH, read_first=False):
    """`outer(cond, body, init)` and `inner(cond, body, init)` run the loops; the
    inner one gets the outer buffer `buf` in its carry and writes `N_IN` rows; the
    outer body reads a row after the inner loop, and with `read_first` before it
    too."""

    def loss(x, w, n_outer):
        def inner_body(c):
            z, buf, j = c
            z = jnp.tanh(w * z + 0.1 * j)
            return z, buf.at[j].set(z), j + 1

        def outer_body(c):
            y, buf, i, j = c
            if read_first:  # write a row and read it back before lending `buf`
                buf = buf.at[j].set(jnp.cos(y))
                y, j = y - 0.2 * buf[j], j + 1
            y, buf, j = inner(lambda c: c[2] < j + N_IN, inner_body, (y, buf, j))
            y = y + 0.3 * buf[j - 2]  # read a row the inner loop wrote
            return 0.9 * y, buf, i + 1, j

        init = (x, jnp.zeros((rows, width)), jnp.array(0), jnp.array(0))
        y, buf, _, _ = outer(lambda c: c[2] < n_outer, outer_body, init)
        return jnp.sum(y**2) + jnp.sum(jnp.sin(buf))

    return loss


def _scans(n_outer, rows=ROWS, read_first=False):
    def scans(length):
        return lambda c, b, init: scan_n(b, init, length)

    return _shared_buffer_loss(scans(n_outer), scans(N_IN), rows, WIDTH, read_first)


def _ours(
    outer_checkpoints,
    inner_checkpoints,
    inner_kind,
    rows=ROWS,
    width=WIDTH,
    read_first=False,
):
    def outer(cond, body, init):
        return bl.while_loop(
            cond,
            body,
            init,
            max_steps=5,
            checkpoints=outer_checkpoints,
            buffers=lambda c: c[1],
        )

    def inner(cond, body, init):
        if inner_kind == "scan":
            step = lambda c, _: (body(c), None)  # noqa: E731
            return bl.scan(step, init, length=N_IN, checkpoints=inner_checkpoints)[0]
        # the outer buffer is named by `buffers=` too, as diffrax does
        return bl.while_loop(
            cond,
            body,
            init,
            max_steps=N_IN + 1,
            checkpoints=inner_checkpoints,
            buffers=lambda c: c[1],
        )

    return _shared_buffer_loss(outer, inner, rows, width, read_first)


@pytest.mark.parametrize("inner_kind", ["while", "scan"])
@pytest.mark.parametrize("checkpoints", [(1, 1), (2, None), (5, 2)])
def test_inner_loop_writes_the_outer_buffer(checkpoints, inner_kind):
    x, w = jnp.array([0.3, -0.5]), jnp.array(1.1)
    f = jax.jit(jax.value_and_grad(_ours(*checkpoints, inner_kind), argnums=(0, 1)))
    for n_outer in [0, 2, 4, 7]:
        trips = min(n_outer, 5)
        expected = on_host(jax.value_and_grad(_scans(trips), argnums=(0, 1)))(
            x, w, trips
        )
        assert tree_allclose(f(x, w, n_outer), expected, rtol=1e-5), n_outer


def test_outer_body_reads_the_buffer_before_lending_it():
    """A step that writes and reads a buffer before lending it to an inner loop
    (traced before the lending is known, so the read has its dummy) is
    differentiated as one that only lends it."""
    x, w, rows = jnp.array([0.3, -0.5]), jnp.array(1.1), 5 * (N_IN + 1)
    ours = _ours(2, 2, "while", rows, read_first=True)
    f = jax.jit(jax.value_and_grad(ours, (0, 1)))
    for n_outer in [0, 3, 5]:
        ref = _scans(n_outer, rows, read_first=True)
        expected = on_host(jax.value_and_grad(ref, argnums=(0, 1)))(x, w, n_outer)
        assert tree_allclose(f(x, w, n_outer), expected, rtol=1e-5), n_outer


def test_inner_loop_writes_the_outer_buffer_jvp_and_vmap():
    x, w = jnp.array([0.3, -0.5]), jnp.array(1.1)
    ours, ref = _ours(2, 2, "while"), _scans(4)
    got = jax.jvp(lambda x, w: ours(x, w, 4), (x, w), (x, w))
    expected = on_host(lambda: jax.jvp(lambda x, w: ref(x, w, 4), (x, w), (x, w)))()
    assert tree_allclose(got, expected)
    grads = jax.vmap(jax.grad(ours), in_axes=(0, None, 0))(
        jnp.stack([x, -x]), w, jnp.array([4, 1])
    )
    for b, n in enumerate([4, 1]):
        expected = on_host(jax.grad(_scans(n)))(jnp.stack([x, -x])[b], w, n)
        assert tree_allclose(grads[b], expected, rtol=1e-5), b


def test_no_copy_of_the_outer_buffer_per_inner_step():
    """The inner loops update the outer buffer (and its cotangent) in place. The
    forward steps the reverse sweep replays run on the final buffer, a constant of
    the reverse loop, so XLA may copy it once per outer step, never per inner
    step."""
    rows, width = 64, 256
    loss = _ours(4, 2, "while", rows, width)
    grad = jax.jit(jax.grad(lambda x: loss(x, jnp.array(1.1), 5)))
    hlo = grad.lower(jnp.ones(width)).compile().as_text()
    shape = f"f32[{rows},{width}]"
    assert not copies_in_while_bodies(hlo, shape, innermost=True)
