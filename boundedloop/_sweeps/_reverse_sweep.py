"""The reverse sweep: cotangents from the last step to the first. Each iteration of
its loop recomputes the input of step `end - 1` from the top checkpoint
(`_recompute.py`) and reverses that step (a vector-Jacobian product); a body with
cheap steps gets two more loops, and a costly one a single loop whose iterations
each take one action of the schedule (`drive`: advance, or reverse and restore)
with one evaluation of the step (`docs/architecture.md`, "The cost model").
`tests/schedule_reference.reverse_events` is the sweep's pure-Python twin.

??? cite "References"

    ```bibtex
    @article{griewank2000revolve,
      author = {Griewank, Andreas and Walther, Andrea},
      title = {Algorithm 799: Revolve: An Implementation of Checkpointing for the
               Reverse or Adjoint Mode of Computational Differentiation},
      journal = {ACM Transactions on Mathematical Software},
      volume = {26}, number = {1}, pages = {19--45}, year = {2000},
    }
    ```
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Int

from .._runtime import _progress
from .._runtime._batching import select_if_batched
from .._runtime._shard_map import (
    vary,
    varying_axes,
    varying_switch,
    varying_while_loop,
)
from .._tracing._loop import LoopConfig
from . import _buffer_checks, _checkpoint_store, _cost_model, _tape
from ._checkpoint_store import CheckpointStore
from ._recompute import (
    make_sweep,
    next_target,
    push,
    Recompute,
    recompute,
    Stack,
    Sweep,
)
from ._step import apply_updates, no_updates, ReversibleStep, wholly_read


class ReverseState(NamedTuple):
    """The outer loop's carry: steps `[0, end)` are still to be reversed."""

    end: Int[Array, ""]
    stack: Stack
    ct: Any  # the cotangent of `x_end`
    ct_bufs: tuple  # the buffers' cotangents
    ct_body: Any  # the accumulated cotangent of the body's arrays
    check: Any  # `bl.buffer_checks`' state (`_buffer_checks.ReverseCheck`), or None


def carried(sw: Sweep, ct):
    """`ct` without the leaves the body never reads: they are not carried."""
    return tuple(None if u else c for c, u in zip(ct, sw.step.unread))


def unread_ct(sw: Sweep, ct, reversed_none):
    """`ct` with the leaves the body never reads put back: the final carry's
    cotangent while `reversed_none` (per element: none of its steps reversed
    yet), zero after."""

    def put_back(c, final, unread):
        if not unread:
            return c
        return jnp.where(reversed_none, final, jnp.zeros_like(final))

    return tuple(map(put_back, ct, sw.ct_final, sw.step.unread))


def reverse_step(sw: Sweep, state: ReverseState, i, x) -> ReverseState:
    """Reverse step `end - 1` from its input `x` (`i == end - 1`, which only
    the data dependence below uses)."""
    # elements whose loop had already stopped there pass `ct` through unchanged
    active = i < sw.tape.trips
    pullback = sw.step.vjp(x, sw.tape.bufs, state.ct_bufs, active)
    return _reverse(sw, state, i, pullback, active)


def _reverse(sw: Sweep, state, i, pullback, active, then=None):
    """Apply `pullback`, step `i`'s, where `i == end - 1`, and count the step
    reversed. With `then = (on_reverse, on_advance, operands)`, always under
    `lax.cond`: the reversing branch also returns `on_reverse(end, operands)`,
    the other `on_advance(operands)`."""
    state = state._replace(ct=unread_ct(sw, state.ct, state.end >= sw.tape.trips))

    def reverse(ct, ct_body, operands):
        d_body, d_x, updates = pullback(ct)
        d_body = select_if_batched(active, d_body, jtu.tree_map(jnp.zeros_like, d_body))
        ct_body = jtu.tree_map(jnp.add, ct_body, d_body)
        out = select_if_batched(active, d_x, ct), ct_body, updates
        return out if then is None else (*out, then[0](state.end - 1, operands))

    operands = None if then is None else then[2]
    shapes = None
    if then is not None or _cost_model.orders_buffer_reads(state.ct_bufs):
        shapes = jax.eval_shape(reverse, state.ct, state.ct_body, operands)[2]
    if then is not None or (
        shapes is not None and not wholly_read(sw.step, shapes, state.ct_bufs)
    ):
        # `i == end - 1` always holds, without `then`. The `lax.cond` is there for
        # XLA: the buffers' cotangents are read inside it and updated in place after
        # it, and only that data dependence lets XLA order the read before the write
        # instead of copying the whole cotangent every step. Not without buffers (its
        # operands would take memory of their own), with small ones (a copy costs
        # less), or when the step reads a whole buffer (its update touches all of
        # the cotangent anyway: `docs/design-notes.md`).
        unchanged = no_updates(sw.step, shapes, state.ct_bufs)

        def skip(ct, ct_body, operands):
            out = ct, ct_body, unchanged
            if then is None:
                return out
            out = (*out, then[1](operands))
            # (inside `shard_map`, the outputs vary as the reversing branch's do)
            like = jax.eval_shape(reverse, ct, ct_body, operands)
            return jtu.tree_map(lambda o, s: vary(o, varying_axes(s)), out, like)

        reversing = i == state.end - 1
        ct, ct_body, updates, *more = lax.cond(
            reversing, reverse, skip, state.ct, state.ct_body, operands
        )
    else:
        ct, ct_body, updates = reverse(state.ct, state.ct_body, None)
        more = []
    ct_bufs = apply_updates(sw.step, state.ct_bufs, updates)
    ct = carried(sw, ct)
    check = state.check
    if check is not None:
        check = _buffer_checks.reverse_check(check, sw.step, updates, i, state.ct_bufs)
    end = state.end - (1 if then is None else reversing.astype(state.end.dtype))
    state = state._replace(
        end=end, ct=ct, ct_bufs=ct_bufs, ct_body=ct_body, check=check
    )
    return state if then is None else (state, *more)


class Driver(NamedTuple):
    """The reverse sweep's carry as one loop: `x`, the state at step `i`, is
    advanced towards `end - 1`, or, there, reversed."""

    i: Int[Array, ""]
    target: Int[Array, ""]  # where the schedule stores the next checkpoint
    x: Any
    state: ReverseState


def _restore(sw: Sweep, stack: Stack):
    """`(i, x)`: the top checkpoint, to advance from."""
    top = jnp.maximum(stack.depth - 1, 0)
    return stack.order_pos[top], _checkpoint_store.load(stack.storage, sw.order[top])


def _target(sw: Sweep, i, end, stack: Stack):
    return next_target(sw, Recompute(i, end, stack, None))


def drive(sw: Sweep, d: Driver) -> Driver:
    """One action of the binomial schedule, as `reverse_events` takes it: at
    `i == end - 1`, reverse that step and restore the top checkpoint; otherwise
    advance one step, storing the state where the schedule says. The step is
    evaluated once either way (forward and linearized); the vector-Jacobian
    product and the restore are under one `lax.cond`; the store and the lookup of
    the next store event under a `lax.switch` (the storage is never an output of
    the first, whose restoring branch reads it: XLA would copy it whole; and an
    iteration that does not store writes nothing). On the chip, with the restore
    under the switch, or under a `lax.cond` of its own, XLA kept a copy of the
    storage: 252 or 202 MB of temp memory and 240 or 199 ms for the headline's
    gradient, against 146 ms this way (`docs/design-notes.md`)."""
    state = d.state
    active = d.i < sw.tape.trips
    x_next, pullback = sw.step.forward_vjp(d.x, sw.tape.bufs, state.ct_bufs, active)
    depth, order_pos, storage = state.stack

    def on_reverse(end, _):
        # drop the top checkpoint once its segment is done, and restore the next
        top = jnp.maximum(depth - 1, 0)
        new_depth = depth - (end == order_pos[top]).astype(jnp.int32)
        i, x = _restore(sw, Stack(new_depth, order_pos, storage))
        return i, x, new_depth

    def on_advance(x_next):
        return d.i + 1, x_next, depth

    state, (i, x, depth) = _reverse(
        sw, state, d.i, pullback, active, then=(on_reverse, on_advance, x_next)
    )
    reversing = d.i == d.state.end - 1
    store = ~reversing & (i == d.target) & (i < state.end - 1)

    # the next store event, looked up once an iteration: after a restore or a store
    def kept(stack):
        return stack, d.target

    def restored(stack):
        return stack, _target(sw, i, state.end, stack)

    def stored(stack):
        return restored(push(sw, Recompute(i, state.end, stack, x)).stack)

    action = jnp.where(store, 2, reversing.astype(jnp.int32))
    stack, target = varying_switch(
        action, (kept, restored, stored), Stack(depth, order_pos, storage)
    )
    return Driver(i, target, x, state._replace(stack=stack))


def reverse_driven(sw: Sweep, state: ReverseState, meter, length) -> ReverseState:
    """The whole reverse sweep as one loop of `drive`, reporting the steps reversed
    to `bl.progress_meter`'s reverse bar where `meter` is one (see `_metered`)."""

    def drive_(d: Driver) -> Driver:
        new = drive(sw, d)
        if meter is not None:
            done = length - d.state.end, length - new.state.end
            _progress.tick_reverse(meter, *done, length)
        return new

    i, x = _restore(sw, state.stack)
    d = Driver(i, _target(sw, i, state.end, state.stack), x, state)
    return varying_while_loop(lambda d: _steps_left(d.state), drive_, d).state


def reverse_stored(sw: Sweep, state: ReverseState) -> ReverseState:
    """Every step whose input is stored: nothing is stored, all is reversed."""
    i = state.end - 1
    return reverse_step(sw, state, i, _checkpoint_store.load(sw.tape.storage, i))


def reverse_segment(sw: Sweep, state: ReverseState) -> ReverseState:
    """Recompute step `end - 1`'s input and reverse it, then reverse the steps
    below it whose inputs are on top of the stack, popping each, in one tight
    loop (no recomputation loop is entered for them)."""
    at = recompute(sw, state.end, state.stack)
    at_stack = at.stack

    def reverse_and_pop(carry):
        state, first, recomputed = carry
        depth, order_pos, storage = state.stack
        top = jnp.maximum(depth - 1, 0)
        # the recomputed input first, then inputs on top of the stack (loaded
        # here rather than carried, so the carry is never overwritten while
        # the step still reads it)
        i = jnp.where(first, recomputed.i, order_pos[top])
        stored = _checkpoint_store.load(storage, sw.order[top])
        x = jtu.tree_map(lambda r, s: jnp.where(first, r, s), recomputed.x, stored)
        state = reverse_step(sw, state, i, x)
        # drop the top checkpoint once its segment is done
        depth = depth - (state.end == order_pos[top]).astype(jnp.int32)
        state = state._replace(stack=Stack(depth, order_pos, storage))
        return state, jnp.array(False), recomputed

    def more(carry):
        state, first, _ = carry
        depth, order_pos, _ = state.stack
        on_top = order_pos[jnp.maximum(depth - 1, 0)] == state.end - 1
        return first | ((depth > 0) & on_top)

    at = at._replace(stack=None)
    carry = (state._replace(stack=at_stack), jnp.array(True), at)
    if not sw.cheap_steps:  # one step per iteration of the sweep
        return reverse_and_pop(carry)[0]
    state, *_ = varying_while_loop(more, reverse_and_pop, carry)
    return state


def _reversing_from(sw: Sweep, taped, tape):
    """One iteration of a loop that reverses taped steps: step `end - 1`, from its
    row of `tape`. `taped` is the `(TapedStep, invariants)` pair."""
    step, invariants = taped

    def reverse_one(state: ReverseState) -> ReverseState:
        i = state.end - 1
        active = i < sw.tape.trips
        row = _tape.read(tape, i)
        pullback = step.pullback(row, invariants, state.ct_bufs, active)
        return _reverse(sw, state, i, pullback, active)

    return reverse_one


def _taped_step(sw: Sweep, state: ReverseState):
    """`(TapedStep, invariants)` for this sweep's step (shapes from `x_0`)."""
    x0 = _checkpoint_store.load(state.stack.storage, sw.order[0])
    taped = _tape.TapedStep(sw.step, x0, sw.tape.bufs)
    return taped, taped.invariants()


def reverse_taped(sw: Sweep, state: ReverseState) -> ReverseState:
    """Every step reversed from the forward sweep's tape (`_tape`), last first,
    none evaluated: the gradient of a stored scan."""
    reverse_one = _reversing_from(sw, _taped_step(sw, state), sw.tape.tape)
    return varying_while_loop(_steps_left, reverse_one, state)


def reverse_blocks(
    sw: Sweep, state: ReverseState, steps: int, ring: _tape.Tape | None = None
) -> ReverseState:
    """The whole reverse sweep in blocks of up to `steps` steps, last first. For
    each: recompute from the top checkpoint to the block's first input (storing
    where the binomial schedule says, as for a single step), recompute the block
    once more taping each step's residuals (`_tape`, step `t` in row
    `t % steps`), and reverse it from the tape. Each step is evaluated twice
    after the forward sweep, plus the schedule's advance to each block. `ring`:
    the forward sweep's tape of its last `steps` steps, if it kept one; the last
    block is reversed from it, none of its steps evaluated again."""
    taped = _taped_step(sw, state)

    def block(carry):
        state, tape, in_ring = carry
        top = jnp.maximum(state.stack.depth - 1, 0)
        start = jnp.maximum(state.end - steps, state.stack.order_pos[top])
        at = recompute(sw, start + 1, state.stack)  # `x_start`, from the top

        def tape_one(c):
            j, x, tape = c
            active = j < sw.tape.trips
            new_x, _, row = taped[0].forward(x, sw.tape.bufs, active)
            x = select_if_batched(active, new_x, x)
            return j + 1, x, _tape.write(tape, j, row)

        first = jnp.where(in_ring, state.end, start)  # the ring's steps: none
        _, _, tape = varying_while_loop(
            lambda c: c[0] < state.end, tape_one, (first, at.x, tape)
        )

        state = varying_while_loop(
            lambda s: (s.end > start) | (s.stack.depth < 0),
            _reversing_from(sw, taped, tape),
            state._replace(stack=at.stack),
        )
        # drop the top checkpoint once its segment is done
        depth, order_pos, storage = state.stack
        top = jnp.maximum(depth - 1, 0)
        depth = depth - (state.end == order_pos[top]).astype(jnp.int32)
        return (
            state._replace(stack=Stack(depth, order_pos, storage)),
            tape,
            jnp.asarray(False),
        )

    tape = taped[0].empty(steps) if ring is None else ring
    carry = (state, tape, jnp.asarray(ring is not None))
    return varying_while_loop(lambda c: _steps_left(c[0]), block, carry)[0]


def _steps_left(state: ReverseState):
    """Whether steps remain to be reversed: `end > 0`, written to read a second
    carried scalar, the stack's depth, which is never negative.

    XLA's trip-count analysis (jaxlib 0.10) takes a loop condition that reads one
    carried scalar for an induction variable, and then copies whatever computes that
    scalar in the body, nested loops and all, on each pass that asks (what that cost:
    `docs/design-notes.md`). A condition on two carried scalars has no
    single induction variable, and is passed over."""
    return (state.end > 0) | (state.stack.depth < 0)


def _metered(reverse, meter: _progress.Meter, length):
    """`reverse` (an iteration of the sweep's loop: a step reversed, or with cheap
    steps a run of them) reporting the steps reversed to `bl.progress_meter`'s
    reverse bar, whose total is the steps taken, `length`."""

    def metered(state: ReverseState) -> ReverseState:
        new = reverse(state)
        _progress.tick_reverse(meter, length - state.end, length - new.end, length)
        return new

    return metered


@jax.named_scope("boundedloop_reverse")
def reverse_sweep(
    step: ReversibleStep, tape: CheckpointStore, ct_final, ct_bufs, config: LoopConfig
):
    """Reverse the loop recorded in `tape`.

    **Arguments:**

    - `step`: the loop's step, forward and linearized.
    - `tape`: the forward sweep's `CheckpointStore`.
    - `ct_final`, `ct_bufs`: the cotangents of the final carry and buffers.
    - `config`: the loop's `LoopConfig` (checkpoints, max_steps).

    **Returns:**

    `(ct_body, ct_init, ct_bufs_init)`.
    """
    ct_final = tuple(ct_final)
    sweep = make_sweep(step, tape, ct_final, config)
    state = ReverseState(
        tape.length,
        Stack(tape.used, sweep.sorted, tape.storage),
        carried(sweep, ct_final),
        ct_bufs,
        step.zero_ct_body(),
        _buffer_checks.reverse_initial(
            step,
            tape.bufs,
            config.buffer_check,
            config.buffer_rules,
            config.max_steps,
            tape.stamps,
        ),
    )
    meter = _progress.start(config.max_steps, reverse=True)  # None unless metered
    # (a tape made by a step that differentiates other leaves, as the first-order
    # sweep's under `grad` of `grad`, holds other residuals: not read here)
    forward_tape = (
        tape.tape if tape.tape is not None and tape.tape.key == step.key else None
    )
    if forward_tape is not None and config.tapes_every_step:
        state = reverse_taped(sweep, state)
    elif config.tape_steps and not config.tapes_every_step:
        state = reverse_blocks(sweep, state, config.tape_steps, forward_tape)
    elif sweep.one_loop and not sweep.every_step_stored:
        state = reverse_driven(sweep, state, meter, tape.length)
    else:
        reverse = reverse_stored if sweep.every_step_stored else reverse_segment
        reverse = functools.partial(reverse, sweep)
        if meter is not None:
            reverse = _metered(reverse, meter, tape.length)
        state = varying_while_loop(_steps_left, reverse, state)
    if meter is not None:
        # the count read off the loop's result (`end == 0`), so that the bar is
        # closed after the loop: an unordered callback reading only `tape.length`
        # may run before it
        _progress.done(meter, tape.length - state.end)
    ct_init = unread_ct(sweep, state.ct, tape.trips == 0)
    out = state.ct_body, ct_init, state.ct_bufs
    name = config.buffer_check
    return _buffer_checks.raise_violations(
        name, step.layout, tape.bufs, state.check, out
    )
