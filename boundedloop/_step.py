"""One step of the loop, forward and as a vector-Jacobian product, on split arrays:
`x` (the ordinary carry leaves) and `bufs` (the buffers)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._indexing import get, put
from ._perturbation import Perturbed
from ._trace import Layout, StepIn


def advance(body, layout: Layout, x, bufs, active, written=None):
    """`(x', bufs', written')`: one step; buffer writes happen only where `active`."""
    active = jnp.asarray(active, bool)
    out = body(StepIn(x, bufs, layout.read_stand_ins(), active, written))
    return out.x, out.bufs, out.written


class ReversibleStep:
    """One step of a loop as the reverse sweep uses it.

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
        # reads of perturbed buffers, whose values have cotangents
        self.float_reads = [
            k for k, leaf in enumerate(layout.read_leaves) if perturbed.bufs[leaf]
        ]

    def forward(self, x, bufs, active):
        """`x'`, one step forward (for recomputation)."""
        return advance(self.body, self.layout, x, bufs, active)[0]

    def zero_ct_body(self):
        """Zeros shaped like the cotangent of the body's differentiated leaves."""
        return jtu.tree_map(jnp.zeros_like, self.diff_body)

    def vjp(self, x, bufs, ct_bufs, active):
        """The step at `x`, linearized: `pullback(ct_x') -> (ct_body, ct_x,
        updates)`, with `ct_x` for the floating leaves of `x`. `updates` says how
        the buffers' cotangents change, for `apply_updates`: cleared where the step
        wrote (those values did not exist before) and added to where it read. They
        are returned rather than applied so that the caller can apply them outside
        any `lax.cond`, keeping the buffer-sized cotangents in place."""
        diff_x, static_x = eqx.partition(x, self.perturbed.x)
        stand_ins = self.layout.read_stand_ins()

        def f(diff_body, diff_x, float_stand_ins):
            all_stand_ins = list(stand_ins)
            for k, d in zip(self.float_reads, float_stand_ins):
                all_stand_ins[k] = d
            body = eqx.combine(diff_body, self.static_body)
            step = StepIn(
                eqx.combine(diff_x, static_x),
                bufs,
                tuple(all_stand_ins),
                jnp.array(True),
                None,
            )
            out = body(step)
            values = tuple(
                v if self.perturbed.bufs[leaf] else None
                for leaf, (v, _, _) in zip(self.layout.write_leaves, out.writes)
            )
            aux = tuple((i, p) for _, i, p in out.writes), out.reads
            return (eqx.filter(out.x, self.perturbed.x), values), aux

        float_stand_ins = tuple(stand_ins[k] for k in self.float_reads)
        _, vjp_fn, (writes, reads) = jax.vjp(
            f, self.diff_body, diff_x, float_stand_ins, has_aux=True
        )
        access = writes, reads
        return lambda ct: self._pullback(vjp_fn, access, ct, ct_bufs, active)

    def _pullback(self, vjp_fn, access, ct, ct_bufs, active):
        writes, reads = access
        ct_writes, cleared = [], []
        for leaf, (index, pred) in zip(self.layout.write_leaves, writes):
            if ct_bufs[leaf] is None:
                ct_writes.append(None)
                continue
            here = get(ct_bufs[leaf], index)
            ct_writes.append(jnp.where(pred, here, jnp.zeros_like(here)))
            cleared.append((index, jnp.logical_and(pred, active)))
        d_body, d_x, d_reads = vjp_fn((ct, tuple(ct_writes)))
        added = []
        # a value this step wrote before reading it back has its cotangent taken
        # by the write: the stand-in's cotangent is zero there
        for k, d in zip(self.float_reads, d_reads):
            if ct_bufs[self.layout.read_leaves[k]] is not None:
                added.append((reads[k], active, d))
        return d_body, d_x, (tuple(cleared), tuple(added))

    def apply_updates(self, ct_bufs, updates):
        """`ct_bufs` after a step's `updates` (see `vjp`)."""
        cleared, added = updates
        ct_bufs = list(ct_bufs)
        write_leaves = [w for w in self.layout.write_leaves if ct_bufs[w] is not None]
        read_leaves = [
            self.layout.read_leaves[k]
            for k in self.float_reads
            if ct_bufs[self.layout.read_leaves[k]] is not None
        ]
        for leaf, (index, live) in zip(write_leaves, cleared):
            ct_bufs[leaf] = put(ct_bufs[leaf], index, 0, live)
        for leaf, (index, live, d) in zip(read_leaves, added):
            here = get(ct_bufs[leaf], index)
            ct_bufs[leaf] = put(ct_bufs[leaf], index, here + d.astype(here.dtype), live)
        return tuple(ct_bufs)
