"""The loop inside `jax.shard_map`: which mesh axes values vary over. Every loop the
library emits is built here (`varying_while_loop`), which also hides the initial
values of the loop's counters from XLA (`opaque_counters`). See
`docs/architecture.md`, "Inside shard_map".
"""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes that `x` (an array or its type) varies over."""
    kind = getattr(x, "manual_axis_type", None)
    if kind is None:
        kind = jax.typeof(x).manual_axis_type
    return frozenset(kind.varying)


# `benchmarks/internal/correct_on_tpu.py` turns this off to measure what the guard costs
HIDE_COUNTERS = True


def opaque_counters(tree):
    """`tree`, with each integer and boolean array leaf passed through its own
    `lax.optimization_barrier`, so that XLA cannot see its value.

    XLA's while-loop simplifier (the HLO pass `simplify-while-loops`) reasons from a
    loop's constant initial values into its body, and on a TPU miscompiles a loop
    whose counter starts at a constant (the docs page "Correct on TPU"); a barrier on
    the initial value makes it opaque to that pass. Only integer and boolean leaves
    (counters, indices, flags: what the pass reasons from) are hidden: the barrier's
    JVP rule would give floating leaves' symbolic-zero tangents a value. One barrier
    per leaf keeps each leaf's type inside `shard_map` (one barrier over several
    operands would join their varying axes).
    """

    def hide(x):
        if isinstance(x, bool | int):  # a Python scalar: as `lax.while_loop` takes it
            x = jnp.asarray(x)
        if isinstance(x, jax.Array | np.ndarray | np.generic) and (
            jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_
        ):
            return lax.optimization_barrier(x)
        return x

    return jtu.tree_map(hide, tree) if HIDE_COUNTERS else tree


def varying_while_loop(cond_fun, body_fun, init_val):
    """As `lax.while_loop`, with the counters' initial values hidden from XLA
    (`opaque_counters`), casting the initial carry to vary over the manual mesh axes
    its step makes it vary over (only inside `shard_map`)."""
    init_val = opaque_counters(init_val)
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return lax.while_loop(cond_fun, body_fun, init_val)
    leaves, treedef = jtu.tree_flatten(init_val)

    def step(leaves):
        init_val = jtu.tree_unflatten(treedef, leaves)
        return jtu.tree_leaves(jax.eval_shape(body_fun, init_val)), None

    leaves, _ = vary_as_stepped(leaves, step)
    return lax.while_loop(cond_fun, body_fun, jtu.tree_unflatten(treedef, leaves))


def varying_switch(index, branches, *operands):
    """As `lax.switch`, with each branch's outputs cast to vary over the manual mesh
    axes that output varies over in any branch (only inside `shard_map`)."""
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return lax.switch(index, branches, *operands)
    likes = [jax.eval_shape(b, *operands) for b in branches]
    axes = jtu.tree_map(lambda *o: frozenset().union(*map(varying_axes, o)), *likes)

    def varied(branch):
        return lambda *ops: jtu.tree_map(vary, branch(*ops), axes)

    return lax.switch(index, [varied(b) for b in branches], *operands)


def vary_as_stepped(carry: list, step) -> tuple[list, Any]:
    """A loop's initial `carry` (a list of arrays), cast to vary wherever its step
    makes it vary. `step(carry) -> (types of the step's outputs, anything)`; returns
    the cast carry and the second result of `step` on it."""
    # each pass widens at least one leaf's axes, so this reaches a fixed point
    for _ in range(len(carry) + 1):
        out, result = step(carry)
        missing = [varying_axes(o) - varying_axes(x) for x, o in zip(carry, out)]
        if not any(missing):
            return carry, result
        carry = [vary(x, m) for x, m in zip(carry, missing)]
    raise AssertionError("boundedloop internal error: carry types do not settle")


def vary_everywhere(tree):
    """`tree` with every array leaf cast to vary over all manual mesh axes (inside
    `shard_map`; outside, `tree` unchanged).

    A traced function whose inputs all vary is traced once and replays the same way
    whatever its inputs' types were, so the loop can replay a body it traced
    outside the loop on values from inside it."""
    axes = jax.sharding.get_abstract_mesh().manual_axes
    if not axes:
        return tree

    return jtu.tree_map(
        lambda x: vary(x, axes) if isinstance(x, jax.Array) else x, tree
    )


def vary(x, axes):
    """`x`, cast to vary over the mesh axes `axes` it does not vary over yet."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def sum_over_devices(ct, aval):
    """A cotangent `ct` for a value of type `aval`: summed (`lax.psum`) over the
    manual mesh axes it varies over and `aval` does not."""
    extra = varying_axes(ct) - frozenset(aval.manual_axis_type.varying)
    return lax.psum(ct, tuple(sorted(extra))) if extra else ct
