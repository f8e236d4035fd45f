"""The buffer checks at run time: each location written at most once, and no read
whose gradient would see a later write.

On by default (`bl.buffer_checks(False)` turns them off), and the body is not traced
again for them: each sweep replays a step's reads and writes (`StepOut.reads` and
`.writes`, in the order `Layout.sites` records) against a mask per buffer, updated
in place, and the first violation is raised once after the loop, attached to what
the loop returns. Nothing in the loop waits for the host.

- The forward sweep, by default (`WriteCounts`): how often each location was
  written, saturating at 2. A location written twice is found after the loop,
  without its step.
- The forward sweep inside `bl.buffer_checks()` (`CheckState`): which locations
  are written, checked at every write and read (no read of an unwritten
  location), keeping the first violation's step and index.
- The reverse sweep (`ReverseCheck`): which locations the steps already reversed
  wrote. A read whose cotangent is nonzero at such a location read the value from
  before a later write, but the backward pass reads the buffer as the loop left it:
  its gradient would be wrong.
"""

import dataclasses

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int

from . import _cost_model
from ._buffers import buffer_names
from ._checks import raise_if
from ._indexing import describe_index, get, overlay, put


class Found(eqx.Module):
    """The first violation found: 1 + its `Layout.sites` entry, negated for a read
    that the backward pass would get wrong (0: none); its step; the integers of
    its index."""

    site: Int[Array, ""]
    step: Int[Array, ""]
    ints: Int[Array, " rank"]

    @classmethod
    def none(cls, layout) -> "Found":
        # how many integers the index of a checked read or write may hold
        rank = max([1, *(sum(p is None for p in s.pattern) for s in layout.sites)])
        zero = jnp.array(0, jnp.int32)
        return cls(zero, zero, jnp.zeros(rank, jnp.int32))

    def first(self, broken, code: int, step, index, earlier=True) -> "Found":
        """This, or the violation `code` at `step` and `index` where `broken` and
        none was found before; or, unless `earlier` (the steps are visited last to
        first), wherever `broken`."""
        first = jnp.logical_and(broken, self.site == 0) if earlier else broken
        here = jnp.zeros_like(self.ints)
        if index.ints:
            here = here.at[: len(index.ints)].set(jnp.stack(index.ints))
        return Found(
            jnp.where(first, code, self.site),
            jnp.where(first, step, self.step),
            jnp.where(first, here, self.ints),
        )


# a step of at least this much work (`_cost_model.work`) has its loop's buffers
# checked by default: the measured cost is under 5% of the gradient there
# (`benchmarks/results/buffer_checks.json`)
CHECKED_WORK = 2**20


def worth_checking(body) -> bool:
    """Whether the default checks the buffers of a loop with this traced body."""
    return _cost_model.work(body.jaxpr) >= CHECKED_WORK


def _after(old, live, found: Found):
    """A mask's window after a write where `live`: `old | live`, written so that
    it depends on every check made before it (`found`). XLA then orders those
    reads of the mask before the write and updates it in place; without that
    dependence it copies the whole mask every step (`live & found` adds nothing to
    `live`, but XLA cannot tell)."""
    checked = jnp.logical_and(live, found.site != 0)
    return jnp.logical_or(old, jnp.logical_or(live, checked))


class ReverseCheck(eqx.Module):
    """What the reverse sweep's check carries: per sparsely differentiated buffer
    (else `None`), the locations written by the steps already reversed."""

    later: tuple
    found: Found


def reverse_initial(step, bufs, layout, name: str | None):
    """The reverse check's initial state, or `None` where it has nothing to check:
    the loop (named `name`) is not checked, or no buffer is differentiated."""
    if name is None or not any(step.sparse):
        return None
    later = tuple(
        jnp.zeros(b.shape, bool) if sparse else None
        for b, sparse in zip(bufs, step.sparse)
    )
    return ReverseCheck(later, Found.none(layout))


def reverse_check(check: ReverseCheck, step, updates, i, layout) -> ReverseCheck:
    """`check` after reversing step `i`, whose `BufferUpdates` are `updates`.

    Both rules matter to the gradient only, and both are checked against the
    locations the loop wrote later (at a later step, or later in this one), which
    the backward pass sees because it reads the buffer as the loop left it:

    - a write there: the location was written twice;
    - a read whose cotangent is nonzero there: the forward read the value from
        before that write, the gradient would use the later one. A read whose
        value does not matter (multiplied by zero, or dropped by `jnp.where`) has
        a zero cotangent there and passes.
    """
    sites = {(s.kind, s.number): (n, s) for n, s in enumerate(layout.sites)}
    write_numbers = [
        n for n, leaf in enumerate(layout.write_leaves) if step.sparse[leaf]
    ]
    writes = [
        (*sites["write", n], index, live)
        for n, (index, live) in zip(write_numbers, updates.cleared)
    ]
    found = check.found
    later = list(check.later)

    def written_later(s, index, since):
        """Where `index` of buffer `s.leaf` is written later than `since` (a
        version of the buffer in this step)."""
        shape = later[s.leaf].shape
        hit = get(later[s.leaf], index)
        for _, w, w_index, w_live in writes:
            if w.leaf == s.leaf and w.version >= since:
                ones = jnp.ones(w_index.result_shape(), bool)
                _, covered = overlay(hit, index, w_index, ones, shape)
                hit = hit | (covered & w_live)
        return hit

    for k, (index, live, d) in zip(step.float_reads, updates.added):
        n, s = sites["read", k]
        matters = jnp.logical_and(written_later(s, index, s.version), d != 0)
        broken = jnp.logical_and(live, jnp.any(matters))
        found = found.first(broken, -(n + 1), i, index, earlier=False)
    for n, s, index, live in writes:
        again = jnp.any(written_later(s, index, s.version + 1))
        found = found.first(jnp.logical_and(live, again), -(n + 1), i, index, False)
    for _, w, index, live in writes:
        old = get(later[w.leaf], index)
        later[w.leaf] = put(later[w.leaf], index, _after(old, live, found))
    return ReverseCheck(tuple(later), found)


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
        if int(site) < 0 and s.kind == "write":
            what = (
                f"wrote the buffer {buffer} at {index} at step {int(step)} (counting "
                "from 0) of the loop, and wrote that location again later (at a "
                "later step, or later in that one): a location already written. "
                "Each location of a buffer may be written at most once in a loop; "
                "the backward pass reads the buffer as the loop left it, so the "
                "gradient would be wrong"
            )
        elif int(site) < 0:
            what = (
                f"read the buffer {buffer} at {index} at step {int(step)} (counting "
                "from 0) of the loop, and the value read matters, but the loop "
                "wrote that location only later (at a later step, or later in that "
                "one). The gradient would be wrong: the backward pass reads the "
                "buffer as the loop left it, so it would see the later value. Read "
                "only locations already written (or never written in the loop), or "
                "keep the values from before the loop in an ordinary carry leaf"
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


def raise_violations(name: str, layout, bufs, state, tree):
    """`tree`, with the checks' error attached: raised if a step broke a rule.
    `state`: a `CheckState`, a `ReverseCheck` or `None` (nothing checked)."""
    if state is None:
        return tree
    found = state.found
    shapes = tuple(b.shape for b in bufs)
    message = BufferViolation(name, layout.sites, buffer_names(layout, bufs), shapes)
    details = (found.site, found.step, found.ints)
    return raise_if(tree, found.site != 0, message, "bl.buffer_checks", details)
