"""Right or loud by default: a buffer body drawn from the mistakes users make
(reads through a clamp, an index array, a wrap at step 0, the whole buffer; writes
at `i // 2`; with and without `pred`; on `bl.while_loop` and `bl.scan`; each step
in an inner loop or not; several checkpoint counts) has, with no switch entered, a gradient that either equals the
same body's unrolled on `jnp` arrays or raises our error naming the read.

The default suite draws a few bodies; `BOUNDEDLOOP_CHECK_EXAMPLES=500 python -m
pytest -n 0 tests/test_default_checks.py` draws many.
"""

import contextlib
import functools
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, Phase, settings, strategies as st

import boundedloop as bl
from boundedloop._api._equinox_signature import equinox_style_while_loop
from boundedloop._sweeps import _buffer_checks, _cost_model

from .helpers import on_host, tree_allclose


ROWS = 6
W = jnp.asarray(np.random.default_rng(1).normal(size=(3, 3)) / 2, jnp.float32)
X0 = jnp.array([0.3, -0.2, 0.5], jnp.float32)
ORDERS = {
    "forward": np.arange(ROWS),  # each row read after it is written
    "reversed": np.arange(ROWS)[::-1],  # rows read before they are written
    "shifted": np.roll(np.arange(ROWS), 1),  # step 0 reads the last row
}
# our error for a read whose gradient would be wrong
LATER = "wrote that location only later"
# and, inside `bl.buffer_checks()`, for a location written twice
ALREADY = "a location already written"


def _read(kind: str, ys, i, order):
    if kind == "none":
        return jnp.zeros(3)
    if kind == "previous":  # `ys[i - 1]`: at step 0 the last row, as `jnp` wraps
        return ys[i - 1]
    if kind == "previous_guarded":
        return jnp.where(i > 0, ys[jnp.maximum(i - 1, 0)], 0.0)
    if kind == "clamped_ahead":
        return ys[jnp.minimum(i + 1, ROWS - 1)]
    if kind == "clipped_ahead":
        return ys[jnp.clip(i + 1, 0, ROWS - 1)]
    if kind == "index_array":
        return ys[order[i]]
    if kind == "whole":
        return jnp.mean(ys[...], axis=0)
    raise AssertionError(kind)


READS = (
    "none",
    "previous",
    "previous_guarded",
    "clamped_ahead",
    "clipped_ahead",
    "index_array",
    "whole",
)


class Body(NamedTuple):
    read: str
    order: str  # of "index_array"'s reads
    write: str  # "step" (`ys[i]`) or "half" (`ys[i // 2]`)
    pred: bool  # the write only at even steps
    scan: bool  # on `bl.scan`, not `bl.while_loop`
    checkpoints: int | None
    steps: int
    rules: bool = False  # inside `bl.buffer_checks()`, which names the writing step
    # each step inside an inner loop of one step, to which the buffer is lent
    nested: bool = False


def _step(body: Body):
    order = jnp.asarray(ORDERS[body.order])

    def step(c):
        x, ys, i = c
        x = jnp.tanh(W @ x + 0.5 * _read(body.read, ys, i, order))
        where = i // 2 if body.write == "half" else i
        if not body.pred:
            return x, ys.at[where].set(x), i + 1
        if isinstance(ys, bl.Buffer):
            return x, ys.at[where].set(x, pred=i % 2 == 0), i + 1
        # the reference, on a `jnp` array: the same write, where the step is even
        return x, ys.at[where].set(jnp.where(i % 2 == 0, x, ys[where])), i + 1

    return step


def _ours(body: Body):
    step = _step(body)
    if body.nested:
        inner = step

        def step(c):
            i = c[2]
            return bl.while_loop(lambda c: c[2] < i + 1, inner, c, max_steps=1)

    def loss(x0):
        init = (x0, jnp.zeros((ROWS, 3)), 0)
        if body.scan:
            out, _ = bl.scan(
                lambda c, _: (step(c), None),
                init,
                length=body.steps,
                checkpoints=body.checkpoints,
                buffers=lambda c: c[1],
            )
        else:
            out = bl.while_loop(
                lambda c: c[2] < body.steps,
                step,
                init,
                max_steps=ROWS,
                checkpoints=body.checkpoints,
                buffers=lambda c: c[1],
            )
        return jnp.sum(out[0] ** 2) + jnp.sum(jnp.sin(out[1]))

    return loss


def _unrolled(body: Body):
    step = _step(body)

    def loss(x0):
        carry = (x0, jnp.zeros((ROWS, 3)), 0)
        for _ in range(body.steps):
            carry = step(carry)
        return jnp.sum(carry[0] ** 2) + jnp.sum(jnp.sin(carry[1]))

    return loss


bodies = st.builds(
    Body,
    read=st.sampled_from(READS),
    order=st.sampled_from(sorted(ORDERS)),
    write=st.sampled_from(["step", "half"]),
    pred=st.booleans(),
    scan=st.booleans(),
    checkpoints=st.sampled_from([1, 2, None]),
    steps=st.integers(1, ROWS),
    rules=st.sampled_from([False, False, True]),
    nested=st.booleans(),
)
_EXAMPLES = int(os.environ.get("BOUNDEDLOOP_CHECK_EXAMPLES", "5"))


@settings(
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize="BOUNDEDLOOP_CHECK_EXAMPLES" not in os.environ,
    database=None,
    # each example compiles a gradient: no shrinking by search
    phases=(Phase.explicit, Phase.generate),
)
@given(body=bodies)
# a read of the row the next outer step writes, from the inner loop: silently wrong
# before the outer loop stamped its lent buffer
@example(body=Body("clamped_ahead", "forward", "step", False, False, 2, 5, nested=True))
def test_the_default_gradient_is_right_or_loud(body):
    expected = on_host(jax.grad(_unrolled(body)))(X0)
    try:
        with bl.buffer_checks() if body.rules else contextlib.nullcontext():
            got = jax.block_until_ready(jax.jit(jax.grad(_ours(body)))(X0))
    except Exception as e:  # noqa: BLE001 (any error must be ours)
        message = str(e)
        if body.rules and ALREADY in message:  # a rule broken: allowed to raise
            return
        assert LATER in message, (body, e)
        if not body.rules or body.scan:  # `bl.scan` checks only the reads
            assert "(`bl.buffer_checks()` names it)" in message
            return
        # it names the read's step and a later step that wrote the location
        pattern = r"at step (\d+) \(counting from 0\).*?(at step (\d+)|in that step)"
        found = re.search(pattern, message)
        assert found, (body, e)
        assert found[3] is None or int(found[3]) > int(found[1]), (body, found[0])
        return
    if _buffer_checks.callbacks_are_costly() and np.all(np.isnan(got)):
        return  # off a CPU the default check's error path is NaN (test below)
    # float32 through at most 6 `tanh` steps; a wrong read is off by 1e-2 or more
    assert tree_allclose(got, expected, rtol=1e-4, atol=1e-5), body


def test_where_callbacks_are_costly_the_default_gradient_is_nan(monkeypatch):
    """Off a CPU the default check's error path is NaN in the gradient (a host
    callback costs a TPU even where it does not fire); inside `bl.buffer_checks()`
    it raises."""
    monkeypatch.setattr(_buffer_checks, "callbacks_are_costly", lambda: True)
    wrong = Body("clamped_ahead", "forward", "step", False, False, 2, 5)
    right = wrong._replace(read="previous_guarded")
    assert np.all(np.isnan(jax.jit(jax.grad(_ours(wrong)))(X0)))
    expected = on_host(jax.grad(_unrolled(right)))(X0)
    assert tree_allclose(jax.jit(jax.grad(_ours(right)))(X0), expected, rtol=1e-4)
    with bl.buffer_checks(), pytest.raises(Exception, match=LATER):
        jax.block_until_ready(jax.jit(jax.grad(_ours(wrong)))(X0))


@pytest.mark.skipif(
    _buffer_checks.callbacks_are_costly(), reason="the default's error path is NaN"
)
def test_under_jax_jit_the_first_line_is_ours(caplog):
    """Under `jax.jit` the error arrives inside XLA's `JaxRuntimeError`: the message
    is logged first, and JAX's log of the failed callback is dropped; under
    `bl.filter_jit`, whose error is the message itself, nothing is logged."""
    wrong = _ours(Body("clamped_ahead", "forward", "step", False, False, 2, 5))
    with pytest.raises(Exception, match=LATER):
        jax.block_until_ready(jax.jit(jax.grad(wrong))(X0))
    first = caplog.records[0]
    assert first.name == "boundedloop" and LATER in first.getMessage()
    assert "at step 0 (counting from 0)" in first.getMessage()
    assert not [r for r in caplog.records if r.name.startswith("jax")]
    caplog.clear()
    with pytest.raises(Exception, match=LATER):
        jax.block_until_ready(bl.filter_jit(jax.grad(wrong))(X0))
    assert not caplog.records


unchecked_loop = functools.partial(equinox_style_while_loop, checked=False)


def _nested(reads: str, buffers: bool, outer_checked: bool = True):
    """Outer step `i` runs an inner loop of 2 steps writing rows `2i` and `2i + 1`,
    reading a row ahead: `"inner"`, row `j + 1` (clamped: written later by this
    inner loop, or by the next outer step); `"outer"`, row `2i + 2` (written by the
    next outer step only; none at the last); or, `"behind"`, row `2i - 1` (written
    by the previous outer step; none at the first)."""

    def inner_body(c):
        x, ys, j = c
        if reads == "inner":
            r = ys[jnp.minimum(j + 1, 2 * 4 - 1)]
        elif reads == "behind":  # row 2i - 1, written by the previous outer step
            k = j - 1 - j % 2
            r = jnp.where(k >= 0, ys[jnp.maximum(k, 0)], 0.0)
        else:
            k = j + 2 - j % 2
            r = jnp.where(k < 2 * 4, ys[jnp.minimum(k, 2 * 4 - 1)], 0.0)
        x = jnp.tanh(W @ x + 0.5 * r)
        return x, ys.at[j].set(x), j + 1

    def outer_body(c):
        x, ys, i = c
        inner = (x, ys, 2 * i)
        if buffers:
            cond = lambda c: c[2] < 2 * i + 2  # noqa: E731
            inner = bl.while_loop(cond, inner_body, inner, max_steps=2)
        else:
            inner = inner_body(inner_body(inner))
        return inner[0], inner[1], i + 1

    def loss(x0):
        carry = (x0, jnp.zeros((2 * 4, 3)), 0)
        if buffers:
            cond = lambda c: c[2] < 4  # noqa: E731
            buffer = lambda c: c[1]  # noqa: E731
            # unchecked: as a client's own loop (checked, the equinox-style loop
            # would check only the reads inside `bl.buffer_checks()`)
            loop = bl.while_loop if outer_checked else unchecked_loop
            carry = loop(
                cond, outer_body, carry, max_steps=4, checkpoints=2, buffers=buffer
            )
        else:
            for _ in range(4):
                carry = outer_body(carry)
        return jnp.sum(carry[0] ** 2) + jnp.sum(jnp.sin(carry[1]))

    return loss


@pytest.mark.skipif(
    _buffer_checks.callbacks_are_costly(), reason="the default's error path is NaN"
)
@pytest.mark.parametrize("reads", ["inner", "outer"])
def test_nested_reads_ahead_are_loud(reads):
    """Both raise: `"inner"` from the inner loop's check; `"outer"` from the outer
    loop's, whose forward sweep stamps the lent buffer (unchecked, its gradient
    was off by 2.6e-3)."""
    with pytest.raises(Exception, match=LATER) as e:
        jax.block_until_ready(jax.jit(jax.grad(_nested(reads, True)))(X0))
    if reads == "outer":  # outer step 0's inner loop reads row 2, which step 1 writes
        assert "a loop inside `body_fun`, at step 0 (counting from 0)" in str(e.value)
        assert "at [2, 0]" in str(e.value)
    with bl.buffer_checks(), pytest.raises(Exception, match=LATER) as e:
        jax.block_until_ready(jax.jit(jax.grad(_nested(reads, True)))(X0))
    if reads == "outer":
        assert "only later: at step 1." in str(e.value)


def test_a_large_lent_buffer_is_stamped_inside_buffer_checks(monkeypatch):
    """By default a lent buffer larger than `SMALL_BUFFERS` is not stamped (it
    would be copied every outer step), so an inner loop's read of what a later
    outer step writes goes unchecked there; inside `bl.buffer_checks()` it is
    stamped whatever its size, and the read raises (before, it passed there too)."""
    monkeypatch.setattr(_cost_model, "SMALL_BUFFERS", 0)  # every buffer is large
    jax.block_until_ready(jax.jit(jax.grad(_nested("outer", True)))(X0))
    with bl.buffer_checks(), pytest.raises(Exception, match=LATER) as e:
        jax.block_until_ready(jax.jit(jax.grad(_nested("outer", True)))(X0))
    assert "only later: at step 1." in str(e.value)


@pytest.mark.skipif(
    _buffer_checks.callbacks_are_costly(), reason="the default's error path is NaN"
)
def test_an_unchecked_loop_keeps_its_inner_loops_checked():
    """`checked=False` (a client's own loop, as diffrax's stage loop) drops that
    loop's check only: the inner loop's read ahead still raises; the outer loop's
    read ahead, which only its stamps would find, passes unchecked."""
    with pytest.raises(Exception, match=LATER):
        jax.block_until_ready(jax.jit(jax.grad(_nested("inner", True, False)))(X0))
    jax.block_until_ready(jax.jit(jax.grad(_nested("outer", True, False)))(X0))


@pytest.mark.parametrize("nested", [False, True])
def test_a_loop_that_reads_no_buffer_is_checked_only_for_the_rules(nested):
    """By default only reads are checked: a body that writes its buffer and never
    reads it (itself, or through the inner loop it lends the buffer to) has
    nothing to check, and its gradient no check; inside `bl.buffer_checks()` its
    writes are."""

    def body(c):
        x, ys, i = c
        x = jnp.tanh(W @ x)
        return x, ys.at[i].set(x), i + 1

    def outer_body(c):  # one inner step writing row i
        x, ys, i = c
        x, ys, _ = bl.while_loop(lambda d: d[2] < i + 1, body, c, max_steps=1)
        return x, ys, i + 1

    def loss(x0):
        init = (x0, jnp.zeros((4, 3)), 0)
        out = bl.while_loop(
            lambda c: c[2] < 4,
            outer_body if nested else body,
            init,
            max_steps=4,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2)

    def checks():  # a new function each time: traced afresh
        return str(jax.make_jaxpr(jax.grad(lambda x: loss(x)))(X0)).count(
            "boundedloop_raise_if"
        )

    assert checks() == 0
    with bl.buffer_checks():
        assert checks() == 1  # nested, the inner loop's: it makes the writes


def test_nested_reads_of_rows_written_before_are_right():
    """The inner loop reads the row the outer loop's previous step wrote: no false
    alarm, and the gradient of the unrolled loops."""
    expected = on_host(jax.grad(_nested("behind", False)))(X0)
    got = jax.jit(jax.grad(_nested("behind", True)))(X0)
    assert tree_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    _buffer_checks.callbacks_are_costly(), reason="the default's error path is NaN"
)
def test_nested_stamps_under_vmap():
    """The stamps are batched with the buffer: a batch of rows read behind is right,
    a batch with a read ahead raises."""
    xs = jnp.stack([X0, 0.5 * X0, -X0])
    expected = on_host(jax.vmap(jax.grad(_nested("behind", False))))(xs)
    got = jax.jit(jax.vmap(jax.grad(_nested("behind", True))))(xs)
    assert tree_allclose(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="a loop inside `body_fun`"):
        jax.block_until_ready(jax.jit(jax.vmap(jax.grad(_nested("outer", True))))(xs))
