"""The carry's dtypes and weak types, decided as `lax.while_loop` decides them (see
`docs/architecture.md`, "Tracing").
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def is_inexact(x) -> bool:
    """Whether `x` (an array, a tracer or an abstract value) is floating or complex:
    what has tangents and cotangents."""
    return jnp.issubdtype(x.dtype, jnp.inexact)


def is_extended(dtype) -> bool:
    """Whether `dtype` is one of JAX's extended dtypes (e.g. a typed PRNG key's
    `key<fry>`), which NumPy cannot interpret and which never promote."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def is_weak(x) -> bool:
    return isinstance(x, bool | int | float | complex) or getattr(x, "weak_type", False)


def strong(x):
    """`x` as a strongly typed array of the same dtype."""
    x = jnp.asarray(x)
    return jax.lax.convert_element_type(x, x.dtype)


def weak_dtype(value, like):
    """The one weak-type rule, JAX's: the dtype a weakly typed `value` takes where it
    meets `like` (a `jax.ShapeDtypeStruct` of the same shape), their common dtype
    (`jnp.result_type`). `None` where `value` is strongly typed, `like` is not a
    shape or has another one, or the two do not promote (the carry check then names
    the leaf)."""
    if not (is_weak(value) and isinstance(like, jax.ShapeDtypeStruct)):
        return None
    if jnp.shape(value) != like.shape:
        return None
    try:
        return jnp.result_type(value, like)
    except jax.dtypes.TypePromotionError:
        return None


def promote_weak_inputs(
    inputs: Sequence, outputs: Sequence, *, by_weak_type: bool = True
) -> tuple[list, bool]:
    """A loop's promotion of its initial carry: each weakly typed input whose output
    (a `jax.ShapeDtypeStruct`) has another dtype, cast (strongly) to their common
    dtype (`weak_dtype`); with `by_weak_type` (`lax.while_loop`'s, not
    `lax.scan`'s) also one whose output is strongly typed.

    **Returns:**

    `(inputs, changed)`.
    """
    new, changed = [], False
    for x, out in zip(inputs, outputs):
        dtype = weak_dtype(x, out)
        if dtype is not None and (
            out.dtype != jnp.result_type(x) or (by_weak_type and not is_weak(out))
        ):
            x = jax.lax.convert_element_type(x, dtype)
            changed = True
        new.append(x)
    return new, changed
