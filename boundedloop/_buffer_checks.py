"""The buffer checks at run time: each location written at most once, and only
written locations read.

On by default, off inside `with bl.buffer_checks(False):`. The body is not traced
again for them: the sweep keeps one bool mask per buffer (which locations are
written) and, after each step, replays the step's reads and writes (`StepOut.reads`
and `.writes`, in the order `Layout.sites` records) against it. The first violation
is kept, with its step and index, and raised once after the loop, attached to
everything the loop returns: one bool per buffer element, and no callback, in the
loop.
"""

import dataclasses

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ._buffers import buffer_names
from ._checks import raise_if
from ._indexing import describe_index, get, put


class CheckState(eqx.Module):
    """What the checks carry through the loop (per element, under `vmap`)."""

    masks: tuple  # per buffer, which locations are written
    # per buffer, which locations were read while unwritten (reads "later" only)
    early: tuple | None
    steps: Int[Array, ""]  # the steps this element has taken
    # the first violation: 1 + its `Layout.sites` entry, negated for a write to a
    # location read before (0: none); its step; its index's integers
    site: Int[Array, ""]
    step: Int[Array, ""]
    ints: Int[Array, " rank"]
    reads: str | None = eqx.field(static=True)  # `_checks.buffer_check_reads`


def _rank(layout) -> int:
    """How many integers the index of a checked read or write may hold."""
    counts = [sum(p is None for p in s.pattern) for s in layout.sites]
    return max([1, *counts])


def initial(bufs, layout, reads: str | None) -> CheckState:
    zero = jnp.array(0, jnp.int32)
    masks = tuple(jnp.zeros(b.shape, bool) for b in bufs)
    early = masks if reads == "later" else None
    ints = jnp.zeros(_rank(layout), jnp.int32)
    return CheckState(masks, early, zero, zero, zero, ints, reads)


def check_step(state: CheckState, out, active: Bool[Array, ""], layout) -> CheckState:
    """`state` after one step, whose `StepOut` is `out`, taken where `active`.

    A read sees the mask as it was at the version of the buffer it read (a read of
    a buffer before a write of the same step does not see that write), as the value
    read does."""
    history = [[m] for m in state.masks]
    early = None if state.early is None else list(state.early)
    site, step, ints = state.site, state.step, state.ints

    def record(broken, code, index):
        nonlocal site, step, ints
        first = jnp.logical_and(broken, site == 0)
        site = jnp.where(first, code, site)
        step = jnp.where(first, state.steps, step)
        here = jnp.zeros_like(ints)
        if index.ints:
            here = here.at[: len(index.ints)].set(jnp.stack(index.ints))
        ints = jnp.where(first, here, ints)

    for n, s in enumerate(layout.sites):
        checked = s.leaf not in layout.shared  # else an inner loop writes it
        if s.kind == "hand":
            history[s.leaf].append(history[s.leaf][-1])
        elif s.kind == "read":
            if state.reads is None or not checked:
                continue
            index = out.reads[s.number]
            unwritten = jnp.logical_and(active, ~get(history[s.leaf][s.version], index))
            if state.reads == "unwritten":
                record(jnp.any(unwritten), n + 1, index)
            else:  # remember where, for a later write there
                was = get(early[s.leaf], index)
                early[s.leaf] = put(early[s.leaf], index, was | unwritten)
        else:
            _, index, pred = out.writes[s.number]
            live = jnp.logical_and(active, pred)
            mask = history[s.leaf][-1]
            history[s.leaf].append(put(mask, index, True, live))
            if not checked:
                continue
            record(jnp.logical_and(live, jnp.any(get(mask, index))), n + 1, index)
            if early is not None:
                read = jnp.logical_and(live, jnp.any(get(early[s.leaf], index)))
                record(read, -(n + 1), index)
    masks = tuple(h[-1] for h in history)
    early = None if early is None else tuple(early)
    steps = state.steps + active.astype(jnp.int32)
    return CheckState(masks, early, steps, site, step, ints, state.reads)


@dataclasses.dataclass(frozen=True)
class BufferViolation:
    """The checks' error message, made when it is raised from the site, step and
    index of the violation (`format`)."""

    loop: str  # the loop's name, `bl.while_loop`
    sites: tuple  # the body's `Layout.sites`
    buffers: tuple[str, ...]  # per buffer, where it is in the carry, and its type
    shapes: tuple  # per buffer, its shape

    def format(self, site, step, ints) -> str:
        s = self.sites[abs(int(site)) - 1]
        index = describe_index(s.pattern, [int(i) for i in ints], self.shapes[s.leaf])
        buffer = self.buffers[s.leaf]
        if int(site) < 0:
            what = (
                f"wrote the buffer {buffer} at {index} at step {int(step)} (counting "
                "from 0) of the loop, where an earlier read (at an earlier step, or "
                "earlier in this one) found it unwritten. The gradient would be "
                "wrong: the backward pass reads the buffer as the loop left it, so "
                "that read would see this write. Read only locations already "
                "written (or never written in the loop)"
            )
        elif s.kind == "write":
            what = (
                f"wrote the buffer {buffer} at {index}, a location already written, at step "
                f"{int(step)} (counting from 0) of the loop. Each location of a "
                "buffer may be written at most once in a loop"
            )
        else:
            what = (
                f"read the buffer {buffer} at {index}, a location not yet written, at step "
                f"{int(step)} (counting from 0) of the loop. Only written locations "
                "of a buffer may be read: a buffer starts unwritten, whatever it "
                "holds (values from before the loop belong in an ordinary carry "
                "leaf, not a buffer)"
            )
        return (
            f"`{self.loop}`: `body_fun` at {s.where} {what}. (Checked by default; "
            "`with bl.buffer_checks(False):` turns the check off.)"
        )

    def summary(self) -> str:
        """The message without its run-time details, for where they cannot reach
        (a TPU's host callback)."""
        return (
            f"`{self.loop}`: a buffer was written twice at one location, or read "
            "where it was not written. Run the loop on the CPU to see where."
        )


def raise_violations(name: str, layout, bufs, state: CheckState | None, tree):
    """`tree`, with the checks' error attached: raised if a step broke a rule."""
    if state is None:
        return tree
    shapes = tuple(b.shape for b in bufs)
    message = BufferViolation(name, layout.sites, buffer_names(layout, bufs), shapes)
    details = (state.site, state.step, state.ints)
    return raise_if(tree, state.site != 0, message, "bl.buffer_checks", details)


def checking(config) -> bool:
    return config.buffer_check is not None
