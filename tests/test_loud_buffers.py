"""Nothing silently wrong from a buffer mistake (issue 54): each mistake is an error,
or gives what the same body gives on ordinary `jnp` arrays in an unrolled Python
loop, computed on the host.

- trace time, always: a write whose result is dropped, a write to a version of a
  buffer already written, a static location written twice in one step or at every
  step, a static index out of range;
- run time, inside `bl.buffer_checks()`: a location written twice, and a read
  whose value matters of a location the loop writes only later, both of which
  leave the values right and make the gradient wrong;
- trace time, a warning: a read at a location that a later step writes, both
  indices following a counter in the carry (whether the value read matters is
  known only at run time);
- as `jnp`: a traced index out of range drops the write; reading a version of a
  buffer from before a write sees the values from before it.

The class is generated too: a body reading and writing at offsets from the step
(runtime data, so one compiled gradient serves every example) must, checked,
either raise exactly when the rules are broken or match the unrolled reference.
"""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings, strategies as st

import boundedloop as bl
from boundedloop._sweeps import _buffer_checks

from .helpers import on_host, tree_allclose


W = 0.5 * jnp.eye(3) + 0.1
X0 = jnp.ones(3)
ALREADY = "a location already written"
LATER = "wrote that location only later"
AHEAD = "at a location that it writes"


def unrolled(body, carry, steps):
    """The body on ordinary arrays, `steps` times: the reference."""
    for _ in range(steps):
        carry = body(carry)
    return carry


def twice_body(w, index=lambda i: 0):
    """The issue's first case: row 0 written every step and read back (or the row
    `index(i)`, which may be traced)."""

    def body(c):
        x, ys, i = c
        x = jnp.tanh(w @ x) * (1 + ys[0])
        return x, ys.at[index(i)].set(x), i + 1

    return body


def twice_loss(w, index=lambda i: 0):
    out = bl.while_loop(
        lambda c: c[2] < 12,
        twice_body(w, index),
        (X0, jnp.zeros((12, 3)), 0),
        max_steps=12,
        buffers=lambda c: c[1],
    )
    return jnp.sum(out[0])


def test_a_row_written_at_every_step_is_an_error_at_trace_time():
    line = twice_body.__code__.co_firstlineno + 7  # the write
    with pytest.raises(ValueError, match="every step writes the same location") as e:
        jax.make_jaxpr(jax.grad(twice_loss))(W)
    assert "`carry[1]`, float32[12, 3]" in str(e.value)
    assert re.search(rf"test_loud_buffers.py:{line} in body", str(e.value))


def test_a_row_written_twice_is_an_error_of_the_checked_gradient():
    def index(i):  # row 0 at steps 0 and 1 (a traced index)
        return i // 2

    loss = lambda w: twice_loss(w, index)  # noqa: E731
    # the forward is right (as `jnp`, the last write wins)...
    init = (X0, jnp.zeros((12, 3)), 0)
    expected = on_host(lambda w: jnp.sum(unrolled(twice_body(w, index), init, 12)[0]))
    assert tree_allclose(bl.filter_jit(loss)(W), expected(W))
    # ...the gradient would not be: checked, an error naming the first write
    with bl.buffer_checks():
        with pytest.raises(eqx.EquinoxRuntimeError) as e:
            jax.block_until_ready(bl.filter_jit(jax.grad(loss))(W))
    message = str(e.value)
    assert "`carry[1]`, float32[12, 3] at [0] at step 0 (counting from 0)" in message
    assert "wrote that location again at step 1:" in message and ALREADY in message
    line = twice_body.__code__.co_firstlineno + 7
    assert re.search(rf"test_loud_buffers.py:{line} in body", message)


def ahead_body(w):
    """The issue's second case: a read of a row not yet written (the next step
    writes it), used multiplicatively."""

    def body(c):
        x, ys, i = c
        x = jnp.tanh(w @ x) * (1 + 0.1 * ys[i + 1])
        return x, ys.at[i].set(x), i + 1

    return body


def ahead_loss(w):
    out = bl.while_loop(
        lambda c: c[2] < 5,
        ahead_body(w),
        (X0, jnp.zeros((6, 3)), 0),
        max_steps=6,
        buffers=lambda c: c[1],
    )
    return jnp.sum(out[0]) + jnp.sum(out[1])


def test_a_read_of_a_row_written_later_is_an_error_of_the_gradient():
    def reference(w):
        out = unrolled(ahead_body(w), (X0, jnp.zeros((6, 3)), 0), 5)
        return jnp.sum(out[0]) + jnp.sum(out[1])

    # the value is right (the forward reads what `jnp` would)...
    with pytest.warns(UserWarning, match=AHEAD):
        assert tree_allclose(jax.jit(ahead_loss)(W), on_host(reference)(W))
    # ...its gradient is not, so checked it is an error, at the read
    with bl.buffer_checks(), pytest.warns(UserWarning, match=AHEAD):
        with pytest.raises(eqx.EquinoxRuntimeError, match=LATER) as e:
            jax.block_until_ready(bl.filter_jit(jax.grad(ahead_loss))(W))
    assert "`carry[1]`, float32[6, 3] at [1] at step 0" in str(e.value)
    # by default too, the gradient is an error, saying how to turn it off; off a
    # CPU, where a host callback is costly, it is NaN instead
    if _buffer_checks.callbacks_are_costly():
        with pytest.warns(UserWarning, match=AHEAD + " 1 step later"):
            got = jax.block_until_ready(bl.filter_jit(jax.grad(ahead_loss))(W))
        assert np.all(np.isnan(got))
    else:
        with pytest.warns(UserWarning, match=AHEAD + " 1 step later"):
            with pytest.raises(eqx.EquinoxRuntimeError, match=LATER) as e:
                jax.block_until_ready(bl.filter_jit(jax.grad(ahead_loss))(W))
        assert "Checked by default in every gradient" in str(e.value)
    # off, the trace-time warning is what the user gets
    with bl.buffer_checks(False), pytest.warns(UserWarning, match=AHEAD):
        jax.block_until_ready(jax.jit(jax.grad(ahead_loss))(W))


def _warnings_of(body, steps=5, counter=0):
    """The read-ahead warnings of tracing a loop of `body` over a (6, 3) buffer."""
    init = (X0, jnp.zeros((6, 3)), counter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(
            lambda: bl.while_loop(
                lambda c: c[2] < steps, body, init, max_steps=6, buffers=lambda c: c[1]
            )
        )
    return [str(w.message) for w in caught if AHEAD in str(w.message)]


def test_a_read_ahead_of_a_counter_warns_at_trace_time():
    """Reads at `i + r` against unconditional writes at `i + w`, the counter `i`
    advancing by `k`: a warning where a later step (or later in the same step)
    writes what was read, naming both lines; none otherwise."""

    def body(read, write, k=1, pred=None):
        def step(c):
            x, ys, i = c
            x = jnp.tanh(W @ x) * (1 + ys[read(i)])
            return x, ys.at[write(i)].set(x, pred=pred), i + k

        return step

    (ahead,) = _warnings_of(body(lambda i: i + 1, lambda i: i))
    assert "writes 1 step later" in ahead and "`carry[1]`, float32[6, 3]" in ahead
    (same,) = _warnings_of(body(lambda i: i, lambda i: i))
    assert f"{AHEAD} later, at" in same  # in the same step, after the read
    (down,) = _warnings_of(body(lambda i: i - 2, lambda i: i, k=-1), counter=5)
    assert "writes 2 steps later" in down
    assert _warnings_of(body(lambda i: 2 * i + 2, lambda i: i + 1, k=1)) == []
    # behind the writes, a conditional write, an offset that is not a constant
    assert _warnings_of(body(lambda i: jnp.maximum(i - 1, 0), lambda i: i)) == []
    assert _warnings_of(body(lambda i: i + 1, lambda i: i, pred=True)) == []
    assert _warnings_of(body(lambda i: i + 1, lambda i: i + 1)) != []
    assert _warnings_of(body(lambda i: i, lambda i: i + 1)) == []

    def after_the_write(c):  # reads what it has just written
        x, ys, i = c
        ys = ys.at[i].set(jnp.tanh(W @ x))
        return ys[i], ys, i + 1

    assert _warnings_of(after_the_write) == []


def test_reads_whose_value_does_not_matter_or_is_never_overwritten_pass():
    """A read dropped by `jnp.where` (or multiplied by zero) before its row is
    written, and a read of an initial row the loop never writes, are right."""

    def body(c):
        x, ys, i = c
        prev = jnp.where(i > 0, ys[jnp.maximum(i - 1, 0)], ys[5])
        # ahead of the writes, so it warns while tracing; its value is dropped
        x = jnp.tanh(W @ x + prev) * (1 + 0.0 * ys[i + 1])
        return x, ys.at[i].set(x), i + 1

    init = (X0, jnp.zeros((6, 3)).at[5].set(0.3), 0)

    def loss(x0):
        out = bl.while_loop(
            lambda c: c[2] < 5,
            body,
            (x0, *init[1:]),
            max_steps=6,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[0] ** 2) + jnp.sum(out[1])

    def reference(x0):
        out = unrolled(body, (x0, *init[1:]), 5)
        return jnp.sum(out[0] ** 2) + jnp.sum(out[1])

    with bl.buffer_checks(), pytest.warns(UserWarning, match=AHEAD):
        got = jax.jit(jax.value_and_grad(loss))(X0)
    assert tree_allclose(got, on_host(jax.value_and_grad(reference))(X0))


def write_loop(body, rows=4, steps=4):
    return bl.while_loop(
        lambda c: c[2] < steps,
        body,
        (jnp.array(1.0), jnp.zeros(rows), 0),
        max_steps=steps,
        buffers=lambda c: c[1],
    )[1]


def test_a_dropped_write_is_an_error_at_trace_time():
    def body(c):
        x, ys, i = c
        ys.at[i].set(x)  # its result unused
        return x + 1, ys, i + 1

    with pytest.raises(ValueError, match="is never used") as e:
        jax.make_jaxpr(lambda: write_loop(body))()
    assert "`carry[1]`, float32[4]" in str(e.value)
    assert "test_loud_buffers.py" in str(e.value)


def test_writes_must_chain():
    def body(c):
        x, ys, i = c
        ys.at[i].set(x)
        return x + 1, ys.at[i].set(2 * x), i + 1

    with pytest.raises(ValueError, match="writes must form one chain"):
        jax.make_jaxpr(lambda: write_loop(body))()


def test_a_static_location_written_twice_in_one_step_is_an_error_at_trace_time():
    def body(c):
        x, ys, i = c
        return x + 1, ys.at[1].set(x).at[-3].set(x), i + 1

    with pytest.raises(ValueError, match=r"written twice in one step at \[-3\]"):
        jax.make_jaxpr(lambda: write_loop(body))()


def test_out_of_range_indices_behave_as_jnp():
    def traced(c):
        x, ys, i = c
        return x + 1, ys.at[i].set(x), i + 1

    # six steps into four rows: the last two writes are dropped, as `jnp` drops them
    got = jax.jit(lambda: write_loop(traced, rows=4, steps=6))()
    expected = unrolled(traced, (jnp.array(1.0), jnp.zeros(4), 0), 6)[1]
    assert np.array_equal(got, expected)
    assert np.array_equal(got, [1.0, 2.0, 3.0, 4.0])

    def static(c):
        x, ys, i = c
        return x + 1, ys.at[7].set(x), i + 1

    with pytest.raises(IndexError, match="out of bounds"):
        jax.make_jaxpr(lambda: write_loop(static))()


def test_reading_a_buffer_from_before_a_write_sees_the_values_before_it():
    def body(c):
        x, ys, i = c
        new = ys.at[i].set(x)
        # `ys`, not `new`: row i - 1 (written at the last step) as `jnp` reads it
        # (at step 0, row 0 is written later in the step: dropped by `jnp.where`)
        last = jnp.where(i > 0, ys[jnp.maximum(i - 1, 0)], 0.0)
        return x * 1.5 + last, new, i + 1

    def loss(x0):
        init = (x0, jnp.zeros((5, 1)).at[0].set(0.25), 0)
        out = bl.while_loop(
            lambda c: c[2] < 5, body, init, max_steps=5, buffers=lambda c: c[1]
        )
        return jnp.sum(out[0]) + jnp.sum(out[1] ** 2)

    def reference(x0):
        out = unrolled(body, (x0, jnp.zeros((5, 1)).at[0].set(0.25), 0), 5)
        return jnp.sum(out[0]) + jnp.sum(out[1] ** 2)

    x0 = jnp.array([0.3])
    got = jax.jit(jax.value_and_grad(loss))(x0)
    assert tree_allclose(got, on_host(jax.value_and_grad(reference))(x0))


# The class: read at `i + a1` (scaled by `m1`), write at `i + b` (where `pred`), read
# back at `i + a2` (scaled by `m2`); the offsets, scales and predicates are runtime
# data.
ROWS, STEPS = 5, 5


def class_body(w, a1, b, a2, m1, m2, every_other):
    def body(c):
        x, ys, i = c
        r1 = ys[jnp.clip(i + a1, 0, ROWS - 1)]
        x = jnp.tanh(w @ x + m1 * r1)
        pred = jnp.logical_or(jnp.logical_not(every_other), i % 2 == 0)
        if isinstance(ys, bl.Buffer):
            ys = ys.at[i + b].set(x, pred=pred)
        else:  # as `jnp`: an out-of-range write is dropped
            ys = ys.at[i + b].set(
                jnp.where(pred, x, ys[jnp.clip(i + b, -ROWS, ROWS - 1)]), mode="drop"
            )
        x = x + m2 * ys[jnp.clip(i + a2, 0, ROWS - 1)]
        return x, ys, i + 1

    return body


def _class_loss(run):
    def loss(w, n, *args):
        x, ys, _ = run(class_body(w, *args), (X0, jnp.zeros((ROWS, 3)), 0), n)
        return jnp.sum(x) + jnp.sum(jnp.sin(ys))

    return loss


_class_ours = bl.filter_jit(
    jax.value_and_grad(
        _class_loss(
            lambda body, init, n: bl.while_loop(
                lambda c: c[2] < n,
                body,
                init,
                max_steps=STEPS,
                checkpoints=2,
                buffers=lambda c: c[1],
            )
        )
    )
)


def _broken(a1, b, a2, m1, m2, every_other, n) -> set:
    """Which rules the class's body breaks, computed on Python integers: a subset
    of `{ALREADY, LATER}`."""
    writes = {}  # location -> the steps that wrote it
    for t in range(n):
        if not (every_other and t % 2):
            k = t + b
            if -ROWS <= k < ROWS:
                writes.setdefault(k % ROWS, []).append(t)
    broken = {ALREADY} if any(len(ts) > 1 for ts in writes.values()) else set()
    for t in range(n):
        for offset, scale, after_write in [(a1, m1, False), (a2, m2, True)]:
            k = min(max(t + offset, 0), ROWS - 1)
            later = any(
                s > t or (s == t and not after_write) for s in writes.get(k, [])
            )
            if scale and later:
                broken.add(LATER)
    return broken


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    a1=st.integers(-2, 2),
    b=st.integers(-1, 1),
    a2=st.integers(-1, 1),
    m1=st.sampled_from([0.0, 0.5]),
    m2=st.sampled_from([0.0, 0.5]),
    every_other=st.booleans(),
    n=st.integers(0, STEPS),
)
def test_buffer_mistakes_raise_or_match_jnp(a1, b, a2, m1, m2, every_other, n):
    # all runtime data, so that one compiled gradient serves every example
    ints = (jnp.int32(a1), jnp.int32(b), jnp.int32(a2))
    args = (*ints, jnp.float32(m1), jnp.float32(m2), jnp.asarray(every_other))
    broken = _broken(a1, b, a2, m1, m2, every_other, n)
    if broken:  # either rule's message
        with bl.buffer_checks():
            with pytest.raises(eqx.EquinoxRuntimeError, match="|".join(broken)):
                jax.block_until_ready(_class_ours(W, jnp.int32(n), *args))
        return
    with bl.buffer_checks():
        got = _class_ours(W, jnp.int32(n), *args)
    reference = _class_loss(lambda body, init, n: unrolled(body, init, n))
    expected = on_host(jax.value_and_grad(reference))(W, n, *args)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-6)


def _read_ahead_expected(r, w, k, read_first, steps=6) -> bool:
    """Whether a read at `c + r` sees a location that an unconditional write at
    `c + w` makes later (a later step, or later in the same step), the counter
    `c` advancing by `k`: simulated on Python integers."""
    reads, writes = [], []  # (location, when), `when` ordering within a step
    for t in range(steps):
        c = 10 + k * t
        reads.append((c + r, 2 * t + (0 if read_first else 1)))
        writes.append((c + w, 2 * t + (1 if read_first else 0)))
    return any(lw == lr and tw > tr for lr, tr in reads for lw, tw in writes)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    r=st.integers(-3, 8),
    w=st.integers(-2, 2),
    k=st.sampled_from([-2, -1, 1, 2]),
    read_first=st.booleans(),
    conditional=st.booleans(),
)
def test_the_read_ahead_warning_fires_exactly_when_a_later_write_lands(
    r, w, k, read_first, conditional
):
    """The class: constant offsets of reads and writes from a counter of any
    constant stride, the read before or after the write, the write with or
    without a `pred`. Tracing warns exactly where a simulation on integers finds
    a later write at the location read within `max_steps` steps (never for a
    conditional write)."""

    def body(c):
        x, ys, i = c
        if read_first:
            x = jnp.tanh(W @ x) * (1 + ys[i + r])
        ys = ys.at[i + w].set(x, pred=True if conditional else None)
        if not read_first:
            x = x * (1 + ys[i + r])
        return x, ys, i + k

    init = (X0, jnp.zeros((40, 3)), 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(
            lambda: bl.while_loop(
                lambda c: c[2] < 100, body, init, max_steps=6, buffers=lambda c: c[1]
            )
        )
    warned = any(AHEAD in str(m.message) for m in caught)
    assert warned == (not conditional and _read_ahead_expected(r, w, k, read_first))


def test_a_row_written_twice_and_never_read_breaks_a_rule_not_the_gradient():
    """Written twice (at a traced index, `i // 2`) and never read: the gradient is
    right, and `bl.buffer_checks()` says a rule was broken, not that the gradient
    would be wrong."""

    def body(c):
        x, ys, i = c
        x = jnp.tanh(W @ x)
        return x, ys.at[i // 2].set(x), i + 1

    def loss(x0):
        init = (x0, jnp.zeros((4, 3)), 0)
        out = bl.while_loop(
            lambda c: c[2] < 6, body, init, max_steps=6, buffers=lambda c: c[1]
        )
        return jnp.sum(out[1] ** 2)

    def reference(x0):
        return jnp.sum(unrolled(body, (x0, jnp.zeros((4, 3)), 0), 6)[1] ** 2)

    expected = on_host(jax.grad(reference))(X0)
    assert tree_allclose(jax.grad(loss)(X0), expected, rtol=1e-5)
    with bl.buffer_checks():
        with pytest.raises(Exception, match=ALREADY) as e:
            jax.block_until_ready(jax.jit(jax.grad(loss))(X0))
    assert "A rule broken" in str(e.value)
    assert "gradient would be wrong" not in str(e.value)
