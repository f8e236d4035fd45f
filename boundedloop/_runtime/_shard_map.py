"""The loop inside `jax.shard_map`: which mesh axes values vary over.

Inside `shard_map` every array's type says over which manual mesh axes it varies, and a loop's
carry must keep its type. A carry that starts out the same on every device (a step
counter, an empty checkpoint store) but is combined with per-device values in the
step (a predicate, the carry itself) would change type, which `lax.while_loop`
rejects. `varying_while_loop` first casts such initial values to vary (`lax.pcast`)
where the step makes them vary. Outside `shard_map` it is `lax.while_loop`, and the
other helpers here return their input unchanged. Every loop the library emits is
built here, so `varying_while_loop` also hides the initial values of the loop's
counters from XLA (`opaque_counters`): XLA's TPU while-loop simplifier miscompiles
loops whose counters start at a known constant.

The loop casts everything it carries to vary over every manual axis once, before
its loops (`vary_everywhere`), so that no cast, and so no collective in its
transpose, happens inside a loop whose trip count differs between devices; the
cotangents of inputs that were the same on every device are summed across devices
once, afterwards (`sum_over_devices`).
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


# `benchmarks/correct_on_tpu.py` turns this off to measure what the guard costs
HIDE_COUNTERS = True


def opaque_counters(tree):
    """`tree`, with each integer and boolean array leaf passed through its own
    `lax.optimization_barrier`, so that XLA cannot see its value.

    XLA's while-loop simplifier (the HLO pass `simplify-while-loops`) reasons from a
    loop's constant initial values into its body: on a TPU it drops a
    `select(i > 0, ...)` from a loop whose counter `i` starts at a constant 0, so step
    0 reads what step -1 would have written (JAX 0.10.2, TPU v5e; see the docs page
    "Correct on TPU"). A barrier on the initial value makes it opaque to that pass.
    Only integer and boolean leaves (counters, indices, flags: what the pass reasons
    from) are hidden; floating leaves are left alone, since the barrier's JVP rule
    would give their symbolic-zero tangents a value. One barrier per leaf keeps each
    leaf's type inside `shard_map` (one barrier over several operands would join
    their varying axes).
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
