"""Tracing the user's functions: splitting the carry into traced arrays and static
values, checking `cond_fun` and `body_fun` against it as `lax.while_loop` does, and
closure-converting them into a `TracedLoop`, whose body speaks one protocol,
`body(StepIn) -> StepOut`, on the carry's array leaves split into `x` (ordinary
leaves) and `bufs` (buffer leaves).
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._runtime._checked_store import CheckedStore
from .._runtime._jax_private import current_trace, new_input
from ._buffers import (
    Buffer,
    buffer_names,
    check_returned_newest,
    find_buffers,
    StepTrace,
)
from ._carry_checks import (
    check_carry_match,
    check_predicate,
    is_carried,
    is_carried_shape,
)
from ._closure import closure_convert, with_inputs_added
from ._dtypes import is_weak, promote_weak_inputs, strong, weak_dtype
from ._loop import Layout, StepIn, StepOut, TracedLoop


def _returns_weak_scalars_cast(out, like):
    """Weakly typed outputs (e.g. a bare Python `0.0`) cast to the carry's dtype
    where they take it (`weak_dtype`)."""

    def cast(o, x):
        # `x` is static where the body turned a static value into an array: the
        # carry check names it
        dtype = weak_dtype(o, x) if is_carried_shape(o) else None
        if dtype is None or dtype != x.dtype:
            return o
        if isinstance(o, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(o.shape, x.dtype)
        return jnp.asarray(o, dtype=x.dtype)

    return jtu.tree_map(cast, out, like, is_leaf=lambda v: v is None)


class BodyOutput(NamedTuple):
    """What tracing the body once learns besides its jaxpr: its own output, as
    shapes (the carry check, the weak types), and its `StepTrace` (the buffers'
    reads and writes)."""

    shapes: Any
    trace: StepTrace


def _generic_body(
    body_fun,
    layout: Layout,
    like,
    name: str,
    gate=None,
    seen: CheckedStore | None = None,
):
    """The body on split arrays, with `Buffer` objects standing in for buffers.
    With `seen`, the body is traced to learn its `BodyOutput`, which `seen`
    receives; its output's tree structure is checked against the carry's there;
    and each buffer read adds its dummy as an input of the jaxpr, after the others
    (see `_trace_body`)."""

    def generic(step: StepIn) -> StepOut:
        dummies = step.dummies
        if seen is not None:
            # each read adds its dummy to the inputs of the jaxpr traced now
            building = current_trace()
            dummies = functools.partial(new_input, building, like=step.active)
        names = buffer_names(layout, step.bufs)
        trace = StepTrace(
            step.bufs, dummies, step.active, layout.shared, gate=gate, names=names
        )
        views = [Buffer(trace, k) for k in range(len(step.bufs))]
        out = body_fun(layout.rebuild(step.x, views))
        if seen is not None:
            arrays = jtu.tree_map(
                lambda v: trace.arrays[v._leaf] if isinstance(v, Buffer) else v,
                out,
                is_leaf=lambda v: isinstance(v, Buffer),
            )
            seen.set(BodyOutput(_as_shapes(arrays), trace))
            if jtu.tree_structure(arrays) != jtu.tree_structure(like):
                check_carry_match(like, _as_shapes(arrays), name)  # raises
        out = _returns_weak_scalars_cast(out, like)
        is_buffer = lambda v: isinstance(v, Buffer)  # noqa: E731
        out_dynamic = eqx.filter(
            out, lambda v: is_carried(v) or is_buffer(v), is_leaf=is_buffer
        )
        leaves = jtu.tree_leaves(out_dynamic, is_leaf=is_buffer)
        for j, k in enumerate(layout.buffer_pos):
            returned = leaves[k] if k < len(leaves) else None
            if not (
                isinstance(returned, Buffer)
                and returned._trace is trace
                and returned._leaf == j
            ):
                raise TypeError(
                    f"`{name}`: `body_fun` must return each buffer it was given "
                    "(the result of `buf.at[i].set(...)`, or `buf` itself) in the "
                    f"same place of the carry ({trace.names[j]})."
                )
            check_returned_newest(trace, returned, name)
        new_x, _ = layout.split(leaves)
        writes = tuple((w.value, w.index, w.pred) for w in trace.writes)
        reads = tuple(index for _, index, _ in trace.reads)
        return StepOut(tuple(new_x), tuple(trace.arrays), writes, reads)

    return generic


def trace_loop(
    cond_fun, body_fun, init_val, buffers_fn, *, name: str, gate=None
) -> TracedLoop:
    """Check and closure-convert `cond_fun` and `body_fun` against `init_val`;
    `gate` (see `_buffers.lent_gate`) guards the writes to lent buffers.

    The body is traced once, as `lax.while_loop` traces it (`_trace_body`)."""
    dynamic, static = eqx.partition(init_val, is_carried)
    dynamic = jtu.tree_map(jnp.asarray, dynamic)  # Python numbers: weakly typed
    buffer_pos = (
        () if buffers_fn is None else find_buffers(buffers_fn, dynamic, static, name)
    )
    leaves, treedef = jtu.tree_flatten(dynamic)
    # where the leaves go; what the body reads and writes is added once it is traced
    unread = Layout(treedef, static, buffer_pos, (), (), ())
    x0, bufs0 = unread.split(leaves)
    x0, body, (out, trace), like = _trace_body(
        body_fun, unread, x0, bufs0, name=name, gate=gate
    )
    check_carry_match(like, _returns_weak_scalars_cast(out, like), name)
    layout = dataclasses.replace(
        unread,
        read_shapes=tuple(shape for _, _, shape in trace.reads),
        read_leaves=tuple(leaf for leaf, _, _ in trace.reads),
        write_leaves=tuple(w.leaf for w in trace.writes),
        weak_out=tuple(is_weak(o) for o in _out_avals(out, like)),
        shared=frozenset(trace.shared),
        lent_read=frozenset(trace.lent_read),
        sites=tuple(trace.sites),
    )
    true = jnp.array(True)
    # traced with lax's (weak) carry types, run on strongly typed arrays
    example = StepIn(x0, bufs0, layout.read_stand_ins(), true)
    if trace.reads:
        # the reads' dummies, added last while tracing, go after the buffers
        body = with_inputs_added(body, len(x0) + len(bufs0), example)

    def cond_dynamic(x, bufs):
        return cond_fun(layout.rebuild(x, bufs))

    cond = closure_convert(cond_dynamic, x0, bufs0)
    check_predicate(cond.out_shapes(), name)
    init = tuple(strong(v) for v in x0)
    return TracedLoop(body, cond, init, tuple(strong(v) for v in bufs0), layout)


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


def _trace_body(body_fun, layout: Layout, x0, bufs0, *, name, gate):
    """The body traced as the loop runs it, once; twice when `lax.while_loop`'s
    weak-type promotion changes a carry type (the initial value is promoted and
    the body traced again). Each buffer read adds its dummy to the traced body's
    inputs, after its arguments (`trace_loop` moves them to their place).

    **Returns:**

    `(x0, body, output, like)`: the (promoted) initial carry, the traced body, its
    `BodyOutput`, and the carry's shapes. A body whose output has another tree
    structure than the carry raises the carry check's error."""
    x0, bufs0 = tuple(x0), tuple(bufs0)
    for _ in range(2):
        like = _like(layout.treedef, layout.static, layout.merge(x0, bufs0))
        seen = CheckedStore("the body's output")
        generic = _generic_body(body_fun, layout, like, name, gate, seen)
        body = closure_convert(generic, StepIn(x0, bufs0, (), jnp.array(True)))
        output = seen.get()
        promoted, changed = promote_weak_inputs(
            x0, layout.split(_out_avals(output.shapes, like))[0]
        )
        if not changed:
            break
        x0 = tuple(promoted)
    return x0, body, output, like


def _out_avals(out, init) -> list:
    """Per carried leaf of `init` (or of its shapes), the body's (abstract) output
    `out` there: an aval
    (Python numbers as weakly typed ones), or `None` where the body returned a
    static value (the carry check names it). `out` has `init`'s tree structure."""
    return [
        None
        if not is_carried_shape(v)
        else v
        if isinstance(v, jax.ShapeDtypeStruct)
        else jax.ShapeDtypeStruct((), jnp.result_type(v), weak_type=True)
        for x, v in zip(jtu.tree_leaves(init), jtu.tree_leaves(out))
        if is_carried_shape(x)
    ]
