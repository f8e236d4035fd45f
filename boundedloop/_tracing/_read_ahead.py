"""A read of a buffer location that a later step writes, found while tracing: a read
at `i + r` and an unconditional write at `i + w`, for a carry leaf `i` that every step
advances by `k`, `(r - w) / k` whole steps ahead (fewer than `max_steps`) or later in
the same step. A warning, not an error: the value read may yet be dropped. See
`docs/guides/buffers.md`, "Checking the rule".
"""

import warnings

import equinox as eqx
import jax.extend.core
import jax.tree_util as jtu

from .._runtime._checks import caller_level
from ._buffers import clamping


class _Offsets:
    """The traced body's jaxpr, read for integers that are an input plus a constant."""

    def __init__(self, body):
        jaxpr = body.jaxpr
        self.inputs = {v: k for k, v in enumerate(jaxpr.invars)}
        self.defs = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        (self.step_in,) = jtu.tree_unflatten(body.in_treedef, jaxpr.invars)
        outs = jtu.tree_unflatten(body.out_treedef, jaxpr.outvars)
        self.out = eqx.combine(outs, body.out_static)
        # per input, how far each step moves a carry leaf it advances by a constant
        self.moves = {}
        for var, new in zip(self.step_in.x, self.out.x):
            found = self.of(new)
            if found is not None and found[0] == self.inputs[var] and found[1] != 0:
                self.moves[found[0]] = found[1]

    def of(self, var) -> tuple[int, int] | None:
        """`(input, offset)` where `var` is input number `input` plus an integer
        constant `offset`; `None` where it is anything else."""
        offset = 0
        while not isinstance(var, jax.extend.core.Literal):
            if var in self.inputs:
                return self.inputs[var], offset
            eqn = self.defs.get(var)
            if eqn is None:
                return None
            name, args = eqn.primitive.name, eqn.invars
            literal = [isinstance(a, jax.extend.core.Literal) for a in args]
            if name == "convert_element_type":
                var = args[0]
            elif name == "add" and literal == [False, True]:
                var, offset = args[0], offset + int(args[1].val)
            elif name == "add" and literal == [True, False]:
                var, offset = args[1], offset + int(args[0].val)
            elif name == "sub" and literal == [False, True]:
                var, offset = args[0], offset - int(args[1].val)
            else:
                return None
        return None

    def along(self, index) -> tuple[int, int] | None:
        """`(input, offset)` of an index with one integer, which a step moves."""
        if len(index.ints) != 1:
            return None
        found = self.of(index.ints[0])
        return found if found is not None and found[0] in self.moves else None


def _reads_ahead(loop, max_steps: int | None):
    """`(read, write, steps)` per read `Site` of `loop`'s body and unconditional
    write `Site` that lands where it read `steps` steps later (0: later in the
    same step), fewer than `max_steps`."""
    offsets = _Offsets(loop.body)
    if not offsets.moves:
        return
    sites = loop.layout.sites
    # a buffer handed to an inner loop is differentiated as a whole array
    handed = {s.leaf for s in sites if s.kind == "hand"}
    reads = zip([s for s in sites if s.kind == "read"], offsets.out.reads)
    writes = list(zip([s for s in sites if s.kind == "write"], offsets.out.writes))
    for read, index in reads:
        r = offsets.along(index)
        if r is None or read.leaf in handed:
            continue
        for write, (_, w_index, _) in writes:
            w = offsets.along(w_index)
            if (
                w is None
                or r[0] != w[0]
                or (read.leaf, read.pattern) != (write.leaf, write.pattern)
                or not write.unconditional
            ):
                continue
            steps, rest = divmod(r[1] - w[1], offsets.moves[r[0]])
            if rest or steps < 0 or (steps == 0 and read.version > write.version):
                continue
            if max_steps is None or steps < max_steps:  # else the loop stops first
                yield read, write, steps


def warn_reads_ahead(loop, names, max_steps: int | None, name: str):
    """Warn where `loop`'s body reads a buffer location that an unconditional write
    of a later step (or later in the same step) makes (see the module)."""
    if (max_steps is not None and max_steps < 2) or clamping():
        return  # one step; or a client's loop, which follows Equinox's rules
    for read, write, steps in _reads_ahead(loop, max_steps):
        when = f"{steps} step{'s' * (steps != 1)} later" if steps else "later"
        warnings.warn(
            f"`{name}`: `body_fun` at {read.where} reads the buffer "
            f"{names[read.leaf]} at a location that it writes {when}, at "
            f"{write.where} (both indices follow a carry leaf that each step "
            "advances). The backward pass reads the buffer as the loop left it, "
            "so if the value read matters, the gradient is wrong. Read only "
            "locations already written; if the value is dropped (`jnp.where`, "
            "multiplied by zero), this warning may be ignored, and "
            "`bl.buffer_checks()` checks it at run time.",
            UserWarning,
            stacklevel=caller_level(),
        )
