"""`bl.while_loop` under `equinox.internal.while_loop`'s signature, the loop that
diffrax and optimistix hand their solves."""

from .._runtime._checks import reads_checked_at_most
from .._tracing._buffers import clamped_writes
from ._while_loop import run_loop


def equinox_style_while_loop(
    cond_fun,
    body_fun,
    init_val,
    *,
    max_steps,
    buffers=None,
    checkpoints=None,
    memory=None,
    checked: bool = True,
    **_,
):
    """`bl.while_loop` called as a client calls `equinox.internal.while_loop`.

    **Arguments:**

    - `cond_fun`, `body_fun`, `init_val`, `max_steps`, `buffers`, `checkpoints`,
      `memory`: as for `bl.while_loop`.
    - `checked`: `False` for a client's own loop whose buffers need no run-time
      check (the loops traced in its body keep theirs).
    - the rest (equinox's `kind`, `base`): ignored; the loop is always ours.

    The client's buffers follow Equinox's rules, not ours: an out-of-range write
    index is clamped into range, as Equinox's buffers do (diffrax's results rely on
    it: its saves of every step write the last row again), where `bl.while_loop`'s
    own drop the write, as `jnp` does; and only their reads are checked (as by
    default), even inside `bl.buffer_checks()`.

    **Returns:** the final value of the loop.
    """
    with clamped_writes(), reads_checked_at_most():
        return run_loop(
            cond_fun,
            body_fun,
            init_val,
            max_steps=max_steps,
            checkpoints=checkpoints,
            memory=memory,
            buffers=buffers,
            name="bl.while_loop",
            checked=checked,
        )


def equinox_default_checkpoints(
    checkpoints: int | None, max_steps: int | None
) -> int | None:
    """`checkpoints`, or where it is `None` the budget that equinox's checkpointed
    loop (and so `RecursiveCheckpointAdjoint`, diffrax's and optimistix's) defaults
    to: the fewest `c` with `(c + 1)(c + 2) / 2 > max_steps`, so that every trip
    count up to `max_steps` is reversed with each step recomputed at most twice.

    **Arguments:**

    - `checkpoints`: the number a user asked for, or `None`.
    - `max_steps`: the loop's bound, or `None` for an unbounded loop (whose
      default is `bl.while_loop`'s own).

    **Returns:** the number of checkpoints to give `bl.while_loop`.
    """
    if checkpoints is not None or max_steps is None:
        return checkpoints
    c = 1
    while (c + 1) * (c + 2) // 2 <= max_steps:
        c += 1
    return c
