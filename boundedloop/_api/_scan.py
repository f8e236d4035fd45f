"""`bl.scan` and `bl.fori_loop`: known trip counts, on the while loop's machinery,
with `xs` and `ys` as buffers of the underlying loop.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._runtime._checks import reads_checked_at_most, tracing_a_loop
from .._runtime._jax_private import weakly_typed
from .._tracing._buffers import lend_buffers, return_buffers
from .._tracing._carry_checks import is_carried, is_carried_shape
from .._tracing._closure import closure_convert
from .._tracing._dtypes import is_weak, promote_weak_inputs, strong
from ._while_loop import run_loop


Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")


def _length(xs, length, name):
    lengths = {int(np.shape(x)[0]) for x in jtu.tree_leaves(xs) if np.ndim(x) > 0}
    if any(np.ndim(x) == 0 for x in jtu.tree_leaves(xs)):
        raise ValueError(
            f"`{name}`: every leaf of `xs` needs a leading axis to scan over."
        )
    if length is not None:
        lengths.add(int(length))
    if len(lengths) != 1:
        raise ValueError(
            f"`{name}` needs `xs` leaves with one common leading length (and `length` "
            f"equal to it, if given), got lengths {sorted(lengths)}."
            if lengths
            else f"`{name}` needs `length` when `xs` is None."
        )
    (out,) = lengths
    return out


def scan(
    f: Callable[[Carry, X], tuple[Carry, Y]],
    init: Carry,
    xs: X = None,
    length: int | None = None,
    *,
    checkpoints: int | None = None,
    memory: int | str | None = None,
    buffers: Callable[[Carry], Any] | None = None,
) -> tuple[Carry, Y]:
    """As `jax.lax.scan`, checkpointed, with the checkpoints placed offline.

    The semantics are those of this Python loop:

    ```python
    def scan(f, init, xs, length=None):
        if xs is None:
            xs = [None] * length
        carry, ys = init, []
        for x in xs:
            carry, y = f(carry, x)
            ys.append(y)
        return carry, np.stack(ys)
    ```

    Since the length is known, the checkpoints go where the binomial schedule
    (Griewank and Walther) puts them, so one gradient makes the fewest body
    evaluations possible for a forward pass followed by a backward pass with
    `checkpoints` slots. The outputs `ys` (and the inputs `xs`) are handled as
    buffers: written (read) one row per step, never checkpointed.

    **Arguments:**

    - `f`: `(carry, x) -> (carry, y)`.
    - `init`: the initial carry.
    - `xs`: a pytree of arrays with a common leading axis, or `None`.
    - `length`: the number of steps; needed when `xs` is `None`.
    - `checkpoints`: carry copies the backward pass may hold; `None` picks the
        default of `bl.while_loop` for `max_steps=length`.
    - `memory`: instead of `checkpoints`, a budget in bytes (or a string such as
        `"2 GiB"`), as for `bl.while_loop`: when every step's residuals fit, the
        gradient is `lax.scan`'s, every step stored.
    - `buffers`: in-place buffers of the carry, as for `bl.while_loop`.

    **Returns:**

    `(final_carry, ys)`, `ys` stacked along a new leading axis.
    """
    name = "bl.scan"
    if not callable(f):
        raise TypeError(f"`{name}` needs `f` to be callable, got {f!r}.")
    n = _length(xs, length, name)
    # an outer loop's buffers in the carry are buffers of this loop too
    init, buffers, lent = lend_buffers(init, buffers)
    xs_arrays = jtu.tree_map(jnp.asarray, xs)
    # `f` is the scan's body: what it traces (inner loops, checks) is in a loop, and
    # reading `xs` (never written inside the loop) skips the write-once checks
    with tracing_a_loop(), reads_checked_at_most():
        init, step, carry_out, y_shapes = _trace_step(
            f, init, xs_arrays, buffers, n, name
        )
    ys0 = jtu.tree_map(lambda y: jnp.zeros((n,) + y.shape, y.dtype), y_shapes)
    if n == 0:  # no step is taken, nor traced again
        return return_buffers(_typed_as(init, carry_out), lent), _weak_as(ys0, y_shapes)

    def body(carry):
        c, xs_rows, ys_rows, i = carry
        x = jtu.tree_map(lambda b: b[i], xs_rows)
        c, y = step(c, x)
        y = jtu.tree_map(_number_as_array, y)
        ys_rows = jtu.tree_map(lambda b, v: b.at[i].set(v), ys_rows, y)
        return c, xs_rows, ys_rows, i + 1

    def loop_buffers(carry):
        own = () if buffers is None else buffers(carry[0])
        return own, carry[1], carry[2]

    with reads_checked_at_most():
        final, _, ys, _ = run_loop(
            lambda carry: carry[3] < n,
            body,
            (init, xs_arrays, ys0, jnp.array(0, jnp.int32)),
            max_steps=n,
            checkpoints=checkpoints,
            memory=memory,
            buffers=loop_buffers,
            name=name,
            known_length=True,
        )
    return return_buffers(final, lent), _weak_as(ys, y_shapes)


def _trace_step(f, init, xs, buffers, n: int, name: str):
    """Trace `f` on `init` and a row of `xs` as `lax.scan` does: once, and once more
    if a weakly typed initial value must be promoted to the type `f` returns there.

    Without buffers in the carry, `f` is closure-converted, and the loop replays that
    trace instead of calling `f` again: `f` is traced exactly as often as by
    `lax.scan`. With buffers, `f` is called again inside the loop (on `bl.Buffer`s,
    which this trace cannot stand in for), once more than by `lax.scan`.

    **Returns:**

    `(init, step, carry_shapes, y_shapes)`: the initial carry (Python numbers as
    weakly typed arrays, promoted where `lax.scan` promotes them), the step the loop
    calls in place of `f`, and the shapes, dtypes and weak types of the carry `f`
    returns and of `y`.
    """
    replay = buffers is None and n > 0
    if replay:
        x = jtu.tree_map(lambda b: b[0], xs)
    else:
        x = jtu.tree_map(lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), xs)
    dynamic, static = eqx.partition(init, is_carried)
    dynamic = jtu.tree_map(jnp.asarray, dynamic)  # Python numbers: weakly typed
    for _ in range(2):
        carry = eqx.combine(dynamic, static)
        if replay:
            step = closure_convert(f, carry, x)
            out = step.out_shapes()
        else:
            step, out = f, eqx.filter_eval_shape(f, carry, x)
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise TypeError(
                f"`{name}` needs `f` to return a pair `(carry, y)`, got {out!r}."
            )
        carry_out = _carried_shapes(out[0])
        leaves, treedef = jtu.tree_flatten(dynamic)
        if len(carry_out) != len(leaves):
            break  # another structure: the loop's carry check names it
        leaves, changed = promote_weak_inputs(leaves, carry_out, by_weak_type=False)
        dynamic = jtu.tree_unflatten(treedef, leaves)
        if not changed:
            break
    if not replay and carry_out is not None:
        # where the body makes a weakly typed initial value strong, `bl.while_loop`
        # would trace the body again with it strong: make it strong now
        leaves, treedef = jtu.tree_flatten(eqx.filter(carry, is_carried))
        leaves, _ = promote_weak_inputs(leaves, carry_out)
        carry = eqx.combine(jtu.tree_unflatten(treedef, leaves), static)
    y_shapes = jtu.tree_map(lambda y: _y_shape(y, name), out[1])
    return carry, step, carry_out, y_shapes


def _carried_shapes(carry_out):
    """Per carried leaf of the carry `f` returned, its shape, dtype and weak type
    (leaves that are neither arrays nor Python numbers are dropped)."""
    leaves = jtu.tree_leaves(eqx.filter(carry_out, is_carried_shape))
    return [_y_shape(o, "") for o in leaves]


def _typed_as(init, carry_out):
    """The initial carry with the weak types `f` returns, as `lax.scan` returns it
    from no steps."""
    dynamic, static = eqx.partition(init, is_carried)
    leaves, treedef = jtu.tree_flatten(dynamic)
    if len(leaves) != len(carry_out):
        return init
    leaves = [
        weakly_typed(v) if o.weak_type else strong(v) for v, o in zip(leaves, carry_out)
    ]
    return eqx.combine(jtu.tree_unflatten(treedef, leaves), static)


def _weak_as(ys, y_shapes):
    """`ys`, weakly typed where `lax.scan`'s would be."""
    return jtu.tree_map(
        lambda y, s: weakly_typed(y) if s.weak_type else y, ys, y_shapes
    )


def _number_as_array(y):
    """A Python number `f` returns as part of `y`, as the array `lax.scan` makes it."""
    return jnp.asarray(y) if isinstance(y, bool | int | float | complex) else y


def _y_shape(y, name: str) -> jax.ShapeDtypeStruct:
    """The shape, dtype and weak type of a leaf of `y` (an array, its shape, or a
    Python number)."""
    if isinstance(y, jax.ShapeDtypeStruct):
        return y
    if isinstance(y, bool | int | float | complex) or eqx.is_array(y):
        y = jnp.asarray(y)
        return jax.ShapeDtypeStruct(y.shape, y.dtype, weak_type=is_weak(y))
    raise TypeError(
        f"`{name}`: every leaf `f` returns as `y` must be an array or a Python "
        f"number, as for `lax.scan`; got {y!r}. Return non-array values in the "
        "carry instead."
    )


def fori_loop(
    lower: int,
    upper: int,
    body_fun: Callable[[Any, Carry], Carry],
    init_val: Carry,
    *,
    checkpoints: int | None = None,
    memory: int | str | None = None,
    buffers: Callable[[Carry], Any] | None = None,
) -> Carry:
    """As `jax.lax.fori_loop` with static bounds, via `bl.scan`:

    ```python
    def fori_loop(lower, upper, body_fun, init_val):
        val = init_val
        for i in range(lower, upper):
            val = body_fun(i, val)
        return val
    ```

    **Arguments:**

    - `lower`, `upper`: Python ints, the range of `i`.
    - `body_fun`: `(i, val) -> val`.
    - `init_val`: the initial value.
    - `checkpoints`, `memory`, `buffers`: as for `bl.scan`.

    **Returns:**

    The final value.
    """
    for name, bound in [("lower", lower), ("upper", upper)]:
        if isinstance(bound, jax.core.Tracer) or not isinstance(
            bound, int | np.integer
        ):
            raise TypeError(
                f"`bl.fori_loop` needs `{name}` to be a Python int, got {bound!r}."
            )
    n = max(int(upper) - int(lower), 0)
    steps = jnp.arange(lower, lower + n, dtype=jnp.int32)
    final, _ = scan(
        lambda val, i: (body_fun(i, val), None),
        init_val,
        steps,
        length=n,
        checkpoints=checkpoints,
        memory=memory,
        buffers=buffers,
    )
    return final
