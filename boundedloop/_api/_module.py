"""`LoopModule` and `Loop`: loops as Equinox modules, whose array fields are traced
and differentiated and everything else static (see `docs/guides/modules.md`).
"""

import abc
import os
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .._runtime._checks import caller_level
from ._arguments import check_callables
from ._captured_arrays import hoist_arrays, static_closures
from ._stats import LoopStats
from ._while_loop import while_loop


Carry = TypeVar("Carry")


class LoopModule(eqx.Module, Generic[Carry]):
    """A bounded loop whose step is a method of an Equinox module.

    Subclass it and implement `body` (and optionally `cond` and `buffers`). Fields
    hold parameters: array fields are traced and receive gradients through `run`;
    other fields (ints, strings, callables) are static. A field holding a plain
    function that captures arrays is static too, arrays and all, so `run` warns of
    it (make the arrays fields, pass them in a `jax.tree_util.Partial`, or use
    `bl.Loop`, which makes a closure's arrays leaves).

    ```python
    class Newton(bl.LoopModule):
        target: jax.Array
        tol: float = 1e-6

        def cond(self, carry):
            x, fx = carry
            return jnp.abs(fx) > self.tol

        def body(self, carry):
            x, _ = carry
            x = x - (x**2 - self.target) / (2 * x)
            return x, x**2 - self.target

    x, _ = Newton(jnp.array(2.0)).run((1.0, 1.0), max_steps=50)
    ```
    """

    def cond(self, carry: Carry) -> Bool[Array, ""]:
        """Whether to take another step. Default: always (the loop runs `max_steps`).

        **Arguments:**

        - `carry`: the current carry.

        **Returns:**

        A scalar boolean.
        """
        del carry
        return jnp.array(True)

    @abc.abstractmethod
    def body(self, carry: Carry) -> Carry:
        """One step. Must be implemented by every subclass.

        **Arguments:**

        - `carry`: the current carry.

        **Returns:**

        The next carry, with the same structure, shapes and dtypes.
        """

    def buffers(self, carry: Carry) -> Any:
        """The carry's in-place buffers (see `bl.while_loop`). Default: none.

        **Arguments:**

        - `carry`: the carry.

        **Returns:**

        A node or sequence of nodes of `carry`, or `None`.
        """
        del carry
        return None

    def run(
        self,
        init: Carry,
        *,
        max_steps: int | None,
        checkpoints: int | None = None,
        memory: int | str | None = None,
        stats: bool = False,
    ) -> Carry | tuple[Carry, LoopStats]:
        """Run the checkpointed bounded loop from `init`: `bl.while_loop(self.cond,
        self.body, init, ...)`, differentiable with respect to `init` and to the
        module's array fields.

        **Arguments:**

        - `init`: the initial carry.
        - `max_steps`: the most steps to take, or `None` for no bound.
        - `checkpoints`: carry copies the backward pass may hold; see
            `bl.while_loop`.
        - `memory`: instead of `checkpoints`, a budget in bytes for the backward
            pass (an `int`, or a string such as `"2 GiB"`); see `bl.while_loop`.
        - `stats`: whether to return a [`bl.LoopStats`][boundedloop.LoopStats] too:
            the steps taken, and whether the loop ran out of steps.

        **Returns:**

        The final carry; with `stats=True`, `(final_carry, stats)`.
        """
        buffers = None if type(self).buffers is LoopModule.buffers else self.buffers
        _warn_static_closures(self)
        return while_loop(
            self.cond,
            self.body,
            init,
            max_steps=max_steps,
            checkpoints=checkpoints,
            memory=memory,
            buffers=buffers,
            stats=stats,
        )


def _warn_static_closures(module: LoopModule):
    """A warning, at the user's `run`, for each field holding a plain function that
    captures arrays: they would silently get no gradient."""
    for field, names in static_closures(module).items():
        warnings.warn(
            f"`{type(module).__name__}.{field}` is a plain function that captures "
            f"arrays ({', '.join(f'`{n}`' for n in names)}): Equinox treats such a "
            "field as static, so those arrays are constants of the loop and get no "
            "gradient. Make them fields of the module, pass them through a "
            "`jax.tree_util.Partial`, or wrap the function with `bl.Loop`, which "
            "makes a closure's arrays leaves.",
            UserWarning,
            stacklevel=caller_level(_LIBRARIES),
        )


# (the user's `run` may be reached through Equinox's and JAX's transforms)
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) for m in (jax, eqx))


class Loop(LoopModule):
    """A `LoopModule` made of plain callables.

    `cond_fun` and `body_fun` may be functions, closures, bound methods of Equinox
    modules, `functools.partial` or `jax.tree_util.Partial` objects. The arrays they
    hold are leaves of the `Loop`, so `bl.filter_jit` traces them and
    `bl.filter_grad` differentiates them: arrays inside a `Partial` or a module, and
    arrays a closure captures (in its closure cells or default arguments, also
    through the functions it calls from its closure). Everything else is static.
    A closure's captured arrays are taken when the `Loop` is made: build a new
    `Loop` (cheap; `bl.filter_jit` reuses the compiled program) to run with other
    values. A recursive closure over arrays is an error (its inner calls could not
    be differentiated).

    A gradient with respect to a `Loop` is a `Loop` of the same structure, and a
    closure's arrays are found by the names the closure uses for them: a closure
    becomes a module whose field `closure` maps each name it captured arrays under
    (a free variable or a parameter with a default) to them, nested the same way for
    a function or `Partial` captured in turn.

    ```python
    def body(carry):  # closes over `A`, an array, and `mix`, a `Partial`
        x, i = carry
        return jnp.tanh(A @ x) + mix(x), i + 1

    loop = bl.Loop(lambda c: c[1] < 10, body)
    g = bl.filter_grad(lambda lp: jnp.sum(lp.run((x0, 0), max_steps=64)[0]))(loop)
    g.body_fun.closure["A"]            # dL/dA
    g.body_fun.closure["mix"].args[0]  # the gradient of the Partial's argument
    ```

    A `Partial` given directly is its own gradient's structure: the gradient of
    `bl.Loop(cond, jax.tree_util.Partial(f, A))` has dL/dA at `g.body_fun.args[0]`.

    A subclass may override `cond`, `body` or `buffers`; `run` calls them.

    **Arguments:**

    - `cond_fun`: `carry -> bool`.
    - `body_fun`: `carry -> carry`.
    - `buffers`: optional, `carry -> node or sequence of nodes`; see
        `bl.while_loop`.

    !!! warning

        Arrays reached only through a module's global variables, or through the
        attributes of an object that is not a pytree, are constants: they get no
        gradient. Pass them in a closure, a `Partial` or a module field instead.
    """

    cond_fun: Callable
    body_fun: Callable
    buffers_fun: Callable | None = None

    def __init__(
        self,
        cond_fun: Callable,
        body_fun: Callable,
        *,
        buffers: Callable | None = None,
    ):
        check_callables(cond_fun, body_fun, buffers, "bl.Loop")
        # captured arrays become leaves, so they are traced and differentiated
        self.cond_fun = hoist_arrays(cond_fun)
        self.body_fun = hoist_arrays(body_fun)
        self.buffers_fun = None if buffers is None else hoist_arrays(buffers)

    def cond(self, carry):
        return self.cond_fun(carry)

    def body(self, carry):
        return self.body_fun(carry)

    def buffers(self, carry):
        return None if self.buffers_fun is None else self.buffers_fun(carry)
