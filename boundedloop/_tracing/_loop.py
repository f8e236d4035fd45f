"""The traced loop as data (`TracedLoop`, with the carry's `Layout`, the traced
body's `StepIn` and `StepOut`, and `Perturbed`) and what it was asked for
(`LoopConfig`). `_trace` makes them; the sweeps and the derivatives read them."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._runtime._jax_private import weakly_typed


class StepIn(NamedTuple):
    """What the traced body takes."""

    x: tuple  # the ordinary carry leaves
    bufs: tuple  # the buffer leaves
    dummies: tuple  # stand-ins for the reads' tangents (see `_buffers._read`)
    active: Any  # scalar bool: buffer writes happen only where true


class Perturbed(NamedTuple):
    """Per carry leaf, whether it is perturbed."""

    x: tuple[bool, ...]
    bufs: tuple[bool, ...]


class StepOut(NamedTuple):
    """What the traced body returns."""

    x: tuple  # the new ordinary leaves
    bufs: tuple  # the buffers after this step's writes
    writes: tuple  # `(value, index, pred)` per write, in order
    reads: tuple  # the `Index` of each read, in order


class TracedLoop(eqx.Module):
    """A user's loop, traced once and closure-converted.

    `body` is `StepIn -> StepOut`, `cond(x, bufs)` the predicate. `init` and `bufs`
    are the initial arrays. Only `body`, `init` and `bufs` are differentiated: the
    predicate is piecewise constant.
    """

    body: Callable
    cond: Callable
    init: tuple
    bufs: tuple
    layout: "Layout" = eqx.field(static=True)

    def differentiable(self):
        """`(body, init, bufs)`: the parts that get tangents."""
        return self.body, self.init, self.bufs

    def finish(self, x, bufs):
        """The user-facing carry from the loop's arrays, weakly typed where
        `lax.while_loop`'s would be (see `_dtypes`)."""
        layout = self.layout
        leaves = layout.merge(x, bufs)
        leaves = [weakly_typed(v) if w else v for v, w in zip(leaves, layout.weak_out)]
        return layout.rebuild(*layout.split(leaves))


class Layout(eqx.Module):
    """Where each array leaf of the carry goes, and the static leaves."""

    treedef: Any = eqx.field(static=True)
    static: Any = eqx.field(static=True)
    buffer_pos: tuple[int, ...] = eqx.field(static=True)
    read_shapes: tuple = eqx.field(static=True)  # per read, in order
    read_leaves: tuple[int, ...] = eqx.field(static=True)  # buffer read, per read
    write_leaves: tuple[int, ...] = eqx.field(static=True)  # buffer written, per write
    weak_out: tuple[bool, ...] = eqx.field(static=True, default=())  # per leaf
    # buffers the body hands to an inner loop, and those of them an inner loop reads
    shared: frozenset[int] = eqx.field(static=True, default=frozenset())
    lent_read: frozenset[int] = eqx.field(static=True, default=frozenset())
    # the body's reads, writes and hand-overs of buffers, in order (`_buffers.Site`)
    sites: tuple = eqx.field(static=True, default=())

    def split(self, leaves):
        x = tuple(v for k, v in enumerate(leaves) if k not in self.buffer_pos)
        bufs = tuple(leaves[k] for k in self.buffer_pos)
        return x, bufs

    def merge(self, x, bufs):
        x, bufs = iter(x), iter(bufs)
        return [
            next(bufs) if k in self.buffer_pos else next(x)
            for k in range(self.treedef.num_leaves)
        ]

    def rebuild(self, x, bufs):
        dynamic = jtu.tree_unflatten(self.treedef, self.merge(x, bufs))
        return eqx.combine(dynamic, self.static)

    def read_stand_ins(self) -> tuple:
        """Zeros standing in for the buffer reads' tangents (see `_buffers._read`)."""
        return tuple(jnp.zeros(r.shape, r.dtype) for r in self.read_shapes)


# (on a TPU v5e, headline workload: a row of 16 MiB written costs about a fifth of
# the step's evaluation; `docs/design-notes.md`, "How a memory budget is split")
RING_SHARE = 4


class LoopConfig(eqx.Module):
    """The static description of one loop: what `bl.while_loop` was asked for.
    (The carry's `Layout`, found when tracing it, is the `TracedLoop`'s.)"""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)
    # the loop always takes `max_steps` steps (a scan): plan checkpoints offline
    known_length: bool = eqx.field(static=True, default=False)
    # the loop's name for `bl.max_steps_check`'s error, or None: no check
    stop_check: str | None = eqx.field(static=True, default=None)
    # the loop's name for the buffer checks' errors, or None: no check
    buffer_check: str | None = eqx.field(static=True, default=None)
    # every rule checked (inside `bl.buffer_checks()`), not only the reads
    buffer_rules: bool = eqx.field(static=True, default=False)
    # `memory=`'s budget in bytes, or None: `checkpoints` alone, nothing taped
    memory: int | None = eqx.field(static=True, default=None)
    # the rows of the tape of step residuals (`_sweeps._tape`), planned from `memory`
    # once the step's residuals are known
    tape_steps: int = eqx.field(static=True, default=0)

    @property
    def tapes_every_step(self) -> bool:
        """Whether the gradient's forward sweep tapes every step (the gradient is a
        stored scan); otherwise the tape's rows serve the reverse sweep's blocks."""
        bounded = self.max_steps is not None
        return self.tape_steps > 0 and bounded and self.tape_steps >= self.max_steps

    @property
    def forward_tapes(self) -> bool:
        """Whether the gradient's forward sweep tapes its steps: every step, or, in
        a ring of `tape_steps` rows, the last ones, which the reverse sweep's last
        block then reverses without evaluating them again. The ring is kept where
        it holds at least `1 / RING_SHARE` of `max_steps`: it writes a row at every
        step taken, and saves an evaluation for each of its rows."""
        bounded = self.max_steps is not None
        return (
            bool(self.tape_steps)
            and bounded
            and RING_SHARE * self.tape_steps >= self.max_steps
        )
