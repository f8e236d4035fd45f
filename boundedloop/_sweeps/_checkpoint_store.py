"""The checkpoint store: what the checkpointed forward sweep leaves for the reverse
sweep (`CheckpointStore`), its rows of stored carries (`Storage`) and their
branch-free writes (`set_where`).
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Int

from .._tracing._dtypes import is_extended, is_inexact


UNUSED = jnp.iinfo(jnp.int32).max  # position of a slot that holds nothing


class Storage(eqx.Module):
    """Rows of stored carries: one stacked array per carry leaf, except that integer
    and boolean scalar leaves sharing a dtype are packed into one stacked array (a
    store writes each array once, so fewer arrays mean fewer writes per store), and
    that a leaf the loop never changes is kept once, as it is."""

    # per leaf: its stacked array, None if packed, or the leaf if it is invariant
    arrays: tuple[Array | None, ...]
    # dtype name -> the `(slots, count)` array of the scalar leaves of that dtype
    packed: dict[str, Array]
    treedef: Any = eqx.field(static=True)
    columns: tuple = eqx.field(static=True)  # per leaf: `(dtype name, column)` or None
    # whether the sweeps keep every array small (`_cost_model.runs_in_order`): the
    # forward decides, and the reverse reads it here
    in_order: bool = eqx.field(static=True)
    # per leaf: whether the loop never changes it (its every row would be `carry`'s)
    invariant: tuple[bool, ...] = eqx.field(static=True)


def empty(
    carry, slots: int, perturbed=None, in_order: bool = False, invariant=None
) -> Storage:
    """Storage for `slots` copies of `carry` (a pytree of arrays), each row sharded
    (on a mesh with explicit axes) as the carry is. `perturbed`, one bool per leaf
    (or `None`: none known), keeps floating scalars that are perturbed apart from
    those that are not. `in_order` (see `_cost_model.runs_in_order`): no leaves are
    packed, so each stacked array stays as small as its leaf allows. `invariant`,
    one bool per leaf (or `None`: none), the leaves the loop never changes: they
    are kept once, as `carry` has them, and never written."""
    leaves, treedef = jtu.tree_flatten(carry)
    invariant = (False,) * len(leaves) if invariant is None else tuple(invariant)
    # Extended dtypes (typed PRNG keys) are never packed: they cannot be stacked
    # with others, and NumPy cannot name them. Floating leaves are packed only with
    # leaves of the same perturbation: under forward over reverse (`jax.hessian`)
    # the storage gets tangents, and a packed array has one tangent for all its
    # columns, so a leaf packed with a perturbed one would be loaded with a tangent
    # of its own (zero, but not symbolically), which
    # `equinox.internal.nondifferentiable` (diffrax's `t` and `dt`) rejects. Integer
    # and boolean leaves never have tangents.
    perturbed = (None,) * len(leaves) if perturbed is None else tuple(perturbed)

    def pack_name(x, p, fixed):
        if fixed or jnp.ndim(x) != 0 or is_extended(x.dtype):
            return None
        name = jnp.dtype(x.dtype).name
        if not is_inexact(x):
            return name
        return None if p is None else f"{name}/{'perturbed' if p else 'fixed'}"

    scalars = list(map(pack_name, leaves, perturbed, invariant))
    # a dtype with one scalar keeps its own array: nothing to save by packing it
    names = [
        n if not in_order and n is not None and scalars.count(n) > 1 else None
        for n in scalars
    ]
    columns = [
        None if n is None else (n, names[:k].count(n)) for k, n in enumerate(names)
    ]
    counts = {n: names.count(n) for n in names if n is not None}
    arrays = tuple(
        x
        if fixed
        else None
        if c is not None
        else jnp.broadcast_to(jnp.zeros_like(x)[None], (slots,) + x.shape)
        for x, c, fixed in zip(leaves, columns, invariant)
    )
    packed = {
        name: jnp.zeros((slots, count), jnp.dtype(name.split("/")[0]))
        for name, count in counts.items()
    }
    return Storage(arrays, packed, treedef, tuple(columns), in_order, invariant)


def load(storage: Storage, slot):
    """The carry held in row `slot`."""
    rows = {
        name: lax.dynamic_index_in_dim(p, slot, keepdims=False)
        for name, p in storage.packed.items()
    }

    def leaf(a, c, fixed):
        if fixed:  # the leaf itself
            return a
        if c is None:  # its own stacked array
            return lax.dynamic_index_in_dim(a, slot, keepdims=False)
        return rows[c[0]][c[1]]  # a column of a packed row

    leaves = map(leaf, storage.arrays, storage.columns, storage.invariant)
    return jtu.tree_unflatten(storage.treedef, list(leaves))


def set_where(rows: Array, index, value, when=True) -> Array:
    """`rows` with row `index` set to `value` where `when` (a scalar) is true.

    A masked write goes to an index past the end, which the update drops: XLA
    then fuses the choice into the in-place write, where selecting between the
    new row and a read of the old one is a kernel of its own."""
    if when is True:
        return lax.dynamic_update_index_in_dim(rows, value, index, 0)
    index = jnp.where(when, index, rows.shape[0])
    return rows.at[index].set(value, mode="drop")


def _write(s, x, slot, when):
    if not is_extended(s.dtype):
        x = x.astype(s.dtype)
    return set_where(s, slot, x, when)


def store(storage: Storage, slot, carry, when=True) -> Storage:
    """`storage` with row `slot` set to `carry` where `when` (a scalar) is true."""
    leaves = storage.treedef.flatten_up_to(carry)
    arrays = tuple(
        a if c is not None or fixed else _write(a, x, slot, when)
        for a, x, c, fixed in zip(
            storage.arrays, leaves, storage.columns, storage.invariant
        )
    )
    packed = {}
    for name, p in storage.packed.items():
        row = [
            x for x, c in zip(leaves, storage.columns) if c is not None and c[0] == name
        ]
        packed[name] = _write(p, jnp.stack(row), slot, when)
    return eqx.tree_at(lambda s: (s.arrays, s.packed), storage, (arrays, packed))


class CheckpointStore(NamedTuple):
    """What the checkpointed sweep leaves for the reverse sweep."""

    storage: Storage  # a row per slot (buffers are never stored)
    positions: Int[Array, " slots"]  # the step whose state each slot holds
    used: Int[Array, ""]  # how many slots hold a state
    trips: Int[Array, ""]  # steps this element took (batched under vmap)
    length: Int[Array, ""]  # iterations the sweep ran (never batched)
    bufs: tuple  # the final buffers: every value ever written
    # the last `tape_steps` steps' residuals (`_tape`), or None: nothing taped
    tape: Any = None
    # per buffer, the last step that changed each element of a buffer lent to an
    # inner loop, or None: not stamped (`_forward_sweeps.initial_stamps`)
    stamps: Any = None
