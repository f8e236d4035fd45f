"""`bl.while_loop`: the public bounded, reverse-mode differentiable while loop."""

from collections.abc import Callable
from typing import Any, TypeVar

from .._autodiff import differentiable_loop
from .._runtime._checks import (
    buffer_check_mode,
    check_stopped,
    max_steps_check_mode,
    tracing_a_loop,
)
from .._sweeps._tape import carry_bytes
from .._tracing._buffers import (
    buffer_names,
    check_every_step_writes,
    lend_buffers,
    lent_gate,
    lent_reads,
    return_buffers,
)
from .._tracing._loop import LoopConfig
from .._tracing._read_ahead import warn_reads_ahead
from .._tracing._trace import trace_loop
from ._arguments import (
    check_callables,
    check_checkpoints,
    check_max_steps,
    check_memory,
    checkpoints_within,
)
from ._stats import count_steps, loop_stats, LoopStats


Carry = TypeVar("Carry")


def while_loop(
    cond_fun: Callable[[Carry], Any],
    body_fun: Callable[[Carry], Carry],
    init_val: Carry,
    *,
    max_steps: int | None,
    checkpoints: int | None = None,
    memory: int | str | None = None,
    buffers: Callable[[Carry], Any] | None = None,
    stats: bool = False,
) -> Carry | tuple[Carry, LoopStats]:
    """As `jax.lax.while_loop`, stopping after at most `max_steps` steps, and
    reverse-mode differentiable at a cost proportional to the steps taken.

    The semantics are those of this Python loop:

    ```python
    def while_loop(cond_fun, body_fun, init_val, *, max_steps):
        val = init_val
        step = 0
        while (max_steps is None or step < max_steps) and cond_fun(val):
            val = body_fun(val)
            step += 1
        return val
    ```

    Undifferentiated, it compiles to one `lax.while_loop` and does no checkpoint work.
    Under `jax.grad` (and `jax.vjp`, `jax.jacrev`, ...) the forward pass stores up to
    `checkpoints` copies of the carry, placed online as it runs, and the backward
    pass reverses the steps last to first, recomputing from the nearest checkpoint
    with an offline-optimal (binomial) schedule once the trip count is known.

    Under `jax.vmap` with a batched predicate each element stops at its own step and
    gets its own gradient; the loop runs until every element has stopped, and the
    checkpoint schedule is shared by the batch.

    **Arguments:**

    - `cond_fun`: `carry -> bool`, a scalar boolean: whether to take another step.
    - `body_fun`: `carry -> carry`, one step. Must return the same tree structure,
        shapes and dtypes as it is given.
    - `init_val`: the initial carry, any pytree. Arrays and Python numbers are
        carried (and differentiated, if floating); other leaves are static and must
        be returned unchanged. Results have the dtypes and weak types
        `lax.while_loop` would give them.
    - `max_steps`: a non-negative `int`, the most steps to take; or `None` for no
        bound. Values above `2**31 - 1` (what the int32 step counter can count)
        act as `2**31 - 1`. Reaching it stops the loop
        silently, as `lax` would; `stats=True` reports it, and inside
        `with bl.max_steps_check():` it is an error instead (a warning with
        `warn=True`).
    - `checkpoints`: how many copies of the carry the backward pass may hold, a
        positive `int`. `None` picks every step when `max_steps <= 16`, otherwise
        `2 * (ceil(log2(max_steps)) + 4)` (28 at `max_steps=1024`, 32 at 4096),
        and 32 for `max_steps=None`. More than `max_steps` are never used. More
        checkpoints cost memory and save recomputation: with `c` checkpoints an
        `n`-step gradient makes at most `2n + r n` body evaluations, where `r` is
        the smallest integer with `binomial(c + r, r) >= n`.
    - `memory`: instead of `checkpoints`, a budget for what the backward pass
        holds for this loop: an `int` of bytes, or a string with a unit (`"2 GiB"`,
        `"500 MB"`). When one copy of the carry and `max_steps` steps' residuals
        (what each step's vector-Jacobian product reads) fit, the forward pass
        tapes every step and the gradient is a stored scan. Otherwise it buys
        copies of the carry and a tape of a block of steps: the backward pass
        recomputes each block once from its checkpoint, taping it, and reverses it
        from the tape (the last block from the forward pass's own tape of its last
        steps, where that holds a quarter of `max_steps`). `bl.memory_plan` says
        what a budget buys. Giving both `memory` and `checkpoints` is an error.
    - `buffers`: optional, a function `carry -> node or sequence of nodes of the
        carry`. Every array leaf under those nodes is a [`bl.Buffer`][boundedloop.Buffer]
        inside `body_fun`: `buf[idx]` reads, `buf.at[idx].set(x, pred=p)` writes in
        place, for any basic index (integers, static slices, `...`). Buffers are never
        checkpointed. Each location may be written at most once, and only written
        locations may be read: a gradient checks the reads by default (see
        `bl.buffer_checks`). An outer loop's buffer in
        `init_val` is a buffer of this loop too (loops in loops share buffers).
    - `stats`: whether to return, next to the final carry, a
        [`bl.LoopStats`][boundedloop.LoopStats]: the number of steps taken and
        whether the loop ran out of steps (reached `max_steps` while `cond_fun` was
        still true). Counting costs an int32 added to the carry, and
        gradients are unchanged. `False` (the default) adds nothing to the program.

    **Returns:**

    The final carry; with `stats=True`, `(final_carry, stats)`:

    ```python
    final, stats = bl.while_loop(cond_fun, body_fun, init_val, max_steps=100,
                                 stats=True)
    stats.num_steps          # int32: the steps taken (one per element under vmap)
    stats.max_steps_reached  # bool: stopped on max_steps with cond_fun still true
    ```

    !!! warning

        Gradients flow to `init_val` and to the floating arrays `body_fun` closes
        over. Arrays `cond_fun` closes over receive no gradient (the predicate is
        piecewise constant). Only carry leaves that depend on what is
        differentiated get tangents and cotangents, as with `lax.while_loop`.
    """
    return run_loop(
        cond_fun,
        body_fun,
        init_val,
        max_steps=max_steps,
        checkpoints=checkpoints,
        memory=memory,
        buffers=buffers,
        name="bl.while_loop",
        stats=stats,
    )


def run_loop(
    cond_fun,
    body_fun,
    init_val,
    *,
    max_steps,
    checkpoints,
    buffers,
    name: str,
    memory=None,
    known_length: bool = False,
    stats: bool = False,
    checked: bool = True,
):
    """`while_loop`, and the machinery `scan` shares: validate, trace, run.
    `checked=False` leaves this loop's buffers unchecked at run time (the loops
    traced in its body keep the checks in force). An outer loop's buffers in the
    carry are buffers of this loop too (`lend_buffers`).

    With `stats`, returns `(final carry, LoopStats)`: the loop runs on a `Counted`
    carry (see `_stats`) that the user's functions never see. (One function of a
    little over 60 lines: the checks, the tracing and the loop's configuration in
    the order their errors must come.)"""
    check_callables(cond_fun, body_fun, buffers, name)
    max_steps = check_max_steps(max_steps, name)
    memory = check_memory(memory, checkpoints, name)
    checkpoints = check_checkpoints(checkpoints, max_steps, name)
    if stats:  # a step counter next to the user's carry
        cond_fun, body_fun, init_val, buffers = count_steps(
            cond_fun, body_fun, init_val, buffers, name
        )
    init_val, buffers, lent = lend_buffers(init_val, buffers)  # outer loops' too
    with tracing_a_loop():  # checks traced in the body know they are in a loop
        loop = trace_loop(
            cond_fun, body_fun, init_val, buffers, name=name, gate=lent_gate(lent)
        )
    if memory is not None:  # the copies it holds; the derivative may tape steps
        size = carry_bytes(loop.body, loop.init)
        checkpoints = checkpoints_within(memory, size, max_steps, name)
    names = buffer_names(loop.layout, loop.bufs)
    check_every_step_writes(loop.layout, names, max_steps, name)
    warn_reads_ahead(loop, names, max_steps, name)
    # a scan always takes all its steps; an unbounded loop never runs out
    check = None if known_length or max_steps is None else max_steps_check_mode()
    mode = buffer_check_mode() if checked else "off"
    if max_steps == 0:
        x, bufs = loop.init, loop.bufs
        if check == "raise":
            x, bufs = check_stopped(loop, (x, bufs), name, max_steps)
    else:
        # the error is raised inside the loop's sweeps, tied to what they return
        config = LoopConfig(
            max_steps,
            checkpoints,
            known_length,
            stop_check=name if check == "raise" else None,
            buffer_check=name if loop.bufs and mode != "off" else None,
            buffer_rules=mode == "rules",
            memory=memory,
        )
        x, bufs = differentiable_loop(loop, config)
    if check == "warn":  # after the loop, outside its sweeps: once per forward pass
        x, bufs = check_stopped(loop, (x, bufs), name, max_steps, warn=True)
    out = return_buffers(loop.finish(x, bufs), lent, lent_reads(loop, init_val, lent))
    if not stats:
        return out
    # the predicate on the final carry: still true only if the loop ran out of steps
    still_going = None if max_steps is None else loop.cond(x, bufs)
    return out.carry, loop_stats(out.steps, still_going, max_steps)
