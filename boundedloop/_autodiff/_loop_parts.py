"""What every JVP pass of one loop reads (`LoopParts`, which also translates between
the passes' index spaces), and what its tangent keeps of it (`Residuals`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._runtime._leaves import pick, zero_ct
from .._runtime._shard_map import vary_everywhere
from .._tracing._loop import LoopConfig, Perturbed, TracedLoop
from .._tracing._perturbation import perturbed_leaves


@dataclasses.dataclass(frozen=True)
class LoopParts:
    """One loop, as the JVP passes read it.

    - `leaves`, `treedef`, `static`: the loop's arrays, flat, and what rebuilds it.
    - `config`: its `LoopConfig`.
    - `wanted`: bools shaped like `(body, init, bufs)`: the differentiated inputs.
    - `perturbed`: the carry leaves (`x`, `bufs`) that get tangents.
    - `effects`: the body's effects.
    - `out_def`: the tree of the outputs, `(x, bufs)`.
    - `loop_fn`: the loop as a differentiable function (`differentiable_loop`),
        rerun by the second-order passes so that transforms of it take its rules.
    """

    leaves: list
    treedef: Any
    static: Any
    config: LoopConfig
    wanted: Any
    perturbed: Perturbed
    effects: frozenset
    out_def: Any
    loop_fn: Callable

    @classmethod
    def of(cls, loop: TracedLoop, config, wanted, perturbed, loop_fn) -> "LoopParts":
        arrays, static = eqx.partition(loop, eqx.is_array)
        leaves, treedef = jtu.tree_flatten(arrays)
        outs = jtu.tree_structure((loop.init, loop.bufs))
        effects = frozenset(loop.body.jaxpr.effects)
        return cls(
            leaves, treedef, static, config, wanted, perturbed, effects, outs, loop_fn
        )

    @property
    def out_perturbed(self) -> list[bool]:
        """Per output leaf, whether it gets a tangent."""
        return list(self.perturbed.x + self.perturbed.bufs)

    @property
    def layout(self):
        """The carry's `Layout` (the loop's, a static part of it)."""
        return self.static.layout

    def loop(self, leaves) -> TracedLoop:
        """The loop with `leaves` for its arrays."""
        # partial evaluation may hand a constant back as a Python scalar
        arrays = jtu.tree_unflatten(self.treedef, [jnp.asarray(v) for v in leaves])
        return vary_everywhere(eqx.combine(arrays, self.static))

    def positions(self) -> TracedLoop:
        """The loop with each array replaced by its position among `leaves`."""
        indices = jtu.tree_unflatten(self.treedef, range(len(self.leaves)))
        return eqx.combine(indices, self.static)

    def wanted_at(self, where):
        """Bools shaped like `(body, init, bufs)`: which of them are among the
        `leaves` at positions `where`."""
        loop = self.positions()
        chosen = set(where)
        return jtu.tree_map(lambda k: k in chosen, loop.differentiable())

    def perturbed_by(self, loop: TracedLoop, wanted) -> Perturbed:
        """The carry leaves `loop` perturbs when its `wanted` inputs are."""
        w_body, w_init, w_bufs = wanted
        return perturbed_leaves(
            loop.body,
            jtu.tree_leaves(w_body),
            Perturbed(tuple(jtu.tree_leaves(w_init)), tuple(jtu.tree_leaves(w_bufs))),
            self.layout,
        )

    def at_leaves(self, wanted, ct_in, where) -> list:
        """Cotangents `ct_in` (shaped like `(body, init, bufs)`, `None` for zero) of
        the `wanted` leaves, as a list aligned with `where` (zeros elsewhere)."""
        leaves = self.leaves  # their types
        loop = self.positions()
        by_position = {
            k: c
            for k, c in zip(pick(wanted, loop.differentiable()), pick(wanted, ct_in))
        }
        return [
            zero_ct(leaves[k]) if by_position.get(k) is None else by_position[k]
            for k in where
        ]


class Residuals:
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
