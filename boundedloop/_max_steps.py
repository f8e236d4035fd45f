"""The opt-in check that a loop did not stop because it ran out of steps.

A bounded loop that reaches `max_steps` while its predicate still holds stops early
and returns an unconverged carry, silently, exactly as the Python loop in
`bl.while_loop`'s docstring would. With the check on, that is a runtime error. The
loop stopped because of `max_steps` exactly when the predicate still holds on the
final carry, so the check evaluates the predicate once more, on the final carry, and
attaches an `eqx.error_if` to it: one predicate evaluation, nothing inside the loop,
and it works under `jit`, `vmap` (an error if any element ran out) and `grad`.
"""

import contextlib

import equinox as eqx

from ._setting import TraceSetting


_checks = TraceSetting(False)


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
    with _checks.set(enabled):
        yield


def check_stopped(loop, x, bufs, max_steps: int | None, name: str):
    """`(x, bufs)`, with a runtime error attached if the loop ran out of steps.

    `loop` is the `TracedLoop`; `x` and `bufs` its final arrays. A no-op unless the
    check is on and the loop is bounded."""
    if not _checks.value or max_steps is None:
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
