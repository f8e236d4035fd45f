"""Shared references for the tests."""

import functools
import math
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

import boundedloop as bl


# The float tolerances' floor on a backend other than the CPU. Tests compare ours, on
# the default backend, with references computed on the host CPU (`on_host`), and an
# accelerator's float32 transcendentals round differently from the host's. On a TPU
# v5e, with matmul precision "highest" (`conftest.py`), the whole suite's gradients
# through a few steps of `tanh` and `sin` differed from the host's by up to 3e-4
# relative (`test_nested.py`, `test_buffer_indexing.py`, `test_forward_mode.py`;
# largest where `1 - tanh**2` cancels). The error is relative to the size of the
# terms a quantity sums, not to each element: a small element that is a difference of
# larger terms carries their absolute error. So off the CPU an array's absolute
# tolerance is at least `ACCELERATOR_RTOL` times its largest magnitude. At 51b94ec
# two such elements missed the elementwise floor on a TPU v5e, both close norm-wise:
# a Hessian element -0.003505 where float64 gives -0.0036648 (1.4e-4 of that block's
# largest, 1.15; `test_forward_mode.py`, 11 steps), and a gradient element 0.022083
# where float64 gives 0.021940 (3.9e-4 of the largest, 0.366; `test_properties.py`,
# 23 steps). And where a whole array is small against the terms it sums, an absolute
# floor: at 47953b9 a gradient element 0.02441 where the host gives 0.02426 (1.5e-4
# off, 2.3e-3 of its array's largest, 0.064; `test_properties.py`, tuple-max23, 23
# steps), beyond the 1e-4 floor of then. `lax.scan` on the same chip was off by the
# same 1.5e-4 there, and by the same as ours in all 18 examples measured
# (`benchmarks/results/tpu_rounding_against_scan_47953b9.txt`): the chip's
# rounding, not the loop's. A wrong answer (the miscompile on the docs page "Correct
# on TPU") is off by 1e-1.
ACCELERATOR_RTOL, ACCELERATOR_ATOL = 1e-3, 3e-4


def accelerator_atol(expected, atol: float) -> float:
    """`atol`, raised off the CPU to the accelerator's floor: `ACCELERATOR_ATOL`, and
    `ACCELERATOR_RTOL` times the largest finite magnitude of `expected`."""
    if jax.default_backend() == "cpu":
        return atol
    magnitudes = np.abs(np.asarray(expected, dtype=np.float64))
    largest = float(magnitudes[np.isfinite(magnitudes)].max(initial=0.0))
    return max(atol, ACCELERATOR_ATOL, ACCELERATOR_RTOL * largest)


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-6) -> bool:
    """Same structure and every leaf close (exactly equal for non-arrays), `y` the
    expected. On a backend other than the CPU, a nonzero tolerance is at least the
    accelerator's floor (`ACCELERATOR_RTOL`; `accelerator_atol` for each leaf)."""
    floored = (rtol or atol) and jax.default_backend() != "cpu"
    if floored:
        rtol = max(rtol, ACCELERATOR_RTOL)
    if jtu.tree_structure(x) != jtu.tree_structure(y):
        return False
    for a, b in zip(jtu.tree_leaves(x), jtu.tree_leaves(y)):
        if isinstance(a, jax.Array | np.ndarray) or isinstance(
            b, jax.Array | np.ndarray
        ):
            if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
                return False
            leaf_atol = accelerator_atol(b, atol) if floored else atol
            if not np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=leaf_atol):
                return False
        elif a != b:
            return False
    return True


def tree_equal(x, y) -> bool:
    """Bit-for-bit equality."""
    return tree_allclose(x, y, rtol=0, atol=0)


def equal_to_host(got, expected) -> bool:
    """`got` (ours, on the default backend) against `expected` (a `lax` reference
    computed on the host, see `on_host`): bit for bit on a CPU backend, where the
    two are the same computation on the same device; elsewhere to the accelerator's
    float tolerance, since its transcendentals round differently from the host's."""
    if jax.default_backend() == "cpu":
        return tree_equal(got, expected)
    return tree_allclose(got, expected)


def scan_loop(body_fun, init, length: int):
    """`length` steps of `body_fun` as a `lax.scan`: the reference for gradients."""
    final, _ = lax.scan(lambda c, _: (body_fun(c), None), init, length=length)
    return final


def on_host(fn):
    """`fn`, run on the host CPU backend: where a test's reference must be computed.

    XLA on a TPU miscompiles some `lax` loops (see the docs page "Correct on TPU"), so a
    reference built from `lax.scan` or `lax.while_loop`, or from a client library's
    loops, is computed on the CPU, whatever the default backend. Array arguments are
    moved there; on a CPU-only machine this changes nothing."""

    @functools.wraps(fn)
    def on_cpu(*args, **kwargs):
        cpu = jax.devices("cpu")[0]
        args, kwargs = jtu.tree_map(
            lambda x: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x,
            (args, kwargs),
        )
        with jax.default_device(cpu):
            return fn(*args, **kwargs)

    return on_cpu


def rounding_spread(fn, *args) -> float:
    """How far any finite element of `fn(*args)`, computed on the host, moves when
    every floating argument moves by one ulp, up and then down: the rounding
    sensitivity of the quantity itself. Where another backend's rounding may take
    another path (an adaptive solver accepting another step), a result can differ
    from the host's by this much and be right."""
    base = jtu.tree_leaves(on_host(fn)(*args))
    spread = 0.0
    for direction in (jnp.inf, -jnp.inf):
        nudged = jtu.tree_map(
            lambda a: (
                jnp.nextafter(a, direction)
                if jnp.issubdtype(jnp.result_type(a), jnp.floating)
                else a
            ),
            args,
        )
        for a, b in zip(base, jtu.tree_leaves(on_host(fn)(*nudged))):
            with np.errstate(invalid="ignore"):  # inf - inf, as `steps` pads with
                moved = np.abs(np.asarray(a) - np.asarray(b))
            spread = max(spread, float(moved[np.isfinite(moved)].max(initial=0.0)))
    return spread


def python_while(cond_fun, body_fun, init, max_steps):
    """The semantics of `bl.while_loop` as a Python loop; returns (final, steps)."""
    val, steps = init, 0
    while (max_steps is None or steps < max_steps) and bool(cond_fun(val)):
        val = body_fun(val)
        steps += 1
    return val, steps


class Counter:
    """Counts (or records) body evaluations through `jax.debug.callback`."""

    def __init__(self):
        self.calls = []

    def __call__(self, value=None):
        jax.debug.callback(self._record, 0 if value is None else value)

    def _record(self, value):
        self.calls.append(int(value))

    def reset(self):
        self.calls = []

    @property
    def count(self):
        return len(self.calls)


def primitive_names(jaxpr) -> list[str]:
    """The names of every primitive in `jaxpr`, sub-jaxprs included, in order."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += primitive_names(sub)
    return out


def copies_in_while_bodies(hlo: str, shape: str, innermost: bool = False) -> list:
    """The `copy` instructions of an array of type `shape` (e.g. `f32[64,256]`)
    inside the computations a compiled program runs as while bodies; with
    `innermost`, only in those bodies that run no while loop carrying such an
    array themselves (the per-step work of the innermost loops). Copies that only
    move the array to another layout or memory space are left out."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)
    bodies = [
        b for b in blocks if any(re.match(rf"%?{re.escape(n)}\b", b) for n in names)
    ]
    assert bodies, "no while loop in the program"
    if innermost:
        bodies = [
            b
            for b in bodies
            if not any(" while(" in line and shape in line for line in b.splitlines())
        ]
    copies = [
        line
        for b in bodies
        for line in b.splitlines()
        if " copy(" in line and shape in line.split("=")[1][:40]
    ]
    return _same_layout_copies(hlo, copies)


def _same_layout_copies(hlo: str, lines: list[str]) -> list[str]:
    """Of the `copy` instructions `lines` of the program `hlo`, those whose result
    has its operand's layout and memory space: the copies an out-of-place update
    makes. A copy that changes either (a TPU's `{2,1,0:T(8,128)S(1)}`, a tiled
    layout in another memory space) is a transfer that the backend's layout and
    memory-space assignment chose, on any program."""
    types = dict(re.findall(r"(%[\w.\-]+) = (\S+)", hlo))
    kept = []
    for line in lines:
        result, inline, operand = re.search(
            r"= (\S+) copy\((?:(\S+) )?(%[\w.\-]+)\)", line
        ).groups()
        if (inline or types.get(operand, result)) == result:
            kept.append(line)
    return kept


def counters_known_to_xla(lowered) -> tuple[int, list[str]]:
    """The `stablehlo.while` loops of a lowered program, and those of their carried
    integer or boolean operands whose initial value XLA can compute at compile time.

    An operand is known when it is a constant or computed from known values only,
    through any operation but `optimization_barrier` (a function's argument is known
    when some call passes a known value: XLA inlines calls). Operands the body passes
    through unchanged are left out: a loop invariant has one value at every step.
    XLA's while-loop simplifier reasons from known initial counters, and on a TPU it
    has miscompiled loops so (see `boundedloop/_shard_map.py`). The StableHLO is what
    JAX hands XLA, before any backend pass, so the answer is the same on every
    backend.

    **Returns:**

    `(loops, known)`: the number of while loops, and one line per known operand.
    """
    from jax._src.lib.mlir import ir

    calls, loops, known = {}, [], {}

    def walk(op):
        if op.name == "func.call":
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            calls.setdefault(callee, []).append(list(op.operands))
        if op.name == "stablehlo.while":
            loops.append(op)
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner)

    def is_known(value) -> bool:
        value = value.maybe_downcast()
        if value in known:
            return known[value]
        known[value] = False  # a cycle is not known
        if isinstance(value, ir.BlockArgument):
            parent = value.owner.owner
            result = parent.name == "func.func" and any(
                is_known(operands[value.arg_number])
                for operands in calls.get(
                    ir.StringAttr(parent.attributes["sym_name"]).value, []
                )
            )
        else:
            op = value.owner
            opaque = ("optimization_barrier", "custom_call", "rng", "while")
            result = op.name.split(".")[-1] not in opaque and all(
                is_known(x) for x in op.operands
            )
        known[value] = result
        return result

    for op in lowered.compiler_ir("stablehlo").body.operations:
        walk(op.operation)
    found = []
    for n, loop in enumerate(loops):
        block = loop.regions[1].blocks[0]
        returned = list(block.operations)[-1].operands
        for k, x in enumerate(loop.operands):
            element = ir.RankedTensorType(x.type).element_type
            if returned[k] == block.arguments[k] or not isinstance(
                element, ir.IntegerType
            ):
                continue
            if is_known(x):
                found.append(f"loop {n}, operand {k}: {x.type}")
    return len(loops), found


def largest_array_in_loops(lowered) -> int:
    """The bytes of the largest array that an operation inside a `stablehlo.while`
    loop of a lowered program takes or makes (following calls made inside loops).
    XLA's CPU runtime runs a loop body's operations in order on one thread only
    while none touches more than 512 bytes (`_cost_model.IN_ORDER_BYTES`)."""
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    functions = {
        ir.StringAttr(op.attributes["sym_name"]).value: op
        for op in module.body.operations
        if op.operation.name == "func.func"
    }
    sizes, seen = [0], set()

    def nbytes(value) -> int:
        try:
            t = ir.RankedTensorType(value.type)
        except (TypeError, ValueError):  # a token, a tuple: not an array
            return 0
        width = getattr(t.element_type, "width", 8)  # an integer's or float's bits
        return math.prod(t.shape) * max(width // 8, 1)

    def walk(op, in_loop: bool):
        in_loop = in_loop or op.name == "stablehlo.while"
        if in_loop:
            sizes.extend(nbytes(v) for v in (*op.operands, *op.results))
            if op.name == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                if callee not in seen:
                    seen.add(callee)
                    walk(functions[callee].operation, True)
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner, in_loop)

    for op in module.body.operations:
        walk(op.operation, False)
    return max(sizes)


class Halving(bl.LoopModule):
    """A `LoopModule` that halves its carry while it is above `tol`."""

    tol: float

    def cond(self, carry):
        return carry > self.tol

    def body(self, carry):
        return carry / 2
