"""Any function behind the loop's dispatch: one pass when evaluated, two when
linearized, so that an outer reverse pass can transpose it.

`linearizable(fn, transpose, effects)` wraps the loop's own sweeps (the checkpointed
sweep, the reverse sweep) when a gradient is itself differentiated (see
`_second_order`). Its custom JVP binds `loop_jvp_p` (`_jvp_primitive`), whose rules pick
the pass, batch it, and differentiate it again.
"""

from collections.abc import Callable

import jax
from jax.custom_derivatives import SymbolicZero

from .._runtime._jax_private import closed_jaxpr, jvp_jaxpr
from .._runtime._leaves import fill, jvp_at
from .._tracing._dtypes import is_inexact
from ._jvp_primitive import custom_jvp_spec, loop_jvp, Passes, Primal
from ._tangent_primitive import outputs_and_tangent


def linearizable(
    fn: Callable,
    transpose: Callable | None,
    effects: frozenset,
    *,
    keep_outputs: bool = False,
) -> Callable:
    """`fn` (a flat list of arrays to a flat list of arrays) behind a custom JVP that
    JAX evaluates in one pass (`jax.jvp` of `fn`) and linearizes in two: `fn` now,
    and its tangent as a `loop_tangent` transposed by hand
    (`_tangent_primitive.outputs_and_tangent`). `transpose(where, with_tangent)` makes
    that transpose, `(res, cts) -> cotangents of primals[where]`, given the
    positions `where` of the perturbed primals and which outputs get tangents
    (`with_tangent`: the inexact ones that depend on a perturbed primal); `res` are
    the primals, then `fn`'s outputs with `keep_outputs`. This is how the loop's
    own sweeps stay differentiable when an outer reverse pass differentiates a
    gradient (see `_autodiff`). With `transpose=None` the linearized tangent cannot
    be transposed: that raises a clear error (a third reverse pass)."""

    @jax.custom_jvp
    def wrapped(*leaves):
        return fn(list(leaves))

    def jvp_rule(primals, tangents):
        primals = list(primals)
        where = [
            k
            for k, (p, t) in enumerate(zip(primals, tangents))
            if type(t) is not SymbolicZero and is_inexact(jax.typeof(p))
        ]
        out_avals, with_tangent = _outputs_with_tangents(fn, primals, where)
        if not where:
            outs = wrapped(*primals)
            return outs, [SymbolicZero(a.to_tangent_aval()) for a in out_avals]

        def one_pass(ps, ts):
            out, t_out = jvp_at(fn, ps, where, ts)
            return list(out) + [t for t, f in zip(t_out, with_tangent) if f]

        by_hand = None if transpose is None else transpose(where, with_tangent)

        def two_pass(ps, ts):
            return outputs_and_tangent(
                fn,
                ps,
                where,
                ts,
                with_tangent=with_tangent,
                transpose=by_hand,
                effects=effects,
                keep_outputs=keep_outputs,
            )

        spec = custom_jvp_spec(
            Passes(one_pass, two_pass),
            Primal(fn, tuple(where), tuple(k for k, f in enumerate(with_tangent) if f)),
            n_primals=len(primals),
            out_avals=out_avals,
            t_avals=tuple(
                a.to_tangent_aval() for a, f in zip(out_avals, with_tangent) if f
            ),
            effects=effects,
        )
        results = loop_jvp(primals, [tangents[k] for k in where], spec)
        outs, t_out = results[: len(out_avals)], results[len(out_avals) :]
        return outs, fill(
            with_tangent, t_out, lambda k: SymbolicZero(out_avals[k].to_tangent_aval())
        )

    wrapped.defjvp(jvp_rule, symbolic_zeros=True)
    return wrapped


def _outputs_with_tangents(fn, primals, where) -> tuple[list, list[bool]]:
    """`fn`'s output types, and which outputs get tangents: the inexact ones that
    depend on a perturbed primal (the others get a symbolic zero; a zero array
    would reach `nondifferentiable` leaves). Read off `fn`'s jaxpr with symbolic
    zeros, which costs one trace of `fn`."""
    jaxpr = closed_jaxpr(
        lambda *a: fn(list(a)),
        [jax.typeof(p) for p in primals],
        "boundedloop_linearizable",
    )
    chosen = set(where)
    nonzeros = [k in chosen for k in range(len(primals))]
    _, out_nonzero = jvp_jaxpr(jaxpr, nonzeros, instantiate=False)
    out_avals = list(jaxpr.out_avals)
    return out_avals, [is_inexact(a) and nz for a, nz in zip(out_avals, out_nonzero)]
