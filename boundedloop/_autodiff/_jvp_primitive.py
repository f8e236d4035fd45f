"""The loop's JVP as one primitive, `loop_jvp_p`, that picks its sweeps by what is
asked of it: one pass when evaluated, two when partially evaluated with the tangents
unknown. See `docs/architecture.md`, "The primitives".
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.dtypes import float0
from jax.interpreters import ad, batching, mlir

from .._runtime._batching import sum_unbatched
from .._runtime._jax_private import (
    batch_jaxpr,
    closed_call_p,
    closed_jaxpr,
    custom_partial_eval_rules,
    mapped_aval,
    partial_eval_jaxpr_custom_rules,
    register_batching,
    set_current_trace,
    Tracer,
)
from .._runtime._leaves import fill, jvp_at, zero_ct
from .._tracing._dtypes import is_inexact
from ._tangent_primitive import outputs_and_tangent


loop_jvp_p = jax.extend.core.Primitive("boundedloop_loop_jvp")
loop_jvp_p.multiple_results = True


class Passes(NamedTuple):
    """The two implementations of the loop's JVP, each
    `(primals, tangents) -> outputs + output tangents` on flat lists; and, for the
    primitive as the loop binds it (not its JVP or batched forms), `two_pass` in
    stages: `primals -> (outputs, tangents -> output tangents)`."""

    one_pass: Callable
    two_pass: Callable
    staged: Callable | None = None
    # `(primals, tangents, cts) -> (primal cts, tangent cts)`: the transpose of this
    # JVP's own linearization (reverse over forward); `None`: not transposable
    reverse_of_jvp: Callable | None = None


class Primal(NamedTuple):
    """What the JVP is the JVP of, where a custom JVP binds it: `fn`,
    `primals -> outputs` on flat lists; per tangent operand, the position of its
    primal; per output tangent, the position of its output. Under `vmap` the
    outputs must be batched exactly as `fn`'s are (see `_out_batched`)."""

    fn: Callable
    tangent_inputs: tuple[int, ...]
    tangent_outputs: tuple[int, ...]


class Spec(NamedTuple):
    """The primitive's one parameter. Made by `custom_jvp_spec` where a custom JVP
    binds the primitive; its JVP and batching rules each make theirs from it
    (`_lifted_spec`, `_batched_spec`)."""

    passes: Passes
    # `None` in the JVP of the JVP, already differentiated: no custom JVP
    # constrains the outputs' batching there
    primal: Primal | None
    n_primals: int  # operands: `n_primals` primals, then tangents
    n_outputs: int  # results: `n_outputs` outputs, then tangents
    out_avals: tuple
    effects: frozenset

    def __repr__(self) -> str:
        # as a jaxpr prints the primitive's parameter: what it computes, not the
        # functions' addresses
        owner = getattr(self.passes.one_pass, "__qualname__", "?").rsplit(".", 1)[0]
        return (
            f"Spec({owner}, primals={self.n_primals}, outputs={self.n_outputs}, "
            f"tangents={len(self.out_avals) - self.n_outputs})"
        )


def custom_jvp_spec(
    passes: Passes,
    primal: Primal,
    n_primals: int,
    out_avals,
    t_avals,
    effects: frozenset,
) -> Spec:
    """The parameter of the primitive as a custom JVP rule binds it.

    **Arguments:**

    - `passes`: the JVP's implementations.
    - `primal`: what it is the JVP of.
    - `n_primals`: the number of `primal.fn`'s operands.
    - `out_avals`: the types of `primal.fn`'s outputs.
    - `t_avals`: the types of the output tangents, one per `primal.tangent_outputs`.
    - `effects`: the loop's effects.

    **Returns:**

    The `Spec`, for `loop_jvp`.
    """
    if len(t_avals) != len(primal.tangent_outputs):
        raise AssertionError("one tangent type per output with a tangent")
    return Spec(
        passes,
        primal,
        n_primals=n_primals,
        n_outputs=len(out_avals),
        out_avals=tuple(out_avals) + tuple(t_avals),
        effects=effects,
    )


def loop_jvp(primals: list, tangents: list, spec: Spec) -> list:
    """Bind the loop's JVP.

    **Arguments:**

    - `primals`: the loop's arrays.
    - `tangents`: the tangents of those that are perturbed.
    - `spec`: the `Spec`, whose `passes` take `(primals, tangents)`.

    **Returns:**

    The outputs, then the tangents of those that are perturbed.
    """
    if len(primals) != spec.n_primals or (
        spec.primal is not None and len(tangents) != len(spec.primal.tangent_inputs)
    ):
        raise AssertionError("the operands do not match the spec")
    return loop_jvp_p.bind(*primals, *tangents, spec=spec)


def _loop_jvp_impl(*args, spec):
    return spec.passes.one_pass(
        list(args[: spec.n_primals]), list(args[spec.n_primals :])
    )


def _loop_jvp_abstract_eval(*args, spec):
    del args
    return list(spec.out_avals), spec.effects


def _tangent_unknown(unknown, spec) -> bool:
    return any(unknown[spec.n_primals :])


def _loop_jvp_partial_eval(trace, *tracers, spec):
    """`jax.linearize`'s rule: two passes when a tangent is unknown."""
    if not _tangent_unknown([not t.pval.is_known() for t in tracers], spec):
        return trace.default_process_primitive(loop_jvp_p, tracers, dict(spec=spec))
    # the checkpointed sweep's operands are known, so it runs now; the tangent
    # primitive's are not, so it is staged for later (and for transposition)
    primals, tangents = tracers[: spec.n_primals], tracers[spec.n_primals :]
    known = _known_values(primals) if spec.passes.staged is not None else None
    if known is not None:
        # the sweep on the known values, outside this trace: traced through it,
        # each of its loops would be partially evaluated (`lax.while_loop`'s rule
        # splits its body even when nothing is unknown; what that cost:
        # `docs/design-notes.md`)
        out, tangent = spec.passes.staged(known)
        with set_current_trace(trace):
            return [trace.new_const(x) for x in out] + tangent(list(tangents))
    with set_current_trace(trace):
        return spec.passes.two_pass(list(primals), list(tangents))


def _known_values(tracers) -> list | None:
    """The values of partial evaluation's `tracers` as arrays of their types, or
    `None` if one is unknown. (A known value may be a Python scalar.)"""
    if not all(t.pval.is_known() for t in tracers):
        return None
    known = [t.pval.get_known() for t in tracers]
    known = [k if isinstance(k, (jax.Array, Tracer)) else jnp.asarray(k) for k in known]
    if any(jax.typeof(k) != t.aval for k, t in zip(known, tracers)):
        return None
    return known


def _as_closed_call(eqn, fn):
    """`eqn` as a `closed_call` of `fn`, traced on its operands' types."""
    n_primals = eqn.params["spec"].n_primals
    avals = [v.aval for v in eqn.invars]

    def flat(*args):
        return fn(list(args[:n_primals]), list(args[n_primals:]))

    closed = closed_jaxpr(flat, avals, "boundedloop_loop_jvp")
    return eqn.replace(
        primitive=closed_call_p,
        params=dict(call_jaxpr=closed),
        effects=closed.effects,
    )


def _loop_jvp_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """The jaxpr rule (`jax.checkpoint`, partial evaluation of a staged jaxpr): the
    pass `_loop_jvp_partial_eval` would pick, as a call that JAX splits further."""
    spec = eqn.params["spec"]
    passes = spec.passes
    pick = passes.two_pass if _tangent_unknown(unks_in, spec) else passes.one_pass
    rule = partial_eval_jaxpr_custom_rules[closed_call_p]
    return rule(saveable, unks_in, inst_in, _as_closed_call(eqn, pick))


def _lifted_passes(spec: Spec, nonzero) -> Passes:
    """The JVP of `spec`'s passes at the operands that are `nonzero`, as passes
    (`(primals, tangents) -> results`) on one flat list of operands: operands, then
    their tangents, in; results, then the tangents of the inexact ones, out.

    Linearized (reverse over forward), its two-pass form is the loop's JVP now, and
    its tangent a linear `loop_tangent` whose transpose is
    `spec.passes.reverse_of_jvp` (a forward-over-reverse product; the loops in the
    one pass cannot be transposed), or none if that is `None` (the JVP of a pass
    that is itself a second derivative)."""
    where = [k for k, nz in enumerate(nonzero) if nz]
    inexact = [is_inexact(a) for a in spec.out_avals]
    reverse_of_jvp = spec.passes.reverse_of_jvp

    def flat_one_pass(args):
        return spec.passes.one_pass(args[: spec.n_primals], args[spec.n_primals :])

    def one_pass(primals, tangents):
        out, t_out = jvp_at(flat_one_pass, primals, where, tangents)
        return list(out) + [t for t, f in zip(t_out, inexact) if f]

    def transpose(res, cts):
        cts = [zero_ct(a) if c is None else c for c, a in zip(cts, spec.out_avals)]
        ct_p, ct_t = reverse_of_jvp(
            list(res[: spec.n_primals]), list(res[spec.n_primals :]), cts
        )
        ct_all = list(ct_p) + list(ct_t)
        return [ct_all[k] for k in where]

    def two_pass(primals, tangents):
        return outputs_and_tangent(
            flat_one_pass,
            primals,
            where,
            tangents,
            with_tangent=inexact,
            transpose=None if reverse_of_jvp is None else transpose,
            effects=spec.effects,
        )

    return Passes(one_pass, two_pass)


def _loop_jvp_jvp(primals, tangents, *, spec):
    nonzero = [type(t) is not ad.Zero for t in tangents]
    inexact = [is_inexact(a) for a in spec.out_avals]
    n_out = len(spec.out_avals)
    if not any(nonzero):
        out = loop_jvp_p.bind(*primals, spec=spec)
        return out, [ad.Zero(a.to_tangent_aval()) for a in spec.out_avals]
    lifted = _lifted_spec(spec, nonzero)
    both = loop_jvp_p.bind(
        *primals, *[t for t in tangents if type(t) is not ad.Zero], spec=lifted
    )
    return both[:n_out], fill(
        inexact, both[n_out:], lambda k: ad.Zero(spec.out_avals[k].to_tangent_aval())
    )


def _lifted_spec(spec: Spec, nonzero: list[bool]) -> Spec:
    """The JVP rule's parameter: the JVP of `spec`'s passes, at the operands that
    are `nonzero`; its operands `spec`'s, then their tangents; its results `spec`'s
    results, then the tangents of the inexact ones."""
    t_avals = tuple(a.to_tangent_aval() for a in spec.out_avals if is_inexact(a))
    return Spec(
        _lifted_passes(spec, nonzero),
        primal=None,
        n_primals=len(nonzero),
        n_outputs=len(spec.out_avals),
        out_avals=spec.out_avals + t_avals,
        effects=spec.effects,
    )


def _out_batched(axis_data, spec: Spec, args, axes) -> list[bool]:
    """Which outputs are batched, given which operands are (`axes`, 0 or `None`).

    The loop's JVP is bound by a custom JVP rule. When `vmap` batches the custom
    JVP before it is differentiated (`grad(vmap(jit(f)))`: `jit`'s batching rule
    batches its jaxpr, primal included), JAX fixes the primal outputs' batch axes
    from the primal function and then requires the JVP's primal outputs, and the
    tangents merged into them, to have the same ones. `lax.while_loop`'s batching
    leaves a leaf unbatched where the body only passes it on, so "every output is
    batched" is wrong there. So the primal outputs are batched as the primal's
    are, found by batching its jaxpr; a tangent output as its primal output, unless
    some tangent is batched where its primal is not (`jacfwd`: that batch axis
    reaches every output tangent). Where no primal is known (the JVP of the JVP,
    already differentiated), every output is batched if any primal operand is.
    """
    n_primals, n_outputs = spec.n_primals, spec.n_outputs
    in_batched = [a is not None for a in axes]
    primal = spec.primal
    if primal is None:
        return [any(in_batched[:n_primals])] * n_outputs + [True] * (
            len(spec.out_avals) - n_outputs
        )
    if not any(in_batched[:n_primals]):
        out_batched = [False] * n_outputs
    else:
        out_batched = _primal_batched(axis_data, primal.fn, args[:n_primals], axes)
    t_batched = in_batched[n_primals:]
    tangent_only = any(
        t and not in_batched[k] for t, k in zip(t_batched, primal.tangent_inputs)
    )
    t_out = [tangent_only or out_batched[k] for k in primal.tangent_outputs]
    return list(out_batched) + t_out


def _primal_batched(axis_data, primal, args, axes) -> list[bool]:
    """Which of `primal`'s outputs `vmap` batches, found by batching its jaxpr."""
    primal_avals = [
        jax.typeof(a) if ax is None else mapped_aval(axis_data.size, 0, jax.typeof(a))
        for a, ax in zip(args, axes)
    ]
    jaxpr = closed_jaxpr(
        lambda *a: primal(list(a)), primal_avals, "boundedloop_loop_jvp"
    )
    in_batched = [ax is not None for ax in axes[: len(args)]]
    _, out_batched = batch_jaxpr(jaxpr, axis_data, in_batched, instantiate=False)
    return list(out_batched)


def _batched_reverse_of_jvp(reverse_of_jvp, in_axes, out_axes, size):
    """`reverse_of_jvp` per batch element; an operand without a batch axis gets the
    sum of the elements' cotangents. An output without a batch axis is computed
    once, from unbatched operands alone, so each element pulls back `1/size` of its
    cotangent (the same for every element) and the sum is the whole."""
    per_element = jax.vmap(
        reverse_of_jvp, in_axes=(in_axes[0], in_axes[1], out_axes), out_axes=0
    )

    def batched(primals, tangents, cts):
        cts = [
            c / size if a is None and c.dtype != float0 else c
            for c, a in zip(cts, out_axes)
        ]
        ct_p, ct_t = per_element(primals, tangents, cts)
        return (
            [sum_unbatched(c, a) for c, a in zip(ct_p, in_axes[0])],
            [sum_unbatched(c, a) for c, a in zip(ct_t, in_axes[1])],
        )

    return batched


def _loop_jvp_batch(axis_data, args, dims, *, spec):
    if all(d is None for d in dims):  # JAX calls this rule even then
        return loop_jvp_p.bind(*args, spec=spec), [None] * len(spec.out_avals)
    size = axis_data.size
    args = [
        a if d is None else batching.bdim_at_front(a, d, size)
        for a, d in zip(args, dims)
    ]
    axes = [None if d is None else 0 for d in dims]
    out_batched = _out_batched(axis_data, spec, args, axes)
    out_axes = [0 if b else None for b in out_batched]
    in_axes = (axes[: spec.n_primals], axes[spec.n_primals :])

    def batched(fn):
        # an output the passes batch where the primal does not is the same for
        # every element: keep one (see `_out_batched`)
        vmapped = jax.vmap(fn, in_axes=in_axes, out_axes=0)

        def run(primals, tangents):
            outs = vmapped(primals, tangents)
            return [o if b else o[0] for o, b in zip(outs, out_batched)]

        return run

    batched_spec = _batched_spec(spec, batched, in_axes, out_axes, size)
    return loop_jvp_p.bind(*args, spec=batched_spec), out_axes


def _batched_spec(spec: Spec, batched, in_axes, out_axes, size: int) -> Spec:
    """The batching rule's parameter: `spec` with its passes `batched`, its primal
    and its reverse over forward vmapped over `in_axes`, and its outputs' types
    given the batch axes `out_axes`. (`staged` is the unbatched loop's alone.)"""
    primal = spec.primal
    if primal is not None and any(a == 0 for a in in_axes[0]):
        fn = jax.vmap(
            primal.fn, in_axes=(in_axes[0],), out_axes=out_axes[: spec.n_outputs]
        )
        primal = primal._replace(fn=fn)
    # else only tangents are batched (`jacfwd`): the primal is unchanged
    reverse_of_jvp = spec.passes.reverse_of_jvp
    if reverse_of_jvp is not None:
        reverse_of_jvp = _batched_reverse_of_jvp(
            reverse_of_jvp, in_axes, out_axes, size
        )
    passes = Passes(
        batched(spec.passes.one_pass),
        batched(spec.passes.two_pass),
        reverse_of_jvp=reverse_of_jvp,
    )
    out_avals = tuple(
        a if ax is None else jax.extend.core.unmapped_aval(size, 0, a)
        for a, ax in zip(spec.out_avals, out_axes)
    )
    return spec._replace(passes=passes, primal=primal, out_avals=out_avals)


loop_jvp_p.def_impl(_loop_jvp_impl)
loop_jvp_p.def_effectful_abstract_eval(_loop_jvp_abstract_eval)
mlir.register_lowering(
    loop_jvp_p, mlir.lower_fun(_loop_jvp_impl, multiple_results=True)
)
ad.primitive_jvps[loop_jvp_p] = _loop_jvp_jvp
register_batching(loop_jvp_p, _loop_jvp_batch, axis_data=True)
custom_partial_eval_rules[loop_jvp_p] = _loop_jvp_partial_eval
partial_eval_jaxpr_custom_rules[loop_jvp_p] = _loop_jvp_partial_eval_custom
