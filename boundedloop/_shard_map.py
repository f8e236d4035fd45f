"""The loop inside `jax.shard_map`: which mesh axes values vary over.

Inside `shard_map` every array's type says over which manual mesh axes it varies, and a loop's
carry must keep its type. A carry that starts out the same on every device (a step
counter, an empty checkpoint store) but is combined with per-device values in the
step (a predicate, the carry itself) would change type, which `lax.while_loop`
rejects. `varying_while_loop` first casts such initial values to vary (`lax.pcast`)
where the step makes them vary. Outside `shard_map` it is `lax.while_loop`, and the
other helpers here return their input unchanged.

The loop casts everything it carries to vary over every manual axis once, before
its loops (`vary_everywhere`), so that no cast, and so no collective in its
transpose, happens inside a loop whose trip count differs between devices; the
cotangents of inputs that were the same on every device are summed across devices
once, afterwards (`sum_over_devices`).
"""

import jax
import jax.tree_util as jtu
from jax import lax


def _varying(x) -> frozenset:
    kind = getattr(x, "manual_axis_type", None)
    if kind is None:
        kind = jax.typeof(x).manual_axis_type
    return frozenset(kind.varying)


def varying_while_loop(cond_fun, body_fun, init_val):
    """As `lax.while_loop`, casting the initial carry to vary over the manual mesh
    axes its step makes it vary over (only inside `shard_map`)."""
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return lax.while_loop(cond_fun, body_fun, init_val)
    leaves, treedef = jtu.tree_flatten(init_val)
    # each pass widens at least one leaf's axes, so this reaches a fixed point
    for _ in range(len(leaves) + 1):
        out = jtu.tree_leaves(jax.eval_shape(body_fun, init_val))
        missing = [_varying(o) - _varying(x) for x, o in zip(leaves, out)]
        if not any(missing):
            break
        leaves = [vary(x, m) for x, m in zip(leaves, missing)]
        init_val = jtu.tree_unflatten(treedef, leaves)
    return lax.while_loop(cond_fun, body_fun, init_val)


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
    missing = tuple(sorted(frozenset(axes) - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def sum_over_devices(ct, aval):
    """A cotangent `ct` for a value of type `aval`: summed (`lax.psum`) over the
    manual mesh axes it varies over and `aval` does not."""
    extra = _varying(ct) - frozenset(aval.manual_axis_type.varying)
    return lax.psum(ct, tuple(sorted(extra))) if extra else ct
