"""Reverse over anything: the loop's sweeps behind JVPs an outer reverse pass can
transpose (`grad` of `grad`, `grad` of `jvp`, gradient penalties), so that no loop
is ever reversed twice. See `docs/architecture.md`, "The primitives", and
`docs/guides/forward-mode.md` for why it holds and what it costs.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_derivatives import SymbolicZero

from .._runtime._checked_store import CheckedStore
from .._runtime._jax_private import closed_jaxpr, jvp_jaxpr
from .._runtime._leaves import (
    add,
    everywhere,
    fill,
    flat,
    jvp_at,
    pick,
    spread,
    zero_ct,
)
from .._sweeps._reverse_sweep import reverse_sweep
from .._sweeps._step import ReversibleStep
from .._tracing._dtypes import is_inexact
from .._tracing._loop import LoopConfig, TracedLoop
from ._jvp_primitive import custom_jvp_spec, loop_jvp, Passes, Primal
from ._loop_jvp import LoopJVP
from ._loop_parts import LoopParts, Residuals
from ._tangent_primitive import outputs_and_tangent


def _rerun(loop_fn, loop: TracedLoop, config: LoopConfig):
    """The loop's outputs as a function of its inexact differentiable leaves, through
    `loop_fn` (`differentiable_loop`), so that any transform of it takes the loop's own
    rules.

    **Returns:**

    `(varying, combine, run)`: those leaves (a tree shaped like
    `loop.differentiable()`, `None` elsewhere), `combine(tree)` filling such a tree's
    `None`s with zeros, and `run(varying) -> flat outputs`.
    """
    varying, fixed = eqx.partition(loop.differentiable(), eqx.is_inexact_array)
    unchecked = dataclasses.replace(config, stop_check=None, buffer_check=None)

    def run(varying):
        body, init, bufs = eqx.combine(varying, fixed)
        plain = TracedLoop(body, loop.cond, init, bufs, loop.layout)
        return jtu.tree_leaves(loop_fn(plain, unchecked))

    def combine(tree):
        zeros = jtu.tree_map(zero_ct, fixed)
        return eqx.combine(tree, zeros)

    return varying, combine, run


def gradient_and_hvp(loop_fn, loop, config, cts, direction=None):
    """Forward over reverse: `(J v, g, H v)` for the loop's outputs `F` at its
    inexact differentiable leaves `p`, `g = J^T cts` and `H = d(J^T cts)/dp`, in the
    direction `v` (a tree shaped like `loop.differentiable()`, `None` for zero): how
    an outer reverse pass transposes the loop's gradient (see `vjp_with_hvp`)."""
    varying, combine, run = _rerun(loop_fn, loop, config)

    def gradient(varying):
        out, pullback = jax.vjp(run, varying)
        return out, pullback(list(cts))[0]

    if direction is None:
        return None, combine(gradient(varying)[1]), None
    v = jtu.tree_map(
        lambda p, t: None if p is None else (jnp.zeros_like(p) if t is None else t),
        varying,
        direction,
        is_leaf=lambda p: p is None,
    )
    (_, g), (j_v, h_v) = jax.jvp(gradient, (varying,), (v,))
    return j_v, combine(g), combine(h_v)


def _reverse_of_tape(parts: LoopParts, where, wanted):
    """`(loop, tape, ct_x, ct_bufs, perturbed) -> cotangents of the loop's leaves
    at `where``: the reverse sweep over `tape`, behind `linearizable` without a
    transpose (forward mode through it works; a third reverse pass raises our
    error)."""
    config = parts.config

    def first_order(loop, tape, ct_x, ct_bufs, perturbed):
        step = ReversibleStep(loop.body, loop.layout, wanted[0], perturbed)
        ct_in = reverse_sweep(step, tape, ct_x, ct_bufs, config)
        return parts.at_leaves(wanted, ct_in, where)

    def reverse(loop, tape, ct_x, ct_bufs, perturbed):
        operands, rebuild = flat((loop, tape, ct_x, ct_bufs))
        run = linearizable(
            lambda ops: first_order(*rebuild(ops), perturbed),
            None,
            parts.effects,
        )
        return run(*operands)

    return reverse


class ReverseOverAnything(LoopJVP):
    """The loop's JVP (`LoopJVP`), with the passes that make its gradient and its JVP
    differentiable in reverse mode once more: the checkpointed sweep, the reverse
    sweep and the tangent's derivative through its residuals, each behind a JVP an
    outer reverse pass can transpose; and the transpose of the JVP's own
    linearization (`reverse_of_jvp`)."""

    def transposable(self, residuals: Residuals, reverse):
        transposed = self.vjp_with_hvp(residuals, reverse)
        return lambda res_leaves, cts: transposed(*res_leaves, *cts)

    def tangent_hvp(self, residuals: Residuals):
        def hvp_fn(res_leaves, t_in, cts):
            return self.residual_hvp(residuals, res_leaves, cts, t_in)[1]

        return hvp_fn

    def taped_sweep(self, leaves):
        """`checkpointed_sweep`, behind a JVP that an outer reverse pass can
        transpose: linearized, its output tangent is a `loop_tangent` whose transpose
        is the reverse sweep over this very tape (the tape's own tangent is never
        transposed: see `vjp_with_hvp`). Its two-pass form is nested here
        because its rules share the sweep's tree structure (`swept_def`), known
        only once the sweep is traced."""
        swept_def = CheckedStore("the checkpointed sweep's tree structure")

        def sweep(leaves):
            result = self.forward_sweep(leaves)
            swept, treedef = jtu.tree_flatten(result)
            swept_def.set(treedef)
            return swept

        def transpose(where, inexact):
            wanted = self.parts.wanted_at(where)
            reverse = _reverse_of_tape(self.parts, where, wanted)

            def vjp(res, cts):
                n = len(res) - swept_def.get().num_leaves
                loop = self.parts.loop(res[:n])
                perturbed = self.parts.perturbed_by(loop, wanted)
                _, tape = jtu.tree_unflatten(swept_def.get(), res[n:])
                (ct_x, ct_bufs), ct_tape = jtu.tree_unflatten(swept_def.get(), cts)
                # the tape's final buffers are the loop's: their cotangents add
                ct_bufs = [add(a, b) for a, b in zip(ct_bufs, ct_tape.bufs)]
                ct_x = tuple(c if p else None for c, p in zip(ct_x, perturbed.x))
                ct_bufs = tuple(
                    c if p else None for c, p in zip(ct_bufs, perturbed.bufs)
                )
                return reverse(loop, tape, ct_x, ct_bufs, perturbed)

            return vjp

        swept = linearizable(sweep, transpose, self.parts.effects, keep_outputs=True)(
            *leaves
        )
        return jtu.tree_unflatten(swept_def.get(), swept)

    def residual_hvp(self, residuals: Residuals, res_leaves, cts, direction):
        """For the loop's outputs `F` at the residuals' `p`, output cotangents `cts`
        (those of the perturbed outputs) and a tangent `direction` of the wanted
        leaves: `J v` (per output) and `H v`, where `H` is the second derivative of
        `cts . F`, as cotangents of the residual operands (the tape's final buffers
        standing for the initial ones, the rest of the tape getting none)."""
        body, cond, init, tape = residuals.unpack(res_leaves)
        # a leaf tracing left constant (a Python bool) is an array to the loop
        init = tuple(jnp.asarray(v) for v in init)
        loop = TracedLoop(body, cond, init, tape.bufs, self.parts.layout)
        out_leaves = jtu.tree_leaves((loop.init, loop.bufs))
        cts = fill(self.parts.out_perturbed, cts, lambda k: zero_ct(out_leaves[k]))
        v = jtu.tree_unflatten(
            jtu.tree_structure(self.parts.wanted),
            spread(self.parts.wanted, list(direction)),
        )
        j_v, _, (h_body, h_init, h_bufs) = gradient_and_hvp(
            self.parts.loop_fn, loop, self.parts.config, cts, v
        )
        zeros = jtu.tree_map(zero_ct, (body, cond, init, tape))
        ct = (h_body, zeros[1], h_init, zeros[3]._replace(bufs=tuple(h_bufs)))
        return j_v, residuals.flatten(ct)

    def vjp_with_hvp(self, residuals: Residuals, reverse):
        """The reverse sweep `reverse(residuals + cts) -> cts_in`, behind a JVP that
        an outer reverse pass can transpose (grad of grad).

        The gradient `g(p, c) = J(p)^T c` linearizes to `dg = H dp + J^T dc`, where
        `H`, the second derivative of `c . F(p)`, is symmetric. So the transpose
        maps a cotangent `w` of `g` to `H w` for `p` and `J w` for `c`: one
        forward-over-reverse product (`gradient_and_hvp`). No loop is reversed
        twice. The tape, part of the residuals, is a cache of `p`: its tangent is
        used when the JVP is evaluated (`jax.hessian`) and given no cotangent, since
        `H w` already accounts for it; the final buffers it holds get the
        cotangent the initial buffers have (the two are equal wherever a
        cotangent reaches them)."""
        n_res = len(residuals.leaves)
        out_perturbed = self.parts.out_perturbed

        def transpose(where, with_tangent):
            def vjp(res, w):
                j_w, ct_res = self.residual_hvp(residuals, res[:n_res], res[n_res:], w)
                ct_cts = [j for j, f in zip(j_w, out_perturbed) if f]
                full = ct_res + ct_cts
                return [full[k] for k in where]

            return vjp

        return linearizable(reverse, transpose, self.parts.effects)

    def reverse_of_jvp(self, leaves, t_in, cts):
        """The transpose of the linearized JVP (reverse over forward, `grad` of
        `jvp`): for output cotangents `u` and tangent cotangents `v`, the primals
        get `J^T u + H_v t` and the tangents `J^T v`, where `H_v`, the second
        derivative of `v . F`, is symmetric, so `H_v t` is a forward-over-reverse
        product in the direction of the tangents `t`."""
        loop = self.parts.loop(leaves)
        n_out = self.parts.out_def.num_leaves
        outs = jtu.tree_leaves((loop.init, loop.bufs))
        u = [zero_ct(o) if c is None else c for o, c in zip(outs, cts[:n_out])]
        v = fill(self.parts.out_perturbed, cts[n_out:], lambda k: zero_ct(outs[k]))
        direction = jtu.tree_unflatten(
            jtu.tree_structure(self.parts.wanted), spread(self.parts.wanted, list(t_in))
        )
        _, g_u, _ = gradient_and_hvp(
            self.parts.loop_fn, loop, self.parts.config, u, None
        )
        _, g_v, h_v = gradient_and_hvp(
            self.parts.loop_fn, loop, self.parts.config, v, direction
        )
        ct_tree = jtu.tree_map(add, g_u, h_v)
        n = len(leaves)
        ct_p = self.parts.at_leaves(everywhere(ct_tree), ct_tree, range(n))
        ct_t = pick(self.parts.wanted, g_v)
        return ct_p, ct_t


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
    the primals, then `fn`'s outputs with `keep_outputs`. With `transpose=None` the
    linearized tangent cannot be transposed: that raises a clear error (a third
    reverse pass)."""

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
