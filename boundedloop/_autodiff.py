"""The loop under autodiff: a custom JVP, and which sweep runs under which transform.

Undifferentiated, the loop is `plain_sweep` and does no checkpoint work. Its JVP
rule binds one primitive (`_loop_jvp`) that returns the outputs and their tangents,
and that JAX evaluates or splits as the transform requires:

- forward mode (`jax.jvp`, `jax.jacfwd`) evaluates it: the JVP of `plain_sweep`, one
  sweep with each step's value and tangent together (`_LoopJVP.one_pass`);
- `jax.linearize`, and so reverse mode (`jax.grad`, `jax.vjp`, `jax.jacrev`),
  partially evaluates it: `checkpointed_sweep` now, and the tangent as one linear
  primitive (`_tangent.loop_tangent`) over the tape (`_LoopJVP.two_pass`). Applied,
  that primitive is the JVP of `replay_sweep` (the same steps again from the initial
  carry); transposed, it is `reverse_sweep` over the checkpoints;
- forward over reverse (`jax.hessian`) differentiates the checkpointed and reverse
  sweeps in forward mode, which `lax.while_loop` supports;
- reverse over anything: the checkpointed sweep (`_LoopJVP.taped_sweep`), the
  reverse sweep (`_LoopJVP.vjp_with_hvp`) and the loop's JVP itself
  (`_LoopJVP.reverse_of_jvp`) each sit behind a JVP that is one pass when evaluated
  (so `jax.hessian` runs as above) and, when linearized, a `loop_tangent` whose
  transpose is a forward-over-reverse product: the linearized gradient is a block
  of a symmetric Hessian, so no loop is ever reversed twice (`docs/guides/forward-mode.md`).

Tangents and cotangents exist for the initial carry and for every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves), and
only for those that are actually perturbed: JAX passes symbolic zeros for the rest, so
a weight matrix nobody differentiates costs nothing. Integer and boolean leaves get
none. Arrays the predicate closes over get none (it is piecewise constant).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._checks import check_stopped
from ._forward_sweeps import checkpointed_sweep, plain_sweep
from ._loop_jvp import linearizable, loop_jvp, Passes, Spec
from ._perturbation import has_tangent, Perturbed, perturbed_leaves
from ._reverse_sweep import reverse_sweep
from ._shard_map import vary_everywhere
from ._step import ReversibleStep
from ._tangent import loop_tangent, replay_tangent
from ._trace import Layout, TracedLoop


class LoopConfig(eqx.Module):
    """The static description of one loop."""

    max_steps: int | None = eqx.field(static=True)
    checkpoints: int = eqx.field(static=True)
    layout: Layout = eqx.field(static=True)
    # the loop always takes `max_steps` steps (a scan): plan checkpoints offline
    known_length: bool = eqx.field(static=True, default=False)
    # the loop's name for `bl.max_steps_check`'s error, or None: no check
    stop_check: str | None = eqx.field(static=True, default=None)


@eqx.filter_custom_jvp
def checkpointed_loop(loop: TracedLoop, config: LoopConfig):
    """Run the loop; see `bl.while_loop`. Returns the final `(x, bufs)`."""
    # inside `shard_map`, everything varies across devices from here on
    return plain_sweep(vary_everywhere(loop), config)


def _pick(mask, tree):
    """The leaves of `tree` (shaped like `mask`, `None` allowed) where `mask` is true."""
    treedef = jtu.tree_structure(mask)
    return [v for m, v in zip(jtu.tree_leaves(mask), treedef.flatten_up_to(tree)) if m]


class _Residuals:
    """The arrays the loop's tangent depends on nonlinearly: the body, the predicate,
    the initial carry and the tape, flattened for the primitive and rebuilt inside
    its rules."""

    def __init__(self, loop: TracedLoop, tape):
        tree = (loop.body, loop.cond, loop.init, tape)
        arrays, self.static = eqx.partition(tree, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(arrays)

    def unpack(self, leaves):
        """`(body, cond, init, tape)` from the primitive's residual operands."""
        arrays = jtu.tree_unflatten(self.treedef, leaves)
        return vary_everywhere(eqx.combine(arrays, self.static))

    def flatten(self, tree) -> list:
        """A tree shaped like `unpack`'s result (arrays where it has arrays), as a
        list aligned with the operands."""
        arrays = eqx.filter(tree, eqx.is_array)
        return self.treedef.flatten_up_to(arrays)


def _inexact_array(x) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_ct(x):
    """A zero cotangent for `x` (`float0` for integers; `x` may be a constant that
    tracing left a Python scalar)."""
    dtype, shape = jnp.result_type(x), jnp.shape(x)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros(shape, dtype)
    return np.zeros(shape, jax.dtypes.float0)


def _rerun(loop: TracedLoop, config: LoopConfig):
    """The loop's outputs as a function of its inexact differentiable leaves, through
    `checkpointed_loop`, so that any transform of it takes the loop's own rules.

    **Returns:**

    `(varying, combine, run)`: those leaves (a tree shaped like
    `loop.differentiable()`, `None` elsewhere), `combine(tree)` filling such a tree's
    `None`s with zeros, and `run(varying) -> flat outputs`.
    """
    varying, fixed = eqx.partition(loop.differentiable(), _inexact_array)
    unchecked = dataclasses.replace(config, stop_check=None)

    def run(varying):
        body, init, bufs = eqx.combine(varying, fixed)
        plain = TracedLoop(body, loop.cond, None, init, bufs, loop.layout)
        return jtu.tree_leaves(checkpointed_loop(plain, unchecked))

    def combine(tree):
        zeros = jtu.tree_map(_zero_ct, fixed)
        return eqx.combine(tree, zeros)

    return varying, combine, run


def _gradient_and_hvp(loop, config, cts, direction=None):
    """Forward over reverse: `(J v, g, H v)` for the loop's outputs `F` at its
    inexact differentiable leaves `p`, `g = J^T cts` and `H = d(J^T cts)/dp`, in the
    direction `v` (a tree shaped like `loop.differentiable()`, `None` for zero).

    This is how an outer reverse pass transposes the loop's gradient: the gradient's
    linearization is a block of the Hessian of `cts . F`, which is symmetric (see
    `_LoopJVP.vjp_with_hvp`)."""
    varying, combine, run = _rerun(loop, config)

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


class _LoopJVP:
    """The loop's JVP in both forms `_loop_jvp.Passes` asks for, on flat lists: the
    loop's arrays and the tangents of the `wanted` ones in, the final `(x, bufs)` and
    the tangents of its `perturbed` leaves out."""

    def __init__(self, loop: TracedLoop, config: LoopConfig, wanted, perturbed):
        arrays, self.static = eqx.partition(loop, eqx.is_array)
        self.leaves, self.treedef = jtu.tree_flatten(arrays)
        self.config, self.wanted = config, wanted
        self.effects = frozenset(loop.body.jaxpr.effects)
        self.out_perturbed = list(perturbed.x + perturbed.bufs)
        self.perturbed = perturbed
        outs = jtu.tree_leaves((loop.init, loop.bufs))
        self.out_def = jtu.tree_structure((loop.init, loop.bufs))
        t_avals = [jax.typeof(o) for o, p in zip(outs, self.out_perturbed) if p]
        self.out_avals = tuple(jax.typeof(o) for o in outs) + tuple(t_avals)

    def _loop(self, leaves) -> TracedLoop:
        # partial evaluation may hand a constant back as a Python scalar
        arrays = jtu.tree_unflatten(self.treedef, [jnp.asarray(v) for v in leaves])
        return vary_everywhere(eqx.combine(arrays, self.static))

    def primal(self, leaves) -> list:
        """The loop itself, as `checkpointed_loop` runs it: `plain_sweep`."""
        return jtu.tree_leaves(plain_sweep(self._loop(leaves), self.config))

    def tangent_inputs(self) -> tuple[int, ...]:
        """Per tangent operand, the position of its primal among `leaves`."""
        positions = jtu.tree_unflatten(self.treedef, range(len(self.leaves)))
        loop = eqx.combine(positions, self.static)
        return tuple(_pick(self.wanted, loop.differentiable()))

    def tangent_outputs(self) -> tuple[int, ...]:
        """Per output tangent, the position of its output."""
        return tuple(k for k, p in enumerate(self.out_perturbed) if p)

    def one_pass(self, leaves, t_in) -> list:
        """The JVP of `plain_sweep`: one sweep, each step's primal and tangent
        together."""
        loop = self._loop(leaves)
        if loop.checked_body is not None:  # `bl.buffer_checks`: a debugging mode
            return self.two_pass(leaves, t_in)
        varying, fixed = eqx.partition(loop.differentiable(), self.wanted)
        t_varying = jtu.tree_unflatten(jtu.tree_structure(varying), t_in)

        # `bl.max_steps_check`'s error is attached below, to the tangents as well
        unchecked = dataclasses.replace(self.config, stop_check=None)

        def run(varying):
            body, init, bufs = vary_everywhere(eqx.combine(varying, fixed))
            plain = TracedLoop(body, loop.cond, None, init, bufs, loop.layout)
            return plain_sweep(plain, unchecked)

        (x, bufs), t_out = jax.jvp(run, (varying,), (t_varying,))
        t_out = [t for t, f in zip(jtu.tree_leaves(t_out), self.out_perturbed) if f]
        if self.config.stop_check is not None:
            name, max_steps = self.config.stop_check, self.config.max_steps
            x, bufs, t_out = check_stopped(loop, (x, bufs, t_out), name, max_steps)
        return jtu.tree_leaves((x, bufs)) + t_out

    def two_pass(self, leaves, t_in) -> list:
        """`checkpointed_sweep`, and the tangent as `loop_tangent` over its tape:
        evaluated, the JVP of `replay_sweep`; transposed, `reverse_sweep`."""
        out, tangent = self.checkpointed(leaves)
        return out + tangent(t_in)

    def taped_sweep(self, leaves):
        """`checkpointed_sweep`, behind a JVP that an outer reverse pass can
        transpose: linearized, its output tangent is a `loop_tangent` whose transpose
        is the reverse sweep over this very tape (the tape's own tangent is never
        transposed: see `vjp_with_hvp`). Its two-pass form is nested here
        because its rules share the sweep's tree structure (`box`), known only
        once the sweep is traced."""
        box = {}
        config, layout = self.config, self.config.layout

        def sweep(leaves):
            result = checkpointed_sweep(self._loop(leaves), config, self.perturbed.x)
            flat, box["def"] = jtu.tree_flatten(result)
            return flat

        def two_pass(primals, where, tangents, inexact):
            outs = sweep(primals)
            n = len(primals)
            avals = [jax.typeof(o) for o in outs]
            wanted = self._wanted_at(where)
            perturbed = self._perturbed_by(self._loop(primals), wanted)

            def jvp_fn(res, ts):
                def at(moving):
                    args = list(res[:n])
                    for k, m in zip(where, moving):
                        args[k] = m
                    return sweep(args)

                moving = [res[k] for k in where]
                t_out = jax.jvp(at, (moving,), (list(ts),))[1]
                return [t for t, f in zip(t_out, inexact) if f]

            def vjp_fn(res, cts):
                loop = self._loop(res[:n])
                (x, bufs), tape = jtu.tree_unflatten(box["def"], res[n:])
                it = iter(cts)
                full = [next(it) if f else None for f in inexact]
                (ct_x, ct_bufs), ct_tape = jtu.tree_unflatten(box["def"], full)
                # the tape's final buffers are the loop's: their cotangents add
                ct_bufs = [_add(a, b) for a, b in zip(ct_bufs, ct_tape.bufs)]
                ct_x = tuple(c if p else None for c, p in zip(ct_x, perturbed.x))
                ct_bufs = tuple(
                    c if p else None for c, p in zip(ct_bufs, perturbed.bufs)
                )
                return reverse(loop, tape, ct_x, ct_bufs)

            def first_order_reverse(loop, tape, ct_x, ct_bufs):
                step = ReversibleStep(loop.body, layout, wanted[0], perturbed)
                ct_in = reverse_sweep(step, tape, ct_x, ct_bufs, config)
                return self._at_leaves(res_primals, wanted, ct_in, where)

            res_primals = primals

            def reverse(loop, tape, ct_x, ct_bufs):
                # forward mode through it works; a third reverse pass raises
                operands, rebuild = _flat((loop, tape, ct_x, ct_bufs))
                return linearizable(
                    lambda ops: first_order_reverse(*rebuild(ops)), None, self.effects
                )(*operands)

            t_out = loop_tangent(
                list(primals) + list(outs),
                list(tangents),
                jvp_fn=jvp_fn,
                vjp_fn=vjp_fn,
                out_avals=tuple(
                    a.to_tangent_aval() for a, f in zip(avals, inexact) if f
                ),
                loop_effects=self.effects,
            )
            return list(outs) + list(t_out)

        flat = linearizable(sweep, two_pass, self.effects)(*leaves)
        return jtu.tree_unflatten(box["def"], flat)

    def _wanted_at(self, where):
        """Bools shaped like `(body, init, bufs)`: which of them are among the
        `leaves` at positions `where`."""
        positions = jtu.tree_unflatten(self.treedef, range(len(self.leaves)))
        loop = eqx.combine(positions, self.static)
        chosen = set(where)
        return jtu.tree_map(lambda k: k in chosen, loop.differentiable())

    def _perturbed_by(self, loop: TracedLoop, wanted) -> Perturbed:
        w_body, w_init, w_bufs = wanted
        return perturbed_leaves(
            loop.body,
            jtu.tree_leaves(w_body),
            Perturbed(tuple(jtu.tree_leaves(w_init)), tuple(jtu.tree_leaves(w_bufs))),
            self.config.layout,
        )

    def _at_leaves(self, leaves, wanted, ct_in, where) -> list:
        """Cotangents `ct_in` (shaped like `(body, init, bufs)`, `None` for zero) of
        the `wanted` leaves, as a list aligned with `where` (zeros elsewhere)."""
        positions = jtu.tree_unflatten(self.treedef, range(len(self.leaves)))
        loop = eqx.combine(positions, self.static)
        by_position = {
            k: c
            for k, c in zip(_pick(wanted, loop.differentiable()), _pick(wanted, ct_in))
        }
        return [
            _zero_ct(leaves[k]) if by_position.get(k) is None else by_position[k]
            for k in where
        ]

    def checkpointed(self, leaves):
        """`two_pass` in two stages: `checkpointed_sweep` now, returning the outputs
        and the tangent stage, `t_in -> t_out`, which reads only its tape."""
        loop, config, wanted = self._loop(leaves), self.config, self.wanted
        out, tape = self.taped_sweep(leaves)
        residuals = _Residuals(loop, tape)
        out_perturbed, out_def = self.out_perturbed, self.out_def

        def jvp_fn(res_leaves, t_in):
            body, _, x, tape = residuals.unpack(res_leaves)
            t_out = replay_tangent((body, x, tape), wanted, t_in, config.layout)
            return [t for t, f in zip(jtu.tree_leaves(t_out), out_perturbed) if f]

        def reverse(operands):
            res_leaves, cts = (
                operands[: len(residuals.leaves)],
                operands[len(residuals.leaves) :],
            )
            body, _, _, tape = residuals.unpack(res_leaves)
            cts = iter(cts)
            ct_x, ct_bufs = jtu.tree_unflatten(
                out_def, [next(cts) if f else None for f in out_perturbed]
            )
            step = ReversibleStep(body, config.layout, wanted[0], self.perturbed)
            ct_in = reverse_sweep(step, tape, ct_x, ct_bufs, config)
            return _pick(wanted, ct_in)

        def vjp_fn(res_leaves, cts):
            return self.vjp_with_hvp(residuals, reverse)(*res_leaves, *cts)

        def hvp_fn(res_leaves, t_in, cts):
            return self.residual_hvp(residuals, res_leaves, cts, t_in)[1]

        def tangent(t_in):
            t_out = loop_tangent(
                residuals.leaves,
                t_in,
                jvp_fn=jvp_fn,
                vjp_fn=vjp_fn,
                hvp_fn=hvp_fn,
                out_avals=self.out_avals[len(jtu.tree_leaves(out)) :],
                loop_effects=frozenset(loop.body.jaxpr.effects),
            )
            return list(t_out)

        return jtu.tree_leaves(out), tangent

    def residual_hvp(self, residuals: _Residuals, res_leaves, cts, direction):
        """For the loop's outputs `F` at the residuals' `p`, output cotangents `cts`
        (those of the perturbed outputs) and a tangent `direction` of the wanted
        leaves: `J v` (per output) and `H v`, where `H` is the second derivative of
        `cts . F`, as cotangents of the residual operands (the tape's final buffers
        standing for the initial ones, the rest of the tape getting none)."""
        body, cond, init, tape = residuals.unpack(res_leaves)
        # a leaf tracing left constant (a Python bool) is an array to the loop
        init = tuple(jnp.asarray(v) for v in init)
        loop = TracedLoop(body, cond, None, init, tape.bufs, self.config.layout)
        it = iter(cts)
        out_leaves = jtu.tree_leaves((loop.init, loop.bufs))
        cts = [
            next(it) if f else _zero_ct(o)
            for o, f in zip(out_leaves, self.out_perturbed)
        ]
        v = jtu.tree_unflatten(
            jtu.tree_structure(self.wanted), _spread(self.wanted, list(direction))
        )
        j_v, _, (h_body, h_init, h_bufs) = _gradient_and_hvp(loop, self.config, cts, v)
        zeros = jtu.tree_map(_zero_ct, (body, cond, init, tape))
        ct = (h_body, zeros[1], h_init, zeros[3]._replace(bufs=tuple(h_bufs)))
        return j_v, residuals.flatten(ct)

    def vjp_with_hvp(self, residuals: _Residuals, reverse):
        """The reverse sweep `reverse(residuals + cts) -> cts_in`, behind a JVP that
        an outer reverse pass can transpose (grad of grad).

        The gradient `g(p, c) = J(p)^T c` linearizes to `dg = H dp + J^T dc`, where
        `H`, the second derivative of `c . F(p)`, is symmetric. So the transpose
        maps a cotangent `w` of `g` to `H w` for `p` and `J w` for `c`: one
        forward-over-reverse product (`_gradient_and_hvp`). No loop is reversed
        twice. The tape, part of the residuals, is a cache of `p`: its tangent is
        used when the JVP is evaluated (`jax.hessian`) and given no cotangent, since
        `H w` already accounts for it; the final buffers it holds get the
        cotangent the initial buffers have (the two are equal wherever a
        cotangent reaches them)."""
        n_res = len(residuals.leaves)
        out_perturbed = self.out_perturbed

        def two_pass(primals, where, tangents, with_tangent):
            outs = reverse(list(primals))

            def jvp_fn(res, ts):
                def at(moving):
                    args = list(res)
                    for k, m in zip(where, moving):
                        args[k] = m
                    return reverse(args)

                t_out = jax.jvp(at, ([res[k] for k in where],), (list(ts),))[1]
                return [t for t, f in zip(t_out, with_tangent) if f]

            def vjp_fn(res, w):
                it = iter(w)
                w = [
                    next(it) if f else jnp.zeros_like(o)
                    for o, f in zip(outs, with_tangent)
                ]
                j_w, ct_res = self.residual_hvp(residuals, res[:n_res], res[n_res:], w)
                ct_cts = [j for j, f in zip(j_w, out_perturbed) if f]
                full = ct_res + ct_cts
                return [full[k] for k in where]

            out_avals = tuple(
                jax.typeof(o).to_tangent_aval() for o, f in zip(outs, with_tangent) if f
            )
            t_out = loop_tangent(
                list(primals),
                list(tangents),
                jvp_fn=jvp_fn,
                vjp_fn=vjp_fn,
                out_avals=out_avals,
                loop_effects=self.effects,
            )
            return list(outs) + list(t_out)

        return linearizable(reverse, two_pass, self.effects)

    def reverse_of_jvp(self, leaves, t_in, cts):
        """The transpose of the linearized JVP (reverse over forward, `grad` of
        `jvp`): for output cotangents `u` and tangent cotangents `v`, the primals
        get `J^T u + H_v t` and the tangents `J^T v`, where `H_v`, the second
        derivative of `v . F`, is symmetric, so `H_v t` is a forward-over-reverse
        product in the direction of the tangents `t`."""
        loop = self._loop(leaves)
        n_out = self.out_def.num_leaves
        outs = jtu.tree_leaves((loop.init, loop.bufs))
        u = [_zero_ct(o) if c is None else c for o, c in zip(outs, cts[:n_out])]
        it = iter(cts[n_out:])
        v = [next(it) if f else _zero_ct(o) for o, f in zip(outs, self.out_perturbed)]
        direction = jtu.tree_unflatten(
            jtu.tree_structure(self.wanted), _spread(self.wanted, list(t_in))
        )
        _, g_u, _ = _gradient_and_hvp(loop, self.config, u, None)
        _, g_v, h_v = _gradient_and_hvp(loop, self.config, v, direction)
        ct_tree = jtu.tree_map(_add, g_u, h_v)
        n = len(leaves)
        ct_p = self._at_leaves(leaves, _everywhere(ct_tree), ct_tree, range(n))
        ct_t = _pick(self.wanted, g_v)
        return ct_p, ct_t


def _flat(tree):
    """`tree`'s arrays as a list, and the function rebuilding `tree` from such a
    list."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(arrays)
    return leaves, lambda ops: eqx.combine(jtu.tree_unflatten(treedef, ops), static)


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if a.dtype == jax.dtypes.float0:
        return a
    return a + b


def _everywhere(tree):
    return jtu.tree_map(lambda _: True, tree)


def _spread(wanted, values: list) -> list:
    """`values` for the `wanted` leaves, `None` for the others, in `wanted`'s
    leaf order."""
    it = iter(values)
    return [next(it) if w else None for w in jtu.tree_leaves(wanted)]


@checkpointed_loop.def_jvp
def _loop_jvp(primals, tangents):
    loop, config = primals
    loop = vary_everywhere(loop)
    # which of (body, init, bufs)'s leaves have a tangent, and those tangents
    t_diff = tangents[0].differentiable()
    wanted = jtu.tree_map(lambda _, t: t is not None, loop.differentiable(), t_diff)
    t_in = jtu.tree_leaves(t_diff)
    if not t_in:  # only the predicate's arrays are perturbed
        out = plain_sweep(loop, config)
        return out, jtu.tree_map(lambda _: None, out)
    t_body, t_init, t_bufs = t_diff
    perturbed = perturbed_leaves(
        loop.body,
        has_tangent(t_body),
        Perturbed(tuple(has_tangent(t_init)), tuple(has_tangent(t_bufs))),
        config.layout,
    )
    # only perturbed leaves get tangents (see `_perturbation`)
    jvp = _LoopJVP(loop, config, wanted, perturbed)
    spec = Spec(
        Passes(
            jvp.one_pass,
            jvp.two_pass,
            jvp.checkpointed,
            jvp.primal,
            jvp.reverse_of_jvp,
        ),
        n_primals=len(jvp.leaves),
        n_outputs=jvp.out_def.num_leaves,
        out_avals=jvp.out_avals,
        effects=frozenset(loop.body.jaxpr.effects),
        tangent_inputs=jvp.tangent_inputs(),
        tangent_outputs=jvp.tangent_outputs(),
    )
    results = loop_jvp(jvp.leaves, t_in, spec)
    out = jtu.tree_unflatten(jvp.out_def, results[: jvp.out_def.num_leaves])
    t_out = iter(results[jvp.out_def.num_leaves :])
    return out, jtu.tree_unflatten(
        jvp.out_def, [next(t_out) if f else None for f in jvp.out_perturbed]
    )
