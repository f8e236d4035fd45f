"""The static cost estimates that pick how the sweeps run, and their thresholds, in
one place. Each choice changes only speed and compile time, never a result: see
`docs/architecture.md`, "The cost model".
"""

import math

import jax
import jax.extend.core

from ._store_rules import TABLE_STEPS


# a body with at most this many equations (nested ones included) is cheap
SMALL_BODY = 64
# so is one whose equations produce at most this many elements each on average (a
# dot counting its multiply-adds): its steps cost per operation, as the control does
LIGHT_WORK = 16
# but not one whose step does at least this much work in all, however few its
# equations: past it the nested loops' compile costs more than they save
# (`docs/design-notes.md`)
HEAVY_WORK = 2**20


def equations(jaxpr) -> int:
    """Equations in `jaxpr`, those of the jaxprs inside it included (once)."""
    return sum(
        1 + sum(map(equations, jax.extend.core.jaxprs_in_params(e.params)))
        for e in jaxpr.eqns
    )


def _size(v) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def _written(e) -> int | None:
    """Elements an in-place update writes (`dynamic_update_slice`'s update, any
    scatter's updates), `None` for another equation: the rest of its output is its
    input, not work."""
    if e.primitive.name == "dynamic_update_slice":
        return _size(e.invars[1])
    if e.primitive.name.startswith("scatter"):
        return _size(e.invars[2])
    return None


def work(jaxpr) -> int:
    """Elements `jaxpr`'s equations produce, a dot's multiply-adds counted twice, an
    in-place update's written elements only (a buffer's row, not the buffer), and
    those of the jaxprs inside it (once)."""
    total = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            (contracted, _), _ = e.params["dimension_numbers"]
            lhs = e.invars[0].aval.shape
            size = 2 * math.prod(lhs[d] for d in contracted)
            total += size * _size(e.outvars[0])
        elif (written := _written(e)) is not None:
            total += written
        else:
            total += sum(map(_size, e.outvars))
        total += sum(map(work, jax.extend.core.jaxprs_in_params(e.params)))
    return total


def is_cheap(body) -> bool:
    """Whether the traced (closure-converted) `body`'s steps are cheap: less than
    `HEAVY_WORK` in all, and at most `SMALL_BODY` equations or at most `LIGHT_WORK`
    elements per equation."""
    n, total = equations(body.jaxpr), work(body.jaxpr)
    return total < HEAVY_WORK and (n <= SMALL_BODY or total <= LIGHT_WORK * n)


def shares_one_step(body, backend: str | None = None) -> bool:
    """Whether the reverse sweep runs as one loop whose iterations share one
    evaluation of the step (`_reverse_sweep.drive`): on a TPU, a step of at least
    `HEAVY_WORK` (of a loop without buffers, whose cotangents the loop's `lax.cond`
    would copy where a step reads one whole). The backend is JAX's default when the
    loop is traced (as for `runs_in_order`) unless `backend` names one.

    On the chip the plain sweep's reverse loop moves a large cotangent between HBM
    and the chip's memory at every reversed step, which the one loop does not, and
    its program holds the step's forward once fewer; on a CPU the plain sweep is
    the faster to run and to compile (`docs/performance.md`, "One loop")."""
    on_tpu = (backend or jax.default_backend()) == "tpu"
    return on_tpu and work(body.jaxpr) >= HEAVY_WORK


def stores_before_taping(body, backend: str | None = None) -> bool:
    """Whether a `memory=` budget stores the carry at every step rather than tape
    the step's residuals, where both would fit (`_tape.plan`): on a TPU, a step of
    less than `HEAVY_WORK`. The backend is JAX's default when the loop is traced
    unless `backend` names one.

    On the chip each taped residual is a write in the forward sweep and a read in
    the reverse one, a kernel each at every step, where a light step costs about as
    much: diffrax's neural ODE (work 11770, 15 residual arrays of 821 bytes a step)
    took 13.9 ms per gradient with every step taped against 9.3 ms with every
    step's carry stored (`docs/design-notes.md`, "How a memory budget is split")."""
    on_tpu = (backend or jax.default_backend()) == "tpu"
    return on_tpu and work(body.jaxpr) < HEAVY_WORK


# a bounded loop's recomputation reads its splits from a listed table of at most
# this many entries (4 MB) on a CPU, and of at most `LISTED_SPLITS_OFF_CPU` (256 kB)
# elsewhere (`lists_splits`)
LISTED_SPLITS = 2**20
LISTED_SPLITS_OFF_CPU = 2**16


def lists_splits(slots: int, max_steps: int | None, backend: str | None = None) -> bool:
    """Whether the recomputation reads each split from a table of every split
    (`_recompute.split_rule`) rather than computing it: for a loop bounded by at
    most `_store_rules.TABLE_STEPS` steps whose table has at most `LISTED_SPLITS`
    entries on a CPU, `LISTED_SPLITS_OFF_CPU` elsewhere. The backend is JAX's
    default when the loop is traced unless `backend` names one.

    On a CPU one lookup makes fewer kernels than the computed split. On the chip a
    small table helps too, and a large one costs more than it saves
    (`docs/performance.md`, "The recomputation's split on the chip"): at 17 x 1025
    entries (70 kB; `headline.py`, 16 checkpoints, `max_steps=1024`) the gradient
    took 146.0 ms listed against 146.8 ms computed, and compiled in 0.88 times
    equinox's wall time against 0.91; at 91 x 4097 (1.5 MB; diffrax's neural ODE,
    90 checkpoints, `max_steps=4096`) it took 15.1 ms listed against 8.9 ms. The
    limit off a CPU lies between the two."""
    on_cpu = (backend or jax.default_backend()) == "cpu"
    bounded = max_steps is not None and max_steps <= TABLE_STEPS
    limit = LISTED_SPLITS if on_cpu else LISTED_SPLITS_OFF_CPU
    return bounded and (slots + 1) * (max_steps + 1) <= limit


# XLA's CPU runtime runs a loop body's operations in order on the calling thread
# when none touches more than this many bytes (`docs/design-notes.md`)
IN_ORDER_BYTES = 512
# the loop form of the recomputation's split is exact in int32 for segments up to
# this long (`_recompute.split_rule`)
IN_ORDER_STEPS = 2**17


def _largest(jaxpr) -> int:
    """The bytes of the largest array `jaxpr` (and any jaxpr inside it) names."""
    variables = [*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars]
    variables += [v for e in jaxpr.eqns for v in (*e.invars, *e.outvars)]
    # (a token has no dtype, and no size)
    sizes = [
        _size(v) * v.aval.dtype.itemsize for v in variables if hasattr(v.aval, "dtype")
    ]
    inner = [
        _largest(j)
        for e in jaxpr.eqns
        for j in jax.extend.core.jaxprs_in_params(e.params)
    ]
    return max(sizes + inner, default=0)


def runs_in_order(body, slots: int, max_steps: int | None, arrays) -> bool:
    """Whether a differentiated loop's sweeps keep every array within
    `IN_ORDER_BYTES` (on a CPU; elsewhere `False`). The backend is JAX's default
    when the loop is traced: a program traced on a CPU host and lowered for another
    platform (`jax.export`) gets the CPU's choice, which changes only its speed.

    **Arguments:**

    - `body`: the traced (closure-converted) body.
    - `slots`: the checkpoints.
    - `max_steps`: the loop's bound (`None`: unbounded, never in order).
    - `arrays`: the sweeps' other arrays: a row per slot of each carry leaf
        (stacked, as the storage holds them) and the buffers, as shapes and dtypes.
    """
    if jax.default_backend() != "cpu" or max_steps is None:
        return False
    if max_steps > IN_ORDER_STEPS:
        return False
    # the schedule's own arrays hold an int32 per slot, and one more
    sizes = [4 * (slots + 1), _largest(body.jaxpr)]
    sizes += [math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(arrays)]
    return max(sizes) <= IN_ORDER_BYTES


# buffers' cotangents up to this many bytes in all are cheaper to copy than to keep
# in place by ordering their reads first
SMALL_BUFFERS = 16 * 1024


def orders_buffer_reads(ct_bufs) -> bool:
    """Whether a reversed step orders its reads of the buffers' cotangents `ct_bufs`
    before their in-place updates (larger than `SMALL_BUFFERS` in all)."""
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(ct_bufs))
    return nbytes > SMALL_BUFFERS
