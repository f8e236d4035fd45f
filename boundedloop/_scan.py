"""`bl.scan` and `bl.fori_loop`: known trip counts, on the while loop's machinery.

The inputs `xs` and the outputs `ys` are buffers of the underlying loop (read and
written one row per step, never checkpointed), and since the length is known the
checkpoints are placed offline by the binomial schedule.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._buffers import lend_buffers, return_buffers
from ._checks import buffer_checks
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
    x_shape = jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)), xs
    )
    _, y_shape = eqx.filter_eval_shape(f, init, x_shape)
    if any(not isinstance(y, jax.ShapeDtypeStruct) for y in jtu.tree_leaves(y_shape)):
        raise TypeError(f"`{name}`: every leaf `f` returns as `y` must be an array.")
    ys0 = jtu.tree_map(lambda y: jnp.zeros((n,) + y.shape, y.dtype), y_shape)
    xs_arrays = jtu.tree_map(jnp.asarray, xs)
    if n == 0:
        return return_buffers(init, lent), ys0

    def body(carry):
        c, xs_rows, ys_rows, i = carry
        x = jtu.tree_map(lambda b: b[i], xs_rows)
        c, y = f(c, x)
        ys_rows = jtu.tree_map(lambda b, v: b.at[i].set(v), ys_rows, y)
        return c, xs_rows, ys_rows, i + 1

    def loop_buffers(carry):
        own = () if buffers is None else buffers(carry[0])
        return own, carry[1], carry[2]

    # reading `xs` (never written inside the loop) is fine: skip the write-once checks
    with buffer_checks(False):
        final, _, ys, _ = run_loop(
            lambda carry: carry[3] < n,
            body,
            (init, xs_arrays, ys0, jnp.array(0, jnp.int32)),
            max_steps=n,
            checkpoints=checkpoints,
            buffers=loop_buffers,
            name=name,
            known_length=True,
        )
    return return_buffers(final, lent), ys


def fori_loop(
    lower: int,
    upper: int,
    body_fun: Callable[[Any, Carry], Carry],
    init_val: Carry,
    *,
    checkpoints: int | None = None,
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
    - `checkpoints`, `buffers`: as for `bl.scan`.

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
        buffers=buffers,
    )
    return final
