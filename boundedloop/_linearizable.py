"""Any function behind the loop's dispatch: one pass when evaluated, two when
linearized, so that an outer reverse pass can transpose it.

`linearizable(fn, two_pass, effects)` wraps the loop's own sweeps (the checkpointed
sweep, the reverse sweep) when a gradient is itself differentiated (see
`_second_order`). Its custom JVP binds `loop_jvp_p` (`_loop_jvp`), whose rules pick
the pass, batch it, and differentiate it again.
"""

from collections.abc import Callable

import jax
from jax.custom_derivatives import SymbolicZero

from ._jax_private import closed_jaxpr, jvp_jaxpr
from ._leaves import jvp_at
from ._loop_jvp import is_inexact, loop_jvp, Passes, Spec
from ._loop_tangent import loop_tangent, THIRD_ORDER_REVERSE


def linearizable(
    fn: Callable, two_pass: Callable | None, effects: frozenset
) -> Callable:
    """`fn` (a flat list of arrays to a flat list of arrays) behind a custom JVP that
    JAX evaluates in one pass (`jax.jvp` of `fn`) and linearizes in two:
    `two_pass(primals, where, tangents, with_tangent)`, `where` the positions of the
    perturbed primals, returns the outputs and the tangents of those marked in
    `with_tangent` (the inexact ones that depend on a perturbed primal), the tangents
    typically a `loop_tangent` whose transpose is written by hand. This is how the
    loop's own sweeps stay differentiable when an outer reverse pass differentiates
    a gradient (see `_autodiff`). With `two_pass=None` the linearized tangent
    cannot be transposed: that raises a clear error (a third reverse pass).

    It is one function (with its JVP rule inside) because the rule closes over
    `fn` and `two_pass`: split, each piece would need them passed along."""

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
        # the outputs that depend on a perturbed primal get tangents, the others a
        # symbolic zero (a zero array would reach `nondifferentiable` leaves)
        jaxpr = closed_jaxpr(
            lambda *a: fn(list(a)),
            [jax.typeof(p) for p in primals],
            "boundedloop_linearizable",
        )
        out_avals = list(jaxpr.out_avals)
        chosen = set(where)
        nonzeros = [k in chosen for k in range(len(primals))]
        _, out_nonzero = jvp_jaxpr(jaxpr, nonzeros, instantiate=False)
        inexact = [is_inexact(a) and nz for a, nz in zip(out_avals, out_nonzero)]
        t_avals = tuple(a.to_tangent_aval() for a, f in zip(out_avals, inexact) if f)
        if not where:
            outs = wrapped(*primals)
            return outs, [SymbolicZero(a.to_tangent_aval()) for a in out_avals]

        def one_pass(ps, ts):
            out, t_out = jvp_at(fn, ps, where, ts)
            return list(out) + [t for t, f in zip(t_out, inexact) if f]

        if two_pass is None:

            def linearized(ps, ts):
                def jvp_fn(res, lin):
                    return one_pass(res, lin)[len(out_avals) :]

                def vjp_fn(res, cts):
                    raise RuntimeError(THIRD_ORDER_REVERSE)

                t_out = loop_tangent(
                    list(ps),
                    list(ts),
                    jvp_fn=jvp_fn,
                    vjp_fn=vjp_fn,
                    out_avals=t_avals,
                    loop_effects=effects,
                )
                return list(fn(list(ps))) + list(t_out)

        else:

            def linearized(ps, ts):
                return two_pass(ps, where, ts, inexact)

        spec = Spec(
            Passes(one_pass, linearized, primal=fn),
            n_primals=len(primals),
            n_outputs=len(out_avals),
            out_avals=tuple(out_avals) + t_avals,
            effects=effects,
            tangent_inputs=tuple(where),
            tangent_outputs=tuple(k for k, f in enumerate(inexact) if f),
        )
        results = loop_jvp(primals, [tangents[k] for k in where], spec)
        outs, t_out = results[: len(out_avals)], iter(results[len(out_avals) :])
        return outs, [
            next(t_out) if f else SymbolicZero(a.to_tangent_aval())
            for a, f in zip(out_avals, inexact)
        ]

    wrapped.defjvp(jvp_rule, symbolic_zeros=True)
    return wrapped
