"""Which carry leaves a differentiated loop perturbs: a fixed point over the body,
read off its JVP with symbolic zeros (see `docs/architecture.md`, "Tracing").
"""

import equinox as eqx
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu

from .._runtime._jax_private import convert_constvars_jaxpr, jvp_jaxpr
from ._closure import ClosureConverted
from ._dtypes import is_inexact
from ._loop import Layout, Perturbed


def perturbed_leaves(
    body: ClosureConverted, consts: list[bool], initial: Perturbed, layout: Layout
) -> Perturbed:
    """The fixed point: perturbed leaves, from those perturbed initially.

    **Arguments:**

    - `body`: the traced body (`StepIn -> StepOut`).
    - `consts`: per array the body closes over, whether it is perturbed.
    - `initial`: the leaves whose initial values are perturbed.
    - `layout`: the carry's `Layout`.
    """
    jaxpr = convert_constvars_jaxpr(body.jaxpr)
    closed = jax.extend.core.ClosedJaxpr(jaxpr, ())
    in_avals = [v.aval for v in jaxpr.invars]
    n_consts, n_x, n_bufs = len(consts), len(initial.x), len(initial.bufs)
    x_avals = in_avals[n_consts : n_consts + n_x]
    buf_avals = in_avals[n_consts + n_x : n_consts + n_x + n_bufs]
    x = [p and is_inexact(a) for p, a in zip(initial.x, x_avals)]
    bufs = [p and is_inexact(a) for p, a in zip(initial.bufs, buf_avals)]
    n_rest = len(in_avals) - n_consts - n_x - n_bufs - len(layout.read_leaves)
    while True:
        reads = [bufs[leaf] for leaf in layout.read_leaves]
        nonzeros = list(consts) + x + bufs + reads + [False] * n_rest
        _, out = jvp_jaxpr(closed, nonzeros, instantiate=False)
        new_x = [a or (b and is_inexact(v)) for a, b, v in zip(x, out, x_avals)]
        out_bufs = out[n_x : n_x + n_bufs]
        new_bufs = [
            a or (b and is_inexact(v)) for a, b, v in zip(bufs, out_bufs, buf_avals)
        ]
        if new_x == x and new_bufs == bufs:
            return Perturbed(tuple(x), tuple(bufs))
        x, bufs = new_x, new_bufs


def has_tangent(tangents) -> list[bool]:
    """Per leaf of a tangent tree (`None` for a symbolic zero), whether it has one."""
    return [
        t is not None for t in jtu.tree_leaves(tangents, is_leaf=lambda t: t is None)
    ]


def seeded_tangents(tree, wanted, perturbed: Perturbed, t_in):
    """`(varying, fixed, tangents)` for `jax.jvp` of a sweep over `tree`, a
    `(body, init, bufs)`: the `wanted` leaves with their tangents `t_in`, and every
    other `perturbed` carry leaf with a zero tangent. Seeded so, `lax.while_loop`'s
    JVP finds its fixed point of perturbed leaves (the one `perturbed_leaves`
    found) at its first trace of the step, rather than tracing the step's JVP once
    per round in which the perturbation reaches another leaf."""
    w_body, w_init, w_bufs = wanted
    seeded = (
        w_body,
        tuple(bool(w or p) for w, p in zip(w_init, perturbed.x)),
        tuple(bool(w or p) for w, p in zip(w_bufs, perturbed.bufs)),
    )
    varying, fixed = eqx.partition(tree, seeded)
    given = iter(t_in)
    t_flat = [
        next(given) if w else jnp.zeros_like(v)
        for w, s, v in zip(
            jtu.tree_leaves(wanted), jtu.tree_leaves(seeded), jtu.tree_leaves(tree)
        )
        if s
    ]
    return varying, fixed, jtu.tree_unflatten(jtu.tree_structure(varying), t_flat)
