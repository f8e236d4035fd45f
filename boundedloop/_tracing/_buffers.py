"""In-place buffers inside the loop: the `Buffer` the body sees, and the trace of a
step's reads and writes (`StepTrace`). What a buffer supports, and the rule that lets
one copy serve the reverse sweep: `docs/guides/buffers.md`.

To differentiate a step sparsely, each read returns `buf[idx]` with a *dummy* input
standing in for its tangent (`_read` below), so the step's VJP with respect to the
dummies is exactly the cotangent of each read value, to be added at `idx`. What an
index may be, and how it is read and written in place, is in `_indexing`.
"""

import contextlib
import dataclasses
import functools
import itertools
import os
import sys
import threading
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu

from .._runtime import PACKAGE_DIR
from .._runtime._jax_private import (
    pytype_aval_mappings,
    register_canonicalize_value_handler,
)
from ._carry_checks import is_carried
from ._indexing import get, Index, make_index, overlay, put, SUPPORTED


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
    version: int  # the buffer's version it wrote to (the one before the write)
    unconditional: bool  # written with no `pred`


class Site(NamedTuple):
    """One read, write or hand-over of a buffer in the body, as traced: what the
    buffer checks replay (`_buffer_checks`) and name in their messages."""

    kind: str  # "read", "write" or "hand" (handed to an inner loop)
    leaf: int  # the buffer
    version: int  # the buffer's version read, or written to
    number: int  # the how-manieth read (or write) of the step
    pattern: tuple  # the index's static pattern (`Index.pattern`)
    where: str  # the user's line, "file.py:12 in body"
    # a write with no `pred` to a static index: the same location at every step
    every_step: bool = False
    unconditional: bool = False  # a write with no `pred`


class StepTrace:
    """One evaluation of the body: the buffers' state and what it read and wrote.

    A buffer is a value, as a `jnp` array is: each write makes a new version of it
    (a new `Buffer`), and reading a version sees the writes made before it. The
    versions of one buffer form a chain, because the buffer is updated in place: a
    write must be to the newest version, and the body must return the newest.
    """

    def __init__(self, arrays, dummies, active, shared=frozenset(), *, gate, names):
        # per buffer, where it is in the carry (`buffer_names`), for messages
        self.names = names
        # each buffer's array at each of its versions in this step
        self.history = [[a] for a in arrays]
        self.dummies = dummies
        self.active = active
        # an inner loop's writes to buffers lent by outer loops happen only where
        # those loops' steps are live too (under `vmap`, an element that stopped
        # must not be written by the inner loops its masked step still runs)
        self.gate = gate
        self.live = active if gate is None else jnp.logical_and(active, gate)
        # buffers this step hands to an inner loop: differentiated as whole arrays
        # (see `hand_back`), so their reads and writes here are plain
        self.shared = set(shared)
        # of those, the ones an inner loop reads (or may read: see `hand_back`)
        self.lent_read: set[int] = set()
        # the trace `body_fun` runs in: buffers are written only there (see `_here`)
        self.trace_state = jax.extend.core.get_opaque_trace_state()
        # (leaf, index, shape/dtype of the value read), per read in order
        self.reads: list[tuple[int, Index, Any]] = []
        self.writes: list[Write] = []
        self.sites: list[Site] = []

    @property
    def arrays(self) -> list:
        """Each buffer's newest array."""
        return [versions[-1] for versions in self.history]

    def latest(self, leaf: int) -> int:
        return len(self.history[leaf]) - 1

    def read(self, leaf: int, version: int, index: Index, traced: bool = False):
        """`traced`: whether the user's index held traced integers."""
        if traced:
            self._here(leaf, "read at a traced index")
        array = self.history[leaf][version]
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
                if w.leaf == leaf and w.version < version:
                    new, hit = overlay(value, index, w.index, w.value, array.shape)
                    value = jnp.where(w.pred, new, value)
        shape = jax.ShapeDtypeStruct(value.shape, value.dtype)
        self._site("read", leaf, version, index)
        self.reads.append((leaf, index, shape))
        return value

    def _site(
        self, kind, leaf, version, index, *, every_step=False, unconditional=False
    ):
        """Record a read, write or hand-over, about to be appended to its list."""
        number = {"read": len(self.reads), "write": len(self.writes)}.get(kind, 0)
        where = user_line()
        site = Site(
            kind, leaf, version, number, index.pattern, where, every_step, unconditional
        )
        self.sites.append(site)

    def _here(self, leaf: int, what: str):
        """Raise if the body is inside a JAX transformation of its own (`lax.cond`,
        `jax.jit`, ...): what it writes there would be that trace's, and escape it."""
        if jax.extend.core.get_opaque_trace_state() != self.trace_state:
            raise ValueError(
                f"A `bl.Buffer` ({self.names[leaf]}) was {what} "
                "inside a JAX transformation nested in `body_fun` (`lax.cond`, "
                "`lax.switch`, an inner `lax` loop, a `jax.jit`- or `jax.vmap`-ed "
                "function, ...). Buffers are written, and read at traced indices, only "
                f"at the top level of `body_fun`. {_INSTEAD}"
            )

    def _newest(self, leaf: int, version: int, what: str):
        """Raise if `version` of the buffer is not its newest: a later write's
        result would be dropped (the buffer is one array, updated in place)."""
        if version == self.latest(leaf):
            return
        later = next(s for s in self.sites if s.leaf == leaf and s.version >= version)
        raise ValueError(
            f"A `bl.Buffer` ({self.names[leaf]}) was {what} through "
            f"a version of it that was already written (at {later.where}). A buffer "
            "is updated in place, so its writes must form one chain: write to the "
            "result of the previous write (`buf = buf.at[i].set(x)`), and hand on "
            "that result."
        )

    def write(self, leaf: int, version: int, index: Index, value, pred):
        self._here(leaf, "written")
        self._newest(leaf, version, "written")
        array = self.history[leaf][-1]
        value = jnp.broadcast_to(jnp.asarray(value), index.result_shape())
        value = value.astype(array.dtype)
        unconditional = pred is None
        pred = jnp.asarray(True if pred is None else pred, bool)
        if pred.shape != ():
            raise TypeError(
                "`buf.at[...].set(x, pred=p)` needs `p` to be a scalar bool."
            )
        inside = index.in_bounds(array.shape)
        # as `jnp`: out of range, dropped (an Equinox-style client's loops clamp
        # the index instead, as Equinox's buffers do, and its results rely on it)
        if isinstance(inside, jax.core.Tracer) and not _clamping.value:
            pred = jnp.logical_and(pred, inside)
        if self.gate is not None:
            pred = jnp.logical_and(pred, self.gate)
        if unconditional:
            _check_not_written_here(self, leaf, index)
        every_step = unconditional and index.static_ints is not None
        self._site(
            "write",
            leaf,
            version,
            index,
            every_step=every_step,
            unconditional=unconditional,
        )
        self.writes.append(Write(leaf, index, value, pred, version, unconditional))
        live = jnp.logical_and(pred, self.active)
        self.history[leaf].append(put(array, index, value, live))

    def hand_back(self, leaf: int, version: int, array, read: bool = True):
        """`array` is buffer `leaf` after an inner loop wrote into it; `read`:
        whether that loop (or one inside it) reads it."""
        self._here(leaf, "handed to an inner loop")
        self._newest(leaf, version, "handed to an inner loop")
        self.shared.add(leaf)
        if read:
            self.lent_read.add(leaf)
        self._site("hand", leaf, version, make_index(..., array.shape))
        self.history[leaf].append(array)


def _check_not_written_here(trace: StepTrace, leaf: int, index: Index):
    """A second unconditional write to a static location in one step breaks the
    write-once rule whenever the step runs: an error now."""
    shape = trace.history[leaf][-1].shape
    mine = _static_cells(index, shape)
    if mine is None:
        return
    for w, site in zip(trace.writes, (s for s in trace.sites if s.kind == "write")):
        if w.leaf != leaf or not w.unconditional:
            continue
        theirs = _static_cells(w.index, shape)
        if theirs is not None and mine & theirs:
            raise ValueError(
                f"A `bl.Buffer` ({trace.names[leaf]}) is written "
                f"twice in one step at {index.describe(shape)}: at {site.where}, then "
                f"at {user_line()}. Each location of a buffer may be written at "
                "most once in a loop."
            )


def check_every_step_writes(layout, names, max_steps: int | None, name: str):
    """Raise if the body writes a static location with no `pred` and the loop may
    take a second step: that step writes the location again."""
    if max_steps is not None and max_steps < 2:
        return
    for s in layout.sites:
        if s.kind == "write" and s.every_step:
            raise ValueError(
                f"`{name}`: `body_fun` at {s.where} writes the buffer {names[s.leaf]} "
                "at a static index with no `pred`, so every step writes the same "
                "location, and a second step would write it again. Each location of "
                "a buffer may be written at most once in a loop: index the write "
                "by the step (`buf.at[i].set(x)`), or write it once "
                "(`buf.at[0].set(x, pred=i == 0)`)."
            )


def check_returned_newest(trace: StepTrace, returned: "Buffer", name: str):
    """Raise if the body returned a buffer without its last writes: as for a `jnp`
    array, a write whose result is not used would change nothing, but a buffer is
    written in place, so the write would happen. An error, at trace time."""
    leaf = returned._leaf
    if returned._version == trace.latest(leaf):
        return
    dropped = [
        s for s in trace.sites if s.leaf == leaf and s.version >= returned._version
    ]
    raise ValueError(
        f"`{name}`: the result of a write to a `bl.Buffer` "
        f"({trace.names[leaf]}) at {dropped[0].where} is never "
        "used: `body_fun` returns the buffer as it was before that write. A "
        "buffer is updated in place, so the write would still happen; use its "
        "result (`buf = buf.at[i].set(x)`) and return that, or remove the write."
    )


class _Clamping(threading.local):
    value = False


_clamping = _Clamping()


def clamping() -> bool:
    """Whether loops traced here are a client's (`clamped_writes`)."""
    return _clamping.value


@contextlib.contextmanager
def clamped_writes():
    """Buffers of loops traced inside clamp an out-of-range traced write index into
    range, as `equinox.internal.while_loop`'s buffers do, rather than dropping the
    write as `jnp` does: for the loops an Equinox-style client hands us."""
    before = _clamping.value
    _clamping.value = True
    try:
        yield
    finally:
        _clamping.value = before


def _static_cells(index: Index, shape) -> set | None:
    """The locations `index` covers, or `None` if it holds traced integers."""
    if index.static_ints is None:
        return None
    ints = iter(index.static_ints)
    axes = []
    for p, dim in zip(index.pattern, shape):
        if p is None:
            axes.append([next(ints) % dim])
        else:
            start, size, step = p
            axes.append(range(start, start + size * step, step) if size else [])
    return set(itertools.product(*axes))


_LIBRARIES = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) for m in (jax, eqx, contextlib)
)


def user_line() -> str:
    """Where the user's code is, in the stack: the innermost frame outside this
    package, JAX, Equinox and the standard library, as `file.py:12 in body`."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(PACKAGE_DIR) and not name.startswith(_LIBRARIES):
            if not name.startswith("<frozen"):
                return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown line"


class Buffer(jax.Array):
    """An array inside the loop body, read and written in place.

    `buf[idx]` reads; `buf.at[idx].set(x)` and `buf.at[idx].set(x, pred=p)` return
    the buffer with `idx` set (only where `p` is true). `idx` is any combination of
    integers (Python ints or traced scalars), slices with static bounds and `...`.
    Each location may be written at most once per loop, and only written locations
    may be read. A buffer may also be passed, inside the carry, to an inner
    `bl.while_loop` or `bl.scan`, where it is a buffer of that loop too.

    It is a `jax.Array` to `isinstance`, so annotations that admit an array of its
    shape and dtype admit it (diffrax's `MaybeBuffer`, checked with jaxtyping); of
    an array's methods it keeps only those above (`_withhold_array_methods`).
    """

    # compared and hashed as a Python object, as the carry's other objects are
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __copy__(self):
        return Buffer(self._trace, self._leaf, self._version)

    def __deepcopy__(self, memo):
        del memo
        return self.__copy__()  # the step's trace is one, shared by its copies

    def __init__(self, trace: StepTrace, leaf: int, version: int = 0):
        self._trace = trace
        self._leaf = leaf
        self._version = version

    @property
    def _array(self):
        return self._trace.history[self._leaf][self._version]

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
        return self._trace.read(self._leaf, self._version, index, _is_traced(idx))

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


def buffer_names(layout, bufs) -> tuple[str, ...]:
    """Per buffer, where it is in the carry and its type: `carry[1]`, float32[12, 3]."""
    marked = jtu.tree_unflatten(layout.treedef, range(layout.treedef.num_leaves))
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(marked)[0]]
    return tuple(
        f"`carry{paths[k]}`, {jnp.dtype(b.dtype).name}{list(b.shape)}"
        for k, b in zip(layout.buffer_pos, bufs)
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
        f"A `bl.Buffer` ({buffer._trace.names[buffer._leaf]}) was passed to a "
        "JAX operation or transformation as an array (to `lax.cond`, `lax.switch`, "
        "`lax.select`, `jnp.where`, a `jax.jit`-ed function, ...). A buffer is not "
        f"an array and cannot leave the top level of `body_fun`. {_INSTEAD}"
    )


# Without these JAX only sees that `Buffer` defines `__jax_array__`, and says that
# `__jax_array__` is no longer supported.
pytype_aval_mappings[Buffer] = _not_a_jax_value
register_canonicalize_value_handler(Buffer, _not_a_jax_value)


class _Withheld:
    """An attribute `jax.Array` has and `Buffer` does not: absent, so that reading
    it reaches `Buffer.__getattr__` and its message."""

    def __get__(self, instance, owner=None):
        raise AttributeError


def _withhold_array_methods(cls):
    """`cls` without the methods it inherits from `jax.Array`: arithmetic and
    comparison operators, `iter` and `in` say that a buffer is not an array; every
    other attribute is absent."""
    kept = {"__doc__", "__module__", "__slots__", "__weakref__"}
    protocols = {"__numpy_dtype__", "__array_namespace__"}
    for name in set(vars(jax.Array)) - set(vars(cls)) - kept:
        operator = name.startswith("__") and name not in protocols
        setattr(cls, name, _not_an_array if operator else _Withheld())
    cls.__iter__ = _not_an_array


_withhold_array_methods(Buffer)


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
        """Set this location to `x` (where `pred` is true). Returns the buffer
        after the write, which the body must use (or return) in place of the
        buffer before it."""
        b = self._buffer
        b._trace.write(b._leaf, b._version, self._index, x, pred)
        return Buffer(b._trace, b._leaf, b._trace.latest(b._leaf))

    def get(self):
        b = self._buffer
        return b._trace.read(b._leaf, b._version, self._index, self._traced)

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
    for _, v in lent:
        v._trace._newest(v._leaf, v._version, "handed to an inner loop")
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
    traces = {id(buffer._trace): buffer._trace for _, buffer in lent}
    gates = [trace.live for trace in traces.values()]
    return functools.reduce(jnp.logical_and, gates) if gates else None


def lent_reads(loop, init_val, lent) -> frozenset:
    """The paths of the lent buffers (`lend_buffers`'s `lent`) that the inner loop
    (a `TracedLoop`, traced from `init_val`) reads: in its body, or through a loop
    inside it."""
    layout = loop.layout
    dynamic = eqx.filter(init_val, is_carried)
    paths = [path for path, _ in jtu.tree_flatten_with_path(dynamic)[0]]
    read = {*layout.read_leaves, *layout.lent_read}
    return frozenset(
        path for path, _ in lent if layout.buffer_pos.index(paths.index(path)) in read
    )


def return_buffers(out, lent, read=None):
    """The inner loop's final carry, with the outer buffers it was lent handed back
    to the outer loop's step (and the `Buffer` objects in their places). `read`:
    the paths of those the inner loop reads (`lent_reads`); `None`: all of them."""
    if not lent:
        return out
    by_path = dict(lent)

    def give_back(path, v):
        buffer = by_path.get(path)
        if buffer is None:
            return v
        trace, leaf = buffer._trace, buffer._leaf
        trace.hand_back(leaf, buffer._version, v, read is None or path in read)
        return Buffer(trace, leaf, trace.latest(leaf))

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
