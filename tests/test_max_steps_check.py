"""`bl.max_steps_check`: an opt-in error (or warning) when a loop runs out of
steps."""

import contextlib
import functools
import re
import warnings

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

import boundedloop as bl

from .helpers import Halving, on_host, primitive_names, scan_loop, tree_allclose


MAX_STEPS = 6
MESSAGE = "reached max_steps=6 while `cond_fun` was still true"


def body(carry):
    x, i = carry
    return jnp.sin(x) * 1.1 + 0.2, i + 1


def loop(x, n, max_steps=MAX_STEPS, checkpoints=2):
    """Takes `min(n, max_steps)` steps; runs out of steps when `n > max_steps`."""
    return bl.while_loop(
        lambda c: c[1] < n,
        body,
        (x, jnp.array(0)),
        max_steps=max_steps,
        checkpoints=checkpoints,
    )


def loss(x, n):
    return jnp.sum(loop(x, n)[0] ** 2)


@functools.cache
def compiled(kind: str, checked: bool | str):
    """One compiled function per kind; the trip count `n` is traced. `checked`:
    `True`, `False`, or `"warn"` for `bl.max_steps_check(warn=True)`."""
    fn = {
        "forward": loop,
        "grad": jax.grad(loss),
        "vmap": jax.vmap(loop),
        "vmap_grad": jax.vmap(jax.grad(loss)),
    }[kind]
    with bl.max_steps_check(bool(checked), warn=checked == "warn"):
        # trace and compile now, under the setting
        return jax.jit(lambda *args: fn(*args)).lower(*ARGS[kind]).compile()


X = jnp.array([0.3, -0.4])
ARGS = {
    "forward": (X, jnp.array(0)),
    "grad": (X, jnp.array(0)),
    "vmap": (jnp.stack([X, -X, 2 * X]), jnp.zeros(3, jnp.int32)),
    "vmap_grad": (jnp.stack([X, -X, 2 * X]), jnp.zeros(3, jnp.int32)),
}


def test_off_by_default_and_free():
    # hitting max_steps is silent without the check ...
    out = jax.jit(lambda x, n: loop(x, n))(X, jnp.array(50))
    assert int(out[1]) == MAX_STEPS
    # ... and the program has no error check in it
    off = primitive_names(
        jax.make_jaxpr(lambda x, n: loop(x, n))(X, jnp.array(50)).jaxpr
    )
    with bl.max_steps_check():
        on = primitive_names(
            jax.make_jaxpr(lambda x, n: loop(x, n))(X, jnp.array(50)).jaxpr
        )
    assert "callback" not in off and "pure_callback" not in off
    assert "boundedloop_raise_if" not in off
    assert "boundedloop_raise_if" in on and len(on) > len(off)


@pytest.mark.parametrize("n", [50, MAX_STEPS + 1])
def test_raises_when_max_steps_is_reached(n):
    with bl.max_steps_check():
        with pytest.raises(Exception, match="reached max_steps=6") as info:
            loop(X, jnp.array(n))  # eager
    message = str(info.value)
    assert "Raise `max_steps`" in message
    with pytest.raises(Exception, match=MESSAGE):
        jax.block_until_ready(compiled("forward", True)(X, jnp.array(n)))


@pytest.mark.parametrize("n", [0, 3, MAX_STEPS])
def test_silent_when_the_loop_ends_by_itself(n):
    """Including a loop that ends at exactly `max_steps` steps."""
    out = compiled("forward", True)(X, jnp.array(n))
    assert int(out[1]) == n
    with bl.max_steps_check():
        out = loop(X, jnp.array(n))
    assert int(out[1]) == n


def test_silent_when_off():
    out = compiled("forward", False)(X, jnp.array(50))
    assert int(out[1]) == MAX_STEPS
    with bl.max_steps_check():
        with bl.max_steps_check(False):
            assert int(loop(X, jnp.array(50))[1]) == MAX_STEPS
        # the setting is restored on exit
        with pytest.raises(Exception, match=MESSAGE):
            loop(X, jnp.array(50))


def test_setting_keys_the_trace_cache():
    """The switch is part of JAX's cache key: a function traced on one side of the
    block is traced again on the other, never silently reused."""
    f = jax.jit(lambda x, n: loop(x, n))
    with bl.max_steps_check():
        f(X, jnp.array(2))  # traced (and compiled) with the check
    assert int(f(X, jnp.array(50))[1]) == MAX_STEPS  # outside the block: unchecked
    g = jax.jit(lambda x, n: loop(x, n))
    g(X, jnp.array(2))  # traced without the check
    with bl.max_steps_check():
        with pytest.raises(Exception, match=MESSAGE):
            jax.block_until_ready(g(X, jnp.array(50)))  # inside: checked


@pytest.mark.parametrize("checkpoints", [2, 16])
def test_fires_under_jit_grad_of_a_linear_loss(checkpoints):
    """The loss is linear in the final carry, so the backward pass never reads the
    forward's outputs: the check must travel with what it does read."""

    def linear(x, n):
        return jnp.sum(loop(x, n, checkpoints=checkpoints)[0])

    with bl.max_steps_check():
        f = jax.jit(jax.grad(linear))
        f(X, jnp.array(2))
        with pytest.raises(Exception, match=MESSAGE):
            jax.block_until_ready(f(X, jnp.array(50)))
        h = jax.jit(lambda x, n: jax.jvp(lambda x: linear(x, n), (x,), (x,))[1])
        with pytest.raises(Exception, match=MESSAGE):
            jax.block_until_ready(h(X, jnp.array(50)))


def test_vmap_one_element_running_out_raises():
    f = compiled("vmap", True)
    xs = ARGS["vmap"][0]
    out = f(xs, jnp.array([2, MAX_STEPS, 0]))
    assert out[1].tolist() == [2, MAX_STEPS, 0]
    with pytest.raises(Exception, match=MESSAGE):
        jax.block_until_ready(f(xs, jnp.array([2, MAX_STEPS + 1, 0])))
    # unchecked: the element that ran out just stops
    out = compiled("vmap", False)(xs, jnp.array([2, MAX_STEPS + 1, 0]))
    assert out[1].tolist() == [2, MAX_STEPS, 0]


def test_grad():
    f = compiled("grad", True)
    for n in [0, 4, MAX_STEPS]:
        loss = lambda x: jnp.sum(scan_loop(body, (x, 0), n)[0] ** 2)  # noqa: E731
        expected = on_host(jax.grad(loss))(X)
        assert tree_allclose(f(X, jnp.array(n)), expected)
    with pytest.raises(Exception, match=MESSAGE):
        jax.block_until_ready(f(X, jnp.array(MAX_STEPS + 1)))
    g = compiled("vmap_grad", True)
    xs = ARGS["vmap_grad"][0]
    assert tree_allclose(
        g(xs, jnp.array([1, MAX_STEPS, 3])),
        compiled("vmap_grad", False)(xs, jnp.array([1, MAX_STEPS, 3])),
    )
    with pytest.raises(Exception, match=MESSAGE):
        jax.block_until_ready(g(xs, jnp.array([1, MAX_STEPS, 30])))


def test_zero_max_steps_and_unbounded():
    with bl.max_steps_check():
        with pytest.raises(Exception, match="reached max_steps=0"):
            loop(X, jnp.array(1), max_steps=0)
        assert int(loop(X, jnp.array(0), max_steps=0)[1]) == 0
        out = bl.while_loop(
            lambda c: c[1] < 9, body, (X, 0), max_steps=None, checkpoints=2
        )
        assert int(out[1]) == 9


def test_scan_and_fori_loop_never_fire():
    with bl.max_steps_check():
        final, ys = bl.scan(lambda c, x: (c + x, c), jnp.array(0.0), jnp.arange(4.0))
        assert float(final) == 6.0
        assert float(bl.fori_loop(0, 3, lambda i, v: v + i, 0)) == 3


def test_loop_module_run():
    module = Halving(0.1)
    with bl.max_steps_check():
        assert float(module.run(jnp.array(1.0), max_steps=4)) == 1 / 16
        with pytest.raises(Exception, match="reached max_steps=3"):
            module.run(jnp.array(1.0), max_steps=3)
        f = bl.filter_jit(lambda m, x: m.run(x, max_steps=3))
        with pytest.raises(Exception, match="reached max_steps=3"):
            jax.block_until_ready(f(module, jnp.array(1.0)))
    assert isinstance(module, eqx.Module)


def test_a_second_copy_of_the_package_imports():
    """`benchmarks/internal/regression.py` imports two revisions side by side: each imports,
    and each copy's switch governs its own loops."""
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(bl.__file__).parent
    spec = importlib.util.spec_from_file_location(
        "boundedloop_copy", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    copy = importlib.util.module_from_spec(spec)
    sys.modules["boundedloop_copy"] = copy
    try:
        spec.loader.exec_module(copy)

        def copy_loop(x, n):
            cond = lambda c: c[1] < n  # noqa: E731
            return copy.while_loop(cond, body, (x, 0), max_steps=MAX_STEPS)

        with copy.max_steps_check():
            with pytest.raises(Exception, match=MESSAGE):
                jax.block_until_ready(copy_loop(X, jnp.array(50)))
            jax.block_until_ready(loop(X, jnp.array(50)))  # not `bl`'s switch
    finally:
        for name in [n for n in sys.modules if n.startswith("boundedloop_copy")]:
            del sys.modules[name]


@pytest.mark.parametrize("jit", ["jax.jit", "bl.filter_jit", "eager"])
def test_the_message_comes_first(jit, caplog):
    """Under plain `jax.jit` the error XLA raises starts `INTERNAL: CpuCallback error
    calling callback: Traceback ...` and ends with a note to use `filter_jit`
    (issue 39); raised inside the block, it is reported with our message first."""
    fn = {"jax.jit": jax.jit, "bl.filter_jit": bl.filter_jit, "eager": lambda f: f}[jit]
    with pytest.raises(RuntimeError) as info:
        with bl.max_steps_check():
            jax.block_until_ready(fn(loop)(X, jnp.array(50)))
    message = str(info.value)
    assert message.startswith("`bl.while_loop` " + MESSAGE), message[:200]
    assert "Raise `max_steps`" in message
    assert "CpuCallback" not in message and "filter_jit" not in message
    if jit == "jax.jit":  # the same type as before, for code that catches it
        assert isinstance(info.value, jax.errors.JaxRuntimeError)
    # nor is it printed before, by JAX's log of the failed callback. (On a TPU,
    # whose runtime raises no callback's error, Equinox's second callback shows the
    # message through `input`, which fails under pytest's capture: that failure is
    # logged, without our message.)
    assert not [r for r in caplog.records if _logs_our_error(r)]


def _logs_our_error(record) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return "callback failed" in record.getMessage() and bool(
        re.search(MESSAGE, str(error))
    )


@contextlib.contextmanager
def no_warnings():
    """Fails if anything inside warns."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield
    assert not [str(w.message) for w in record]


@pytest.mark.parametrize("n", [50, MAX_STEPS + 1])
def test_warns_when_max_steps_is_reached(n):
    """With `warn=True` a loop that ran out of steps warns, once, and the program
    goes on with the loop's result."""
    with pytest.warns(UserWarning, match=MESSAGE) as record:
        out = jax.block_until_ready(compiled("forward", "warn")(X, jnp.array(n)))
    assert len(record) == 1
    assert "Raise `max_steps`" in str(record[0].message)
    # traced, the warning points at the line that called the loop (in `loop` here),
    # not into JAX's callback machinery
    assert record[0].filename == __file__
    assert tree_allclose(out, compiled("forward", False)(X, jnp.array(n)))
    # eagerly, the warning points at the caller's line
    with bl.max_steps_check(warn=True):
        with pytest.warns(UserWarning, match=MESSAGE) as record:
            loop(X, jnp.array(n))
    assert len(record) == 1 and record[0].filename == __file__


@pytest.mark.parametrize("n", [0, 3, MAX_STEPS])
def test_no_warning_when_the_loop_ends_by_itself(n):
    with no_warnings():
        out = jax.block_until_ready(compiled("forward", "warn")(X, jnp.array(n)))
        with bl.max_steps_check(warn=True):
            loop(X, jnp.array(n))
    assert int(out[1]) == n


def test_warn_program():
    """The warning is a host callback; nothing raises."""
    with bl.max_steps_check(warn=True):
        names = primitive_names(
            jax.make_jaxpr(lambda x, n: loop(x, n))(X, jnp.array(50)).jaxpr
        )
    assert "debug_callback" in names
    assert "boundedloop_raise_if" not in names


def test_warns_under_vmap_once_for_the_batch():
    f = compiled("vmap", "warn")
    xs = ARGS["vmap"][0]
    with no_warnings():
        jax.block_until_ready(f(xs, jnp.array([2, MAX_STEPS, 0])))
    with pytest.warns(UserWarning, match=MESSAGE) as record:
        out = jax.block_until_ready(f(xs, jnp.array([2, MAX_STEPS + 1, 50])))
    assert len(record) == 1
    assert out[1].tolist() == [2, MAX_STEPS, MAX_STEPS]


def test_warns_under_grad():
    n = jnp.array(MAX_STEPS + 1)
    with pytest.warns(UserWarning, match=MESSAGE) as record:
        grad = jax.block_until_ready(compiled("grad", "warn")(X, n))
    assert len(record) == 1
    assert tree_allclose(grad, compiled("grad", False)(X, n))
    xs = ARGS["vmap_grad"][0]
    ns = jnp.array([1, MAX_STEPS, 30])
    with pytest.warns(UserWarning, match=MESSAGE) as record:
        grads = jax.block_until_ready(compiled("vmap_grad", "warn")(xs, ns))
    assert len(record) == 1
    assert tree_allclose(grads, compiled("vmap_grad", False)(xs, ns))
    with no_warnings():
        jax.block_until_ready(compiled("grad", "warn")(X, jnp.array(MAX_STEPS)))


def test_warns_under_jit_grad_of_a_linear_loss():
    """The backward pass of a linear loss never reads the forward's outputs: the
    warning must not be pruned with them."""

    def linear(x, n):
        return jnp.sum(loop(x, n)[0])

    with bl.max_steps_check(warn=True):
        f = jax.jit(jax.grad(linear))
        with pytest.warns(UserWarning, match=MESSAGE):
            jax.block_until_ready(f(X, jnp.array(50)))


def test_warns_for_zero_max_steps_and_loop_module():
    f = jax.jit(lambda x, n: loop(x, n, max_steps=0))
    with bl.max_steps_check(warn=True):
        with pytest.warns(UserWarning, match="reached max_steps=0"):
            jax.block_until_ready(f(X, jnp.array(1)))
        with no_warnings():
            jax.block_until_ready(f(X, jnp.array(0)))
        g = bl.filter_jit(lambda m, x: m.run(x, max_steps=3))
        with pytest.warns(UserWarning, match="reached max_steps=3"):
            assert float(g(Halving(0.1), jnp.array(1.0))) == 0.125
