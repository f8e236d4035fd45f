"""`bl.Loop`'s functions: the arrays a Python closure captures, as leaves
(`hoist_arrays`), so that `bl.filter_jit` traces them and `bl.filter_grad`
differentiates them (see `docs/guides/modules.md`).
"""

import dataclasses
import functools
import types
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu


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


def _positional_defaults(fn) -> dict[str, Any]:
    """`fn.__defaults__` by parameter name (they are the last positional ones)."""
    code, defaults = fn.__code__, fn.__defaults__ or ()
    names = code.co_varnames[: code.co_argcount]
    return dict(zip(names[len(names) - len(defaults) :], defaults))


def _defaults(fn) -> dict[str, Any]:
    """`fn`'s default arguments, positional and keyword-only, by parameter name."""
    return _positional_defaults(fn) | (fn.__kwdefaults__ or {})


class _Skeleton:
    """The static part of a function: its code and globals, the cells kept as they
    are, and the non-array parts of the hoisted values. Equal when the function
    would compute the same thing from the same arrays."""

    def __init__(self, fn, kept_cells, static):
        self.fn = fn
        self.kept_cells = kept_cells  # per cell: the cell, or None where hoisted
        # the hoisted values with their arrays removed, by name (as `closure`)
        self.static = static

    @classmethod
    def of(cls, fn):
        return cls(fn, tuple(fn.__closure__ or ()), {})

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
    """A Python function whose captured arrays are the field `closure`; calling it
    calls the function on them.

    `closure` maps each name under which the function captured arrays (a free
    variable, `fn.__code__.co_freevars`, or a parameter with a default) to the
    arrays it holds there, in the value's own structure: an array, a pytree of
    them, a `HoistedFunction` for a function captured in turn, or a `Partial` (its
    `.args` and `.keywords`). A gradient has the same structure, so the gradient
    with respect to a closure's `A` is `grad.closure["A"]`."""

    skeleton: _Skeleton = eqx.field(static=True)
    closure: dict[str, Any]

    @property
    def __wrapped__(self):
        return self.skeleton.fn

    def __call__(self, *args, **kwargs):
        fn = self.skeleton.fn
        values = eqx.combine(self.closure, self.skeleton.static)
        cells = tuple(
            kept if kept is not None else _make_cell(values[name])
            for name, kept in zip(fn.__code__.co_freevars, self.skeleton.kept_cells)
        )
        # the defaults as they were, the hoisted ones rebuilt around these arrays
        defaults, kwdefaults = fn.__defaults__, fn.__kwdefaults__
        if defaults is not None:
            named = _positional_defaults(fn).items()
            defaults = tuple(values.get(name, v) for name, v in named)
        if kwdefaults is not None:
            kwdefaults = {name: values.get(name, v) for name, v in kwdefaults.items()}
        rebuilt = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__, defaults, cells or None
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
    # the captured values that hold arrays, by the name the function uses
    hoisted, kept = {}, []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value = _cell_contents(cell)
        converted = None if value is _EMPTY else _hoist_tree(value, seen)
        if value is not _EMPTY and _has_arrays(converted):
            kept.append(None)
            hoisted[name] = converted
        else:  # shared with the original, as Python shares it
            kept.append(cell)
    for name, value in _defaults(fn).items():
        converted = _hoist_tree(value, seen)
        if _has_arrays(converted):
            hoisted[name] = converted
    recursive = seen.pop(fn)
    if not fn.__closure__ and not hoisted:
        return fn  # captures nothing: static as it is
    if recursive and hoisted:
        # its inner calls would run the original, on the arrays as constants
        raise TypeError(
            f"`bl.Loop`: the function `{fn.__qualname__}` calls itself through its "
            "closure and captures arrays, which then could not be differentiated "
            "in its inner calls. Pass those arrays as arguments (e.g. through a "
            "`jax.tree_util.Partial`) or as fields of an `equinox.Module`."
        )
    arrays, static = eqx.partition(hoisted, eqx.is_array)
    return HoistedFunction(_Skeleton(fn, tuple(kept), static), arrays)


def hoist_arrays(fn):
    """`fn`, with the arrays it captures as leaves.

    A Python closure becomes a `HoistedFunction`, a module whose leaves are the
    arrays its closure cells or default arguments hold, directly or inside pytrees or
    functions they capture, keyed by name in its field `closure`; a
    `functools.partial` holding arrays becomes an `eqx.Partial`. Any other callable is returned as it is. Cells without arrays are
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


def static_closures(module) -> dict[str, list[str]]:
    """The fields of `module` (an `equinox.Module`) that hold a plain Python function
    or `functools.partial` capturing floating arrays that are not traced: static to
    Equinox, so under `bl.filter_grad` of the module those arrays are constants and
    get no gradient (arrays a closure captures while traced, as `jax.grad` of a
    function that builds the module, are differentiated). Field name -> the names
    the arrays are captured under (`["args"]` for a partial's arguments)."""
    found = {}
    for field in dataclasses.fields(module):
        value = getattr(module, field.name, None)
        if not (
            isinstance(value, types.FunctionType) or type(value) is functools.partial
        ):
            continue
        hoisted = hoist_arrays(value)
        if hoisted is value or not any(
            eqx.is_inexact_array(v) and not isinstance(v, jax.core.Tracer)
            for v in jtu.tree_leaves(hoisted)
        ):
            continue
        closure = getattr(hoisted, "closure", None)
        found[field.name] = sorted(closure) if closure is not None else ["args"]
    return found
