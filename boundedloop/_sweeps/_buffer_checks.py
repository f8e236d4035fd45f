"""The buffer checks at run time: no read whose gradient would see a later write
(by default), and each location written at most once (inside
`bl.buffer_checks()`). They run
in the reverse sweep (`reverse_check`), without tracing the body again, and the first
violation is raised once after it: nothing in the loop waits for the host. See
`docs/guides/buffers.md`, "Checking the rule".
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int

from .._runtime._checks import raise_if
from .._tracing._buffers import buffer_names
from .._tracing._indexing import describe_index, get, overlay, put


class Found(eqx.Module):
    """The first violation found: 1 + its `Layout.sites` entry (0: none), its step,
    the integers of its index, and the step that wrote the location later (of a
    read; of a write, the step that wrote it again)."""

    site: Int[Array, ""]
    step: Int[Array, ""]
    ints: Int[Array, " rank"]
    writer: Int[Array, ""] | None  # `None` where the marks do not name steps

    @classmethod
    def none(cls, layout, named: bool, ndims=()) -> "Found":
        """No violation; `named`: the writing steps are known (`_marks`). (Carrying
        one scalar more through the reverse loop when they are not cost a small
        step 1.18 times the unchecked gradient, where the check costs 0.99.)"""
        # how many integers the index of a checked read or write may hold
        rank = max([1, *(sum(p is None for p in s.pattern) for s in layout.sites)])
        rank = max([rank, *ndims])  # (of a lent buffer's location)
        zero = jnp.array(0, jnp.int32)
        return cls(zero, zero, jnp.zeros(rank, jnp.int32), zero if named else None)

    def record(self, broken, code: int, step, ints, writer) -> "Found":
        """This, or the violation `code` at `step` and the index of integers
        `ints`, whose location `writer` wrote later, where `broken`: the steps are
        visited last to first, so what is kept is the first in the loop's order."""
        here = jnp.zeros_like(self.ints)
        if ints:
            here = here.at[: len(ints)].set(jnp.stack(ints).astype(jnp.int32))
        return Found(
            jnp.where(broken, code, self.site),
            jnp.where(broken, step, self.step),
            jnp.where(broken, here, self.ints),
            None if self.writer is None else jnp.where(broken, writer, self.writer),
        )


def _after(old, live, step, found: Found):
    """A window of the marks after a write at `step` where `live`, written so that
    it depends on every check made before it (`found`, each of whose fields reads
    the marks). XLA then orders those reads before the write and updates the marks
    in place; without that dependence it copies them whole every step (`found`
    changes nothing here, but XLA cannot tell)."""
    if old.dtype == bool:  # `old | live`
        checked = jnp.logical_and(live, found.site != 0)
        return jnp.logical_or(old, jnp.logical_or(live, checked))
    # `step` where `live`: no field of `found` is that low
    never = jnp.minimum(found.site, found.writer) < jnp.iinfo(jnp.int16).min
    return jnp.where(live, jnp.where(never, UNWRITTEN, step).astype(old.dtype), old)


UNWRITTEN = -1  # the writer of a location no later step wrote, or of one not known


def _marks(shape, rules: bool, max_steps: int | None):
    """The marks of a buffer of `shape`: by default whether a later step wrote
    each element (a bool); checking every rule, which later step did (the first
    in the loop's order; an int16 where `max_steps` allows, else an int32), for
    the message."""
    if not rules:
        return jnp.zeros(shape, bool)
    small = max_steps is not None and max_steps < jnp.iinfo(jnp.int16).max
    return jnp.full(shape, UNWRITTEN, jnp.int16 if small else jnp.int32)


class ReverseCheck(eqx.Module):
    """What the reverse sweep's check carries: per sparsely differentiated buffer
    (else `None`), the marks (`_marks`) of the locations written by the steps
    already reversed; per buffer lent to an inner loop, its stamps from the
    forward sweep (the last step that changed each element), or `None`."""

    later: tuple
    found: Found
    stamps: tuple
    # every rule (`bl.buffer_checks()`), or only the reads (the default)
    rules: bool = eqx.field(static=True, default=False)


def reverse_initial(
    step,
    bufs,
    name: str | None,
    rules: bool = False,
    max_steps: int | None = None,
    stamps=None,
):
    """The reverse check's initial state, or `None` where it has nothing to check:
    the loop (named `name`) is not checked, no buffer is differentiated, or only
    the reads are checked and the body reads no buffer (nor lends one).
    `rules`: check every rule, not only the reads. `max_steps`: the loop's bound
    (`None`: unbounded), which sizes the integers that name the steps. `stamps`:
    the forward sweep's (`CheckpointStore.stamps`), or `None`."""
    stamps = tuple(
        None if stamps is None or leaf not in step.dense else stamps[leaf]
        for leaf in range(len(bufs))
    )
    stamped = [s is not None for s in stamps]
    if name is None or not (any(step.sparse) or any(stamped)):
        return None
    if not (rules or step.layout.read_leaves or any(stamped)):
        return None
    later = tuple(
        _marks(b.shape, rules, max_steps) if sparse else None
        for b, sparse in zip(bufs, step.sparse)
    )
    ndims = [b.ndim for b, s in zip(bufs, stamped) if s]
    return ReverseCheck(later, Found.none(step.layout, rules, ndims), stamps, rules)


def reverse_check(check: ReverseCheck, step, updates, i, ct_bufs) -> ReverseCheck:
    """`check` after reversing step `i`, whose `BufferUpdates` are `updates`, from
    the buffers' cotangents `ct_bufs`. Against the locations the loop wrote later
    (at a later step, or later in this one), which the backward pass sees, a write
    there (the location was written twice) and a read whose cotangent is nonzero
    there (the forward read the value from before that write) are violations: see
    `docs/guides/buffers.md`, "Checking the rule". In a buffer lent to an inner
    loop, whose reads and writes this loop does not see, a location that a later
    step changed (its stamp) and whose cotangent this step changed is one: the
    inner loop read it (a write there would find its cotangent zeroed already).
    """
    layout = step.layout
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
    named = check.rules  # the marks name the steps

    def written_later(s, index, since):
        """Per element of `index` of buffer `s.leaf`, its mark, counting the
        writes of this step after `since` (a version of the buffer in it) as
        written at step `i`."""
        mark = get(later[s.leaf], index)
        mark = mark.astype(jnp.int32) if named else mark
        for _, w, w_index, w_live in writes:
            if w.leaf == s.leaf and w.version >= since:
                steps = jnp.full(
                    w_index.result_shape(), i if named else True, mark.dtype
                )
                _, covered = overlay(mark, index, w_index, steps, later[s.leaf].shape)
                written = jnp.logical_and(covered, w_live)
                mark = jnp.where(written, i, mark) if named else mark | written
        return mark

    def first(mark, where):
        """The step that wrote first where `where` (`None`: not known)."""
        if not named:
            return None
        return jnp.min(jnp.where(where, mark, jnp.iinfo(jnp.int32).max))

    def hit(mark):
        return mark != UNWRITTEN if named else mark

    for k, (index, live, d) in zip(step.float_reads, updates.added):
        n, s = sites["read", k]
        mark = written_later(s, index, s.version)
        matters = jnp.logical_and(hit(mark), d != 0)
        broken = jnp.logical_and(live, jnp.any(matters))
        found = found.record(broken, n + 1, i, index.ints, first(mark, matters))
    for n, s, index, live in writes if check.rules else ():
        mark = written_later(s, index, s.version + 1)
        broken = jnp.logical_and(live, jnp.any(hit(mark)))
        found = found.record(broken, n + 1, i, index.ints, first(mark, hit(mark)))
    for leaf, d_in in zip(step.dense, updates.replaced):
        stamp = check.stamps[leaf]
        if stamp is not None:
            read = jnp.logical_and(differs(d_in, ct_bufs[leaf]), stamp > i)
            where = jnp.unravel_index(jnp.argmax(read), read.shape)
            writer = stamp[where] if named else None
            found = found.record(jnp.any(read), -1 - leaf, i, list(where), writer)
    for _, w, index, live in writes:
        old = get(later[w.leaf], index)
        later[w.leaf] = put(later[w.leaf], index, _after(old, live, i, found))
    return ReverseCheck(tuple(later), found, check.stamps, check.rules)


def differs(a, b):
    """Where `a` differs from `b` (NaN equal to NaN)."""
    same = jnp.logical_or(a == b, jnp.isnan(a) & jnp.isnan(b))
    return jnp.logical_not(same)


@dataclasses.dataclass(frozen=True)
class BufferViolation:
    """The checks' error message, made when it is raised from the site, step and
    index of the violation (`format`)."""

    loop: str  # the loop's name, `bl.while_loop`
    sites: tuple  # the body's `Layout.sites`
    buffers: tuple[str, ...]  # per buffer, where it is in the carry, and its type
    shapes: tuple  # per buffer, its shape
    rules: bool = False  # every rule checked (`bl.buffer_checks()`), or the reads

    def format(self, site, step, ints, writer) -> str:
        if int(site) < 0:
            return self._format_lent(-1 - int(site), step, ints, writer)
        s = self.sites[int(site) - 1]
        index = describe_index(s.pattern, [int(i) for i in ints], self.shapes[s.leaf])
        at = f"the buffer {self.buffers[s.leaf]} at {index} at step {int(step)}"
        head = f"`{self.loop}`: `body_fun` at {s.where}"
        step, writer = int(step), int(writer)
        if writer == UNWRITTEN:  # not named by default: see `_marks`
            when = (
                "at a later step, or later in that one (`bl.buffer_checks()` names it)"
            )
        else:
            when = f"at step {writer}" if writer > step else "later in that step"
        if s.kind == "write":
            return (
                f"{head} wrote {at} (counting from 0), and wrote that location again "
                f"{when}: a location already "
                "written. A rule broken: each location of a buffer may be written "
                "at most once in a loop. (The gradient stays right while no step "
                "reads the first value; `bl.buffer_checks()` holds the rule "
                "itself.)"
            )
        return (
            f"{head} read {at} (counting from 0), and the value read matters, but "
            f"the loop wrote that location only later: {when}. The backward pass "
            "reads the buffer as the loop left it, so "
            "the gradient would be wrong. Read only locations already written, or "
            "never written in the loop; values from before the loop that the loop "
            f"overwrites belong in an ordinary carry leaf. ({self._checked()})"
        )

    def _format_lent(self, leaf, step, ints, writer) -> str:
        """A loop in `body_fun` read a location of a lent buffer that a later step
        changed (see `reverse_check`)."""
        index = list(map(int, ints))[: len(self.shapes[leaf])]
        where = f"at step {int(writer)}"  # (a stamp later than `step`)
        if int(writer) == UNWRITTEN:
            where = "at a later step (`bl.buffer_checks()` names it)"
        return (
            f"`{self.loop}`: a loop inside `body_fun`, at step {int(step)} (counting "
            f"from 0), read the buffer {self.buffers[leaf]} at {index}, and the "
            "value read matters, but the loop wrote that location only later: "
            f"{where}. The backward pass reads the buffer as the loop left it, so "
            "the gradient would be wrong. Read only locations already written, or "
            f"never written in the loop. ({self._checked()})"
        )

    def _checked(self) -> str:
        if self.rules:
            return "Checked inside `bl.buffer_checks()`."
        return (
            "Checked by default in every gradient; `bl.buffer_checks(False)` turns "
            "the check off."
        )

    def summary(self) -> str:
        """The message without its run-time details, for where they cannot reach
        (a TPU's host callback)."""
        return (
            f"`{self.loop}`: a buffer was written twice at one location, or read "
            "where it was not written. Run the loop on the CPU to see where."
        )


def callbacks_are_costly() -> bool:
    """Whether the backend the loop is traced for pays for a host callback even
    where it does not fire: off a CPU (on a TPU v5e, 1.07 to 1.50 times a buffer
    gradient, against 0.97 to 1.09 for NaN in its outputs; `docs/design-notes.md`,
    "The buffer checks' error path")."""
    return jax.default_backend() != "cpu"


def _poisoned(tree, broken):
    """`tree` with its floating arrays NaN where `broken`: the default check's
    error path where callbacks are costly."""

    def poison(leaf):
        if not eqx.is_inexact_array(leaf):
            return leaf
        return jnp.where(broken, jnp.array(jnp.nan, leaf.dtype), leaf)

    return jtu.tree_map(poison, tree)


def raise_violations(name: str, layout, bufs, state, tree):
    """`tree`, with the checks' error attached: raised if a step broke a rule.
    `state`: a `ReverseCheck`, or `None` (nothing checked). The default check (of
    the reads) makes the gradient NaN instead where callbacks are costly
    (`callbacks_are_costly`); inside `bl.buffer_checks()` it always raises."""
    if state is None:
        return tree
    found = state.found
    if not state.rules and callbacks_are_costly():
        return _poisoned(tree, found.site != 0)
    shapes = tuple(b.shape for b in bufs)
    names = buffer_names(layout, bufs)
    message = BufferViolation(name, layout.sites, names, shapes, state.rules)
    writer = UNWRITTEN if found.writer is None else found.writer
    details = (found.site, found.step, found.ints, writer)
    return raise_if(tree, found.site != 0, message, "bl.buffer_checks", details)
