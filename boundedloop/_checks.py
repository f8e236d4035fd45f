"""Opt-in runtime checks, and the trace-time settings that switch them on.

Each switch is a `with` block read when a loop is traced. Off (the default), a check
leaves the compiled program exactly as it would be without it.

- `buffer_checks`: the buffer rules (each location written at most once, only
  written locations read), checked in the forward pass.
- `max_steps_check`: a loop must not stop because it ran out of steps. The loop
  stopped because of `max_steps` exactly when the predicate still holds on the final
  carry, so the check evaluates the predicate once more, on the final carry, and
  attaches an `eqx.error_if` to it: one predicate evaluation, nothing inside the
  loop.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import equinox as eqx


class TraceSetting:
    """A value, replaced inside `with setting.set(value):` and restored after."""

    def __init__(self, default: Any):
        self.value = default

    @contextlib.contextmanager
    def set(self, value: Any) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous


_buffer_checks = TraceSetting(False)


@contextlib.contextmanager
def buffer_checks(enabled: bool = True):
    """Check the buffer rules of loops traced inside this block.

    Off by default and free when off. When on, the forward pass of every loop traced
    in the block keeps a record of which buffer locations have been written and
    raises a runtime error (through `eqx.error_if`) on a second write to one
    location, or on a read of a location that has not been written.

    ```python
    with bl.buffer_checks():
        out = jax.jit(f)(x)   # f calls bl.while_loop(..., buffers=...)
    ```

    **Arguments:**

    - `enabled`: whether to check.
    """
    with _buffer_checks.set(enabled):
        yield


def buffer_checks_enabled() -> bool:
    return _buffer_checks.value


def raise_violations(active, violations):
    """`active`, with a runtime error attached if the step broke a buffer rule.

    Tied to the loop's predicate so that the check can never be pruned away."""
    double_write, unwritten_read = violations
    active = eqx.error_if(
        active,
        double_write,
        "`bl.while_loop`: a buffer location was written twice. Each location of a "
        "buffer may be written at most once.",
    )
    return eqx.error_if(
        active,
        unwritten_read,
        "`bl.while_loop`: a buffer read a location that has not been written. Only "
        "written locations may be read.",
    )


_max_steps_checks = TraceSetting(False)


@contextlib.contextmanager
def max_steps_check(enabled: bool = True):
    """Raise an error when a loop traced inside this block reaches `max_steps` while
    its predicate is still true.

    Off by default and free when off. When on, every `bl.while_loop` (and
    `LoopModule.run`) traced in the block evaluates `cond_fun` once more on its final
    carry and raises a runtime error (through `eqx.error_if`) if it is still true:
    the loop stopped because it ran out of steps, not because it finished. A loop
    that finishes at exactly `max_steps` steps passes. Under `jax.vmap` the error is
    raised if any element ran out of steps. `bl.scan` and `bl.fori_loop` always take
    all their steps and are never checked.

    ```python
    with bl.max_steps_check():
        out = jax.jit(f)(x)   # f calls bl.while_loop(..., max_steps=100)
    ```

    The setting is read when the loop is traced, and JAX caches traces by function
    and argument types, not by this setting: a function traced before the block
    stays unchecked inside it, and one traced inside stays checked after it. Enter
    the block before the first call (or call `jax.clear_caches()`).

    **Arguments:**

    - `enabled`: whether to check.
    """
    with _max_steps_checks.set(enabled):
        yield


def check_stopped(loop, x, bufs, max_steps: int | None, name: str):
    """`(x, bufs)`, with a runtime error attached if the loop ran out of steps.

    `loop` is the `TracedLoop`; `x` and `bufs` its final arrays. A no-op unless the
    check is on and the loop is bounded."""
    if not _max_steps_checks.value or max_steps is None:
        return x, bufs
    still_going = loop.cond(x, bufs)
    return eqx.error_if(
        (x, bufs),
        still_going,
        f"`{name}` reached max_steps={max_steps} while `cond_fun` was still true, "
        "so it stopped before the loop finished. Raise `max_steps` (or pass "
        "`max_steps=None` with `checkpoints=...` for no bound), or leave "
        "`bl.max_steps_check` off if stopping early is intended.",
    )
