"""One step of the loop, forward and as a vector-Jacobian product, on split arrays:
`x` (the ordinary carry leaves) and `bufs` (the buffers)."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._runtime._batching import select_if_batched
from .._runtime._jax_private import convert_constvars_jaxpr, dce_jaxpr
from .._tracing._closure import ClosureConverted
from .._tracing._indexing import get, put
from .._tracing._loop import Layout, Perturbed, StepIn


def advance(body, layout: Layout, x, bufs, active):
    """`(x', bufs')`: one step; buffer writes happen only where `active`."""
    active = jnp.asarray(active, bool)
    out = body(StepIn(x, bufs, layout.read_stand_ins(), active))
    return out.x, out.bufs


def unread_leaves(body: ClosureConverted, n_x: int) -> tuple[bool, ...]:
    """Per ordinary carry leaf, whether the body ignores its value (a leaf it only
    overwrites, as a solver's scratch values): its cotangent is zero after every
    reversed step, so the reverse sweep need not carry it."""
    jaxpr = convert_constvars_jaxpr(body.jaxpr)
    _, used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    n_consts = len(body.jaxpr.constvars)
    return tuple(not u for u in used[n_consts : n_consts + n_x])


def invariant_leaves(body: ClosureConverted, n_x: int) -> tuple[bool, ...]:
    """Per ordinary carry leaf, whether the body returns it as it took it (a bound
    or a parameter carried along): every state of the loop holds its initial
    value, so no checkpoint need store it. (The body's inputs and outputs begin
    with the ordinary leaves.)"""
    ins, outs = body.jaxpr.invars[:n_x], body.jaxpr.outvars[:n_x]
    return tuple(o is i for o, i in zip(outs, ins))


class BufferUpdates(NamedTuple):
    """How one reversed step changes the buffers' cotangents (see `ReversibleStep`)."""

    cleared: tuple  # `(index, live)` per write: zero the cotangent there
    added: tuple  # `(index, live, d)` per read: add `d` there
    replaced: tuple  # the new cotangent of each buffer handed to an inner loop


class ReversibleStep:
    """One step of a loop as the reverse sweep uses it.

    A buffer's cotangent is updated sparsely, only where the step reads or writes
    it, except for a buffer the step hands to an inner loop: that one is
    differentiated as a whole array through the step (the inner loop's own
    reverse sweep updates it in place).

    **Arguments:**

    - `body`: the traced body (`StepIn -> StepOut`, closure-converted).
    - `layout`: the carry's `Layout`.
    - `wanted`: bools shaped like `body`: which of its leaves get cotangents.
        Leaving the rest out matters: a weight matrix nobody asked about would
        otherwise get a full-size cotangent every step.
    - `perturbed`: the carry leaves that get cotangents (see `_perturbation`).
    """

    def __init__(self, body, layout: Layout, wanted, perturbed: Perturbed):
        self.body = body
        self.layout = layout
        self.perturbed = perturbed
        self.diff_body, self.static_body = eqx.partition(body, wanted)
        # what it differentiates: a tape of its residuals serves only this `key`
        self.key = (tuple(jtu.tree_leaves(wanted)), perturbed)
        self.dense = [
            leaf for leaf, p in enumerate(perturbed.bufs) if p and leaf in layout.shared
        ]
        self.sparse = [
            p and leaf not in layout.shared for leaf, p in enumerate(perturbed.bufs)
        ]
        # perturbed leaves whose cotangent every step zeroes (see `unread_leaves`)
        unread = unread_leaves(body, len(perturbed.x))
        self.unread = tuple(p and u for p, u in zip(perturbed.x, unread))
        # reads of sparsely updated buffers, whose values have cotangents
        self.float_reads = [
            k for k, leaf in enumerate(layout.read_leaves) if self.sparse[leaf]
        ]

    def forward(self, x, bufs, active):
        """`x'`, one step forward (for recomputation)."""
        return advance(self.body, self.layout, x, bufs, active)[0]

    def zero_ct_body(self):
        """Zeros shaped like the cotangent of the body's differentiated leaves."""
        return jtu.tree_map(jnp.zeros_like, self.diff_body)

    def vjp(self, x, bufs, ct_bufs, active):
        """The step at `x`, linearized: `pullback(ct_x') -> (ct_body, ct_x,
        updates)`, with `ct_x` for the perturbed leaves of `x`. `updates`, a
        `BufferUpdates`, says how the buffers' cotangents change, for
        `apply_updates` (below): cleared where the step wrote (those values did
        not exist before), added to where it read, replaced for buffers handed to
        an inner loop. They are returned rather than applied so that the caller
        can apply them outside any `lax.cond`, keeping the buffer-sized cotangents
        in place."""
        _, _, residuals = self.linearize(x, bufs)
        return self.pullback(residuals, ct_bufs, active)

    def forward_vjp(self, x, bufs, ct_bufs, active):
        """`(x', pullback)`: the step at `x`, forward and linearized, from one
        evaluation (`vjp`'s pullback; `x'` is the step's result where `active`,
        else `x`)."""
        x_next, _, residuals = self.linearize(x, bufs)
        x_next = select_if_batched(active, x_next, x)
        return x_next, self.pullback(residuals, ct_bufs, active)

    def pullback(self, residuals, ct_bufs, active):
        """`vjp`'s pullback from the step's `residuals` (`linearize`'s): what it
        reads, so that a taped step (`_tape`) is reversed without evaluating it."""
        return lambda ct: self._pullback(*residuals, ct, ct_bufs, active)

    def linearize(self, x, bufs, active=True, policy=None):
        """`(x', bufs', residuals)`: the step at `x` (its result `x'`, the buffers
        after its writes, made only where `active`), and what its pullback reads:
        `residuals = (vjp_fn, access)`, its `jax.vjp` in the perturbed leaves (a
        tree whose leaves are its residual arrays) and where it wrote and read.
        `policy`: a `jax.checkpoint` policy naming the values the residuals keep;
        the pullback computes the others again from them (`None`: all kept)."""
        diff_x, static_x = eqx.partition(x, self.perturbed.x)
        stand_ins = self.layout.read_stand_ins()

        def f(diff_body, diff_x, float_stand_ins, dense_bufs):
            all_stand_ins = list(stand_ins)
            for k, d in zip(self.float_reads, float_stand_ins):
                all_stand_ins[k] = d
            all_bufs = list(bufs)
            for leaf, b in zip(self.dense, dense_bufs):
                all_bufs[leaf] = b
            body = eqx.combine(diff_body, self.static_body)
            step = StepIn(
                eqx.combine(diff_x, static_x),
                tuple(all_bufs),
                tuple(all_stand_ins),
                jnp.asarray(active, bool),
            )
            out = body(step)
            values = tuple(
                v if self.sparse[leaf] else None
                for leaf, (v, _, _) in zip(self.layout.write_leaves, out.writes)
            )
            dense_out = tuple(out.bufs[leaf] for leaf in self.dense)
            access = tuple((i, p) for _, i, p in out.writes), out.reads
            unperturbed = eqx.filter(out.x, self.perturbed.x, inverse=True)
            diff_out = eqx.filter(out.x, self.perturbed.x)
            return (diff_out, values, dense_out), (access, unperturbed, out.bufs)

        if policy is not None:
            f = jax.checkpoint(f, policy=policy, prevent_cse=False)
        float_stand_ins = tuple(stand_ins[k] for k in self.float_reads)
        dense_bufs = tuple(bufs[leaf] for leaf in self.dense)
        (diff_out, _, _), vjp_fn, (access, unperturbed, new_bufs) = jax.vjp(
            f, self.diff_body, diff_x, float_stand_ins, dense_bufs, has_aux=True
        )
        return eqx.combine(diff_out, unperturbed), new_bufs, (vjp_fn, access)

    def _pullback(self, vjp_fn, access, ct, ct_bufs, active):
        writes, reads = access
        ct_writes, cleared = [], []
        for leaf, (index, pred) in zip(self.layout.write_leaves, writes):
            if not self.sparse[leaf]:
                ct_writes.append(None)
                continue
            here = get(ct_bufs[leaf], index)
            ct_writes.append(jnp.where(pred, here, jnp.zeros_like(here)))
            cleared.append((index, jnp.logical_and(pred, active)))
        ct_dense = tuple(ct_bufs[leaf] for leaf in self.dense)
        d_body, d_x, d_reads, d_dense = vjp_fn((ct, tuple(ct_writes), ct_dense))
        # a value this step wrote before reading it back has its cotangent taken
        # by the write: the stand-in's cotangent is zero there
        added = tuple((reads[k], active, d) for k, d in zip(self.float_reads, d_reads))
        # elements whose loop had stopped (under vmap) keep their cotangent
        replaced = select_if_batched(active, d_dense, ct_dense)
        return d_body, d_x, BufferUpdates(tuple(cleared), added, replaced)


def _read_leaves(step: ReversibleStep) -> list[int]:
    """The buffer leaf of each read in `BufferUpdates.added`."""
    return [step.layout.read_leaves[k] for k in step.float_reads]


def wholly_read(step: ReversibleStep, updates: BufferUpdates, ct_bufs) -> set[int]:
    """The buffers some read in `updates` covers whole (its cotangent is as
    large as the buffer's), as a stage loop reads all its stages; `updates`
    may be abstract."""
    return {
        leaf
        for leaf, (_, _, d) in zip(_read_leaves(step), updates.added)
        if d.size >= ct_bufs[leaf].size
    }


def no_updates(step: ReversibleStep, updates: BufferUpdates, ct_bufs) -> BufferUpdates:
    """Updates shaped like `updates` (abstract) that change nothing."""
    zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), updates)
    return zeros._replace(replaced=tuple(ct_bufs[leaf] for leaf in step.dense))


def apply_updates(step: ReversibleStep, ct_bufs, updates: BufferUpdates):
    """`ct_bufs` after a step's `updates` (see `vjp`)."""
    ct_bufs = list(ct_bufs)
    write_leaves = [w for w in step.layout.write_leaves if step.sparse[w]]
    # a buffer the step reads whole gets a whole new cotangent anyway: its
    # written windows are zeroed by a mask in the same pass, rather than in
    # place (which needs the old cotangent copied for the reads of it)
    whole = wholly_read(step, updates, ct_bufs)
    for leaf, (index, live) in zip(write_leaves, updates.cleared):
        if leaf in whole:
            mask = put(jnp.zeros(ct_bufs[leaf].shape, bool), index, live)
            ct_bufs[leaf] = jnp.where(mask, 0, ct_bufs[leaf])
        else:
            ct_bufs[leaf] = put(ct_bufs[leaf], index, 0, live)
    for leaf, (index, live, d) in zip(_read_leaves(step), updates.added):
        here = get(ct_bufs[leaf], index)
        ct_bufs[leaf] = put(ct_bufs[leaf], index, here + d.astype(here.dtype), live)
    for leaf, new in zip(step.dense, updates.replaced):
        ct_bufs[leaf] = new
    return tuple(ct_bufs)
