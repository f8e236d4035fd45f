"""What the checkpointed forward sweep leaves for the reverse sweep: the `Tape`.

Checkpoint storage is one stacked array per carry leaf, a row per slot. Writes are
branch-free: `store` always writes a row, either the new value or the row's own old
value, so the storage is updated in place and never copied whole.
"""

from typing import NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Int, PyTree


UNUSED = jnp.iinfo(jnp.int32).max  # position of a slot that holds nothing


def empty(carry, slots: int):
    """Storage for `slots` copies of `carry` (a pytree of arrays), each row sharded
    (on a mesh with explicit axes) as the carry is."""
    return jtu.tree_map(
        lambda x: jnp.broadcast_to(jnp.zeros_like(x)[None], (slots,) + x.shape), carry
    )


def load(storage, slot):
    """The carry held in row `slot`."""
    return jtu.tree_map(
        lambda s: lax.dynamic_index_in_dim(s, slot, keepdims=False), storage
    )


def store(storage, slot, carry, when=True):
    """`storage` with row `slot` set to `carry` where `when` (a scalar) is true."""

    def _store(s, x):
        if when is not True:
            x = jnp.where(when, x, lax.dynamic_index_in_dim(s, slot, keepdims=False))
        return lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), slot, 0)

    return jtu.tree_map(_store, storage, carry)


class Tape(NamedTuple):
    """What the checkpointed sweep leaves for the reverse sweep."""

    storage: PyTree[Array]  # a row per slot (buffers are never stored)
    positions: Int[Array, " slots"]  # the step whose state each slot holds
    trips: Int[Array, ""]  # steps this element took (batched under vmap)
    length: Int[Array, ""]  # iterations the sweep ran (never batched)
    bufs: tuple  # the final buffers: every value ever written
