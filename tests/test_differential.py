"""Our loops on the default backend against references computed where they are right.

XLA on a TPU has miscompiled loops whose counter starts at a known constant (JAX
0.10.2, TPU v5e: a `lax.while_loop` whose step 0 should read `x` read row 0 of a
buffer; see the docs page "Correct on TPU"). Our loops hide their counters' initial
values from XLA (`boundedloop/_shard_map.opaque_counters`). These tests hold that on
whatever backend runs them:

- one body of the miscompiled kind through every transform, at several checkpoint
  counts and `memory=` budgets, with and without `buffers=`, against the same transform of an unrolled
  Python loop (no loop for XLA to simplify) computed on the host CPU backend;
- the lowered program of every kind of loop we emit carries no carried counter whose
  initial value XLA knows (a check that needs no accelerator);
- a property-based fuzzer: random small bodies built from counter-dependent selects,
  dynamic row reads and in-place row writes, random trip counts and `max_steps`,
  through the transforms, against float64 (complex-step) NumPy. The default suite
  runs a few bodies; `BOUNDEDLOOP_FUZZ_EXAMPLES=2000 python -m pytest -n 0
  tests/test_differential.py -k fuzz` runs many, and `BOUNDEDLOOP_FUZZ_FINDINGS=FILE`
  also runs each body on `lax.fori_loop` (static bounds) on the default backend and writes one JSON
  line per body with both errors (how the docs' findings were made).
"""

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, Phase, settings, strategies as st
from jax import lax

import boundedloop as bl
from boundedloop._api import _memory_plan
from boundedloop._sweeps import _tape

from .helpers import counters_known_to_xla, on_host, tree_allclose


ROWS, STEPS = 6, 4
W = np.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]], np.float32)
X0 = np.array([0.3, -0.2, 0.5], np.float32)
V = np.array([0.7, -1.1, 0.4], np.float32)


def body(carry):
    """Step `i` reads the row step `i - 1` wrote; step 0 reads `x`."""
    x, buf, i, n = carry
    prev = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], x)
    return x, buf.at[i].set(jnp.tanh(W @ prev + 0.1) * x), i + 1, n


def unrolled(x):
    """`body`'s loop, unrolled in Python with a Python counter: nothing for XLA's
    loop passes to reason about."""
    buf = jnp.zeros((ROWS, 3))
    for i in range(STEPS):
        prev = x if i == 0 else buf[i - 1]
        buf = buf.at[i].set(jnp.tanh(W @ prev + 0.1) * x)
    return buf


# How the gradient stores the carry: counts, and budgets in bytes that buy (for this
# carry of 80 bytes, or 8 with `buffers=`, and a tape row of 57 or 58 bytes, with
# steps planned as costly by `_costly_steps`) only checkpoints (or, with buffers,
# blocks), blocks between checkpoints, and a tape of every step (`bl.memory_plan`)
SETTINGS = {
    "1": dict(checkpoints=1),
    "2": dict(checkpoints=2),
    "None": dict(checkpoints=None),
    "150B": dict(memory=150),
    "300B": dict(memory=300),
    "1000B": dict(memory=1000),
}


@pytest.fixture(autouse=True)
def _costly_steps(monkeypatch):
    """A budget stores this file's cheap steps every step rather than taping them
    (`_tape.plan`): planned as costly, its budgets take the tape's paths."""
    for module in (_tape, _memory_plan):
        monkeypatch.setattr(module, "is_cheap", lambda body: False)
        monkeypatch.setattr(module, "stores_before_taping", lambda body: False)


def ours(setting, buffers):
    """`body`'s loop, its gradient stored as `setting` says: a checkpoint count, or
    a key of `SETTINGS`."""
    kwargs = (
        SETTINGS[setting] if isinstance(setting, str) else dict(checkpoints=setting)
    )

    def rows(x):
        init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(STEPS))
        lent = dict(buffers=lambda c: c[1]) if buffers else {}
        out = bl.while_loop(
            lambda c: c[2] < c[3], body, init, max_steps=ROWS, **kwargs, **lent
        )
        return out[1]

    return rows


def _sum_squares(f):
    return lambda x: jnp.sum(f(x) ** 2)


TRANSFORMS = {
    "primal": lambda f: jax.jit(f)(X0),
    "jvp": lambda f: jax.jit(lambda x, v: jax.jvp(f, (x,), (v,))[1])(X0, V),
    "jacfwd": lambda f: jax.jit(jax.jacfwd(f))(X0),
    "jacrev": lambda f: jax.jit(jax.jacrev(f))(X0),
    "grad": lambda f: jax.jit(jax.grad(_sum_squares(f)))(X0),
    "vmap_jvp": lambda f: jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (V,))[1]))(
        np.stack([X0, -X0])
    ),
    "hessian": lambda f: jax.jit(jax.hessian(_sum_squares(f)))(X0),
}


# a budget changes only what reverse mode keeps: its forward-mode rows run with `-m slow`;
# `jacrev` and `hessian`, compositions of what `grad` and `jvp` run at every
# setting, run by default at one count and one budget
REVERSE = {"jacrev", "grad", "hessian"}
COMPOSED = {"jacrev", "hessian"}


def _slow_row(transform: str, setting: str) -> bool:
    if "memory" in SETTINGS[setting] and transform not in REVERSE:
        return True
    return transform in COMPOSED and setting not in ("2", "300B")


ROW_GRID = [
    pytest.param(
        transform,
        setting,
        marks=pytest.mark.slow if _slow_row(transform, setting) else (),
    )
    for transform in TRANSFORMS
    for setting in SETTINGS
]


@pytest.mark.parametrize("buffers", [False, True], ids=["carry", "buffers"])
@pytest.mark.parametrize("transform, setting", ROW_GRID)
def test_reads_the_row_written_before(transform, setting, buffers):
    apply = TRANSFORMS[transform]
    expected = on_host(lambda: apply(unrolled))()
    got = apply(ours(setting, buffers))
    # float32 through 4 tanh steps (and their derivatives): a wrong row read gives
    # errors of 1e-1, rounding about 1e-6
    assert tree_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------
# The guard is in every loop we emit.


def _shard_mapped(f):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("data")

    def per_device(x):
        return f(x[0])[None]

    return jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)


def _nested(x):
    def outer(carry):
        x, j = carry
        inner = ours(2, False)(x)
        return x + inner[STEPS - 1], j + 1

    return bl.while_loop(lambda c: c[1] < 2, outer, (x, 0), max_steps=3)[0]


def _moving(x):
    """A loop whose every carry leaf changes each step."""

    def step(carry):
        x, i = carry
        return jnp.where(i > 0, jnp.tanh(W @ x), 2 * x), i + 1

    return bl.while_loop(lambda c: c[1] < STEPS, step, (x, 0), max_steps=ROWS)[0]


def _scan(x):
    def step(c, _):
        return body(c), None

    init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(STEPS))
    return bl.scan(step, init, length=STEPS, checkpoints=2)[0][1]


def _fori(x):
    init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(STEPS))
    return bl.fori_loop(0, STEPS, lambda _, c: body(c), init, checkpoints=2)[1]


def _unbounded(x):
    init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(STEPS))
    return bl.while_loop(lambda c: c[2] < c[3], body, init, max_steps=None)[1]


def _batched_stop(x):
    def rows(x, n):
        init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), n)
        return bl.while_loop(
            lambda c: c[2] < c[3], body, init, max_steps=ROWS, buffers=lambda c: c[1]
        )[1]

    return jax.vmap(rows)(jnp.stack([x, x]), jnp.array([2, STEPS]))


LOOP_KINDS = {
    "forward": ours(2, False),
    "forward_buffers": ours(2, True),
    "grad": jax.grad(_sum_squares(ours(2, False))),
    "grad_buffers": jax.grad(_sum_squares(ours(1, True))),
    "grad_unbounded": jax.grad(_sum_squares(_unbounded)),
    "grad_blocks": jax.grad(_sum_squares(ours("300B", False))),
    "grad_tape_buffers": jax.grad(_sum_squares(ours("1000B", True))),
    "jvp": lambda x: jax.jvp(ours(None, True), (x,), (x,))[1],
    "vmap_grad_batched_stop": jax.grad(_sum_squares(_batched_stop)),
    "hessian": jax.hessian(_sum_squares(ours(2, True))),
    "grad_of_jvp": jax.grad(lambda x: jnp.sum(jax.jvp(ours(2, False), (x,), (x,))[1])),
    "scan_grad": jax.grad(_sum_squares(_scan)),
    "fori_grad": jax.grad(_sum_squares(_fori)),
    "nested_grad": jax.grad(_sum_squares(_nested)),
    "shard_map": lambda x: _shard_mapped(ours(2, False))(x[None]),
    "shard_map_jvp": lambda x: jax.jvp(
        _shard_mapped(ours(2, False)), (x[None],), (x[None],)
    ),
    "shard_map_grad": lambda x: jax.grad(_sum_squares(_shard_mapped(_moving)))(x[None]),
}


@pytest.mark.parametrize("kind", list(LOOP_KINDS))
def test_no_loop_starts_from_a_counter_xla_knows(kind):
    loops, known = counters_known_to_xla(jax.jit(LOOP_KINDS[kind]).lower(X0))
    assert loops > 0
    assert not known, known


@pytest.mark.parametrize("buffers", [False, True], ids=["carry", "buffers"])
def test_shard_map_reads_the_row_written_before(buffers):
    """Inside `shard_map`: a buffer read in the body, and a carry leaf (`x`) that the
    body passes through unchanged, whose cotangent arrives unvarying (both failed
    before: `new_input`'s type without a mesh, the reverse step's VJP)."""
    grad = jax.grad(_sum_squares(_shard_mapped(ours(2, buffers))))
    expected = on_host(jax.grad(_sum_squares(unrolled)))(X0)
    assert tree_allclose(jax.jit(grad)(X0[None])[0], expected, rtol=1e-4, atol=1e-4)


@jax.custom_jvp
def _tanh_matvec(a, x):
    return jnp.tanh(a @ x)


@_tanh_matvec.defjvp
def _tanh_matvec_jvp(primals, tangents):
    (a, x), (ta, tx) = primals, tangents
    y = jnp.tanh(a @ x)
    return y, (1 - y**2) * (ta @ x + a @ tx)


# what a body may run inside `shard_map`, each on `W`, which the body closes over
INSIDE_THE_BODY = {
    "bl.while_loop": lambda x: ours(2, False)(x)[STEPS - 1],
    "jit": lambda x: jax.jit(lambda a, x: jnp.tanh(a @ x))(W, x),
    "jit_closure": lambda x: jax.jit(lambda x: jnp.tanh(W @ x))(x),
    "cond": lambda x: lax.cond(
        x[0] > 0, lambda x: jnp.tanh(W @ x), lambda x: jnp.sin(W @ x), x
    ),
    "custom_jvp": lambda x: _tanh_matvec(W, x),
    "checkpoint": lambda x: jax.checkpoint(lambda x: jnp.tanh(W @ x))(x),
    "scan": lambda x: lax.scan(lambda c, _: (jnp.tanh(W @ c), None), x, length=2)[0],
    "fori_loop": lambda x: lax.fori_loop(0, 2, lambda i, c: jnp.tanh(W @ c), x),
    "while_loop": lambda x: lax.while_loop(
        lambda c: c[1] < 2, lambda c: (jnp.tanh(W @ c[0]), c[1] + 1), (x, 0)
    )[0],
    # `W` combined with a value made in the body, before the carry: alike (the
    # same on every device) when traced, not when replayed on varying values
    "made_in_the_body": lambda x: 0.1 * x * (jnp.zeros(3) + jnp.tanh(W).sum(0)),
    # a loop whose carry starts as a value made in the body and takes in `W`
    "fori_accumulates": lambda x: (
        0.1
        * x
        * lax.fori_loop(0, 2, lambda i, acc: acc + jnp.tanh(W).sum(0), jnp.zeros(3))
    ),
    "while_accumulates": lambda x: (
        0.1
        * x
        * lax.while_loop(
            lambda c: c[1] < 2,
            lambda c: (c[0] + jnp.tanh(W).sum(0), c[1] + 1),
            (jnp.zeros(3), 0),
        )[0]
    ),
    "scan_over_W": lambda x: x + lax.scan(lambda c, w: (c, jnp.tanh(w @ x)), 0.0, W)[1],
    # branches whose outputs vary alike when traced, not when replayed
    "cond_made_in_a_branch": lambda x: (
        x * lax.cond(x[0] > 0, lambda: jnp.tanh(W).sum(0), lambda: jnp.ones(3))
    ),
}
REFERENCES = {"bl.while_loop": lambda x: unrolled(x)[STEPS - 1]}
# `lax.while_loop` has no reverse mode: forward mode only
FORWARD_ONLY = {"while_loop", "while_accumulates"}
SHARD_MAP_TRANSFORMS = {
    "primal": lambda f: f,
    "grad": lambda f: jax.grad(_sum_squares(f)),
    "jvp": lambda f: lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1],
    "hessian": lambda f: jax.hessian(_sum_squares(f)),
}


def _outer(inner):
    """Three steps of `x <- x / 2 + inner(x)`: as our loop, and unrolled."""

    def step(x):
        return 0.5 * x + inner(x)

    def f(x):
        final = bl.while_loop(
            lambda c: c[1] < 3,
            lambda c: (step(c[0]), c[1] + 1),
            (x, 0),
            max_steps=4,
            checkpoints=2,
        )
        return final[0]

    def reference(x):
        for _ in range(3):
            x = step(x)
        return x

    return f, reference


def _first_transform(inside: str) -> str:
    """The default run's transform of a body: `grad` (which runs the forward too),
    or `jvp` where there is no reverse mode."""
    return "jvp" if inside in FORWARD_ONLY else "grad"


# the default run: `_first_transform`; `-m slow`: every transform
SHARD_MAP_GRID = [
    pytest.param(
        inside,
        transform,
        marks=() if transform == _first_transform(inside) else pytest.mark.slow,
    )
    for inside in INSIDE_THE_BODY
    for transform in SHARD_MAP_TRANSFORMS
]


@pytest.mark.parametrize("inside, transform", SHARD_MAP_GRID)
def test_shard_map_body_runs(inside, transform):
    """A body that runs a nested loop, a `jit`, a `cond`, a custom JVP, a
    `jax.checkpoint` or a `lax` loop on an array it closes over, or combines that
    array with a value it makes, inside `shard_map`, under each transform, against
    the same steps unrolled on the host. Once, the nested loop, the
    custom JVP and the values made in the body failed, primal included, and the
    other loops and `jax.checkpoint` under `grad` and `hessian`: the body is traced
    with `W` the same on every device and replayed with it varying (see
    `_closure._retyped_equation`)."""
    if inside in FORWARD_ONLY and transform in ("grad", "hessian"):
        pytest.skip("`lax.while_loop` cannot be reverse-differentiated")
    apply = SHARD_MAP_TRANSFORMS[transform]
    ours_fn, _ = _outer(INSIDE_THE_BODY[inside])
    _, reference = _outer(REFERENCES.get(inside, INSIDE_THE_BODY[inside]))
    got = jax.jit(apply(_shard_mapped(ours_fn)))(X0[None])
    expected = on_host(apply(lambda x: reference(x[0])[None]))(X0[None])
    assert tree_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_the_check_finds_lax_counters():
    """The check above can fail: `lax.while_loop` hands XLA its counter's 0."""

    def rows(x):
        init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(STEPS))
        return lax.while_loop(lambda c: c[2] < c[3], body, init)[1]

    loops, known = counters_known_to_xla(jax.jit(rows).lower(X0))
    assert loops == 1 and len(known) == 1 and known[0].endswith("tensor<i32>")


# ---------------------------------------------------------------------------------
# The fuzzer: random bodies against float64 NumPy.


class Read(NamedTuple):
    """A read of the row written `lag` steps before, or of `x` while `i < lag`."""

    lag: int  # 1 or 2
    test: str  # how `i >= lag` is written
    index: str  # how the row index `i - lag` is clamped


class Program(NamedTuple):
    reads: tuple[Read, ...]
    update: str  # "tanh" or "sin"
    scale_at: int  # `x` is scaled by 1.5 after the step of this index (-1: never)
    steps: int  # the natural trip count
    max_steps: int | None
    checkpoints: int | None
    memory: int | None  # bytes (then `checkpoints` is None)
    buffers: bool


TESTS = {
    ">": lambda i, lag: i > lag - 1,
    ">=": lambda i, lag: i >= lag,
    "!<": lambda i, lag: jnp.logical_not(i < lag),
    "-0": lambda i, lag: i - lag >= 0,
    "cond": lambda i, lag: i > lag - 1,  # `lax.cond(i > lag - 1, ...)`
}
INDICES = {
    "max": lambda i, lag: jnp.maximum(i - lag, 0),
    "clip": lambda i, lag: jnp.clip(i - lag, 0, ROWS - 1),
    "raw": lambda i, lag: i - lag,  # negative: wraps, and is not selected
    "dynamic": lambda i, lag: jnp.maximum(i - lag, 0),  # `lax.dynamic_index_in_dim`
}
# a buffer cannot be read inside `lax.cond` or by `lax.dynamic_index_in_dim`
CARRY_ONLY = {"cond", "dynamic"}


def _read(read: Read, x, buf, i, plain: bool):
    index = INDICES[read.index](i, read.lag)
    if read.index == "dynamic":
        row = lax.dynamic_index_in_dim(buf, index, keepdims=False)
    else:
        row = buf[index]
    later = TESTS[read.test](i, read.lag)
    if read.test == "cond" and plain:
        return lax.cond(later, lambda: row, lambda: x)
    return jnp.where(later, row, x)


def _fuzz_body(program: Program, plain: bool):
    def step(carry):
        x, buf, i, n = carry
        total = sum(_read(r, x, buf, i, plain) for r in program.reads)
        if program.update == "tanh":
            row = jnp.tanh(W @ total + 0.1) * x
        else:
            row = jnp.sin(0.7 * total) + 0.3 * x
        x = jnp.where(i == program.scale_at, 1.5 * x, x)
        return x, buf.at[i].set(row), i + 1, n

    return step


def _fuzz_loop(program: Program, on_lax: bool):
    step = _fuzz_body(program, plain=on_lax or not program.buffers)
    bound = program.max_steps

    def run(x):
        init = (x, jnp.zeros((ROWS, 3)), jnp.array(0), jnp.array(program.steps))
        if on_lax:  # static bounds: a `lax.scan`, which reverse mode accepts
            trip = program.steps if bound is None else min(program.steps, bound)
            out = lax.fori_loop(0, trip, lambda _, c: step(c), init)
        else:
            kwargs = dict(buffers=lambda c: c[1]) if program.buffers else {}
            out = bl.while_loop(
                lambda c: c[2] < c[3],
                step,
                init,
                max_steps=bound,
                checkpoints=program.checkpoints,
                memory=program.memory,
                **kwargs,
            )
        return jnp.concatenate([out[0], out[1].ravel()])

    return run


def _numpy_run(program: Program, x):
    """The program in NumPy, with Python counters, in `x`'s dtype (complex128)."""
    buf = np.zeros((ROWS, 3), x.dtype)
    trip = (
        program.steps
        if program.max_steps is None
        else min(program.steps, program.max_steps)
    )
    for i in range(trip):
        total = sum(buf[i - r.lag] if i >= r.lag else x for r in program.reads)
        if program.update == "tanh":
            row = np.tanh(W.astype(np.float64) @ total + 0.1) * x
        else:
            row = np.sin(0.7 * total) + 0.3 * x
        buf[i] = row
        if i == program.scale_at:
            x = 1.5 * x
    return np.concatenate([x, buf.ravel()])


def _numpy_jacobian(program: Program, x):
    """The Jacobian at `x` by the complex step: exact to float64 rounding."""
    h = 1e-30
    x = x.astype(np.complex128)
    return np.stack(
        [_numpy_run(program, x + 1j * h * e).imag / h for e in np.eye(3)], axis=1
    )


FUZZ_TRANSFORMS = ("primal", "jvp", "jacfwd", "jacrev", "grad", "vmap_jvp")
OUT_WEIGHTS = np.linspace(-1.0, 1.0, 3 + 3 * ROWS).astype(np.float32)


def _fuzz_apply(transform: str, f):
    if transform == "primal":
        return jax.jit(f)(X0)
    if transform == "jvp":
        return jax.jit(lambda x, v: jax.jvp(f, (x,), (v,))[1])(X0, V)
    if transform == "jacfwd":
        return jax.jit(jax.jacfwd(f))(X0)
    if transform == "jacrev":
        return jax.jit(jax.jacrev(f))(X0)
    if transform == "grad":
        return jax.jit(jax.grad(lambda x: jnp.dot(f(x), OUT_WEIGHTS)))(X0)
    return jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (V,))[1]))(np.stack([X0, -X0]))


def _fuzz_truth(transform: str, program: Program):
    x = X0.astype(np.float64)
    if transform == "primal":
        return _numpy_run(program, x)
    jac = _numpy_jacobian(program, x)
    if transform == "jvp":
        return jac @ V
    if transform in ("jacfwd", "jacrev"):
        return jac
    if transform == "grad":
        return OUT_WEIGHTS @ jac
    return np.stack([jac @ V, _numpy_jacobian(program, -x) @ V])


@st.composite
def programs(draw):
    buffers = draw(st.booleans())
    tests = [t for t in TESTS if not (buffers and t in CARRY_ONLY)]
    indices = [i for i in INDICES if not (buffers and i in CARRY_ONLY)]
    reads = draw(
        st.lists(
            st.builds(
                Read,
                st.sampled_from([1, 2]),
                st.sampled_from(tests),
                st.sampled_from(indices),
            ),
            min_size=1,
            max_size=2,
        )
    )
    memory = draw(st.sampled_from([None, None, 150, 300, 1000]))
    return Program(
        reads=tuple(reads),
        update=draw(st.sampled_from(["tanh", "sin"])),
        scale_at=draw(st.integers(-1, ROWS - 1)),
        steps=draw(st.integers(0, ROWS)),
        max_steps=draw(st.one_of(st.none(), st.integers(0, ROWS))),
        checkpoints=None if memory else draw(st.one_of(st.none(), st.integers(1, 3))),
        memory=memory,
        buffers=buffers,
    )


_EXAMPLES = int(os.environ.get("BOUNDEDLOOP_FUZZ_EXAMPLES", "6"))
_FINDINGS = os.environ.get("BOUNDEDLOOP_FUZZ_FINDINGS")


@settings(
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize="BOUNDEDLOOP_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    # each example compiles: shrinking by search would take minutes; a failure prints
    # its program, which is small already
    phases=(Phase.explicit, Phase.generate),
    report_multiple_bugs=False,
)
@given(program=programs(), transform=st.sampled_from(FUZZ_TRANSFORMS))
def test_fuzz_against_numpy(program, transform):
    truth = _fuzz_truth(transform, program)
    got = np.asarray(_fuzz_apply(transform, _fuzz_loop(program, on_lax=False)))
    error = float(np.max(np.abs(got - truth), initial=0.0))
    if _FINDINGS:
        lax_got = np.asarray(_fuzz_apply(transform, _fuzz_loop(program, on_lax=True)))
        finding = dict(
            program=program._asdict(),
            transform=transform,
            backend=jax.default_backend(),
            ours=error,
            lax=float(np.max(np.abs(lax_got - truth), initial=0.0)),
        )
        with open(_FINDINGS, "a") as file:
            file.write(json.dumps(finding) + "\n")
    # float32 through at most 6 steps; a wrong read is off by 1e-2 or more
    assert error <= 1e-4 * (1 + np.max(np.abs(truth), initial=0.0)), (program, error)


@pytest.mark.parametrize(
    "inside",
    [
        pytest.param(k, marks=() if k == "bl.while_loop" else pytest.mark.slow)
        for k in INSIDE_THE_BODY
    ],
)
def test_shard_map_vmapped_body_runs(inside):
    """The scaling guide's pattern, `vmap` inside `shard_map` (two elements per
    device), with each body of `test_shard_map_body_runs`: `grad` (`jvp` where
    there is no reverse mode) against the unrolled steps on the host."""
    ours_fn, _ = _outer(INSIDE_THE_BODY[inside])
    _, reference = _outer(REFERENCES.get(inside, INSIDE_THE_BODY[inside]))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("data")
    batched = jax.shard_map(jax.vmap(ours_fn), mesh=mesh, in_specs=spec, out_specs=spec)
    apply = SHARD_MAP_TRANSFORMS[_first_transform(inside)]
    xs = jnp.stack([X0, -0.5 * X0])
    expected = on_host(apply(jax.vmap(reference)))(xs)
    assert tree_allclose(jax.jit(apply(batched))(xs), expected, rtol=1e-4, atol=1e-4)
