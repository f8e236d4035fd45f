"""A read of a buffer location that a later step writes, found while tracing.

A read sees the buffer as it is at that point of the loop, as a `jnp` array's would;
the backward pass sees it as the loop left it. So a read of a location that a later
step writes makes the gradient wrong wherever the value read matters. Whether it
matters is known only at run time (`bl.buffer_checks`); that a later step writes it
is often clear from the body alone: the read is at `i + r` and an unconditional
write at `i + w`, for a carry leaf `i` that every step advances by `k`, with
`(r - w) / k` a whole number of steps ahead, fewer than `max_steps` (or the same
step, the read before the write). `warn_reads_ahead` looks for that in the traced body's jaxpr and warns: the
value read may yet be dropped (`jnp.where`), so it is not an error.
"""

import warnings

import equinox as eqx
import jax.extend.core
import jax.tree_util as jtu

from .._runtime._checks import caller_level
from ._buffers import clamping


def _offset_of(var, defs, inputs) -> tuple[int, int] | None:
    """`(input, offset)` where `var` is input number `input` plus an integer
    constant `offset`; `None` where it is anything else."""
    offset = 0
    while not isinstance(var, jax.extend.core.Literal):
        if var in inputs:
            return inputs[var], offset
        eqn = defs.get(var)
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


def warn_reads_ahead(loop, names, max_steps: int | None, name: str):
    """Warn where `loop`'s body reads a buffer location that an unconditional write
    of a later step (or later in the same step) makes (see the module)."""
    if (max_steps is not None and max_steps < 2) or clamping():
        return  # one step; or a client's loop, which follows Equinox's rules
    body = loop.body
    jaxpr = body.jaxpr
    inputs = {v: k for k, v in enumerate(jaxpr.invars)}
    defs = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    (step_in,) = jtu.tree_unflatten(body.in_treedef, jaxpr.invars)
    out = eqx.combine(
        jtu.tree_unflatten(body.out_treedef, jaxpr.outvars), body.out_static
    )
    # per input, how far each step moves a carry leaf that it advances by a constant
    moves = {}
    for var, new in zip(step_in.x, out.x):
        found = _offset_of(new, defs, inputs)
        if found is not None and found[0] == inputs[var] and found[1] != 0:
            moves[found[0]] = found[1]
    if not moves:
        return
    sites = loop.layout.sites
    # a buffer handed to an inner loop is differentiated as a whole array
    handed = {s.leaf for s in sites if s.kind == "hand"}
    reads = [s for s in sites if s.kind == "read"]
    writes = [s for s in sites if s.kind == "write"]

    def along(index):
        """`(input, offset)` of an index with one integer, which a step moves."""
        if len(index.ints) != 1:
            return None
        found = _offset_of(index.ints[0], defs, inputs)
        return found if found is not None and found[0] in moves else None

    for read, index in zip(reads, out.reads):
        r = along(index)
        for write, (_, w_index, _) in zip(writes, out.writes):
            w = along(w_index)
            if (
                r is None
                or w is None
                or r[0] != w[0]
                or read.leaf != write.leaf
                or read.leaf in handed
                or read.pattern != write.pattern
                or not write.unconditional
            ):
                continue
            steps, rest = divmod(r[1] - w[1], moves[r[0]])
            if rest or steps < 0 or (steps == 0 and read.version > write.version):
                continue
            if max_steps is not None and steps >= max_steps:
                continue  # the loop stops before the write lands
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
