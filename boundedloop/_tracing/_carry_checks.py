"""Checks of what the user's functions return, with messages that name the leaf at
fault."""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def _describe(leaf) -> str:
    if isinstance(leaf, jax.ShapeDtypeStruct | jax.Array | np.ndarray):
        weak = getattr(leaf, "weak_type", False)
        # a dtype prints as its name: `float32`, or `key<fry>` for a typed key
        return f"{leaf.dtype}{list(leaf.shape)}" + (" (weakly typed)" if weak else "")
    return repr(leaf)


def check_carry_match(init, out, name: str, what: str = "body_fun") -> None:
    """Raise if `out` (the body's output, abstract) differs from `init` in structure,
    shape or dtype, naming every leaf that differs (as `lax.while_loop` does)."""
    init_paths, init_def = jtu.tree_flatten_with_path(init)
    out_paths, out_def = jtu.tree_flatten_with_path(out)
    if init_def != out_def:
        raise TypeError(
            f"`{name}`: `{what}` must return a carry with the same tree structure as "
            f"its input, but the input carry has structure\n  {init_def}\nand the "
            f"output has structure\n  {out_def}.\nReturn every carry component, "
            "in the same containers."
        )
    problems = [
        problem
        for (path, a), (_, b) in zip(init_paths, out_paths)
        if (problem := _leaf_mismatch("carry" + jtu.keystr(path), a, b, what))
    ]
    if not problems:
        return
    # a changed static value alone is a ValueError; a wrong type is a TypeError
    kind = TypeError if any(k is TypeError for k, _ in problems) else ValueError
    if len(problems) == 1:
        raise kind(f"`{name}`: {problems[0][1]}")
    listed = "\n- ".join(message for _, message in problems)
    raise kind(
        f"`{name}`: `{what}` changes {len(problems)} carry components:\n- {listed}"
    )


def _leaf_mismatch(where: str, a, b, what: str) -> tuple[type, str] | None:
    """How output leaf `b` differs from input leaf `a`, or `None`."""
    a_array, b_array = is_carried_shape(a), is_carried_shape(b)
    if a_array != b_array:
        return TypeError, (
            f"the input carry component {where} is {_describe(a)} but `{what}` "
            f"returns {_describe(b)} there; an array must stay an array and a "
            "static (non-array) value must stay static."
        )
    if not a_array:
        if a is not b and a != b:
            return ValueError, (
                f"the carry component {where} is a static value ({a!r}), but "
                f"`{what}` changed it to {b!r}. Static values cannot change inside a "
                "compiled loop; make it an array instead."
            )
        return None
    if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
        return TypeError, (
            f"the input carry component {where} has type {_describe(a)} but the "
            f"corresponding output carry component has type {_describe(b)}, so the "
            f"carry changes across iterations. Make `{what}` return the same shape "
            "and dtype (e.g. with `.astype`), or change the initial value to match."
        )
    return None


def check_predicate(pred, name: str, what: str = "cond_fun") -> None:
    """Raise unless `pred` (abstract) is a scalar boolean."""
    if not is_carried_shape(pred):
        raise TypeError(
            f"`{name}`: `{what}` must return a scalar boolean array, got {pred!r}."
        )
    if jnp.shape(pred) != () or jnp.result_type(pred) != jnp.bool_:
        raise TypeError(
            f"`{name}`: `{what}` must return a scalar boolean, got "
            f"{_describe(pred)}. Reduce it, e.g. with `jnp.all(...)` or "
            "`jnp.any(...)`, and compare rather than returning a number."
        )


def is_carried(x) -> bool:
    """Leaves carried as arrays: JAX and NumPy arrays and Python numbers."""
    return isinstance(
        x, jax.Array | np.ndarray | np.generic | bool | int | float | complex
    )


def is_carried_shape(x) -> bool:
    """A carried leaf, or its shape (a `jax.ShapeDtypeStruct`)."""
    return isinstance(x, jax.ShapeDtypeStruct) or is_carried(x)
