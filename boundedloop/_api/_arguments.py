"""The loops' static arguments (`max_steps`, `checkpoints`, `memory`), checked
before tracing."""

import operator
import re
from typing import Any

import jax

from .._sweeps._schedule import default_checkpoints, INT32_MAX


def check_callables(cond_fun, body_fun, buffers, name: str):
    """A clear error where a function argument of a loop is not callable."""
    for arg, fn in [("cond_fun", cond_fun), ("body_fun", body_fun)]:
        if not callable(fn):
            raise TypeError(f"`{name}` needs `{arg}` to be callable, got {fn!r}.")
    if buffers is not None and not callable(buffers):
        raise TypeError(
            f"`{name}` needs `buffers` to be a function `carry -> node(s)`, got "
            f"{buffers!r}."
        )


def check_max_steps(max_steps: Any, name: str) -> int | None:
    """`max_steps` as a Python int (or `None`), or a clear error."""
    if max_steps is None:
        return None
    if isinstance(max_steps, bool) or isinstance(max_steps, jax.core.Tracer):
        raise TypeError(
            f"`{name}` needs `max_steps` to be a Python int or None, got "
            f"{max_steps!r}. It fixes the size of the loop's memory, so it cannot be "
            "traced; pass it as a static value."
        )
    try:
        value = operator.index(max_steps)
    except TypeError:
        raise TypeError(
            f"`{name}` needs `max_steps` to be a non-negative int or None, got "
            f"{max_steps!r} of type {type(max_steps).__name__}."
        ) from None
    if value < 0:
        raise ValueError(
            f"`{name}` needs `max_steps >= 0`, got {value}. Use `max_steps=None` for "
            "a loop with no bound."
        )
    # the step counter is an int32: no loop takes more steps than it can count
    return min(value, INT32_MAX)


def check_checkpoints(checkpoints: Any, max_steps: int | None, name: str) -> int:
    """The number of checkpoint slots to use, resolving the default."""
    if checkpoints is None:
        return default_checkpoints(max_steps)
    if isinstance(checkpoints, bool) or isinstance(checkpoints, jax.core.Tracer):
        raise TypeError(
            f"`{name}` needs `checkpoints` to be a positive Python int or None, got "
            f"{checkpoints!r}."
        )
    try:
        value = operator.index(checkpoints)
    except TypeError:
        raise TypeError(
            f"`{name}` needs `checkpoints` to be a positive int or None, got "
            f"{checkpoints!r} of type {type(checkpoints).__name__}."
        ) from None
    if value < 1:
        raise ValueError(
            f"`{name}` needs `checkpoints >= 1`, got {value}: the backward pass must "
            "hold at least the initial carry."
        )
    if max_steps is not None:
        value = min(value, max(max_steps, 1))
    return value


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def check_memory(memory: Any, checkpoints: Any, name: str) -> int | None:
    """`memory=` as a number of bytes (or `None`), or a clear error: an `int` of
    bytes or a string with a unit (`"2 GiB"`, `"500 MB"`), not with `checkpoints`."""
    if memory is None:
        return None
    if checkpoints is not None:
        raise ValueError(
            f"`{name}` takes `memory` or `checkpoints`, not both: a budget of "
            "`memory` bytes chooses the checkpoints itself (and how many steps to "
            f"tape). Got memory={memory!r} and checkpoints={checkpoints!r}."
        )
    value = None
    if isinstance(memory, str):
        match = _MEMORY.match(memory)
        unit = match and _UNITS.get(match.group(2).lower() or "b")
        if unit:
            value = int(float(match.group(1)) * unit)
    elif not isinstance(memory, bool) and not isinstance(memory, jax.core.Tracer):
        try:
            value = operator.index(memory)
        except TypeError:
            pass
    if value is None:
        raise TypeError(
            f"`{name}` needs `memory` to be a number of bytes: an int, or a string "
            f"with a unit such as '2 GiB' or '500 MB' (units: "
            "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), "
            f"got {memory!r}."
        )
    if value < 1:
        raise ValueError(f"`{name}` needs `memory > 0` bytes, got {memory!r}.")
    return value


def checkpoints_within(memory: int, carry_bytes: int, max_steps, name: str) -> int:
    """The carry copies `memory` bytes hold (before any are traded for taped steps),
    or a clear error where not even one does."""
    if memory < carry_bytes:
        raise ValueError(
            f"`{name}`: `memory={memory}` bytes cannot hold one copy of the carry, "
            f"which takes {carry_bytes} bytes (the backward pass keeps at least the "
            "initial carry). Give at least that much, or use `checkpoints=1`."
        )
    return check_checkpoints(max(memory // max(carry_bytes, 1), 1), max_steps, name)
