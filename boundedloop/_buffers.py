"""In-place buffers inside the loop.

Inside `body_fun` every array leaf named by `buffers=` is a `Buffer`: it supports
`buf[i]` and `buf.at[i].set(x, pred=p)`. Buffers are carried as one copy, never
checkpointed: the reverse sweep reads the final buffer, which holds every value ever
written because each location is written at most once. Cotangents are kept in a
buffer-sized array too and touched only where the body reads or writes.

To differentiate a step sparsely, each read returns `buf[idx]` with a *dummy* input
standing in for its tangent (`_read` below), so the step's VJP with respect to the
dummies is exactly the cotangent of each read value, to be added at `idx`. What an
index may be, and how it is read and written in place, is in `_indexing`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu

from ._indexing import get, Index, make_index, overlay, put, SUPPORTED
from ._jax_private import pytype_aval_mappings, register_canonicalize_value_handler


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


@dataclasses.dataclass
class Write:
    leaf: int
    index: Index
    value: Any
    pred: Any


class StepTrace:
    """One evaluation of the body: the buffers' state and what it read and wrote."""

    def __init__(
        self, arrays, dummies, active, written, shared=frozenset(), *, gate=None
    ):
        self.arrays = list(arrays)
        self.dummies = dummies
        self.active = active
        # an inner loop's writes to buffers lent by outer loops happen only where
        # those loops' steps are live too (under `vmap`, an element that stopped
        # must not be written by the inner loops its masked step still runs)
        self.gate = gate
        self.live = active if gate is None else jnp.logical_and(active, gate)
        self.written = None if written is None else list(written)
        # buffers this step hands to an inner loop: differentiated as whole arrays
        # (see `hand_back`), so their reads and writes here are plain
        self.shared = set(shared)
        # the trace `body_fun` runs in: buffers are written only there (see `_here`)
        self.trace_state = jax.extend.core.get_opaque_trace_state()
        # runtime rule violations seen in this step (only with the checks on)
        self.double_write = jnp.array(False)
        self.unwritten_read = jnp.array(False)
        # (leaf, index, shape/dtype of the value read), per read in order
        self.reads: list[tuple[int, Index, Any]] = []
        self.writes: list[Write] = []

    def read(self, leaf: int, index: Index, traced: bool = False):
        """`traced`: whether the user's index held traced integers."""
        if self.written is not None:
            self._here(leaf, "read with `bl.buffer_checks` on")
        elif traced:
            self._here(leaf, "read at a traced index")
        array = self.arrays[leaf]
        if self.written is not None:
            done = jnp.all(get(self.written[leaf], index))
            unwritten = jnp.logical_and(self.active, ~done)
            self.unwritten_read = jnp.logical_or(self.unwritten_read, unwritten)
        # every read has its dummy, so that the loop's stand-ins line up with the
        # reads; a read of a buffer lent to an inner loop leaves it unused
        if callable(self.dummies):  # made as the reads are found
            dummy = self.dummies(index.result_shape(), array.dtype)
        else:
            dummy = self.dummies[len(self.reads)]
        if leaf in self.shared:
            value = get(array, index)
        else:
            # the reverse sweep reads the final buffer: values this step wrote are
            # there already, but their cotangent must reach the written value. (A
            # read traced before the step hands the buffer to an inner loop is
            # one of these too: `_read`'s JVP carries the buffer's own tangent.)
            value = _read(array, index, dummy)
            for w in self.writes:
                if w.leaf == leaf:
                    new, hit = overlay(value, index, w.index, w.value, array.shape)
                    value = jnp.where(w.pred, new, value)
        shape = jax.ShapeDtypeStruct(value.shape, value.dtype)
        self.reads.append((leaf, index, shape))
        return value

    def _here(self, leaf: int, what: str):
        """Raise if the body is inside a JAX transformation of its own (`lax.cond`,
        `jax.jit`, ...): what it writes there would be that trace's, and escape it."""
        if jax.extend.core.get_opaque_trace_state() != self.trace_state:
            raise ValueError(
                f"A `bl.Buffer` ({describe(self.arrays[leaf], leaf)}) was {what} "
                "inside a JAX transformation nested in `body_fun` (`lax.cond`, "
                "`lax.switch`, an inner `lax` loop, a `jax.jit`- or `jax.vmap`-ed "
                "function, ...). Buffers are written, and read at traced indices, only "
                f"at the top level of `body_fun`. {_INSTEAD}"
            )

    def write(self, leaf: int, index: Index, value, pred):
        self._here(leaf, "written")
        array = self.arrays[leaf]
        value = jnp.broadcast_to(jnp.asarray(value), index.result_shape())
        value = value.astype(array.dtype)
        pred = jnp.asarray(True if pred is None else pred, bool)
        if pred.shape != ():
            raise TypeError(
                "`buf.at[...].set(x, pred=p)` needs `p` to be a scalar bool."
            )
        if self.gate is not None:
            pred = jnp.logical_and(pred, self.gate)
        self.writes.append(Write(leaf, index, value, pred))
        live = jnp.logical_and(pred, self.active)
        if self.written is not None:
            mask = self.written[leaf]
            again = jnp.logical_and(live, jnp.any(get(mask, index)))
            self.double_write = jnp.logical_or(self.double_write, again)
            self.written[leaf] = put(mask, index, True, live)
        self.arrays[leaf] = put(array, index, value, live)

    def hand_back(self, leaf: int, array):
        """`array` is buffer `leaf` after an inner loop wrote into it."""
        self._here(leaf, "handed to an inner loop")
        self.shared.add(leaf)
        self.arrays[leaf] = array


class Buffer:
    """An array inside the loop body, read and written in place.

    `buf[idx]` reads; `buf.at[idx].set(x)` and `buf.at[idx].set(x, pred=p)` return
    the buffer with `idx` set (only where `p` is true). `idx` is any combination of
    integers (Python ints or traced scalars), slices with static bounds and `...`.
    Each location may be written at most once per loop, and only written locations
    may be read. A buffer may also be passed, inside the carry, to an inner
    `bl.while_loop` or `bl.scan`, where it is a buffer of that loop too.
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
        index = make_index(idx, self.shape)
        return self._trace.read(self._leaf, index, _is_traced(idx))

    @property
    def at(self):
        return _BufferAt(self)

    def __repr__(self):
        return f"Buffer({jnp.dtype(self.dtype).name}{list(self.shape)})"

    def __getattr__(self, name):
        raise AttributeError(f"A `bl.Buffer` has no `{name}`. {_WHAT_A_BUFFER_DOES}")

    def __jax_array__(self):
        raise TypeError(
            "A `bl.Buffer` is not an array: read it with `buf[idx]` (`buf[...]` "
            f"for all of it). {_WHAT_A_BUFFER_DOES}"
        )

    __array__ = __jax_array__


def _not_an_array(self, *args):
    del args
    self.__jax_array__()


def describe(array, leaf: int) -> str:
    return (
        f"buffer #{leaf}, {jnp.dtype(array.dtype).name}{list(array.shape)}; a loop's "
        "buffers are numbered from 0 in the order of the carry's leaves"
    )


_INSTEAD = (
    "For a conditional write use `buf.at[i].set(x, pred=p)` rather than "
    "`lax.cond`, `lax.select` or `jnp.where` on the buffer; to compute with its "
    "values, read them first (`buf[i]`, or `buf[...]` for all of it) and pass "
    "those; to write it in an inner loop, put it in the carry of an inner "
    "`bl.while_loop` or `bl.scan`."
)


def _not_a_jax_value(buffer: Buffer):
    """What JAX meets when a `Buffer` is an operand of a primitive or an argument
    of a traced function (`lax.cond`, `lax.select`, `jnp.where`, `jax.jit`, ...).

    A `ValueError`: JAX re-raises a `TypeError` from here as its own error."""
    raise ValueError(
        f"A `bl.Buffer` ({describe(buffer._array, buffer._leaf)}) was passed to a "
        "JAX operation or transformation as an array (to `lax.cond`, `lax.switch`, "
        "`lax.select`, `jnp.where`, a `jax.jit`-ed function, ...). A buffer is not "
        f"an array and cannot leave the top level of `body_fun`. {_INSTEAD}"
    )


# Without these JAX only sees that `Buffer` defines `__jax_array__`, and says that
# `__jax_array__` is no longer supported.
pytype_aval_mappings[Buffer] = _not_a_jax_value
register_canonicalize_value_handler(Buffer, _not_a_jax_value)


for _op in "add sub mul truediv floordiv mod pow matmul and or xor lt le gt ge".split():
    setattr(Buffer, f"__{_op}__", _not_an_array)
    setattr(Buffer, f"__r{_op}__", _not_an_array)
Buffer.__neg__ = Buffer.__abs__ = Buffer.__iter__ = _not_an_array


_WHAT_A_BUFFER_DOES = (
    "Inside the loop a buffer supports `buf[idx]`, `buf.at[idx].set(x)`, "
    "`buf.at[idx].set(x, pred=p)`, `buf.at[idx].get()`, `.shape`, `.dtype` and "
    "`.ndim`; to compute with it, read it first (`buf[...]`). " + SUPPORTED
)


class _BufferAt:
    def __init__(self, buffer: Buffer):
        self._buffer = buffer

    def __getitem__(self, idx):
        index = make_index(idx, self._buffer.shape)
        return _BufferRef(self._buffer, index, _is_traced(idx))


def _is_traced(idx) -> bool:
    idx = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, jax.core.Tracer) for i in idx)


class _BufferRef:
    def __init__(self, buffer: Buffer, index: Index, traced: bool):
        self._buffer = buffer
        self._index = index
        self._traced = traced

    def set(self, x, *, pred=None) -> Buffer:
        """Set this location to `x` (where `pred` is true). Returns the buffer."""
        b = self._buffer
        b._trace.write(b._leaf, self._index, x, pred)
        return b

    def get(self):
        b = self._buffer
        return b._trace.read(b._leaf, self._index, self._traced)

    def __getattr__(self, name):
        raise AttributeError(
            f"`buf.at[...].{name}` is not supported: a buffer location is written "
            f"once, with `.set`. {_WHAT_A_BUFFER_DOES}"
        )


def lend_buffers(init_val, buffers_fn):
    """An inner loop's view of the outer loop's buffers in its initial carry.

    **Returns:**

    `(init_val, buffers_fn, lent)`: the carry with each outer `Buffer` replaced by
    its current array, a `buffers` function that adds those leaves to the inner
    loop's buffers, and `lent`, the `(path, Buffer)` pairs for `return_buffers`.
    """
    is_buffer = lambda v: isinstance(v, Buffer)  # noqa: E731
    leaves = jtu.tree_flatten_with_path(init_val, is_leaf=is_buffer)[0]
    lent = [(path, v) for path, v in leaves if is_buffer(v)]
    if not lent:
        return init_val, buffers_fn, lent
    init_val = jtu.tree_map(
        lambda v: v._array if is_buffer(v) else v, init_val, is_leaf=is_buffer
    )
    paths = {path for path, _ in lent}

    def with_lent(carry):
        own = () if buffers_fn is None else buffers_fn(carry)
        picked = [
            v for path, v in jtu.tree_flatten_with_path(carry)[0] if path in paths
        ]
        return own, picked

    return init_val, with_lent, lent


def lent_gate(lent):
    """Where the outer loops whose buffers an inner loop was lent are live (a scalar
    bool), or `None` if it was lent none: the inner loop writes them only there."""
    gates = []
    for _, buffer in lent:
        if not any(buffer._trace is trace for trace, _ in gates):
            gates.append((buffer._trace, buffer._trace.live))
    if not gates:
        return None
    gate = gates[0][1]
    for _, live in gates[1:]:
        gate = jnp.logical_and(gate, live)
    return gate


def return_buffers(out, lent):
    """The inner loop's final carry, with the outer buffers it was lent handed back
    to the outer loop's step (and the `Buffer` objects in their places)."""
    if not lent:
        return out
    by_path = dict(lent)

    def give_back(path, v):
        buffer = by_path.get(path)
        if buffer is None:
            return v
        buffer._trace.hand_back(buffer._leaf, v)
        return buffer

    return jtu.tree_map_with_path(give_back, out)


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
