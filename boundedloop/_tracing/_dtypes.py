"""The carry's dtypes and weak types, decided as `lax.while_loop` decides them.

A Python number in the initial carry is weakly typed. `lax.while_loop` traces the
body once; where a weakly typed initial value and the body's output there differ in
type, it promotes the initial value to their common dtype (strongly typed) and
traces again. The loop's results then have the types of the body's outputs, weak
types included. `bl.while_loop` follows the same rule, so results are
interchangeable under `jax_numpy_dtype_promotion='strict'`.

Inside the compiled loops every carried array is strongly typed; the body is traced
with the weak types lax would give it (so the dtypes it computes are lax's), and
the weak types of the results are restored at the end.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .._runtime._jax_private import weakly_typed


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


def weak(x):
    """`x` as a weakly typed array of the same dtype."""
    # the public `convert_element_type` always returns a strongly typed array
    return weakly_typed(x)


def promote_weak_inputs(inputs: Sequence, outputs: Sequence) -> tuple[list, bool]:
    """`lax.while_loop`'s promotion: each weakly typed input whose output differs
    from it in dtype or weak type, cast (strongly) to their common dtype.

    **Returns:**

    `(inputs, changed)`.
    """
    new, changed = [], False
    for x, out in zip(inputs, outputs):
        differs = (
            isinstance(out, jax.ShapeDtypeStruct)
            and jnp.shape(x) == out.shape
            and (out.dtype != jnp.result_type(x) or is_weak(out) != is_weak(x))
        )
        if is_weak(x) and differs:
            try:
                dtype = jnp.result_type(x, out)
            except jax.dtypes.TypePromotionError:
                dtype = None  # the carry check names the leaf instead
            if dtype is not None:
                x = jax.lax.convert_element_type(x, dtype)
                changed = True
        new.append(x)
    return new, changed
