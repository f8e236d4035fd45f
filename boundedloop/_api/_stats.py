"""`stats=True`: what a loop did, read without changing the user's carry. The loop
runs on a counted carry (`Counted`), the user's carry next to an int32 step counter
that the body increments: an element that has stopped under `vmap` keeps its count,
and the counter, an integer, gets no tangent or cotangent.
"""

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Bool, Int

from .._tracing._carry_checks import check_carry_match


class LoopStats(eqx.Module):
    """What a loop did, returned next to its final carry by
    `bl.while_loop(..., stats=True)` and `LoopModule.run(..., stats=True)`.

    Under `jax.vmap` each field has one element per batch element.

    **Fields:**

    - `num_steps`: an int32 array, the steps the loop took: `min(natural trip count,
        max_steps)`.
    - `max_steps_reached`: a bool array, true exactly when the loop stopped because
        it reached `max_steps` while `cond_fun` was still true on the final carry
        (it ran out of steps). A loop that finishes at exactly `max_steps` steps has
        false here. Always false for `max_steps=None`.
    """

    num_steps: Int[Array, "*batch"]
    max_steps_reached: Bool[Array, "*batch"]


class _CarryKey:
    """The key of the user's carry in a counted carry, printed as nothing: errors
    name the user's leaves (`carry[0]`, `carry.x`) as they would without stats."""

    def __str__(self) -> str:
        return ""

    def __repr__(self) -> str:
        return "_CarryKey()"


_CARRY_KEY = _CarryKey()
_STEPS_KEY = jtu.GetAttrKey("num_steps")


@jtu.register_pytree_with_keys_class
class Counted:
    """The loop's carry with stats: the user's carry and the steps taken."""

    def __init__(self, carry, steps):
        self.carry = carry
        self.steps = steps

    def tree_flatten_with_keys(self):
        return ((_CARRY_KEY, self.carry), (_STEPS_KEY, self.steps)), None

    def tree_flatten(self):
        return (self.carry, self.steps), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)


def count_steps(cond_fun, body_fun, init_val, buffers, name: str):
    """The loop `(cond_fun, body_fun, init_val, buffers)` on a `Counted` carry.

    **Returns:**

    `(cond_fun, body_fun, init_val, buffers)` of the counted loop. The user's
    functions see the user's carry only.
    """

    def cond(counted):
        return cond_fun(counted.carry)

    def body(counted):
        out = body_fun(counted.carry)
        if jtu.tree_structure(out) != jtu.tree_structure(counted.carry):
            # the loop's own check would show the counted carry's structure
            check_carry_match(counted.carry, out, name)
        return Counted(out, counted.steps + 1)

    counted_buffers = None
    if buffers is not None:
        counted_buffers = lambda counted: buffers(counted.carry)  # noqa: E731
    init = Counted(init_val, jnp.array(0, jnp.int32))
    return cond, body, init, counted_buffers


def loop_stats(steps, still_going, max_steps: int | None) -> LoopStats:
    """The stats of a loop that took `steps` steps, its predicate `still_going` on
    the final carry (`None` for `max_steps=None`, where it is not needed)."""
    if max_steps is None:  # an unbounded loop never runs out of steps
        reached = jnp.zeros_like(steps, dtype=bool)
    else:
        reached = jnp.logical_and(steps == max_steps, still_going)
    return LoopStats(num_steps=steps, max_steps_reached=reached)
