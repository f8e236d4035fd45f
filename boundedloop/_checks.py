"""Opt-in runtime checks, and the trace-time settings that switch them on.

Each switch is a `with` block read when a loop is traced. Off (the default), a check
leaves the compiled program exactly as it would be without it.

- `buffer_checks`: the buffer rules (each location written at most once, only
  written locations read), checked in the forward pass.
- `max_steps_check`: a loop must not stop because it ran out of steps. The loop
  stopped because of `max_steps` exactly when the predicate still holds on the final
  carry, so the check evaluates the predicate once more, on the final carry, and
  attaches an error to it (`raise_if`): one predicate evaluation, nothing inside
  the loop. It is attached to what every later use of the loop reads (the final carry,
  and the trip count the backward pass reverses), so no transform prunes it.

The two checks are JAX configuration states that are part of JAX's trace and jit
cache keys, so entering a block after a function was first traced retraces it
rather than silently reusing the unchecked trace.

Both raise through `raise_if`. On one device that is `eqx.error_if`. In a program
partitioned over several devices `eqx.error_if`'s callback runs on one device only,
and its result is sent to the others: when it raises, the others wait for it in a
collective until XLA aborts the process. So the error is a primitive, `raise_if_p`,
that chooses when it is lowered: `eqx.error_if` on one device, and on several a
callback that every device runs and raises from, on a flag that is the same on every
device (inside `shard_map`, the flags of all devices are combined first), so that
every device stops at the same point and none waits for another. A raise from a
callback on several devices is also kept by JAX for `jax.effects_barrier()` (and so
reported again at exit), until the next program with a callback runs on them.
"""

import contextlib
import functools
import logging
import re
import threading

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.interpreters import ad, batching, mlir

from ._batching import any_across_batch
from ._jax_private import ShardingContext, SPMDAxisContext
from ._shard_map import vary


# switches in the jit cache key and trace context: a function traced with a check
# on is traced again with it off, so entering the block before or after the first
# call makes no difference
_buffer_checks = jax.make_user_context(default_value=False)


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

    The switch is part of JAX's cache key, so it may be entered after a first call.
    `bl.scan` (and `bl.fori_loop`) turn it off for everything in their body, inner
    loops included; enter the block inside the body to check those.

    **Arguments:**

    - `enabled`: whether to check.
    """
    with _buffer_checks(bool(enabled)):
        yield


def buffer_checks_enabled() -> bool:
    return _buffer_checks.value


def raise_violations(active, violations):
    """`active`, with a runtime error attached if the step broke a buffer rule.

    Tied to the loop's predicate so that the check can never be pruned away. Inside
    `shard_map` each device may take its own number of steps, so no check can wait
    for the other devices in the loop: there the violations are gathered over the
    steps (`gather_violations`) and raised after the loop (`raise_violations_after`).
    """
    if _manual_axes():
        return active
    double_write, unwritten_read = violations
    active = raise_if(active, double_write, DOUBLE_WRITE, _BUFFER_CHECKS)
    return raise_if(active, unwritten_read, UNWRITTEN_READ, _BUFFER_CHECKS)


def gather_violations(before, after):
    """The buffer checks' state `after` a step, its violations those of every step
    so far (`before` is the state before it)."""
    if before is None:
        return after
    gathered = tuple(jnp.logical_or(a, b) for a, b in zip(before[1], after[1]))
    return after[0], gathered


def raise_violations_after(written, tree):
    """`tree`, with the buffer checks' errors attached, for the violations gathered
    over a loop inside `shard_map` (elsewhere they were raised in the loop)."""
    if written is None or not _manual_axes():
        return tree
    double_write, unwritten_read = written[1]
    tree = raise_if(tree, any_across_batch(double_write), DOUBLE_WRITE, _BUFFER_CHECKS)
    return raise_if(
        tree, any_across_batch(unwritten_read), UNWRITTEN_READ, _BUFFER_CHECKS
    )


DOUBLE_WRITE = (
    "`bl.while_loop`: a buffer location was written twice. Each location of a "
    "buffer may be written at most once."
)
UNWRITTEN_READ = (
    "`bl.while_loop`: a buffer read a location that has not been written. Only "
    "written locations may be read."
)


_max_steps_checks = jax.make_user_context(default_value=False)


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

    An error that reaches the end of the block is re-raised with this message first,
    under `jax.jit` as under `bl.filter_jit` (the same exception type; the original,
    whose message XLA buries in a traceback under `jax.jit`, is its `__context__`).
    A function compiled inside the block and run outside it raises the error as JAX
    or Equinox report it; prefer `bl.filter_jit` there.

    **Arguments:**

    - `enabled`: whether to check.
    """
    callback_log = logging.getLogger("jax._src.callback")
    unlogged = _Unlogged(_MAX_STEPS_MESSAGE)
    callback_log.addFilter(unlogged)
    try:
        with _max_steps_checks(bool(enabled)):
            yield
    except RuntimeError as error:
        reworded = _reworded(error, _MAX_STEPS_MESSAGE)
        if reworded is None:
            raise
        raise reworded from None
    finally:
        callback_log.removeFilter(unlogged)


class _Unlogged(logging.Filter):
    """Drops JAX's log of a callback that raised a message matching `pattern` (the
    error itself is raised, with the message first): under `jax.jit` that log is
    printed before the error, with Equinox's note to use `filter_jit`."""

    def __init__(self, pattern: "re.Pattern"):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or self.pattern.search(str(error)) is None


def _reworded(error: RuntimeError, pattern: "re.Pattern") -> RuntimeError | None:
    """`error` of the same type, with the message matching `pattern` first, or `None`
    if `error` has no such message or already starts with it.

    A check's runtime error reaches the user wrapped: under `jax.jit` in XLA's
    `INTERNAL: CpuCallback error calling callback: Traceback ...` followed by a note
    to use `equinox.filter_jit`; under `filter_jit` after Equinox's stack of our
    lowering."""
    text = str(error)
    found = pattern.search(text)
    if found is None or found.start() == 0:
        return None
    try:
        reworded = type(error)(found.group(0))
    except Exception:  # a type that cannot be made from a message
        reworded = RuntimeError(found.group(0))
    return reworded if str(reworded) == found.group(0) else RuntimeError(found.group(0))


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
    return raise_if(
        tree,
        still_going,
        f"`{name}` reached max_steps={max_steps} while `cond_fun` was still true, "
        "so it stopped before the loop finished. Raise `max_steps` (or pass "
        "`max_steps=None` for no bound), or leave `bl.max_steps_check` off if "
        "stopping early is intended.",
        "bl.max_steps_check",
    )


# `check_stopped`'s message, wherever it is embedded
_MAX_STEPS_MESSAGE = re.compile(
    r"`[^`\n]+` reached max_steps=\d+ while `cond_fun` was still true, .*?"
    r"if stopping early is intended\.",
    re.DOTALL,
)


_BUFFER_CHECKS = "bl.buffer_checks"
_tracing = threading.local()


@contextlib.contextmanager
def tracing_a_loop():
    """Around the tracing of a loop's functions: a check traced inside is in the
    body of a loop."""
    depth = getattr(_tracing, "depth", 0)
    _tracing.depth = depth + 1
    try:
        yield
    finally:
        _tracing.depth = depth


def _manual_axes() -> tuple:
    """The mesh axes of the enclosing `shard_map`s."""
    return tuple(sorted(jax.sharding.get_abstract_mesh().manual_axes))


def raise_if(tree, flag, msg: str, switch: str):
    """`tree`, with a runtime error `msg` attached that is raised if `flag` (a bool,
    scalar but for `vmap`: raised if any element is true) is true; as
    `eqx.error_if`, which it is on one device. Anything that reads `tree` afterwards
    runs after the check. `switch` is the check's `with` block, for errors.
    """
    if not isinstance(flag, jax.core.Tracer):
        return eqx.error_if(tree, flag, msg)  # resolved now
    flag = _same_on_every_device(jnp.asarray(flag, bool), switch)
    arrays, rest = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(arrays)
    leaves = raise_if_p.bind(flag, *leaves, msg=msg, switch=switch)
    return eqx.combine(jtu.tree_unflatten(treedef, leaves), rest)


def _same_on_every_device(flag, switch: str):
    """Inside `shard_map`, whether `flag` is true on any device, on every device."""
    axes = _manual_axes()
    if not axes:
        return flag
    mesh = jax.sharding.get_abstract_mesh()
    auto = set(mesh.axis_names) - set(axes)
    if auto:
        raise ValueError(_partial_auto_error(switch, auto))
    if getattr(_tracing, "depth", 0):
        # the devices may take different numbers of steps of the outer loop, and
        # a collective inside it would wait for steps that never come
        raise ValueError(
            f"`{switch}` cannot check a loop nested in the body of another loop "
            "inside `jax.shard_map`: its error would need the devices to agree, in a "
            "loop whose steps may differ between them. Check the outer loop only "
            f"(`with {switch}(False):` around the inner loop, "
            "inside the body), or check the loops outside `shard_map`."
        )
    return lax.psum(vary(flag.astype(jnp.int32), axes), axes) > 0


def _partial_auto_error(switch: str, auto) -> str:
    return (
        f"`{switch}` cannot check a loop inside a `jax.shard_map` that leaves mesh "
        f"axes automatic (here {sorted(auto)}): only one device of those axes would "
        "run the check, and the others would wait for it. Map over every mesh axis "
        f"in that `shard_map`, check the loop outside it, or leave `{switch}` off "
        "there."
    )


raise_if_p = jax.extend.core.Primitive("boundedloop_raise_if")
raise_if_p.multiple_results = True


@raise_if_p.def_impl
def _impl(flag, *leaves, msg, switch):
    del switch
    return eqx.error_if(list(leaves), flag, msg)


@raise_if_p.def_abstract_eval
def _abstract_eval(flag, *leaves, msg, switch):
    del flag, msg, switch
    return leaves


def _jvp(primals, tangents, **params):
    # the tangents pass unchecked: they are computed with the primal outputs
    out = raise_if_p.bind(*primals, **params)
    return out, list(tangents[1:])


ad.primitive_jvps[raise_if_p] = _jvp


def _transpose(cts, flag, *leaves, **params):
    # the check stays in the transposed program, on the cotangents
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return [None, *raise_if_p.bind(flag, *cts, **params)]


ad.primitive_transposes[raise_if_p] = _transpose


def _batch(args, dims, **params):
    flag, *leaves = args
    if dims[0] is not None:  # batched
        flag = jnp.any(flag, axis=dims[0])
    return raise_if_p.bind(flag, *leaves, **params), list(dims[1:])


batching.primitive_batchers[raise_if_p] = _batch


def _fire(msg):
    raise RuntimeError(msg)


def _on_every_device(flag, *leaves, msg):
    """The check in a program partitioned over several devices: every device runs
    the callback, from a branch that every device takes, as `flag` is the same on
    each; the leaves come out of it only afterwards."""

    def fire():
        jax.debug.callback(functools.partial(_fire, msg), partitioned=True)
        return flag

    done = lax.cond(flag, fire, lambda: flag)
    return lax.optimization_barrier((done, list(leaves)))[1]


def _error_if(flag, *leaves, msg):
    return eqx.error_if(list(leaves), flag, msg)


def _lowering(ctx, flag, *leaves, msg, switch):
    context = ctx.module_context.axis_context
    partitioned = isinstance(context, SPMDAxisContext) or (
        isinstance(context, ShardingContext) and context.num_devices > 1
    )
    # partitioned callbacks exist on CPU and GPU; TPUs do not raise from callbacks
    platforms = ctx.module_context.platforms
    if partitioned and all(p in ("cpu", "cuda", "rocm") for p in platforms):
        if isinstance(context, SPMDAxisContext):
            auto = set(context.mesh.axis_names) - set(context.manual_axes)
            if auto:  # caught when traced, unless traced outside the `shard_map`
                raise ValueError(_partial_auto_error(switch, auto))
        fn = _on_every_device
    else:
        fn = _error_if
    return mlir.lower_fun(functools.partial(fn, msg=msg), multiple_results=True)(
        ctx, flag, *leaves
    )


mlir.register_lowering(raise_if_p, _lowering)
