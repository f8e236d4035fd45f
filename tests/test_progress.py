"""`bl.progress_meter`: a tqdm bar fed by host callbacks, throttled, compiled out when
off."""

import functools
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

import boundedloop as bl

from .helpers import primitive_names


class FakeBar:
    """The part of tqdm's interface the meter uses; records what it is told."""

    bars: list["FakeBar"] = []

    def __init__(self, total=None, desc=None, **kwargs):
        self.total, self.desc, self.kwargs = total, desc, kwargs
        self.first_total = total  # `total` is set to the steps taken at the end
        self.n, self.seen, self.closed = 0, [], False
        FakeBar.bars.append(self)

    def update(self, k):
        assert not self.closed and k > 0
        self.n += k
        self.seen.append(self.n)

    def close(self):
        self.closed = True


@pytest.fixture(autouse=True)
def clear_bars():
    FakeBar.bars = []


def body(carry):
    x, i = carry
    return jnp.sin(x) + 0.1, i + 1


def loop(x, n, max_steps, checkpoints=None):
    return bl.while_loop(
        lambda c: c[1] < n,
        body,
        (x, jnp.array(0)),
        max_steps=max_steps,
        checkpoints=checkpoints,
    )


@functools.cache
def metered(kind, max_steps, every=None):
    """Compiled once per kind; the trip count `n` is traced."""
    fn = {
        "forward": lambda x, n: loop(x, n, max_steps),
        "grad": jax.grad(lambda x, n: jnp.sum(loop(x, n, max_steps, 4)[0])),
        "vmap": jax.vmap(lambda x, n: loop(x, n, max_steps)),
        "vmap_grad": jax.vmap(
            jax.grad(lambda x, n: jnp.sum(loop(x, n, max_steps, 4)[0]))
        ),
        "buffers": lambda x, n: bl.while_loop(
            lambda c: c[2] < n,
            lambda c: (c[0] * 0.5, c[1].at[c[2]].set(c[0]), c[2] + 1),
            (x, jnp.zeros((max_steps,) + x.shape), jnp.array(0)),
            max_steps=max_steps,
            buffers=lambda c: c[1],
        ),
    }[kind]
    with bl.progress_meter(every, desc="testing", tqdm_class=FakeBar, leave=False):
        return jax.jit(fn).lower(*ARGS[kind]).compile()


X = jnp.array([0.1, 0.2])
ARGS = {
    "forward": (X, jnp.array(0)),
    "grad": (X, jnp.array(0)),
    "vmap": (jnp.stack([X, X]), jnp.zeros(2, jnp.int32)),
    "vmap_grad": (jnp.stack([X, X]), jnp.zeros(2, jnp.int32)),
    "buffers": (X, jnp.array(0)),
}


def test_reports_every_k_steps_and_the_end():
    f = metered("forward", 100, every=10)
    out = jax.block_until_ready(f(X, jnp.array(35)))
    assert int(out[1]) == 35
    (bar,) = FakeBar.bars
    assert (bar.first_total, bar.desc, bar.kwargs) == (100, "testing", {"leave": False})
    assert bar.seen == [10, 20, 30, 35] and bar.closed
    # stopped early: the total becomes the steps taken, so the bar ends full
    assert bar.total == 35
    # each run of the compiled loop gets its own bar
    jax.block_until_ready(f(X, jnp.array(20)))
    assert len(FakeBar.bars) == 2 and FakeBar.bars[1].seen == [10, 20]


def test_short_loops_show_nothing():
    jax.block_until_ready(metered("forward", 100, every=10)(X, jnp.array(9)))
    assert FakeBar.bars == []


def test_default_every_makes_about_100_updates():
    f = metered("forward", 1000)  # every = 10
    jax.block_until_ready(f(X, jnp.array(1000)))
    (bar,) = FakeBar.bars
    assert bar.seen == list(range(10, 1001, 10))
    jax.block_until_ready(f(X, jnp.array(57)))  # stops early: the count is exact
    assert FakeBar.bars[1].seen == [10, 20, 30, 40, 50, 57]


def test_gradient_and_buffers():
    """The checkpointed sweep (under `grad`) and the masked sweep (with buffers)."""
    jax.block_until_ready(metered("grad", 100, every=25)(X, jnp.array(60)))
    jax.block_until_ready(metered("buffers", 40, every=8)(X, jnp.array(30)))
    grad_bar, _, buffer_bar = FakeBar.bars  # the second: the gradient's reverse
    assert grad_bar.seen == [25, 50, 60] and grad_bar.closed
    assert buffer_bar.seen == [8, 16, 24, 30] and buffer_bar.closed
    assert (grad_bar.total, buffer_bar.total) == (60, 30)


def test_reverse_sweep_under_grad():
    """A second bar counts the steps reversed, up to the steps taken."""
    jax.block_until_ready(metered("grad", 100, every=10)(X, jnp.array(57)))
    forward, reverse = FakeBar.bars
    assert (forward.desc, reverse.desc) == ("testing", "testing (reverse)")
    assert forward.seen[-1] == forward.total == 57 and forward.closed
    # its total is the steps taken from the start; with 4 checkpoints an update
    # may come a few steps past a multiple of `every` (a run of steps whose inputs
    # are stored is reversed at once), but it comes once per multiple passed
    assert reverse.first_total == reverse.total == 57 and reverse.closed
    assert reverse.seen[-1] == 57 and len(reverse.seen) == 6
    assert reverse.seen == sorted(reverse.seen)


def test_vmap_of_grad_one_bar_per_loop():
    """Under `vmap`, one forward and one reverse bar for the batch, counting the
    steps of its longest element."""
    f = metered("vmap_grad", 100, every=10)
    jax.block_until_ready(f(jnp.stack([X, -X]), jnp.array([23, 57])))
    forward, reverse = FakeBar.bars
    assert forward.seen == [10, 20, 30, 40, 50, 57] and forward.total == 57
    assert reverse.desc == "testing (reverse)" and reverse.closed
    assert reverse.seen[-1] == reverse.total == 57


def test_unbounded_total():
    """With `max_steps=None` the bar starts with no total (tqdm shows a count) and
    ends with the steps taken."""
    with bl.progress_meter(every=100, tqdm_class=FakeBar):
        jax.block_until_ready(jax.jit(lambda x, n: loop(x, n, None))(X, jnp.array(250)))
    (bar,) = FakeBar.bars
    assert (bar.first_total, bar.total, bar.seen) == (None, 250, [100, 200, 250])


def test_vmap_one_bar_for_the_batch():
    out = metered("vmap", 100, every=10)(jnp.stack([X, -X]), jnp.array([12, 31]))
    assert out[1].tolist() == [12, 31]
    (bar,) = FakeBar.bars  # one callback per update, not one per element
    assert bar.seen == [10, 20, 30, 31] and bar.total == 31


def test_scan():
    with bl.progress_meter(every=4, tqdm_class=FakeBar):
        jax.block_until_ready(
            jax.jit(lambda x: bl.scan(lambda c, _: (c * 0.9, c), x, length=10))(X)
        )
    (bar,) = FakeBar.bars
    assert bar.total == 10 and bar.seen == [4, 8, 10]


@pytest.mark.parametrize("kind", ["forward", "grad"])
def test_compiled_out_when_off(kind):
    fn = {
        "forward": lambda x, n: loop(x, n, 100),
        "grad": jax.grad(lambda x, n: jnp.sum(loop(x, n, 100, 4)[0])),
    }[kind]
    """Off, the program has no host callback: none in its jaxpr, which is what
    every backend lowers (the lowered callback's name differs per backend)."""
    off = primitive_names(jax.make_jaxpr(lambda *a: fn(*a))(X, jnp.array(3)).jaxpr)
    assert not [name for name in off if "callback" in name]
    with bl.progress_meter(tqdm_class=FakeBar):
        on = primitive_names(jax.make_jaxpr(lambda *a: fn(*a))(X, jnp.array(3)).jaxpr)
    assert "debug_callback" in on


def test_real_tqdm(capsys):
    pytest.importorskip("tqdm")
    with bl.progress_meter(every=50, desc="solving"):
        f = jax.jit(lambda x, n: loop(x, n, 200))
        jax.block_until_ready(f(X, jnp.array(120)))
    err = capsys.readouterr().err
    # the bar starts out of `max_steps` and ends out of the steps taken, full
    assert "solving" in err and "0/200" in err and "100%" in err and "120/120" in err


def test_missing_tqdm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"pip install tqdm"):
        with bl.progress_meter():
            pass
    with bl.progress_meter(tqdm_class=FakeBar):  # a bar of one's own needs no tqdm
        pass


def test_bad_every():
    for every in [0, -3, 2.5, True]:
        with pytest.raises(ValueError, match="positive int"):
            with bl.progress_meter(every, tqdm_class=FakeBar):
                pass
