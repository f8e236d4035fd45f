"""The reverse sweep: cotangents from the last step to the first.

Once the forward sweep has ended the trip count is known, so each segment between
stored checkpoints is reversed offline-optimally (Griewank and Walther's binomial
schedule, `_schedule.revolve_split`). The sweep is one `lax.while_loop` whose
iterations each either advance a step (recomputation) or reverse one (a
vector-Jacobian product); `_schedule.reverse_events` is its pure-Python twin.

The checkpoints form a stack ordered by position. `order[:depth]` are the slots in
use, bottom to top; `order[depth:]` are free. The top segment `[order_pos[top],
end)` may use `slots - top` slots, its own start included.
"""

from collections.abc import Callable

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _slots
from ._forward import Tape
from ._schedule import binomial_table


def split_rule(slots: int, max_length: int) -> Callable:
    """`split(length, k)` in-graph: as `_schedule.revolve_split`, from a table."""
    table = binomial_table(slots, max_length)
    table = jnp.asarray(np.minimum(table, np.iinfo(np.int32).max), jnp.int32)

    def split(length, k):
        k = jnp.clip(k, 1, slots)
        row = table[k]
        # repetition number: first r with C(k + r, k) >= length (clipped: still valid)
        r = jnp.minimum(jnp.sum(row < length), row.shape[0] - 1)
        r1 = jnp.maximum(r - 1, 0)
        general = jnp.minimum(row[r1], length - table[k - 1][r1])
        out = jnp.where(k == 1, length - 1, general)
        return jnp.where(length <= 1, 0, out).astype(jnp.int32)

    return split


def reverse_sweep(
    step: Callable,
    step_vjp: Callable,
    tape: Tape,
    ct_final,
    ct_params_zero,
    slots: int,
    max_length: int,
):
    """Reverse the loop recorded in `tape`.

    **Arguments:**

    - `step`: `x -> x'`, one step of the loop.
    - `step_vjp`: `(x, ct_x') -> (ct_params, ct_x)`, its vector-Jacobian product.
    - `tape`: the forward sweep's `Tape`.
    - `ct_final`: the cotangent of the final carry.
    - `ct_params_zero`: zeros shaped like `ct_params`.
    - `slots`: the number of checkpoint slots.
    - `max_length`: the longest a segment can be (sizes the split table).

    **Returns:**

    `(ct_params, ct_init)`.
    """
    split = split_rule(slots, max_length)
    # sort the checkpoints by position (unused slots sort last)
    order = jnp.argsort(tape.positions).astype(jnp.int32)
    order_pos = tape.positions[order]
    depth = jnp.sum(tape.positions != _slots.UNUSED).astype(jnp.int32)
    end = tape.length

    def top_segment(depth, order_pos, order, storage, end):
        top = jnp.maximum(depth - 1, 0)
        i = order_pos[top]
        return i, _slots.load(storage, order[top]), i + split(end - i, slots - top)

    i, x, target = top_segment(depth, order_pos, order, tape.storage, end)

    def masked_step(x, i):
        return _slots.select(i < tape.trips, step(x), x)

    def masked_vjp(x, ct, ct_params, i):
        # elements whose loop had already stopped at step i pass `ct` through
        active = i < tape.trips
        d_params, d_x = step_vjp(x, ct)
        d_x = _slots.select(active, d_x, ct)
        ct_params = jtu.tree_map(
            lambda acc, d: acc + jnp.where(active, d, jnp.zeros_like(d)),
            ct_params,
            d_params,
        )
        return d_x, ct_params

    def cond(state):
        return state[1] > 0

    def body(state):
        i, end, depth, target, order_pos, order, storage, x, ct, ct_params = state
        turn = i == end - 1

        def reverse(x, ct, ct_params):
            return (x, *masked_vjp(x, ct, ct_params, i))

        def advance(x, ct, ct_params):
            return masked_step(x, i), ct, ct_params

        x, ct, ct_params = lax.cond(turn, reverse, advance, x, ct, ct_params)
        # after an advance: store the new state if it starts the next segment
        i_next = i + 1
        push = (~turn) & (i_next == target) & (i_next < end - 1)
        free = jnp.minimum(depth, slots - 1)
        storage = _slots.store(storage, order[free], x, push)
        order_pos = order_pos.at[free].set(jnp.where(push, i_next, order_pos[free]))
        depth = depth + push.astype(jnp.int32)
        # after a reversal: drop the checkpoint if its segment is done, restore the top
        end = end - turn.astype(jnp.int32)
        depth = depth - (turn & (end == order_pos[jnp.maximum(depth - 1, 0)])).astype(jnp.int32)
        top_i, top_x, top_target = top_segment(depth, order_pos, order, storage, end)
        new_target = i_next + split(end - i_next, slots - (depth - 1))
        i = jnp.where(turn, top_i, i_next)
        x = _slots.select(turn, top_x, x)
        target = jnp.where(turn, top_target, jnp.where(push, new_target, target))
        return i, end, depth, target, order_pos, order, storage, x, ct, ct_params

    state = (
        i,
        end,
        depth,
        target,
        order_pos,
        order,
        tape.storage,
        x,
        ct_final,
        ct_params_zero,
    )
    state = lax.while_loop(cond, body, state)
    ct_init, ct_params = state[8], state[9]
    return ct_params, ct_init
