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

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _slots
from ._forward import Tape
from ._schedule import binomial_table
from ._unbatched import select_if_batched


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
    step_vjp: Callable,
    apply_updates: Callable,
    tape: Tape,
    ct_final,
    ct_bufs,
    ct_params_zero,
    slots: int,
    max_length: int,
    every_step_stored: bool = False,
):
    """Reverse the loop recorded in `tape`.

    **Arguments:**

    - `step_vjp`: `(x, bufs, ct_bufs, active) -> (x', pullback)`, one step
        linearized, and `apply_updates(ct_bufs, updates, when)` (see
        `_step.make_step_vjp`).
    - `tape`: the forward sweep's `Tape`.
    - `ct_final`, `ct_bufs`: the cotangents of the final carry and buffers.
    - `ct_params_zero`: zeros shaped like `ct_params`.
    - `slots`: the number of checkpoint slots.
    - `max_length`: sizes the split table (longer segments stay correct).
    - `every_step_stored`: the forward stored every state (`slots >= max_steps`),
        so every iteration reverses a step and there is nothing to choose.

    **Returns:**

    `(ct_params, ct_init, ct_bufs_init)`.
    """
    split = split_rule(slots, max_length)
    bufs = tape.bufs
    # sort the checkpoints by position (unused slots sort last)
    order = jnp.argsort(tape.positions).astype(jnp.int32)
    order_pos = tape.positions[order]
    depth = jnp.sum(tape.positions != _slots.UNUSED).astype(jnp.int32)

    top = jnp.maximum(depth - 1, 0)
    i = order_pos[top]
    x = _slots.load(tape.storage, order[top])
    target = i + split(tape.length - i, slots - top)
    shapes = jax.eval_shape(
        lambda: step_vjp(x, bufs, ct_bufs, jnp.array(True))[1](ct_final)[2]
    )
    no_updates = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def cond(state):
        return state[1] > 0

    def body(state):
        i, end, depth, target, order_pos, storage, x, ct, ct_bufs, ct_params = state
        turn = jnp.array(True) if every_step_stored else i == end - 1
        # elements whose loop had already stopped at step i neither move nor
        # pass anything but `ct` through
        active = i < tape.trips
        # the step's forward evaluation happens here, once, whichever branch runs
        new_x, pullback = step_vjp(x, bufs, ct_bufs, active)

        def reverse(x, ct, ct_params):
            d_params, d_x, updates = pullback(ct)
            d_params = select_if_batched(
                active, d_params, jtu.tree_map(jnp.zeros_like, d_params)
            )
            ct_params = jtu.tree_map(jnp.add, ct_params, d_params)
            return x, select_if_batched(active, d_x, ct), ct_params, updates

        def advance(x, ct, ct_params):
            return select_if_batched(active, new_x, x), ct, ct_params, no_updates

        if every_step_stored:
            x, ct, ct_params, updates = reverse(x, ct, ct_params)
        else:
            # the buffers' cotangents stay out of the cond (passing them through
            # its branches would copy them every iteration); their updates come out
            x, ct, ct_params, updates = lax.cond(
                turn, reverse, advance, x, ct, ct_params
            )
        ct_bufs = apply_updates(ct_bufs, updates, turn)
        # after an advance: store the new state if it starts the next segment
        i_next = i + 1
        push = (~turn) & (i_next == target) & (i_next < end - 1)
        free = jnp.minimum(depth, slots - 1)
        storage = _slots.store(storage, order[free], x, push)
        order_pos = order_pos.at[free].set(jnp.where(push, i_next, order_pos[free]))
        depth = depth + push.astype(jnp.int32)
        # after a reversal: drop the checkpoint if its segment is done, restore the top
        end = end - turn.astype(jnp.int32)
        done = turn & (end == order_pos[jnp.maximum(depth - 1, 0)])
        depth = depth - done.astype(jnp.int32)
        # the next segment starts at the restored top (after a reversal) or at the
        # state just stored (after a push); either way it is the top of the stack
        top = jnp.maximum(depth - 1, 0)
        i = jnp.where(turn, order_pos[top], i_next)
        x = _slots.select(turn, _slots.load(storage, order[top]), x)
        planned = i + split(end - i, slots - top)
        target = jnp.where(turn | push, planned, target)
        return i, end, depth, target, order_pos, storage, x, ct, ct_bufs, ct_params

    state = (
        i,
        tape.length,
        depth,
        target,
        order_pos,
        tape.storage,
        x,
        ct_final,
        ct_bufs,
        ct_params_zero,
    )
    state = lax.while_loop(cond, body, state)
    return state[9], state[7], state[8]
