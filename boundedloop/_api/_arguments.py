"""The loops' static arguments (`max_steps`, `checkpoints`), checked before tracing."""

import operator
from typing import Any

import jax

from .._sweeps._schedule import default_checkpoints, INT32_MAX


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
