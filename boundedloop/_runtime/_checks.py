"""Opt-in runtime checks (`buffer_checks`, `max_steps_check`), the trace-time
switches that turn them on, and the error they raise (`raise_if`), which every device
of a partitioned program raises together. See `docs/architecture.md`, "Run-time
checks".
"""

import contextlib
import dataclasses
import functools
import logging
import re
import sys
import threading
import warnings

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.interpreters import ad, mlir

from . import PACKAGE_DIR
from ._batching import any_across_batch
from ._jax_private import register_batching, ShardingContext, SPMDAxisContext
from ._shard_map import vary


# switches in JAX's trace and jit cache keys (`docs/architecture.md`, "Run-time
# checks"): entering a block after a function's first call traces it again
# `"reads"` (the default: reads whose gradient would be wrong), `"rules"` (inside
# `bl.buffer_checks()`: every rule) or `"off"` (`bl.buffer_checks(False)`)
_buffer_checks = jax.make_user_context(default_value="reads")


@contextlib.contextmanager
def buffer_checks(enabled: bool = True):
    """Check the buffer rules of loops traced inside this block, at run time.

    By default, every differentiated loop with buffers checks the one mistake that
    makes its gradient wrong: a read whose value matters of a location the loop
    wrote only later. Inside `bl.buffer_checks()` every rule is checked; inside
    `bl.buffer_checks(False)`, none.

    Breaking the rules (each location written at most once; only written locations
    read) leaves a loop's values as a `jnp` array's would be, but makes its
    gradient wrong, so the checks run in the gradient's reverse sweep: a location
    written twice, and a read whose value matters (its cotangent is nonzero) of a
    location the loop wrote only later, raise a runtime error (through
    `eqx.error_if`) after the loop, naming the buffer (its place in the carry),
    the step, the index and the line of `body_fun` (and, inside this block, the
    step that wrote the location later). A read whose value does not matter
    (dropped by `jnp.where`, multiplied by zero) passes.

    They cost one bool per buffer element (inside this block, the step that wrote
    it: 2 bytes where `max_steps` is below 32767, else 4) and a few operations per
    reversed read
    and write (`benchmarks/internal/buffer_checks.py`, shown in the buffers
    guide). What can be decided while
    tracing is an error at trace time whatever this says: a write whose result is
    dropped, a write to a version of a buffer that was already written, a static
    location written twice in one step or at every step, and a static index out
    of range.

    ```python
    with bl.buffer_checks():
        grads = bl.filter_jit(jax.grad(loss))(x)   # loss calls bl.while_loop(...)
    ```

    The switch is part of JAX's cache key, so it may be entered after a first call.
    `bl.scan` (and `bl.fori_loop`) check only the reads, as by default, for
    everything in their body, inner loops included; enter the block inside the body
    to check every rule there.

    **Arguments:**

    - `enabled`: whether to check every rule (`True`) or nothing (`False`).
    """
    with _buffer_checks("rules" if enabled else "off"):
        yield


@contextlib.contextmanager
def reads_checked_at_most():
    """Inside: the buffer checks of `bl.buffer_checks()` drop to the default's
    (reads whose gradient would be wrong); off stays off."""
    with _buffer_checks("off" if _buffer_checks.value == "off" else "reads"):
        yield


def buffer_check_mode() -> str:
    """`"reads"`, `"rules"` or `"off"`: what the loops traced here check."""
    return _buffer_checks.value


_max_steps_checks = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def max_steps_check(enabled: bool = True, *, warn: bool = False):
    """Raise an error (or, with `warn=True`, issue a warning) when a loop traced inside
    this block reaches `max_steps` while its predicate is still true.

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

    With `warn=True` the loop does not stop the program: a loop call that ran out of
    steps issues a `UserWarning` naming the loop and its `max_steps` (under `vmap`,
    one for the batch if any element ran out), from a host callback (a
    `jax.debug.callback` that runs only when the bound was reached) after the loop,
    and the run goes on. That costs one predicate evaluation per loop call and no
    host round trip while loops finish in time, so it can stay on in training:

    ```python
    with bl.max_steps_check(warn=True):
        params = train_step(params, batch)   # warns, and goes on, if a loop ran out
    ```

    Python's warning filters apply: by default a warning with one message is shown
    once, however often it is issued (`warnings.simplefilter("always")` shows every
    one; `"error"` turns them into exceptions, raised from the callback). Under
    `jax.grad` the warning is issued by the forward pass; a loop nested in the body of
    another `bl.while_loop` may issue it again when the outer loop's gradient
    recomputes its steps. Without `jax.jit` (eagerly) the warning is issued when the
    loop returns.

    The setting is part of JAX's trace and jit cache keys: a jitted function called
    inside the block is traced (and compiled) again with the check on.

    An error that reaches the end of the block is re-raised with this message first,
    under `jax.jit` as under `bl.filter_jit` (the same exception type; the original,
    whose message XLA buries in a traceback under `jax.jit`, is its `__context__`).
    A function compiled inside the block and run outside it raises the error as JAX
    or Equinox report it; prefer `bl.filter_jit` there.

    **Arguments:**

    - `enabled`: whether to check.
    - `warn`: warn instead of raising.
    """
    callback_log = logging.getLogger("jax._src.callback")
    unlogged = _Unlogged(_MAX_STEPS_MESSAGE)
    callback_log.addFilter(unlogged)
    try:
        with _max_steps_checks(("warn" if warn else "raise") if enabled else False):
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


def max_steps_check_mode() -> str | None:
    """`bl.max_steps_check`'s setting where a loop is traced: `"raise"`, `"warn"`, or
    `None` (off)."""
    return _max_steps_checks.value or None


def check_stopped(loop, tree, name: str, max_steps: int, *, warn: bool = False):
    """`tree`, with a runtime error attached if the loop ran out of steps: if its
    predicate still holds on the final carry (for any element, under `vmap`). With
    `warn`, a warning instead (`warn_if`).

    **Arguments:**

    - `loop`: the `TracedLoop`.
    - `tree`: `(x, bufs, ...)`: the final carry's arrays first, then anything else
        the error must travel with.
    - `name`, `max_steps`: for the message.
    - `warn`: warn instead of raising.
    """
    x, bufs = tree[:2]
    still_going = any_across_batch(loop.cond(x, bufs))
    message = (
        f"`{name}` reached max_steps={max_steps} while `cond_fun` was still true, "
        "so it stopped before the loop finished. Raise `max_steps` (or pass "
        "`max_steps=None` for no bound), or leave `bl.max_steps_check` off if "
        "stopping early is intended."
    )
    if warn:
        return warn_if(tree, still_going, message)
    return raise_if(tree, still_going, message, "bl.max_steps_check")


# `check_stopped`'s message, wherever it is embedded
_MAX_STEPS_MESSAGE = re.compile(
    r"`[^`\n]+` reached max_steps=\d+ while `cond_fun` was still true, .*?"
    r"if stopping early is intended\.",
    re.DOTALL,
)


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


def raise_if(tree, flag, msg, switch: str, details: tuple = ()):
    """`tree`, with a runtime error `msg` attached that is raised if `flag` (a bool,
    scalar but for `vmap`: raised if any element is true) is true; as
    `eqx.error_if`, which it is on one device. Anything that reads `tree` afterwards
    runs after the check. `switch` is the check's `with` block, for errors.

    With `details` (integer arrays, known at run time), `msg` is an object whose
    `format(*details)` makes the message and `summary()` a message without them;
    under `vmap` the details are those of the first element whose flag is true.
    """
    if not isinstance(flag, jax.core.Tracer):
        if details and bool(flag):
            raise RuntimeError(msg.format(*(jnp.asarray(d) for d in details)))
        return eqx.error_if(tree, flag, msg)  # resolved now
    flag = _same_on_every_device(jnp.asarray(flag, bool), switch)
    arrays, rest = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(arrays)
    details = [jnp.asarray(d, jnp.int32) for d in details]
    leaves = raise_if_p.bind(
        flag, *details, *leaves, msg=msg, switch=switch, n_details=len(details)
    )
    return eqx.combine(jtu.tree_unflatten(treedef, leaves), rest)


def warn_if(tree, flag, msg: str):
    """`tree`, after a `UserWarning` `msg` issued if `flag` (a bool, scalar but for
    `vmap`: one warning if any element is true) is true; the program goes on.

    Traced, the warning comes from a host callback under a `lax.cond`, so nothing
    leaves the device unless `flag` is true. The callback is an effect, which no
    transform prunes, and `tree` is passed on behind the `lax.cond` (an
    `optimization_barrier` over both), so what reads `tree` afterwards runs after
    the warning was issued."""
    if not isinstance(flag, jax.core.Tracer):  # resolved now: warn from here
        if bool(jnp.any(flag)):
            warnings.warn(msg, UserWarning, stacklevel=caller_level())
        return tree
    flag = any_across_batch(flag)  # unbatched: one callback for the batch
    where = _caller()  # the user's line, found now: the callback runs inside JAX

    def fire():
        jax.debug.callback(functools.partial(_warn_at, msg, where))
        return jnp.array(True)

    # constants, not `flag` itself, which `lax.cond` would forward past the branches
    done = lax.cond(flag, fire, lambda: jnp.array(False))
    arrays, rest = eqx.partition(tree, eqx.is_array)
    arrays = lax.optimization_barrier((done, arrays))[1]
    return eqx.combine(arrays, rest)


# the registry of the warnings issued from a callback, as a module's
# `__warningregistry__` (a message is shown once per line, as `warnings.warn` does)
_WARNED: dict = {}


def _caller():
    """`(filename, lineno, module)` of the first frame outside this package."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "")
    return frame.f_code.co_filename, frame.f_lineno, module


def _warn_at(msg: str, where):
    """`warnings.warn(msg)` attributed to the line `where` (`_caller`'s)."""
    filename, lineno, module = where
    warnings.warn_explicit(msg, UserWarning, filename, lineno, module, _WARNED)


def caller_level(libraries: tuple[str, ...] = ()) -> int:
    """The `stacklevel` that attributes a warning issued by this function's caller to
    the first frame outside this package (and the folders `libraries`): the user's
    call of the loop."""
    ours = (PACKAGE_DIR, *libraries)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


def _same_on_every_device(flag, switch: str):
    """Inside `shard_map`, whether `flag` is true on any device, on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(sorted(mesh.manual_axes))  # those of the enclosing `shard_map`s
    if not axes:
        return flag
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


# operands: `flag, *details, *leaves`; results: the leaves
@raise_if_p.def_impl
def _impl(flag, *operands, msg, n_details, **_):
    return _error_if(flag, *operands, msg=msg, n_details=n_details)


@raise_if_p.def_abstract_eval
def _abstract_eval(flag, *operands, n_details, **_):
    return operands[n_details:]


def _jvp(primals, tangents, **params):
    # the tangents pass unchecked: they are computed with the primal outputs
    out = raise_if_p.bind(*primals, **params)
    return out, list(tangents[1 + params["n_details"] :])


ad.primitive_jvps[raise_if_p] = _jvp


def _transpose(cts, flag, *operands, **params):
    # the check stays in the transposed program, on the cotangents
    n = params["n_details"]
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return [None] * (1 + n) + raise_if_p.bind(flag, *operands[:n], *cts, **params)


ad.primitive_transposes[raise_if_p] = _transpose


def _batch(args, dims, **params):
    n = params["n_details"]
    flag, details, leaves = args[0], args[1 : 1 + n], args[1 + n :]
    # the details of the first element that fails (of the first element where the
    # flag is the same for every element)
    first = 0 if dims[0] is None else jnp.argmax(flag, axis=dims[0])
    details = [
        d if dim is None else jnp.take(d, first, axis=dim)
        for d, dim in zip(details, dims[1 : 1 + n])
    ]
    if dims[0] is not None:
        flag = jnp.any(flag, axis=dims[0])
    out = raise_if_p.bind(flag, *details, *leaves, **params)
    return out, list(dims[1 + n :])


register_batching(raise_if_p, _batch)


def _fire(msg, *details):
    raise RuntimeError(msg.format(*details) if details else msg)


def _on_every_device(flag, *operands, msg, n_details):
    """The check in a program partitioned over several devices: every device runs
    the callback, from a branch that every device takes, as `flag` is the same on
    each; the leaves come out of it only afterwards."""
    details, leaves = operands[:n_details], operands[n_details:]

    def fire():
        jax.debug.callback(functools.partial(_fire, msg), *details, partitioned=True)
        return flag

    done = lax.cond(flag, fire, lambda: flag)
    return lax.optimization_barrier((done, list(leaves)))[1]


def _error_if(flag, *operands, msg, n_details):
    details, leaves = operands[:n_details], list(operands[n_details:])
    if not n_details:
        return eqx.error_if(leaves, flag, msg)
    # The message is made on the host from the details: a callback keeps it under a
    # key, which Equinox's error then reads (`_Kept`), so the message reaches the
    # user as any `eqx.error_if`'s does (`bl.filter_jit` shows it cleanly).
    key = lax.cond(
        flag,
        lambda: jax.pure_callback(
            functools.partial(_keep, msg),
            jax.ShapeDtypeStruct((), jnp.int32),
            *details,
        ),
        lambda: jnp.array(0, jnp.int32),
    )
    return eqx.branched_error_if(leaves, flag, key, _Kept(msg))


_kept: dict[int, str] = {}
_log = logging.getLogger("boundedloop")


def _keep(msg, *details):
    """Keeps the message made from `details` for Equinox's error to read, and logs
    it, so that under `jax.jit` it is the first line the user sees: the error
    itself then arrives inside XLA's `JaxRuntimeError`, after JAX's log of the
    failed callback (`_KeptUnlogged` drops that log). Under `eqx.filter_jit`,
    whose error is the message itself, nothing is logged."""
    key = len(_kept) % 64 + 1  # the last messages only
    _kept[key] = msg.format(*details)
    if not _equinox_reports():
        _log.error("%s", _kept[key])
    return np.array(key, np.int32)


def _equinox_reports() -> bool:
    """Whether `eqx.filter_jit` is running a program: it then raises a runtime
    error as its message alone, and filters JAX's log of the callback that raised
    it (the filter is how this is told)."""
    filters = logging.getLogger("jax._src.callback").filters
    return any(type(f).__name__ == "_FilterCallback" for f in filters)


class _KeptUnlogged(logging.Filter):
    """Drops JAX's log of a callback that raised a message `_keep` logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not any(m in str(error) for m in _kept.values())


logging.getLogger("jax._src.callback").addFilter(_KeptUnlogged())


@dataclasses.dataclass(frozen=True)
class _Kept:
    """`eqx.branched_error_if`'s messages: the one kept under `key` by `_keep`, or
    `msg.summary()` where the callback gave no key (a TPU drops its results)."""

    msg: object

    def __getitem__(self, key: int) -> str:
        return _kept.get(int(key)) or self.msg.summary()

    def __len__(self) -> int:
        return 65


def _lowering(ctx, flag, *leaves, msg, switch, n_details):
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
    fn = functools.partial(fn, msg=msg, n_details=n_details)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, flag, *leaves)


mlir.register_lowering(raise_if_p, _lowering)
