"""Splitting a user's carry into traced arrays and static values, and tracing the
user's functions once against it (with the checks `lax.while_loop` makes)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._errors import check_carry_match, check_predicate


def is_carried(x) -> bool:
    """Leaves carried as arrays: JAX and NumPy arrays and Python numbers."""
    return isinstance(x, jax.Array | np.ndarray | np.generic) or (
        isinstance(x, bool | int | float | complex)
    )


def _as_array(x, dtype=None):
    # strongly typed, as every carry component is inside the compiled loop
    x = jnp.asarray(x, dtype=dtype)
    return jax.lax.convert_element_type(x, x.dtype) if dtype is None else x


def _weak(x) -> bool:
    return isinstance(x, bool | int | float | complex) or getattr(
        x, "weak_type", False
    )


def _adopt_output_dtype(a, b):
    """`lax.while_loop`'s rule: a weakly typed initial value takes the body's dtype."""
    if (
        is_carried(a)
        and isinstance(b, jax.ShapeDtypeStruct)
        and _weak(a)
        and jnp.shape(a) == b.shape
        and jnp.promote_types(jnp.result_type(a), b.dtype) == b.dtype
    ):
        return _as_array(a, b.dtype)
    return a


def _returns_weak_scalars_cast(out, like):
    """Cast weakly typed outputs (e.g. a bare Python `0.0`) to the carry's dtype when
    that loses nothing, as `lax` promotion would."""

    def cast(o, x):
        if x is None or not is_carried_shape(o) or not _weak(o):
            return o
        if jnp.shape(o) != x.shape:
            return o
        if jnp.promote_types(x.dtype, jnp.result_type(o)) != x.dtype:
            return o
        if isinstance(o, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(o.shape, x.dtype)
        return jnp.asarray(o, dtype=x.dtype)

    return jtu.tree_map(cast, out, like, is_leaf=lambda v: v is None)


class TracedLoop(eqx.Module):
    """A user's loop, traced once: closure-converted `body` and `cond` acting on the
    array part of the carry, and the static part to put back afterwards."""

    body: Callable
    cond: Callable
    init: object
    static: object = eqx.field(static=True)

    def finish(self, dynamic):
        """The user-facing carry from the loop's array part."""
        return eqx.combine(dynamic, self.static)


def trace_loop(cond_fun, body_fun, init_val, name: str) -> TracedLoop:
    """Check and closure-convert `cond_fun` and `body_fun` against `init_val`."""
    dynamic, static = eqx.partition(init_val, is_carried)
    dynamic = jtu.tree_map(_as_array, dynamic)

    def full_body(d):
        return body_fun(eqx.combine(d, static))

    out = eqx.filter_eval_shape(full_body, dynamic)
    if jtu.tree_structure(out) == jtu.tree_structure(init_val):
        out_dynamic = eqx.filter(out, is_carried_shape)
        adopted = jtu.tree_map(
            _adopt_output_dtype, dynamic, out_dynamic, is_leaf=lambda v: v is None
        )
        if any(
            a.dtype != b.dtype
            for a, b in zip(jtu.tree_leaves(adopted), jtu.tree_leaves(dynamic))
        ):
            dynamic = adopted
            out = eqx.filter_eval_shape(full_body, dynamic)
    like = eqx.combine(
        jtu.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), dynamic), static
    )
    if jtu.tree_structure(out) == jtu.tree_structure(like):
        out = _returns_weak_scalars_cast(out, like)
    check_carry_match(like, out, name)

    def body_dynamic(d):
        return eqx.filter(_returns_weak_scalars_cast(full_body(d), like), is_carried)

    def cond_dynamic(d):
        return cond_fun(eqx.combine(d, static))

    check_predicate(eqx.filter_eval_shape(cond_dynamic, dynamic), name)
    body = eqx.filter_closure_convert(body_dynamic, dynamic)
    cond = eqx.filter_closure_convert(cond_dynamic, dynamic)
    return TracedLoop(body, cond, dynamic, static)


def is_carried_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or is_carried(x)
