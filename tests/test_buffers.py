"""In-place buffers: values and gradients against a `lax.scan` that carries the
array normally; vmap; the opt-in misuse check; no copies in the compiled loop."""

import functools
from contextlib import nullcontext

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import boundedloop as bl
from boundedloop._sweeps import _buffer_checks

from .helpers import copies_in_while_bodies, equal_to_host, on_host, tree_allclose


ROWS, WIDTH = 12, 3


def step(x, row_prev, i, scale):
    return jnp.sin(row_prev) * scale + 0.1 * x + 0.01 * i.astype(x.dtype)


def make_body(scale, use_pred):
    """Writes row `i` (skipping odd rows when `use_pred`), reading the last written
    row: a trajectory buffer."""

    def body(carry):
        x, buf, last, i, n = carry
        prev = jnp.where(last >= 0, buf[jnp.maximum(last, 0)], x)
        new = step(x, prev, i, scale)
        write = (i % 2 == 0) if use_pred else jnp.array(True)
        buf = buf.at[i].set(new, pred=write)
        last = jnp.where(write, i, last)
        return x, buf, last, i + 1, n

    return body


def reference_body(scale, use_pred):
    def body(carry):
        x, buf, last, i, n = carry
        prev = jnp.where(last >= 0, buf[jnp.maximum(last, 0)], x)
        new = step(x, prev, i, scale)
        write = (i % 2 == 0) if use_pred else jnp.array(True)
        buf = buf.at[i].set(jnp.where(write, new, buf[i]))
        last = jnp.where(write, i, last)
        return x, buf, last, i + 1, n

    return body


def init(x, buf0, n):
    return x, buf0, jnp.array(-1), jnp.array(0), jnp.asarray(n, jnp.int32)


def cond(carry):
    return carry[3] < carry[4]


@functools.cache
def ours(max_steps, checkpoints, use_pred):
    def loss(x, buf0, scale, n):
        out = bl.while_loop(
            cond,
            make_body(scale, use_pred),
            init(x, buf0, n),
            max_steps=max_steps,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2) + jnp.sum(out[1][0] * x), out[1]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def reference(x, buf0, scale, trips, use_pred):
    def loss(x, buf0, scale):
        body = reference_body(scale, use_pred)
        out = lax.scan(lambda c, _: (body(c), None), init(x, buf0, 0), length=trips)[0]
        return jnp.sum(out[1] ** 2) + jnp.sum(out[1][0] * x), out[1]

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return on_host(grad)(x, buf0, scale)


X = jnp.array([0.3, -0.5, 0.9])
BUF0 = jnp.linspace(-1.0, 1.0, ROWS * WIDTH).reshape(ROWS, WIDTH)
SCALE = jnp.array(1.3)


@pytest.mark.parametrize("checkpoints", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("use_pred", [False, True])
def test_values_and_gradients_match_scan(checkpoints, use_pred):
    f = ours(ROWS, checkpoints, use_pred)
    for n in [0, 1, 2, 5, 9, 12]:
        (value, buf), grads = f(X, BUF0, SCALE, n)
        (value_r, buf_r), grads_r = reference(X, BUF0, SCALE, n, use_pred)
        assert tree_allclose(buf, buf_r)
        assert tree_allclose(value, value_r)
        assert tree_allclose(grads, grads_r), (n, checkpoints)


def test_vmap_batched_buffers_indices_and_pred():
    f = ours(ROWS, 3, True)
    ns = jnp.array([0, 4, 11, 7])
    xs = jnp.stack([X * s for s in [1.0, -0.7, 0.4, 1.5]])
    bufs = jnp.stack([BUF0 * s for s in [1.0, 0.5, -1.0, 2.0]])
    (values, out_bufs), grads = jax.vmap(f, in_axes=(0, 0, None, 0))(
        xs, bufs, SCALE, ns
    )
    for b in range(4):
        (v, buf), g = reference(xs[b], bufs[b], SCALE, int(ns[b]), True)
        assert tree_allclose(out_bufs[b], buf)
        assert tree_allclose((grads[0][b], grads[1][b], grads[2][b]), g)


def test_forward_matches_lax_while_loop_bitwise():
    body = make_body(SCALE, True)
    got = bl.while_loop(
        cond, body, init(X, BUF0, 9), max_steps=ROWS, buffers=lambda c: c[1]
    )
    expected = on_host(
        lambda: lax.while_loop(cond, reference_body(SCALE, True), init(X, BUF0, 9))
    )()
    assert equal_to_host(tuple(got), tuple(expected))


def test_several_buffers_and_integer_buffer():
    def body(c):
        i, floats, ints = c
        floats = floats.at[i].set(
            jnp.cos(i.astype(jnp.float32)) * c[1][jnp.maximum(i - 1, 0)] * 0
            + 1.5 * i.astype(jnp.float32)
        )
        ints = ints.at[i].set(i * 2)
        return i + 1, floats, ints

    out = bl.while_loop(
        lambda c: c[0] < 4,
        body,
        (jnp.array(0), jnp.zeros(6), jnp.zeros(6, jnp.int32)),
        max_steps=6,
        buffers=lambda c: (c[1], c[2]),
    )
    assert np.array_equal(out[2], [0, 2, 4, 6, 0, 0])
    assert np.allclose(out[1], [0, 1.5, 3.0, 4.5, 0, 0])


def test_buffer_errors():
    with pytest.raises(TypeError, match="array of the carry"):
        bl.while_loop(
            cond,
            make_body(SCALE, False),
            init(X, BUF0, 3),
            max_steps=4,
            buffers=lambda c: 3.0,
        )
    with pytest.raises(TypeError, match="at least one axis"):
        bl.while_loop(
            cond,
            make_body(SCALE, False),
            init(X, BUF0, 3),
            max_steps=4,
            buffers=lambda c: c[3],
        )
    with pytest.raises(TypeError, match="scalar integers"):
        bl.while_loop(
            lambda c: c[1] < 2,
            lambda c: (c[0].at[0.5].set(1.0), c[1] + 1),
            (jnp.zeros(3), 0),
            max_steps=3,
            buffers=lambda c: c[0],
        )


def _write_in_a_branch(buf, i):
    def write():
        buf.at[i].set(1.0)
        return 0

    lax.cond(i > 0, write, lambda: 0)
    return buf


_NESTED = {
    # the buffer as an operand or argument: JAX abstractifies it
    "cond": lambda buf, i: lax.cond(
        i > 0, lambda b: b.at[i].set(1.0), lambda b: b, buf
    ),
    "switch": lambda buf, i: lax.switch(i, [lambda b: b, lambda b: b], buf),
    "select": lambda buf, i: lax.select(i > 0, buf, buf),
    "where": lambda buf, i: jnp.where(i > 0, buf, buf),
    "jit": lambda buf, i: jax.jit(lambda b, i: b.at[i].set(1.0))(buf, i),
    # the buffer closed over (or static): written inside the inner trace
    "cond_closure": lambda buf, i: _write_in_a_branch(buf, i),
    "filter_jit": lambda buf, i: eqx.filter_jit(lambda b, i: b.at[i].set(1.0))(buf, i),
    "fori_read": lambda buf, i: lax.fori_loop(
        0, 2, lambda k, b: b.at[k].set(buf[k + 2]), buf
    ),
}


@pytest.mark.parametrize("case", list(_NESTED))
def test_buffer_in_a_nested_transformation_is_our_error(case):
    """Not JAX's "`__jax_array__()` during abstractification" nor a leaked tracer:
    an error at trace time naming the buffer and the conditional write."""

    def body(c):
        other, buf, i = c
        return other, _NESTED[case](buf, i), i + 1

    with pytest.raises(
        ValueError, match=r"Buffer` \(`carry\[1\]`, float32\[5\]\)"
    ) as e:
        bl.while_loop(
            lambda c: c[2] < 3,
            body,
            (jnp.zeros(2), jnp.zeros(5), 0),
            max_steps=4,
            buffers=lambda c: (c[0], c[1]),
        )
    assert "`buf.at[i].set(x, pred=p)`" in str(e.value)


def read_after_write(c):
    """Writes row i, then reads it back in the same step."""
    x, buf, i = c
    buf = buf.at[i].set(jnp.sin(x) * 1.5)
    return jnp.cos(buf[i]) + x * 0.5, buf, i + 1


@pytest.mark.parametrize("checkpoints", [1, 3, 12])
def test_read_after_write_in_one_step(checkpoints):
    def loss(x, body_fn, **kw):
        out = body_fn((x, jnp.zeros((ROWS, WIDTH)), 0))
        return jnp.sum(out[0]) + jnp.sum(out[1] ** 2)

    def ours(x):
        out = bl.while_loop(
            lambda c: c[2] < 7,
            read_after_write,
            (x, jnp.zeros((ROWS, WIDTH)), 0),
            max_steps=ROWS,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[0]) + jnp.sum(out[1] ** 2)

    def ref(x):
        out = lax.scan(
            lambda c, _: (read_after_write(c), None),
            (x, jnp.zeros((ROWS, WIDTH)), 0),
            length=7,
        )[0]
        return jnp.sum(out[0]) + jnp.sum(out[1] ** 2)

    assert tree_allclose(jax.grad(ours)(X), on_host(jax.grad(ref))(X))


def test_misuse_check_catches_double_write_and_unwritten_read():
    def double_write(c):
        buf, i = c
        return buf.at[i // 2].set(1.0 * i), i + 1

    def unwritten_read(c):
        buf, i = c
        return buf.at[i].set(buf[i + 1] + 1.0), i + 1

    def make_run(body):
        def run(x):
            return bl.while_loop(
                lambda c: c[1] < 3,
                body,
                (x, 0),
                max_steps=4,
                checkpoints=2,
                buffers=lambda c: c[0],
            )[0]

        return run

    def grad_of(run):
        return jax.jit(jax.grad(lambda x: jnp.sum(run(x) ** 2)))

    zeros = jnp.zeros(5)
    # the forward's values are right (a `jnp` array's): by default the read whose
    # gradient would be wrong is an error of the gradient, and the double write
    # (whose gradient is right: nothing reads the first value) passes; checked,
    # both are errors; off, neither (the read ahead of a counter also warns while
    # tracing, checked or not)
    for body, message, warns, by_default in [
        (double_write, "location already written", None, False),
        (unwritten_read, "wrote that location only later", "writes 1 step later", True),
    ]:
        with pytest.warns(UserWarning, match=warns) if warns else nullcontext():
            if by_default and _buffer_checks.callbacks_are_costly():
                # off a CPU the default check's error path is NaN
                got = jax.block_until_ready(grad_of(make_run(body))(zeros))
                assert np.all(np.isnan(got))
            elif by_default:
                with pytest.raises(Exception, match=message):
                    jax.block_until_ready(grad_of(make_run(body))(zeros))
            else:
                jax.block_until_ready(grad_of(make_run(body))(zeros))
            with bl.buffer_checks(False):
                jax.block_until_ready(grad_of(make_run(body))(zeros))
            # the flag is read when a loop is traced, so trace afresh in the block
            with bl.buffer_checks():
                jax.block_until_ready(jax.jit(make_run(body))(zeros))
                with pytest.raises(Exception, match=message):
                    jax.block_until_ready(grad_of(make_run(body))(zeros))

    # a correct loop passes the check, forward and gradient
    def good(x):
        return bl.while_loop(
            lambda c: c[2] < 9,
            read_after_write,
            (x, jnp.zeros((ROWS, WIDTH)), 0),
            max_steps=ROWS,
            checkpoints=3,
            buffers=lambda c: c[1],
        )[1]

    with bl.buffer_checks():
        jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.sum(good(x))))(X))


@pytest.mark.parametrize("checkpoints", [4, 64])
def test_no_copy_of_the_buffer_inside_the_compiled_loops(checkpoints):
    rows, width = 64, 256

    def loss(x):
        def body(c):
            v, buf, i = c
            v = jnp.tanh(v * 1.1)
            return v, buf.at[i].set(v), i + 1

        out = bl.while_loop(
            lambda c: c[2] < 40,
            body,
            (x, jnp.zeros((rows, width)), 0),
            max_steps=rows,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(jnp.ones(width)).compile().as_text()
    assert not copies_in_while_bodies(hlo, f"f32[{rows},{width}]")


def test_buffer_passes_array_annotations():
    """A buffer is admitted where its array would be, by jaxtyping's checks with
    beartype: plain array hints and equinox's `MaybeBuffer` (which diffrax puts on
    its save state), and refused on a wrong dtype or shape, as its array would be."""
    beartype = pytest.importorskip("beartype")
    import equinox.internal as eqxi
    from jaxtyping import Array, Float, Int, jaxtyped

    def accepts(hint):
        @jaxtyped(typechecker=beartype.beartype)
        def f(x: hint):
            return x

        return f

    admitted = [Float[Array, "4 2"], eqxi.MaybeBuffer[Float[Array, "times 2"]]]
    refused = [Int[Array, "4 2"], eqxi.MaybeBuffer[Float[Array, "4 3"]]]
    seen = []

    def body(carry):
        i, ys = carry
        seen.append(isinstance(ys, jax.Array))
        for hint in admitted:
            accepts(hint)(ys)
        for hint in refused:
            with pytest.raises(Exception, match="Type-check error"):
                accepts(hint)(ys)
        return i + 1, ys.at[i].set(jnp.ones(2))

    bl.while_loop(
        lambda c: c[0] < 4,
        body,
        (0, jnp.zeros((4, 2))),
        max_steps=4,
        buffers=lambda c: c[1],
    )
    assert seen and all(seen)
