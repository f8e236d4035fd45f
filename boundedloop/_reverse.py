"""The reverse sweep: cotangents from the last step to the first.

Once the forward sweep has ended the trip count is known, so each segment between
stored checkpoints is reversed offline-optimally (Griewank and Walther's binomial
schedule, `_schedule.revolve_split`). The sweep is two nested `lax.while_loop`s: each
outer iteration reverses one step (a vector-Jacobian product), after an inner loop
that advances from the nearest checkpoint to that step (forward evaluations only,
storing the checkpoints the schedule places on the way). `_schedule.reverse_events` is
its pure-Python twin.

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

from . import _slots, _vma
from ._forward import Tape
from ._schedule import binomial_table
from ._unbatched import select_if_batched


def split_rule(slots: int, max_length: int) -> Callable:
    """`split(length, k)` in-graph: as `_schedule.revolve_split`, from a table."""
    table = binomial_table(slots, max_length)
    table = jnp.asarray(np.minimum(table, np.iinfo(np.int32).max), jnp.int32)
    last = table.shape[1] - 1

    def split(length, k):
        k = jnp.clip(k, 1, slots)
        # the repetition number: the first r with C(k + r, k) >= length (clipped:
        # still valid). A scalar while loop: it compiles several times faster than
        # a reduction over the row, and takes a few iterations for k >= 3.
        r = lax.while_loop(
            lambda r: (r < last) & (table[k, r] < length),
            lambda r: r + 1,
            jnp.array(0, jnp.int32),
        )
        r1 = jnp.maximum(r - 1, 0)
        general = jnp.minimum(table[k, r1], length - table[k - 1, r1])
        out = jnp.where(k == 1, length - 1, general)
        return jnp.where(length <= 1, 0, out).astype(jnp.int32)

    return split


def reverse_sweep(
    step: Callable,
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

    - `step`: `(x, bufs, active) -> x'`, one step forward (for recomputation).
    - `step_vjp`: `(x, bufs, ct_bufs, active) -> pullback`, one step linearized,
        and `apply_updates(ct_bufs, updates)` (see `_step.make_step_vjp`).
    - `tape`: the forward sweep's `Tape`.
    - `ct_final`, `ct_bufs`: the cotangents of the final carry and buffers.
    - `ct_params_zero`: zeros shaped like `ct_params`.
    - `slots`: the number of checkpoint slots.
    - `max_length`: sizes the split table (longer segments stay correct).
    - `every_step_stored`: the forward stored every state (`slots >= max_steps`),
        so there is nothing to recompute and the inner loop is left out.

    **Returns:**

    `(ct_params, ct_init, ct_bufs_init)`.
    """
    split = split_rule(slots, max_length)
    bufs = tape.bufs
    # sort the checkpoints by position (unused slots sort last)
    order = jnp.argsort(tape.positions).astype(jnp.int32)
    order_pos = tape.positions[order]
    depth = jnp.sum(tape.positions != _slots.UNUSED).astype(jnp.int32)

    def recompute(state):
        """Advance from the top checkpoint to the segment's last step, storing the
        checkpoints the binomial schedule places on the way (forward steps only)."""

        def cond(inner):
            return inner[0] < inner[1] - 1

        def body(inner):
            i, end, depth, target, order_pos, storage, x = inner
            # elements whose loop had already stopped at step i do not move
            new_x = step(x, bufs, i < tape.trips)
            x = select_if_batched(i < tape.trips, new_x, x)
            i = i + 1
            push = (i == target) & (i < end - 1)
            free = jnp.minimum(depth, slots - 1)
            storage = _slots.store(storage, order[free], x, push)
            order_pos = order_pos.at[free].set(jnp.where(push, i, order_pos[free]))
            depth = depth + push.astype(jnp.int32)
            # computed every step: a `lax.cond` on `push` here measured 4x slower
            planned = i + split(end - i, slots - (depth - 1))
            target = jnp.where(push, planned, target)
            return i, end, depth, target, order_pos, storage, x

        end, depth, order_pos, storage = state[:4]
        top = jnp.maximum(depth - 1, 0)
        i = order_pos[top]
        x = _slots.load(storage, order[top])
        if every_step_stored:  # the segment is one step long: nothing to recompute
            return i, depth, order_pos, storage, x
        target = i + split(end - i, slots - top)
        inner = (i, end, depth, target, order_pos, storage, x)
        i, _, depth, _, order_pos, storage, x = _vma.while_loop(cond, body, inner)
        return i, depth, order_pos, storage, x

    def cond(state):
        return state[0] > 0

    def body(state):
        end, depth, order_pos, storage, ct, ct_bufs, ct_params = state
        i, depth, order_pos, storage, x = recompute(state)
        # reverse step i = end - 1; elements whose loop had already stopped there
        # pass `ct` through unchanged
        active = i < tape.trips
        pullback = step_vjp(x, bufs, ct_bufs, active)

        def reverse(ct, ct_params):
            d_params, d_x, updates = pullback(ct)
            d_params = select_if_batched(
                active, d_params, jtu.tree_map(jnp.zeros_like, d_params)
            )
            ct_params = jtu.tree_map(jnp.add, ct_params, d_params)
            return select_if_batched(active, d_x, ct), ct_params, updates

        if jtu.tree_leaves(ct_bufs):
            # `i == end - 1` always holds here. The `lax.cond` is there for XLA: the
            # buffers' cotangents are read inside it and updated in place after
            # it, and only that data dependence lets XLA order the read before the
            # write instead of copying the whole cotangent every step. (Without
            # buffers it is left out: its operands would take memory of their own.)
            shapes = jax.eval_shape(reverse, ct, ct_params)[2]
            no_updates = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            ct, ct_params, updates = lax.cond(
                i == end - 1,
                reverse,
                lambda ct, ct_params: (ct, ct_params, no_updates),
                ct,
                ct_params,
            )
        else:
            ct, ct_params, updates = reverse(ct, ct_params)
        ct_bufs = apply_updates(ct_bufs, updates)
        # drop the top checkpoint once its segment is done
        end = end - 1
        done = end == order_pos[jnp.maximum(depth - 1, 0)]
        depth = depth - done.astype(jnp.int32)
        return end, depth, order_pos, storage, ct, ct_bufs, ct_params

    state = (
        tape.length,
        depth,
        order_pos,
        tape.storage,
        ct_final,
        ct_bufs,
        ct_params_zero,
    )
    state = _vma.while_loop(cond, body, state)
    return state[6], state[4], state[5]
