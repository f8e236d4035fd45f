"""Flat lists, as primitives take them: a tree's arrays and back (`flat`), the
entries a mask picks and the list made whole again (`pick`, `fill`, `spread`), the
JVP of a function of such a list in some of its entries (`jvp_at`), and the zero
and sum of cotangents (`zero_ct`, `add`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def pick(mask, tree):
    """The leaves of `tree` (shaped like `mask`, `None` allowed) where `mask` is true."""
    treedef = jtu.tree_structure(mask)
    return [v for m, v in zip(jtu.tree_leaves(mask), treedef.flatten_up_to(tree)) if m]


def zero_ct(x):
    """A zero cotangent for `x`, a value or its type (`float0` for integers; `x` may
    be a constant that tracing left a Python scalar)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # an array or an aval
        dtype, shape = x.dtype, x.shape
    else:
        dtype, shape = jnp.result_type(x), jnp.shape(x)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros(shape, dtype)
    return np.zeros(shape, jax.dtypes.float0)


def jvp_at(fn, args: list, where, tangents) -> tuple[list, list]:
    """`jax.jvp` of `fn(args)` (a list to a list) with respect to the arguments at
    positions `where` only, in the directions `tangents`: `(outputs, tangents)`."""

    def at(moving):
        full = list(args)
        for k, m in zip(where, moving):
            full[k] = m
        return fn(full)

    return jax.jvp(at, ([args[k] for k in where],), (list(tangents),))


def flat(tree):
    """`tree`'s arrays as a list, and the function rebuilding `tree` from such a
    list."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(arrays)
    return leaves, lambda ops: eqx.combine(jtu.tree_unflatten(treedef, ops), static)


def add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if a.dtype == jax.dtypes.float0:
        return a
    return a + b


def everywhere(tree):
    return jtu.tree_map(lambda _: True, tree)


def fill(mask, values, absent=lambda k: None) -> list:
    """`values`, in order, at the positions where `mask` is true, and `absent(k)` at
    each other position `k` (`None` by default): a flat list of the values that
    exist (tangents of the perturbed leaves, say) made whole again. Every value is
    used."""
    values = list(values)
    if len(values) != sum(map(bool, mask)):
        raise AssertionError(
            f"boundedloop internal error: {len(values)} values for "
            f"{sum(map(bool, mask))} places; please report it."
        )
    it = iter(values)
    return [next(it) if m else absent(k) for k, m in enumerate(mask)]


def spread(wanted, values: list) -> list:
    """`values` for the `wanted` leaves, `None` for the others, in `wanted`'s
    leaf order."""
    return fill(jtu.tree_leaves(wanted), values)
