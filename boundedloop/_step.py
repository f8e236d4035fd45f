"""One step of the loop, forward and as a vector-Jacobian product, on split arrays:
`x` (the ordinary carry leaves) and `bufs` (the buffers)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._buffers import get, put


def is_float(x) -> bool:
    """Leaves that get cotangents. Inside a custom VJP a weakly typed Python float
    the body closed over may arrive as a bare `float`, so count those too."""
    return eqx.is_inexact_array(x) or isinstance(x, float | complex)


def float_part(tree):
    return eqx.filter(tree, is_float)


def dummies(layout):
    """Stand-ins for the buffer reads' tangents (see `_buffers._read`)."""
    return tuple(jnp.zeros(r.shape, r.dtype) for r in layout.read_shapes)


def advance(body, layout, x, bufs, active, written=None):
    """`(x', bufs', written')`: one step; buffer writes happen only where `active`."""
    active = jnp.asarray(active, bool)
    new_x, new_bufs, new_written, _, _ = body(x, bufs, dummies(layout), active, written)
    return new_x, new_bufs, new_written


def make_step_vjp(body, layout, wanted):
    """`step_vjp(x, bufs, ct_bufs, active) -> pullback`, one step linearized, with
    `pullback(ct_x') -> (ct_body, ct_x, updates)`.

    `ct_body` covers the leaves of `body` where `wanted` (bools shaped like `body`)
    is true, `ct_x` the floating leaves of `x`. Leaving the rest out matters: a weight
    matrix nobody asked about would otherwise get a full-size cotangent every step.
    `updates` says how the buffers' cotangents change, for `apply_updates`: cleared
    where the step wrote (those values did not exist before) and added to where it
    read. They are returned rather than applied so that the caller can apply them
    outside any `lax.cond`, keeping the buffer-sized cotangents in place.
    """
    diff_body, static_body = eqx.partition(body, wanted)
    float_reads = [
        k
        for k, r in enumerate(layout.read_shapes)
        if jnp.issubdtype(r.dtype, jnp.inexact)
    ]

    def step_vjp(x, bufs, ct_bufs, active):
        diff_x, static_x = eqx.partition(x, is_float)
        stand_ins = dummies(layout)

        def f(db, dx, float_dummies):
            all_dummies = list(stand_ins)
            for k, d in zip(float_reads, float_dummies):
                all_dummies[k] = d
            new_x, _, _, writes, reads = eqx.combine(db, static_body)(
                eqx.combine(dx, static_x),
                bufs,
                tuple(all_dummies),
                jnp.array(True),
                None,
            )
            values = tuple(v if is_float(v) else None for v, _, _ in writes)
            aux = tuple((i, p) for _, i, p in writes), reads
            return (eqx.filter(new_x, is_float), values), aux

        float_dummies = tuple(stand_ins[k] for k in float_reads)
        _, vjp_fn, (writes, reads) = jax.vjp(
            f, diff_body, diff_x, float_dummies, has_aux=True
        )
        return lambda ct: _pullback(vjp_fn, writes, reads, ct, ct_bufs, active)

    def _pullback(vjp_fn, writes, reads, ct, ct_bufs, active):
        ct_writes, cleared = [], []
        for leaf, (index, pred) in zip(layout.write_leaves, writes):
            if ct_bufs[leaf] is None:
                ct_writes.append(None)
                continue
            here = get(ct_bufs[leaf], index)
            ct_writes.append(jnp.where(pred, here, jnp.zeros_like(here)))
            cleared.append((index, jnp.logical_and(pred, active)))
        d_body, d_x, d_reads = vjp_fn((ct, tuple(ct_writes)))
        added = []
        for k, d in zip(float_reads, d_reads):
            index, fresh = reads[k]
            if ct_bufs[layout.read_leaves[k]] is not None:
                added.append((index, jnp.logical_and(fresh, active), d))
        return d_body, d_x, (tuple(cleared), tuple(added))

    def apply_updates(ct_bufs, updates):
        """`ct_bufs` after a step's `updates`."""
        cleared, added = updates
        ct_bufs = list(ct_bufs)
        write_leaves = [w for w in layout.write_leaves if ct_bufs[w] is not None]
        read_leaves = [
            layout.read_leaves[k]
            for k in float_reads
            if ct_bufs[layout.read_leaves[k]] is not None
        ]
        for leaf, (index, live) in zip(write_leaves, cleared):
            here = get(ct_bufs[leaf], index)
            ct_bufs[leaf] = put(ct_bufs[leaf], index, jnp.zeros_like(here), live)
        for leaf, (index, live, d) in zip(read_leaves, added):
            here = get(ct_bufs[leaf], index)
            ct_bufs[leaf] = put(ct_bufs[leaf], index, here + d.astype(here.dtype), live)
        return tuple(ct_bufs)

    return step_vjp, apply_updates, jtu.tree_map(jnp.zeros_like, diff_body)
