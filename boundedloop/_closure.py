"""Closure conversion: a traced function as a module whose closed-over arrays are
leaves, so that the loop's custom JVP sees (and differentiates) them.

`eqx.filter_closure_convert` does this too, but it insists that every later call
passes arguments with exactly the example arguments' shardings. Inside
`jax.shard_map` that is never so for the loop's own scalars (a flag created outside
the loop has no sharding; inside it, it has the manual mesh's), so the loop could not
run there. Here only the tree structure and the non-array arguments are checked;
shapes and dtypes are fixed by the loop, which feeds the body its own outputs. Inside
`shard_map` the arguments are cast to vary over every manual axis, when traced and
when called, so the replayed jaxpr always sees the types it was traced with.
"""

import functools
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.extend.source_info_util as source_info_util
import jax.tree_util as jtu

from ._shard_map import vary, vary_everywhere


class ClosureConverted(eqx.Module):
    """`fn`, traced once against example arguments; its closed-over arrays are the
    field `consts`. Call it with arguments shaped like the examples."""

    jaxpr: jax.extend.core.Jaxpr = eqx.field(static=True)
    consts: list
    in_treedef: Any = eqx.field(static=True)
    in_static: Any = eqx.field(static=True)
    out_treedef: Any = eqx.field(static=True)
    out_static: Any = eqx.field(static=True)

    def __call__(self, *args):
        dynamic, static = eqx.partition(vary_everywhere(args), eqx.is_array)
        leaves, treedef = jtu.tree_flatten(dynamic)
        if treedef != self.in_treedef or not _same_static(static, self.in_static):
            raise ValueError(
                "boundedloop internal error: a closure-converted function was "
                "called with arguments of another structure; please report it."
            )
        out = _replay(self.jaxpr, self.consts, leaves)
        return eqx.combine(jtu.tree_unflatten(self.out_treedef, out), self.out_static)

    def out_shapes(self):
        """The output as `jax.ShapeDtypeStruct`s (static leaves as they are), read
        off the traced jaxpr."""
        shapes = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
            for v in self.jaxpr.outvars
        ]
        return eqx.combine(
            jtu.tree_unflatten(self.out_treedef, shapes), self.out_static
        )


def _replay(jaxpr, consts, args):
    """`jax.core.eval_jaxpr` (source locations and `jax.named_scope`s included),
    except that the casts to varying which tracing put in (`pvary`, inside
    `shard_map`) leave values that vary already as they are. The loop passes
    closed-over arrays in already varying, once, outside its loops; casting them
    inside would make their cotangents be summed across devices inside the reverse
    loop, whose trip count differs between devices."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        # as `eval_jaxpr` does: keep the equation's source location and name stack
        # (`jax.named_scope` in the body), under the name stack of the replay
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        context = source_info_util.user_context(
            eqn.source_info.traceback, name_stack=name_stack
        )
        with context, eqn.ctx.manager:
            if eqn.primitive.name == "pvary":
                out = [vary(x, eqn.params["axes"]) for x in invals]
                out = out if eqn.primitive.multiple_results else out[0]
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                out = eqn.primitive.bind(*invals, **params)
        outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _same_static(a, b) -> bool:
    return jtu.tree_structure(a) == jtu.tree_structure(b) and all(
        x is y or x == y for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    )


def closure_convert(fn: Callable, *args) -> ClosureConverted:
    """Trace `fn(*args)` and return it as a `ClosureConverted`.

    **Arguments:**

    - `fn`: any function of pytrees; array leaves of its arguments are traced, other
        leaves are static.
    - `args`: example arguments.

    **Returns:**

    A `ClosureConverted` that computes `fn`.
    """
    args = vary_everywhere(args)
    closed, out_struct, out_static = eqx.filter_make_jaxpr(fn)(*args)
    dynamic, static = eqx.partition(args, eqx.is_array)
    return ClosureConverted(
        jaxpr=closed.jaxpr,
        consts=list(closed.consts),
        in_treedef=jtu.tree_structure(dynamic),
        in_static=static,
        out_treedef=jtu.tree_structure(out_struct),
        out_static=out_static,
    )


def with_inputs_added(fn: ClosureConverted, at: int, *args) -> ClosureConverted:
    """`fn`, whose jaxpr gained inputs while it was traced (`_jax_private.new_input`
    puts them after its arguments), as a function of `*args`: the flattened array
    leaves of `args` are those of `fn`'s arguments with the gained inputs, in
    order, inserted at position `at`."""
    dynamic, static = eqx.partition(vary_everywhere(args), eqx.is_array)
    treedef = jtu.tree_structure(dynamic)
    invars = list(fn.jaxpr.invars)
    old = fn.in_treedef.num_leaves
    if treedef.num_leaves != len(invars):
        raise AssertionError("boundedloop internal error: inputs gained in tracing")
    invars = invars[:at] + invars[old:] + invars[at:old]
    debug = fn.jaxpr.debug_info
    if debug.arg_names is not None:
        names = debug.arg_names
        added = tuple(f"dummy{i}" for i in range(len(invars) - old))
        debug = debug._replace(arg_names=names[:at] + added + names[at:])
    return ClosureConverted(
        jaxpr=fn.jaxpr.replace(invars=invars, debug_info=debug),
        consts=fn.consts,
        in_treedef=treedef,
        in_static=static,
        out_treedef=fn.out_treedef,
        out_static=fn.out_static,
    )


# ---- Python closures: captured arrays as leaves ---------------------------------
#
# `bl.Loop` is given plain functions. Under `bl.filter_jit`/`bl.filter_grad` a
# function is static, so arrays it captures (in closure cells or default arguments)
# would be baked-in constants with no gradient. `hoist_arrays` rebuilds such a
# function as a module whose captured arrays are fields; the rest stays static,
# compared by value where that is safe, so that a closure rebuilt around new arrays
# reuses the compiled program.

_IMMUTABLE = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))


def _static_equal(a, b) -> bool:
    """Whether two static values captured by functions are interchangeable: the same
    object, equal immutable values, or functions of the same code over such values.
    Anything mutable is compared by identity."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, _IMMUTABLE):
        return a == b
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(_static_equal, a, b))
    if isinstance(a, types.FunctionType):
        return _Skeleton.of(a) == _Skeleton.of(b)
    return False


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: a name the enclosing scope binds later
        return _EMPTY


_EMPTY = object()


class _Skeleton:
    """The static part of a function: its code and globals, the cells kept as they
    are, and the non-array parts of the hoisted ones. Equal when the function would
    compute the same thing from the same arrays."""

    def __init__(self, fn, kept_cells, static):
        self.fn = fn
        self.kept_cells = kept_cells  # per cell: the cell, or None where hoisted
        self.static = static  # (cells, defaults, kwdefaults) with arrays removed

    @classmethod
    def of(cls, fn):
        cells = tuple(fn.__closure__ or ())
        return cls(fn, cells, (None,) * len(cells))

    def _key(self):
        fn = self.fn
        return (fn.__code__, fn.__name__, tuple(c is None for c in self.kept_cells))

    def __eq__(self, other):
        if not isinstance(other, _Skeleton) or self._key() != other._key():
            return False
        if self.fn.__globals__ is not other.fn.__globals__:
            return False
        for a, b in zip(self.kept_cells, other.kept_cells):
            if a is not None and a is not b:
                x, y = _cell_contents(a), _cell_contents(b)
                if x is _EMPTY or y is _EMPTY or not _static_equal(x, y):
                    return False
        flat_a, tree_a = jtu.tree_flatten(self.static)
        flat_b, tree_b = jtu.tree_flatten(other.static)
        return tree_a == tree_b and all(map(_static_equal, flat_a, flat_b))

    def __hash__(self):
        return hash(self.fn.__code__)

    def __repr__(self):
        return f"<function {self.fn.__qualname__}>"


class HoistedFunction(eqx.Module):
    """A Python function whose captured arrays (in closure cells and default
    arguments) are the field `arrays`; calling it calls the function on them."""

    skeleton: _Skeleton = eqx.field(static=True)
    arrays: Any

    @property
    def __wrapped__(self):
        return self.skeleton.fn

    def __call__(self, *args, **kwargs):
        cells, defaults, kwdefaults = eqx.combine(self.arrays, self.skeleton.static)
        closure = tuple(
            kept if kept is not None else _make_cell(value)
            for kept, value in zip(self.skeleton.kept_cells, cells)
        )
        fn = self.skeleton.fn
        rebuilt = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, defaults, closure or None
        )
        rebuilt.__kwdefaults__ = kwdefaults
        return rebuilt(*args, **kwargs)


def _make_cell(value):
    return (lambda: value).__closure__[0]


def _has_arrays(tree) -> bool:
    return any(eqx.is_array(v) for v in jtu.tree_leaves(tree))


def _hoist_tree(tree, seen):
    is_partial = lambda v: isinstance(v, functools.partial)  # noqa: E731
    return jtu.tree_map(lambda v: _hoist(v, seen), tree, is_leaf=is_partial)


def _hoist(obj, seen):
    if isinstance(obj, types.FunctionType):
        return _hoist_function(obj, seen)
    if isinstance(obj, functools.partial):
        func = _hoist(obj.func, seen)
        args = _hoist_tree(obj.args, seen)
        keywords = _hoist_tree(dict(obj.keywords), seen)
        if isinstance(func, HoistedFunction) or (
            type(obj) is functools.partial and _has_arrays((args, keywords))
        ):
            return eqx.Partial(func, *args, **keywords)
    return obj


def _hoist_function(fn, seen):
    if fn in seen:  # the function reaches itself through its closure (recursion)
        seen[fn] = True
        return fn
    seen[fn] = False
    kept, hoisted = [], []
    for cell in fn.__closure__ or ():
        value = _cell_contents(cell)
        converted = None if value is _EMPTY else _hoist_tree(value, seen)
        if value is not _EMPTY and _has_arrays(converted):
            kept.append(None)
            hoisted.append(converted)
        else:  # shared with the original, as Python shares it
            kept.append(cell)
            hoisted.append(None)
    defaults, kwdefaults = fn.__defaults__, fn.__kwdefaults__
    converted = _hoist_tree((defaults, kwdefaults), seen)
    if _has_arrays(converted):
        defaults, kwdefaults = converted
    recursive = seen.pop(fn)
    if not fn.__closure__ and defaults is fn.__defaults__:
        return fn  # captures nothing: static as it is
    if recursive and (_has_arrays(hoisted) or defaults is not fn.__defaults__):
        # its inner calls would run the original, on the arrays as constants
        raise TypeError(
            f"`bl.Loop`: the function `{fn.__qualname__}` calls itself through its "
            "closure and captures arrays, which then could not be differentiated "
            "in its inner calls. Pass those arrays as arguments (e.g. through a "
            "`jax.tree_util.Partial`) or as fields of an `equinox.Module`."
        )
    arrays, static = eqx.partition((tuple(hoisted), defaults, kwdefaults), eqx.is_array)
    return HoistedFunction(_Skeleton(fn, tuple(kept), static), arrays)


def hoist_arrays(fn):
    """`fn`, with the arrays it captures as leaves.

    A Python closure becomes a `HoistedFunction`, a module whose leaves are the
    arrays its closure cells or default arguments hold, directly or inside pytrees or
    functions they capture; a `functools.partial` holding arrays becomes an
    `eqx.Partial`. Any other callable is returned as it is. Cells without arrays are
    shared with `fn`, so the function sees later changes to them as Python would;
    the hoisted values are fixed when `hoist_arrays` is called. Two closures of the
    same code over equal immutable values (and any arrays) compare equal, so
    `bl.filter_jit` reuses a trace for a rebuilt closure.

    **Arguments:**

    - `fn`: a callable.

    **Returns:**

    A callable computing what `fn` computes.
    """
    return _hoist(fn, {})
