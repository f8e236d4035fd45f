"""Opt-in runtime checks, and the trace-time settings that switch them on.

Each switch is a `with` block read when a loop is traced. Off (the default), a check
leaves the compiled program exactly as it would be without it.

- `buffer_checks`: the buffer rules (each location written at most once, only
  written locations read), checked in the forward pass.
- `max_steps_check`: a loop must not stop because it ran out of steps. The loop
  stopped because of `max_steps` exactly when the predicate still holds on the final
  carry, so the check evaluates the predicate once more, on the final carry, and
  attaches an `eqx.error_if` to it: one predicate evaluation, nothing inside the
  loop. It is attached to what every later use of the loop reads (the final carry,
  and the trip count the backward pass reverses), so no transform prunes it.

The two checks are JAX configuration states that are part of JAX's trace and jit
cache keys, so entering a block after a function was first traced retraces it
rather than silently reusing the unchecked trace.
"""

import contextlib

import equinox as eqx
from jax._src import config as jax_config

from ._batching import any_across_batch


def _traced_switch(name: str, help: str):
    """A boolean JAX configuration state keyed into traces and jit caches."""
    existing = jax_config.config_states.get(name)
    if existing is not None:  # this module imported twice (e.g. two revisions)
        return existing
    return jax_config.bool_state(
        name, False, help, include_in_jit_key=True, include_in_trace_context=True
    )


_buffer_checks = _traced_switch(
    "boundedloop_buffer_checks", "Check the buffer rules of boundedloop's loops."
)


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
    with _buffer_checks(bool(enabled)):
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


_max_steps_checks = _traced_switch(
    "boundedloop_max_steps_check",
    "Raise when a boundedloop loop stops because it reached max_steps.",
)


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

    The setting is part of JAX's trace and jit cache keys: a jitted function called
    inside the block is traced (and compiled) again with the check on.

    **Arguments:**

    - `enabled`: whether to check.
    """
    with _max_steps_checks(bool(enabled)):
        yield


def max_steps_check_enabled() -> bool:
    return _max_steps_checks.value


def check_stopped(loop, tree, name: str, max_steps: int):
    """`tree`, with a runtime error attached if the loop ran out of steps: if its
    predicate still holds on the final carry (for any element, under `vmap`).

    **Arguments:**

    - `loop`: the `TracedLoop`.
    - `tree`: `(x, bufs, ...)`: the final carry's arrays first, then anything else
        the error must travel with.
    - `name`, `max_steps`: for the message.
    """
    x, bufs = tree[:2]
    still_going = any_across_batch(loop.cond(x, bufs))
    return eqx.error_if(
        tree,
        still_going,
        f"`{name}` reached max_steps={max_steps} while `cond_fun` was still true, "
        "so it stopped before the loop finished. Raise `max_steps` (or pass "
        "`max_steps=None` for no bound), or leave `bl.max_steps_check` off if "
        "stopping early is intended.",
    )
