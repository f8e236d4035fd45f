"""What the docs say about the `with` switches' reach (`docs/guides/scale.md`,
`docs/limitations.md`): `bl.max_steps_check` keys the trace cache, the progress meter
does not, and `bl.scan` turns `bl.buffer_checks` off for its whole body."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import boundedloop as bl


def double_write(x):
    """A loop that writes location 0 of its buffer twice (at steps 0 and 1)."""
    return bl.while_loop(
        lambda c: c[1] < 2,
        lambda c: (c[0].at[c[1] // 2].set(x), c[1] + 1),
        (jnp.zeros(3), jnp.array(0)),
        max_steps=3,
        buffers=lambda c: c[0],
    )[0]


def test_max_steps_check_entered_after_the_first_call():
    f = bl.filter_jit(
        lambda x: bl.while_loop(
            lambda c: c[1] < 100, lambda c: (0.9 * c[0], c[1] + 1), (x, 0), max_steps=10
        )
    )
    f(1.0)
    with bl.max_steps_check(), pytest.raises(eqx.EquinoxRuntimeError):
        f(1.0)
    assert int(f(1.0)[1]) == 10


class Bar:
    made = 0

    def __init__(self, total=None, desc=None):
        self.n = 0
        Bar.made += 1

    def update(self, k):
        self.n += k

    def close(self):
        pass


def test_progress_meter_is_read_when_traced():
    def loop(x, n):
        return bl.while_loop(
            lambda c: c[1] < n,
            lambda c: (0.9 * c[0], c[1] + 1),
            (x, jnp.array(0)),
            max_steps=100,
        )

    Bar.made = 0
    first_outside, first_inside = jax.jit(loop), jax.jit(lambda x, n: loop(x, n))
    args = (jnp.ones(2), jnp.array(50))
    jax.block_until_ready(first_outside(*args))
    with bl.progress_meter(every=10, tqdm_class=Bar):
        jax.block_until_ready(first_outside(*args))
        assert Bar.made == 0  # traced without the meter: no bar
        jax.block_until_ready(first_inside(*args))
        assert Bar.made == 1
    jax.block_until_ready(first_inside(*args))
    assert Bar.made == 2  # traced with the meter: it keeps its bar


def run_checked(fn):
    """The gradient of `fn`, with the buffer checks on (they check gradients)."""
    with bl.buffer_checks():
        grad = bl.filter_jit(jax.grad(lambda x: jnp.sum(fn(x))))
        return jax.block_until_ready(grad(1.0))


def test_buffer_checks_fire_outside_a_scan():
    with pytest.raises(eqx.EquinoxRuntimeError, match="location already written"):
        run_checked(double_write)


def test_buffer_checks_are_off_in_a_scan_body_inner_loops_included():
    def scan_of(inner):
        return lambda x: bl.scan(
            lambda c, _: (c + jnp.sum(inner(x)), None), 0.0, length=2
        )[0]

    run_checked(scan_of(double_write))  # not checked: no error

    def rechecked(x):
        with bl.buffer_checks():
            return double_write(x)

    with pytest.raises(eqx.EquinoxRuntimeError, match="location already written"):
        run_checked(scan_of(rechecked))
