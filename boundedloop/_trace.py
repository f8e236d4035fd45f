"""Tracing the user's functions: splitting the carry into traced arrays and static
values, checking `cond_fun` and `body_fun` against it as `lax.while_loop` does, and
closure-converting them into a `TracedLoop`.

The traced body speaks one protocol, `body(StepIn) -> StepOut`, on the carry's array
leaves split into `x` (ordinary leaves) and `bufs` (buffer leaves).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._buffers import Buffer, find_buffers, StepTrace
from ._checks import buffer_checks_enabled
from ._closure import closure_convert
from ._dtypes import is_weak, promote_weak_inputs, strong, weak
from ._errors import check_carry_match, check_predicate


def is_carried(x) -> bool:
    """Leaves carried as arrays: JAX and NumPy arrays and Python numbers."""
    return isinstance(x, jax.Array | np.ndarray | np.generic) or (
        isinstance(x, bool | int | float | complex)
    )


def _returns_weak_scalars_cast(out, like):
    """Cast weakly typed outputs (e.g. a bare Python `0.0`) to the carry's dtype when
    that loses nothing, as `lax` promotion would."""

    def cast(o, x):
        # `x` is static where the body turned a static value into an array: the
        # carry check names it
        if not isinstance(x, jax.ShapeDtypeStruct):
            return o
        if not is_carried_shape(o) or not is_weak(o):
            return o
        if jnp.shape(o) != x.shape:
            return o
        try:
            if jnp.promote_types(x.dtype, jnp.result_type(o)) != x.dtype:
                return o
        except jax.dtypes.TypePromotionError:
            return o  # the carry check names the leaf
        if isinstance(o, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(o.shape, x.dtype)
        return jnp.asarray(o, dtype=x.dtype)

    return jtu.tree_map(cast, out, like, is_leaf=lambda v: v is None)


class StepIn(NamedTuple):
    """What the traced body takes."""

    x: tuple  # the ordinary carry leaves
    bufs: tuple  # the buffer leaves
    dummies: tuple  # stand-ins for the reads' tangents (see `_buffers._read`)
    active: Any  # scalar bool: buffer writes happen only where true
    written: Any  # None, or the buffer checks' `(masks, violations)`


class StepOut(NamedTuple):
    """What the traced body returns."""

    x: tuple  # the new ordinary leaves
    bufs: tuple  # the buffers after this step's writes
    written: Any  # None, or the buffer checks' state after this step
    writes: tuple  # `(value, index, pred)` per write, in order
    reads: tuple  # the `Index` of each read, in order


class TracedLoop(eqx.Module):
    """A user's loop, traced once and closure-converted.

    `body` is `StepIn -> StepOut`, `checked_body` the same with the buffer checks on
    (or `None`), `cond(x, bufs)` the predicate. `init` and `bufs` are the initial
    arrays. Only `body`, `init` and `bufs` are differentiated: the predicate is
    piecewise constant, and `checked_body` computes what `body` does.
    """

    body: Callable
    cond: Callable
    checked_body: Callable | None
    init: tuple
    bufs: tuple
    layout: "Layout" = eqx.field(static=True)

    def differentiable(self):
        """`(body, init, bufs)`: the parts that get tangents."""
        return self.body, self.init, self.bufs

    def finish(self, x, bufs):
        """The user-facing carry from the loop's arrays, weakly typed where
        `lax.while_loop`'s would be (see `_dtypes`)."""
        layout = self.layout
        leaves = layout.merge(x, bufs)
        leaves = [weak(v) if w else v for v, w in zip(leaves, layout.weak_out)]
        return layout.rebuild(*layout.split(leaves))


class Layout(eqx.Module):
    """Where each array leaf of the carry goes, and the static leaves."""

    treedef: Any = eqx.field(static=True)
    static: Any = eqx.field(static=True)
    buffer_pos: tuple[int, ...] = eqx.field(static=True)
    read_shapes: tuple = eqx.field(static=True)  # per read, in order
    read_leaves: tuple[int, ...] = eqx.field(static=True)  # buffer read, per read
    write_leaves: tuple[int, ...] = eqx.field(static=True)  # buffer written, per write
    weak_out: tuple[bool, ...] = eqx.field(static=True, default=())  # per leaf
    # buffers the body hands to an inner loop
    shared: frozenset[int] = eqx.field(static=True, default=frozenset())

    def split(self, leaves):
        x = tuple(v for k, v in enumerate(leaves) if k not in self.buffer_pos)
        bufs = tuple(leaves[k] for k in self.buffer_pos)
        return x, bufs

    def merge(self, x, bufs):
        x, bufs = iter(x), iter(bufs)
        return [
            next(bufs) if k in self.buffer_pos else next(x)
            for k in range(self.treedef.num_leaves)
        ]

    def rebuild(self, x, bufs):
        dynamic = jtu.tree_unflatten(self.treedef, self.merge(x, bufs))
        return eqx.combine(dynamic, self.static)

    def read_stand_ins(self) -> tuple:
        """Zeros standing in for the buffer reads' tangents (see `_buffers._read`)."""
        return tuple(jnp.zeros(r.shape, r.dtype) for r in self.read_shapes)


class LoopConfig(eqx.Module):
    """The static description of one loop: what `bl.while_loop` was asked for,
    and the carry's `Layout` found when tracing it."""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    # the loop always takes `max_steps` steps (a scan): plan checkpoints offline
    known_length: bool = eqx.field(static=True, default=False)
    # the loop's name for `bl.max_steps_check`'s error, or None: no check
    stop_check: str | None = eqx.field(static=True, default=None)


def _generic_body(
    body_fun, layout: Layout, like, name: str, gate=None, record: dict | None = None
):
    """The body on split arrays, with `Buffer` objects standing in for buffers;
    `record`, if given, receives the body's own output as shapes and its
    `StepTrace`, and buffers are read plainly (see `_trace_once`)."""

    def generic(step: StepIn) -> StepOut:
        written = step.written
        trace = StepTrace(
            step.bufs,
            None if record is not None else step.dummies,
            step.active,
            None if written is None else written[0],
            layout.shared,
            gate=gate,
        )
        views = [Buffer(trace, k) for k in range(len(step.bufs))]
        out = body_fun(layout.rebuild(step.x, views))
        if record is not None:
            arrays = jtu.tree_map(
                lambda v: trace.arrays[v._leaf] if isinstance(v, Buffer) else v,
                out,
                is_leaf=lambda v: isinstance(v, Buffer),
            )
            record["out"], record["trace"] = _as_shapes(arrays), trace
        out = _returns_weak_scalars_cast(out, like)
        is_buffer = lambda v: isinstance(v, Buffer)  # noqa: E731
        out_dynamic = eqx.filter(
            out, lambda v: is_carried(v) or is_buffer(v), is_leaf=is_buffer
        )
        leaves = jtu.tree_leaves(out_dynamic, is_leaf=is_buffer)
        for j, k in enumerate(layout.buffer_pos):
            if k >= len(leaves) or leaves[k] is not views[j]:
                raise TypeError(
                    f"`{name}`: `body_fun` must return each buffer it was given "
                    "(the result of `buf.at[i].set(...)`, or `buf` itself) in the "
                    "same place of the carry."
                )
        new_x, _ = layout.split(leaves)
        writes = tuple((w.value, w.index, w.pred) for w in trace.writes)
        reads = tuple(index for _, index, _ in trace.reads)
        written = None
        if trace.written is not None:
            violations = (trace.double_write, trace.unwritten_read)
            written = (tuple(trace.written), violations)
        return StepOut(tuple(new_x), tuple(trace.arrays), written, writes, reads)

    return generic


def trace_loop(
    cond_fun, body_fun, init_val, buffers_fn, name: str, gate=None
) -> TracedLoop:
    """Check and closure-convert `cond_fun` and `body_fun` against `init_val`;
    `gate` (see `_buffers.lent_gate`) guards the writes to lent buffers."""
    dynamic, static = eqx.partition(init_val, is_carried)
    dynamic = jtu.tree_map(jnp.asarray, dynamic)  # Python numbers: weakly typed
    buffer_pos = (
        () if buffers_fn is None else find_buffers(buffers_fn, dynamic, static, name)
    )
    leaves, treedef = jtu.tree_flatten(dynamic)
    layout = Layout(treedef, static, buffer_pos, (), (), ())
    x0, bufs0 = layout.split(leaves)
    if not (buffer_pos and buffer_checks_enabled()):
        traced = _trace_once(
            cond_fun, body_fun, init_val, layout, x0, bufs0, name, gate
        )
        if traced is not None:
            return traced
    out, (access, shared) = _shape_and_static(
        _buffer_access(body_fun, layout), x0, bufs0
    )
    if jtu.tree_structure(out) == jtu.tree_structure(init_val):
        # `lax.while_loop`'s rule for weakly typed initial values, then trace again
        promoted, changed = promote_weak_inputs(
            x0, layout.split(_out_avals(out, init_val))[0]
        )
        x0 = tuple(promoted)
        if changed:
            out, (access, shared) = _shape_and_static(
                _buffer_access(body_fun, layout), x0, bufs0
            )
    leaves = layout.merge(x0, bufs0)
    like = eqx.combine(
        jtu.tree_unflatten(
            treedef, [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves]
        ),
        static,
    )
    weak_out = ()
    if jtu.tree_structure(out) == jtu.tree_structure(like):
        weak_out = tuple(is_weak(o) for o in _out_avals(out, init_val))
        out = _returns_weak_scalars_cast(out, like)
    check_carry_match(like, out, name)
    layout = Layout(treedef, static, buffer_pos, *access, weak_out, shared)

    def cond_dynamic(x, bufs):
        return cond_fun(layout.rebuild(x, bufs))

    check_predicate(eqx.filter_eval_shape(cond_dynamic, x0, bufs0), name)
    generic = _generic_body(body_fun, layout, like, name, gate)
    true = jnp.array(True)
    # traced with lax's (weak) carry types, run on strongly typed arrays
    example = StepIn(tuple(x0), tuple(bufs0), layout.read_stand_ins(), true, None)
    body = closure_convert(generic, example)
    checked = None
    if buffer_pos and buffer_checks_enabled():
        masks = tuple(jnp.zeros(b.shape, bool) for b in bufs0)
        checked = closure_convert(
            generic, example._replace(written=(masks, (true, true)))
        )
    cond = closure_convert(cond_dynamic, x0, bufs0)
    init = tuple(strong(v) for v in x0)
    return TracedLoop(
        body, cond, checked, init, tuple(strong(v) for v in bufs0), layout
    )


def _like(treedef, static, leaves):
    """The carry's shapes and dtypes, static leaves in place."""
    shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves]
    return eqx.combine(jtu.tree_unflatten(treedef, shapes), static)


def _as_shapes(tree):
    """`tree` with its arrays as `jax.ShapeDtypeStruct`s, exactly as
    `eqx.filter_eval_shape` returns them (a NumPy constant is strongly typed)."""

    def shape(v):
        if not eqx.is_array(v):
            return v
        weak = isinstance(v, jax.Array) and jax.typeof(v).weak_type
        return jax.ShapeDtypeStruct(np.shape(v), v.dtype, weak_type=weak)

    return jtu.tree_map(shape, tree)


def _trace_once(cond_fun, body_fun, init_val, layout: Layout, x0, bufs0, name, gate):
    """`trace_loop` tracing `body_fun` once (twice when `lax.while_loop`'s
    weak-type promotion changes a type): the carry's types and the buffers' writes
    are read off the trace the loop runs, so that nested loops do not trace their
    bodies twice per level. `None` where that trace cannot be the loop's: the body
    reads a buffer (its reads' tangents enter as inputs whose shapes only a first
    trace tells), or its output does not fit the carry (the general path then
    raises the error that names the leaf)."""
    treedef, static = layout.treedef, layout.static
    for _ in range(2):
        like = _like(treedef, static, layout.merge(x0, bufs0))
        record = {}
        generic = _generic_body(body_fun, layout, like, name, gate, record)
        example = StepIn(tuple(x0), tuple(bufs0), (), jnp.array(True), None)
        try:
            body = closure_convert(generic, example)
        except (TypeError, ValueError):
            return None
        out, trace = record["out"], record["trace"]
        if jtu.tree_structure(out) != jtu.tree_structure(init_val):
            return None
        promoted, changed = promote_weak_inputs(
            x0, layout.split(_out_avals(out, init_val))[0]
        )
        if not changed:
            break
        x0 = tuple(promoted)
    else:
        return None
    weak_out = tuple(is_weak(o) for o in _out_avals(out, init_val))
    check_carry_match(like, _returns_weak_scalars_cast(out, like), name)
    access = (
        tuple(shape for _, _, shape in trace.reads),
        tuple(leaf for leaf, _, _ in trace.reads),
        tuple(w.leaf for w in trace.writes),
    )
    shared = frozenset(trace.shared)
    layout = Layout(treedef, static, layout.buffer_pos, *access, weak_out, shared)
    if trace.reads:
        # the reads' tangents are inputs of the body the loop runs, with the
        # shapes this trace found: trace it again with them
        generic = _generic_body(body_fun, layout, like, name, gate)
        example = example._replace(dummies=layout.read_stand_ins())
        body = closure_convert(generic, example)

    def cond_dynamic(x, bufs):
        return cond_fun(layout.rebuild(x, bufs))

    check_predicate(eqx.filter_eval_shape(cond_dynamic, x0, bufs0), name)
    cond = closure_convert(cond_dynamic, x0, bufs0)
    init = tuple(strong(v) for v in x0)
    return TracedLoop(body, cond, None, init, tuple(strong(v) for v in bufs0), layout)


def _out_avals(out, init) -> list:
    """Per carried leaf of `init`, the body's (abstract) output `out` there: an aval
    (Python numbers as weakly typed ones), or `None` where the body returned a
    static value (the carry check names it). `out` has `init`'s tree structure."""
    return [
        None
        if not is_carried_shape(v)
        else v
        if isinstance(v, jax.ShapeDtypeStruct)
        else jax.ShapeDtypeStruct((), jnp.result_type(v), weak_type=True)
        for x, v in zip(jtu.tree_leaves(init), jtu.tree_leaves(out))
        if is_carried(x)
    ]


def _buffer_access(body_fun, layout: "Layout"):
    """`(x, bufs) -> (carry', access)`: the body on plain arrays, returning the
    output carry and, as static metadata, the `Layout` fields that describe its
    buffer reads and writes."""

    def shape_body(x, bufs):
        trace = StepTrace(bufs, None, jnp.array(True), None)
        views = [Buffer(trace, k) for k in range(len(bufs))]
        out = body_fun(layout.rebuild(x, views))
        out = jtu.tree_map(
            lambda v: trace.arrays[v._leaf] if isinstance(v, Buffer) else v,
            out,
            is_leaf=lambda v: isinstance(v, Buffer),
        )
        access = (
            tuple(shape for _, _, shape in trace.reads),
            tuple(leaf for leaf, _, _ in trace.reads),
            tuple(w.leaf for w in trace.writes),
        )
        return out, (access, frozenset(trace.shared))

    return shape_body


def _shape_and_static(fn, *args):
    """`eqx.filter_eval_shape` for a function that also returns static metadata."""
    box = {}

    def wrapped(*a):
        out, box["meta"] = fn(*a)
        return out

    out = eqx.filter_eval_shape(wrapped, *args)
    return out, box["meta"]


def is_carried_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or is_carried(x)
