"""In-place buffers inside the loop.

Inside `body_fun` every array leaf named by `buffers=` is a `Buffer`: it supports
`buf[i]` and `buf.at[i].set(x, pred=p)`. Buffers are carried as one copy, never
checkpointed: the reverse sweep reads the final buffer, which holds every value ever
written because each location is written at most once. Cotangents are kept in a
buffer-sized array too and touched only where the body reads or writes.

To differentiate a step sparsely, each read returns `buf[i]` with a *dummy* input
standing in for its tangent (`_read` below), so the step's VJP with respect to the
dummies is exactly the cotangent of each read value, to be added at `i`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax


def _index(idx, buf_ndim: int):
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) > buf_ndim:
        raise IndexError(
            f"Too many indices for a buffer of rank {buf_ndim}: got {len(idx)}."
        )
    out = []
    for i in idx:
        i = jnp.asarray(i)
        if i.shape != () or not jnp.issubdtype(i.dtype, jnp.integer):
            raise TypeError(
                "A buffer is indexed by scalar integers along its leading axes, "
                f"`buf[i]` or `buf[i, j]`; got an index of type {i.dtype}{list(i.shape)}."
            )
        out.append(i.astype(jnp.int32))
    return tuple(out)


def get(array, idx):
    start = idx + (jnp.array(0, jnp.int32),) * (array.ndim - len(idx))
    sizes = (1,) * len(idx) + array.shape[len(idx) :]
    return lax.dynamic_slice(array, start, sizes).reshape(array.shape[len(idx) :])


def put(array, idx, value, pred=True):
    if pred is not True:
        value = jnp.where(pred, value, get(array, idx))
    start = idx + (jnp.array(0, jnp.int32),) * (array.ndim - len(idx))
    value = value.reshape((1,) * len(idx) + array.shape[len(idx) :])
    return lax.dynamic_update_slice(array, value, start)


@jax.custom_jvp
def _read(array, idx, dummy):
    del dummy
    return get(array, idx)


def _read_jvp(primals, tangents):
    array, idx, dummy = primals
    t_array, _, t_dummy = tangents
    # Reverse mode differentiates a step with respect to the dummy only: its tangent
    # is that of the value read. Forward mode carries the buffer's own tangent, read
    # at the same location.
    out = _read(array, idx, dummy)
    zero = jax.custom_derivatives.SymbolicZero
    if isinstance(t_array, zero):
        return out, t_dummy
    t_out = get(t_array, idx)
    return out, t_out if isinstance(t_dummy, zero) else t_out + t_dummy


_read.defjvp(_read_jvp, symbolic_zeros=True)


def _same_index(a, b):
    return jnp.all(jnp.stack([i == j for i, j in zip(a, b)]))


@dataclasses.dataclass
class Write:
    leaf: int
    index: tuple
    value: Any
    pred: Any


class StepTrace:
    """One evaluation of the body: the buffers' state and what it read and wrote."""

    def __init__(self, arrays, dummies, active, written):
        self.arrays = list(arrays)
        self.dummies = dummies
        self.active = active
        self.written = None if written is None else list(written)
        # runtime rule violations seen in this step (only with the checks on)
        self.double_write = jnp.array(False)
        self.unwritten_read = jnp.array(False)
        # (leaf, index, shape/dtype, fresh): `fresh` is false where the read saw a
        # value this same step wrote, whose cotangent belongs to that write instead
        self.reads: list[tuple[int, tuple, Any, Any]] = []
        self.writes: list[Write] = []

    def read(self, leaf, idx):
        array = self.arrays[leaf]
        if self.written is not None:
            done = jnp.all(get(self.written[leaf], idx))
            unwritten = jnp.logical_and(self.active, ~done)
            self.unwritten_read = jnp.logical_or(self.unwritten_read, unwritten)
        fresh = jnp.array(True)
        if self.dummies is None:
            value = get(array, idx)
        else:
            # the reverse sweep reads the final buffer: values this step wrote are
            # there already, but their cotangent must reach the written value
            value = _read(array, idx, self.dummies[len(self.reads)])
            for w in self.writes:
                if w.leaf == leaf and len(w.index) == len(idx):
                    same = jnp.logical_and(w.pred, _same_index(w.index, idx))
                    value = jnp.where(same, w.value, value)
                    fresh = jnp.logical_and(fresh, ~same)
        shape = jax.ShapeDtypeStruct(value.shape, value.dtype)
        self.reads.append((leaf, idx, shape, fresh))
        return value

    def write(self, leaf, idx, value, pred):
        array = self.arrays[leaf]
        value = jnp.asarray(value)
        shape = array.shape[len(idx) :]
        if value.shape != shape:
            value = jnp.broadcast_to(value, shape)
        value = value.astype(array.dtype)
        pred = jnp.asarray(True if pred is None else pred, bool)
        if pred.shape != ():
            raise TypeError("`buf.at[i].set(x, pred=p)` needs `p` to be a scalar bool.")
        self.writes.append(Write(leaf, idx, value, pred))
        live = jnp.logical_and(pred, self.active)
        if self.written is not None:
            again = jnp.logical_and(live, jnp.any(get(self.written[leaf], idx)))
            self.double_write = jnp.logical_or(self.double_write, again)
            mask = self.written[leaf]
            block = jnp.ones(mask.shape[len(idx) :], bool)
            self.written[leaf] = put(mask, idx, block, live)
        self.arrays[leaf] = put(array, idx, value, live)


class Buffer:
    """An array inside the loop body, read and written one location at a time.

    `buf[i]` reads; `buf.at[i].set(x)` and `buf.at[i].set(x, pred=p)` return the
    buffer with location `i` set (only where `p` is true). `i` is a scalar integer
    or a tuple of them, indexing the leading axes. Each location may be written at
    most once per loop, and only written locations may be read.
    """

    def __init__(self, trace: StepTrace, leaf: int):
        self._trace = trace
        self._leaf = leaf

    @property
    def _array(self):
        return self._trace.arrays[self._leaf]

    @property
    def shape(self):
        return self._array.shape

    @property
    def dtype(self):
        return self._array.dtype

    @property
    def ndim(self):
        return self._array.ndim

    def __getitem__(self, idx):
        return self._trace.read(self._leaf, _index(idx, self.ndim))

    @property
    def at(self):
        return _BufferAt(self)

    def __repr__(self):
        return f"Buffer({jnp.dtype(self.dtype).name}{list(self.shape)})"


class _BufferAt:
    def __init__(self, buffer: Buffer):
        self._buffer = buffer

    def __getitem__(self, idx):
        return _BufferRef(self._buffer, _index(idx, self._buffer.ndim))


class _BufferRef:
    def __init__(self, buffer: Buffer, idx):
        self._buffer = buffer
        self._idx = idx

    def set(self, x, *, pred=None) -> Buffer:
        """Set this location to `x` (where `pred` is true). Returns the buffer."""
        b = self._buffer
        b._trace.write(b._leaf, self._idx, x, pred)
        return b

    def get(self):
        return self._buffer[self._idx]


class _Marker:
    def __init__(self, k):
        self.k = k


def find_buffers(buffers_fn, dynamic, static, name: str) -> tuple[int, ...]:
    """The flat positions (among the leaves of `dynamic`, the carry's array part) of
    the leaves under the nodes `buffers_fn(carry)` returns."""
    leaves, treedef = jtu.tree_flatten(dynamic)
    marked = jtu.tree_unflatten(treedef, [_Marker(k) for k in range(len(leaves))])
    is_marker = lambda x: isinstance(x, _Marker)  # noqa: E731
    nodes = buffers_fn(eqx.combine(marked, static, is_leaf=is_marker))
    found = []
    for leaf in jtu.tree_leaves(nodes, is_leaf=is_marker):
        if not isinstance(leaf, _Marker):
            raise TypeError(
                f"`{name}`: every leaf under the nodes `buffers` returns must be an "
                f"array of the carry, but found {leaf!r}. Return the carry's array "
                "nodes, e.g. `buffers=lambda carry: carry[1]`."
            )
        if jnp.ndim(leaves[leaf.k]) == 0:
            raise TypeError(
                f"`{name}`: a buffer must be an array with at least one axis, but one "
                f"of the nodes `buffers` returns is a scalar ({leaves[leaf.k]!r})."
            )
        found.append(leaf.k)
    return tuple(sorted(set(found)))
