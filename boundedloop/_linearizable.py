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

from ._dtypes import is_inexact
from ._jax_private import closed_jaxpr, jvp_jaxpr
from ._leaves import fill, jvp_at
from ._loop_jvp import custom_jvp_spec, loop_jvp, Passes, Primal
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
    cannot be transposed: that raises a clear error (a third reverse pass)."""

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

        if two_pass is None:
            linearized = _untransposable(fn, one_pass, out_avals, with_tangent, effects)
        else:

            def linearized(ps, ts):
                return two_pass(ps, where, ts, with_tangent)

        spec = custom_jvp_spec(
            Passes(one_pass, linearized),
            Primal(fn, tuple(where), tuple(k for k, f in enumerate(with_tangent) if f)),
            n_primals=len(primals),
            out_avals=out_avals,
            t_avals=_tangent_avals(out_avals, with_tangent),
            effects=effects,
        )
        results = loop_jvp(primals, [tangents[k] for k in where], spec)
        outs, t_out = results[: len(out_avals)], results[len(out_avals) :]
        return outs, fill(
            with_tangent, t_out, lambda k: SymbolicZero(out_avals[k].to_tangent_aval())
        )

    wrapped.defjvp(jvp_rule, symbolic_zeros=True)
    return wrapped


def _tangent_avals(out_avals, with_tangent) -> tuple:
    return tuple(a.to_tangent_aval() for a, f in zip(out_avals, with_tangent) if f)


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


def _untransposable(fn, one_pass, out_avals, with_tangent, effects) -> Callable:
    """The two-pass form of a pass that is itself a second derivative: `fn` now, its
    tangent as a `loop_tangent` that evaluates `one_pass` and whose transpose (a
    third reverse pass) raises `THIRD_ORDER_REVERSE`."""

    def jvp_fn(res, lin):
        return one_pass(res, lin)[len(out_avals) :]

    def vjp_fn(res, cts):
        raise RuntimeError(THIRD_ORDER_REVERSE)

    def linearized(ps, ts):
        t_out = loop_tangent(
            list(ps),
            list(ts),
            jvp_fn=jvp_fn,
            vjp_fn=vjp_fn,
            out_avals=_tangent_avals(out_avals, with_tangent),
            loop_effects=effects,
        )
        return list(fn(list(ps))) + list(t_out)

    return linearized
