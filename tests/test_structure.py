"""Exact structural facts: body evaluations, recomputation order, program size."""

import contextlib
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import boundedloop as bl
from boundedloop._autodiff._jvp_primitive import (
    custom_jvp_spec,
    loop_jvp,
    Passes,
    Primal,
)
from boundedloop._runtime._checked_store import CheckedStore
from boundedloop._runtime._leaves import fill
from boundedloop._sweeps import _cost_model, _store_rules
from boundedloop._sweeps._cost_model import IN_ORDER_BYTES, IN_ORDER_STEPS
from boundedloop._sweeps._recompute import split_rule
from boundedloop._sweeps._schedule import (
    _merge_choice,
    BAND_CAP,
    grown_bands,
    offline_placement,
    online_stores,
    revolve_split,
    targets,
)
from boundedloop._sweeps._store_rules import OnlineRule, TABLE_STEPS
from boundedloop._tracing._trace import trace_loop

from .helpers import Counter, largest_array_in_loops, on_host, tree_allclose
from .schedule_reference import (
    forward_placement,
    gradient_body_evaluations,
    reverse_events,
)


def recorded_gradient(n, max_steps, checkpoints):
    """Run one gradient of an `n`-step loop, recording the step index of every body
    evaluation in order."""
    counter = Counter()

    def body(carry):
        x, i = carry
        counter(i)
        return jnp.sin(x) * 1.1, i + 1

    def loss(x):
        out = bl.while_loop(
            lambda c: c[1] < n,
            body,
            (x, 0),
            max_steps=max_steps,
            checkpoints=checkpoints,
        )
        return out[0]

    jax.block_until_ready(jax.jit(jax.grad(loss))(0.4))
    return counter.calls


@pytest.mark.parametrize("max_steps", [8, 64, 4096])
def test_eight_steps_cost_sixteen_evaluations(max_steps):
    for checkpoints in [8, 16]:
        assert len(recorded_gradient(8, max_steps, checkpoints)) == 16


def test_evaluations_do_not_depend_on_max_steps():
    for checkpoints in [2, 3]:
        counts = {len(recorded_gradient(8, m, checkpoints)) for m in [64, 4096]}
        assert len(counts) == 1


@pytest.mark.parametrize("max_steps", [200, None])  # a table; the in-loop rule
@pytest.mark.parametrize(
    "n,checkpoints", [(1, 1), (5, 1), (7, 2), (20, 3), (45, 4), (100, 5)]
)
def test_recomputation_order_matches_the_schedule(n, checkpoints, max_steps):
    calls = recorded_gradient(n, max_steps, checkpoints)
    positions = forward_placement(n, checkpoints)
    expected = list(range(n)) + [
        i for _, i in reverse_events(positions, n, checkpoints)
    ]
    assert calls == expected
    assert len(calls) == gradient_body_evaluations(n, checkpoints)


def _grad_program(max_steps, checkpoints):
    def loss(x):
        return bl.while_loop(
            lambda c: c[1] < 8,
            lambda c: (jnp.tanh(c[0] * 1.3), c[1] + 1),
            (x, 0),
            max_steps=max_steps,
            checkpoints=checkpoints,
        )[0].sum()

    return jax.jit(jax.grad(loss)), jnp.ones(64)


def _jaxpr_lines(max_steps):
    f, x = _grad_program(max_steps, 8)
    return len(str(jax.make_jaxpr(f)(x)).splitlines())


def test_jaxpr_does_not_grow_with_max_steps():
    # bounds up to `TABLE_STEPS` replay a table of stores, longer ones decide in
    # the loop: the same program within each
    table = {_jaxpr_lines(m) for m in [64, 4096, TABLE_STEPS]}
    online = {_jaxpr_lines(m) for m in [TABLE_STEPS + 1, 100_000, 10**9]}
    assert len(table) == 1 and len(online) == 1
    # no bound: the same, less the comparison with `max_steps`
    assert _jaxpr_lines(None) <= online.pop()


def compiled_stores(slots, n):
    """The stores `OnlineRule` makes in the compiled loop up to step `n`, event by
    event, as `(t, slot)` pairs."""
    rule = OnlineRule(slots)

    def run():
        def event(state):
            t, rule_state, k, steps, slot_ids = state
            decision = rule.decide(t, rule_state)
            steps = steps.at[k].set(jnp.where(decision.store, t, -1))
            slot_ids = slot_ids.at[k].set(decision.slot)
            return decision.stop, decision.state, k + 1, steps, slot_ids

        first = rule.initial()
        empty = jnp.full(n, -1, jnp.int32)
        init = (rule.first_stop(first), first, 0, empty, jnp.zeros(n, jnp.int32))
        return lax.while_loop(lambda state: state[0] < n, event, init)[2:]

    events, steps, slot_ids = jax.jit(run)()
    pairs = zip(np.asarray(steps)[: int(events)], np.asarray(slot_ids))
    return [(0, 0)] + [(int(t), int(s)) for t, s in pairs if t >= 0]


@pytest.mark.parametrize(
    "slots, n",
    [(2, 3000), (3, 3000), (5, 3000), (16, 3000), (33, 3000), (3, 2 * 10**6)],
)
def test_compiled_store_rule_matches_the_schedule(slots, n):
    """The forward's in-graph store rule makes `_schedule.online_stores`'s choices,
    through regimes 0 to 5 at 5 slots and 0 to 2 at 33 (and over 200 regimes at
    3 slots, to 2 * 10**6 steps). Both are exact integer arithmetic, so this holds on every
    backend."""
    assert compiled_stores(slots, n) == online_stores(n, slots)


@pytest.mark.parametrize("slots", [2, 3, 5, 16, 200])
def test_compiled_bands_match_the_schedule_in_every_regime(slots):
    """`_store_rules._grown_bands` (int32) equals `_schedule.grown_bands` (Python
    integers) in every regime the rule enters, up to the clipped bands at
    `BAND_CAP`: no intermediate overflows."""
    rows = [[1] * (slots + 1)]
    while grown_bands(rows[-1])[-1] < BAND_CAP:  # the regimes entered
        rows.append(grown_bands(rows[-1]))
    got = jax.jit(jax.vmap(_store_rules._grown_bands))(jnp.asarray(rows, jnp.int32))
    assert np.asarray(got).tolist() == [grown_bands(row) for row in rows]


@pytest.mark.parametrize("slots", [2, 3, 5, 16, 33])
def test_targets_are_the_optimum_at_the_regime_end(slots):
    """The positions the rule keeps stand-ins for in regime `r` (`targets`) are
    the optimal placement for its last trip count, `C(slots + r + 1, slots) - 1`."""
    grown = grown_bands([1] * (slots + 1))
    while grown[-1] <= 10**5:
        end = grown[-1] - 1
        assert [0, *targets(grown)] == offline_placement(end, slots)
        grown = grown_bands(grown)


@pytest.mark.parametrize("slots", [2, 3, 7, 16])
def test_compiled_choice_matches_the_schedule_at_any_position(slots):
    """`_store_rules._merge` drops the position `_schedule._merge_choice` drops,
    from random placements in several regimes, positions up to `2**31 - 1` (the
    keys' clipping at `KEY_CAP` and the kept offset stay within int32)."""
    rng = np.random.default_rng(slots)
    regimes = [([1] * (slots + 1), grown_bands([1] * (slots + 1)))]  # (bands, grown)
    while regimes[-1][1][-1] < BAND_CAP and len(regimes) < 6:
        regimes.append((regimes[-1][1], grown_bands(regimes[-1][1])))
    cases = []
    for k in range(400):
        bands, grown = regimes[k % len(regimes)]
        top = [2 * grown[-1], 2**31 - 1][k % 2]
        grid = np.arange(1, top, max(top // 10**6, 1))
        points = np.sort(rng.choice(grid, slots, replace=False)).tolist()
        cases.append(([0, *points[:-1]], points[-1], bands, grown))
    positions = jnp.asarray([h for h, *_ in cases], jnp.int32)
    held = (
        positions,
        jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), positions.shape),
    )
    t, bands, grown = (jnp.asarray([c[i] for c in cases], jnp.int32) for i in (1, 2, 3))
    _, slot = jax.jit(jax.vmap(_store_rules._merge))(held, t, bands, grown)
    want = [_merge_choice(h, t, b, targets(g)) for h, t, b, g in cases]
    assert np.asarray(slot).tolist() == want


@pytest.mark.parametrize("slots", [2, 3, 8])
@pytest.mark.parametrize(
    "form, max_steps, in_order",
    [("splits listed", 1000, False), ("binomials", None, False), ("loop", 1000, True)],
)
def test_in_graph_split_matches_the_schedule(slots, form, max_steps, in_order):
    """The reverse sweep's compiled split, listed for a bounded loop, computed from
    binomials or by a loop, equals `revolve_split` for every slot count and
    segment length the loop can have (the loop's up to `IN_ORDER_STEPS`)."""
    split = split_rule(slots, max_steps, in_order)
    split = jax.jit(jax.vmap(split, in_axes=(0, None)))
    top = {"splits listed": max_steps, "binomials": 2**15}.get(form, IN_ORDER_STEPS)
    lengths = np.concatenate(
        [np.arange(0, 600), np.random.default_rng(0).integers(600, top + 1, 300)]
    )
    for k in range(1, slots + 1):
        got = np.asarray(split(jnp.asarray(lengths, jnp.int32), jnp.int32(k)))
        expected = [revolve_split(int(n), k) for n in lengths]
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("backend, listed", [("cpu", True), ("tpu", False)])
def test_a_large_split_table_is_listed_on_a_cpu_only(backend, listed):
    """diffrax's default on its neural ODE (90 checkpoints, `max_steps=4096`, a
    1.5 MB table): a listed split table is one lookup on a CPU, and 1.7x slower
    gradients on a TPU; the headline's (16 checkpoints, `max_steps=1024`, 70 kB) is
    listed on both (`_cost_model.lists_splits`)."""
    assert _cost_model.lists_splits(90, 4096, backend=backend) is listed
    assert _cost_model.lists_splits(16, 1024, backend=backend)
    assert not _cost_model.lists_splits(90, None, backend=backend)
    assert not _cost_model.lists_splits(16, None, backend=backend)


def _name_stacks(jaxpr) -> set[str]:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(str(eqn.source_info.name_stack))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _name_stacks(sub)
    return out


def test_loop_phases_are_named():
    f, x = _grad_program(4096, 8)
    names = " ".join(_name_stacks(jax.make_jaxpr(f)(x).jaxpr))
    for phase in ["checkpointed_forward", "reverse", "recompute"]:
        assert f"boundedloop_{phase}" in names, phase
    forward = jax.make_jaxpr(
        lambda x: bl.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, x, max_steps=5)
    )(1.0)
    assert "boundedloop_forward" in " ".join(_name_stacks(forward.jaxpr))


def test_named_scopes_in_the_body_survive():
    """`jax.named_scope` inside `body_fun` reaches the jaxpr's name stacks and the
    lowered program's locations, forward and in the gradient, as in `lax`."""

    def body(c):
        with jax.named_scope("my_scope"):
            x = jnp.sin(c[0]) * 2.0
        return x, c[1] + 1

    def f(x):
        return bl.while_loop(lambda c: c[1] < 5, body, (x, 0), max_steps=10)[0].sum()

    x = jnp.ones(3)
    for g in [f, jax.grad(f)]:
        names = " ".join(_name_stacks(jax.make_jaxpr(g)(x).jaxpr))
        assert "my_scope" in names
        # `as_text()` leaves locations out, for `lax.while_loop`'s body too
        assert "my_scope" in jax.jit(g).lower(x).as_text(debug_info=True)


def test_which_steps_count_as_cheap():
    """`_cost_model.is_cheap`: few equations, or many on few elements each (a
    solver's scalar bookkeeping) are cheap; many on large arrays are not, nor a few
    that do much work (a large matrix product)."""

    def body_of(step, init):
        return trace_loop(lambda c: c[1] < 3, step, init, None, name="test").body

    def chain(x, n):
        for _ in range(n):
            x = jnp.sin(x) * 1.01
        return x

    small = body_of(lambda c: (jnp.tanh(c[0]), c[1] + 1), (jnp.ones(4), 0))
    scalars = body_of(lambda c: (chain(c[0], 60), c[1] + 1), (jnp.ones(()), 0))
    wide = body_of(lambda c: (chain(c[0], 60), c[1] + 1), (jnp.ones(256), 0))
    assert _cost_model.equations(scalars.jaxpr) > _cost_model.SMALL_BODY
    assert _cost_model.is_cheap(small)
    assert _cost_model.is_cheap(scalars)
    assert not _cost_model.is_cheap(wide)
    w = jnp.ones((512, 512))  # 4 * 512**2 multiply-adds a step, in 3 equations
    matmul = body_of(lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (jnp.ones((4, 512)), 0))
    assert _cost_model.equations(matmul.jaxpr) <= _cost_model.SMALL_BODY
    assert not _cost_model.is_cheap(matmul)
    # a large buffer written a row a step: its update is the row's work, not the
    # buffer's (the regression benchmark's buffer workload, 1.34 times slower when
    # counted as the whole (4096, 256) buffer)
    row = body_of(
        lambda c: (c[0].at[c[1]].set(jnp.tanh(c[0][c[1] - 1])), c[1] + 1),
        (jnp.ones((4096, 256)), 1),
    )
    assert _cost_model.work(row.jaxpr) < 4096
    assert _cost_model.is_cheap(row)


def _carries(jaxpr, phase):
    """The carried avals of every while loop whose name stack mentions `phase`."""
    out = []
    for eqn in jaxpr.eqns:
        name = str(eqn.source_info.name_stack)
        if eqn.primitive.name == "while" and phase in name:
            out.append([v.aval for v in eqn.params["body_jaxpr"].jaxpr.invars])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _carries(sub, phase)
    return out


def _trajectory(x, loop):
    def body(c):
        x, buf, i = c
        return x * 1.1, buf.at[i].set(x), i + 1

    return loop(lambda c: jnp.cos(c[0]) > 0.5, body, (x, jnp.zeros(8), jnp.array(0)))


def test_masked_sweeps_test_the_predicate_once_per_step():
    """A loop with buffers runs masked (so `vmap` keeps its control unbatched),
    yet unbatched it carries no flag of its own and evaluates the predicate once
    per step, in the loop's condition, as `lax.while_loop` does."""

    def ours(x):
        return _trajectory(
            x,
            lambda *a: bl.while_loop(*a, max_steps=8, buffers=lambda c: c[1]),
        )

    def reference(x):
        def loop(cond, body, init):
            return jax.lax.while_loop(lambda c: cond(c) & (c[2] < 8), body, init)

        return _trajectory(x, loop)

    x = jnp.array(0.1)
    assert jax.jit(ours).lower(x).compile().as_text().count(" cosine(") == 1
    programs = {
        "boundedloop_forward": jax.make_jaxpr(ours)(x),
        "boundedloop_checkpointed_forward": jax.make_jaxpr(
            jax.grad(lambda x: ours(x)[0])
        )(x),
    }
    for phase, program in programs.items():
        carries = _carries(program.jaxpr, phase)
        assert carries, phase
        for avals in carries:
            assert not any(a.dtype == jnp.bool_ and a.shape == () for a in avals)
    # under vmap each element stops at its own step (here after 8 and 6)
    xs = jnp.array([0.1, 0.6])
    assert tree_allclose(jax.vmap(ours)(xs), on_host(jax.vmap(reference))(xs))


def test_jax_internals_are_imported_in_one_module():
    """Every `jax._src` import is in `_jax_private.py`, so a JAX upgrade touches one
    file (see `docs/limitations.md`)."""
    import ast
    import pathlib

    package = pathlib.Path(bl.__file__).parent
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                importers.add(path.name)
    assert importers == {"_jax_private.py"}


def _nested_loops(depth, counter, reads=False):
    """`depth` nested loops around a body that counts its Python runs; with
    `reads`, each level reads and writes a buffer."""

    def run(x, d):
        if d == 0:
            counter.append(1)
            return jnp.sin(x) * 1.01

        def body(carry):
            i, y, buf = carry
            y = run(y * buf[i] if reads else y, d - 1)
            return i + 1, y, buf.at[i + 1].set(y) if reads else buf

        init = (0, x, jnp.ones(5))
        buffers = (lambda c: c[2]) if reads else None
        return bl.while_loop(
            lambda c: c[0] < 3, body, init, max_steps=4, buffers=buffers
        )[1]

    return lambda x: run(x, depth)


@pytest.mark.parametrize("reads", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_body_traced_once_at_any_depth(depth, reads):
    """Tracing is paid at every compile: the innermost body of nested loops is
    traced once, forward and gradient alike, as `lax.while_loop`'s is; bodies
    that read buffers too (each read's dummy joins the trace's inputs as it is
    found)."""
    counter = []
    f = _nested_loops(depth, counter, reads)
    x = jnp.float32(1.0)  # a weakly typed carry would be promoted by the reads
    jax.make_jaxpr(f)(x)
    assert len(counter) == 1
    counter.clear()
    jax.make_jaxpr(jax.grad(f))(x)
    assert len(counter) == 1


@pytest.mark.parametrize("transform", ["jvp", "linearize"])
def test_forward_mode_traces_the_steps_jvp_once(monkeypatch, transform):
    """`jax.jvp` of a loop whose perturbation reaches one more carry leaf each step
    (a chain of four), and a `jax.linearize`d one applied (the tangent replayed from
    the checkpoints): the loop finds the perturbed leaves once
    (`perturbed_leaves`) and seeds `lax.while_loop`'s JVP with them, so its
    fixed point traces the step's JVP once, not once per leaf reached."""
    from jax._src.interpreters import ad as jax_ad  # the rule looks it up here

    while_rounds = []
    original = jax_ad.jvp_jaxpr

    def counting(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "_while_loop_jvp":
            while_rounds.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax_ad, "jvp_jaxpr", counting)

    def f(a):
        def body(c):
            a, b, c, d, i = c
            return 1.1 * a, a + b, b + c, c + d, i + 1

        zero = jnp.float32(0.0)
        init = (a, zero, zero, zero, 0)
        return bl.while_loop(lambda c: c[4] < 5, body, init, max_steps=8)[3]

    one = jnp.float32(1.0)
    if transform == "jvp":
        result = jax.jvp(f, (one,), (one,))
    else:
        value, f_jvp = jax.linearize(f, one)
        result = value, f_jvp(one)
    # none at all: JAX renamed the rule or `jvp_jaxpr`; four before the seeding
    assert len(while_rounds) == 1

    def unrolled(a):
        c = (a, 0.0, 0.0, 0.0)
        for _ in range(5):
            c = (1.1 * c[0], c[0] + c[1], c[1] + c[2], c[2] + c[3])
        return c[3]

    assert tree_allclose(result, on_host(jax.jvp)(unrolled, (one,), (one,)))


def test_body_traced_again_only_when_promotion_changes_a_type():
    traces = []

    def body(carry):
        traces.append(1)
        i, x = carry
        return i + 1, x + jnp.float32(0.5)  # a weak `0` becomes float32

    out = bl.while_loop(lambda c: c[0] < 3, body, (0, 0), max_steps=4)
    assert len(traces) == 2 and out[1].dtype == jnp.float32
    traces.clear()
    bl.while_loop(lambda c: c[0] < 3, body, (0, jnp.float32(0.0)), max_steps=4)
    assert len(traces) == 1


def test_buffer_checks_do_not_trace_the_body_again():
    """The buffer checks (on by default, strict inside `bl.buffer_checks()`) replay
    each step's reads and writes: the body is traced once, checked or not."""
    for checks, expected in ((False, 1), (True, 1), (None, 1)):
        traces = []

        def body(carry, traces=traces):
            traces.append(1)
            i, x, buf = carry
            return i + 1, x, buf.at[i].set(buf[i - 1] * 2.0)

        def loop(init, body=body):
            return bl.while_loop(
                lambda c: c[0] < 4, body, init, max_steps=4, buffers=lambda c: c[2]
            )

        with contextlib.nullcontext() if checks is None else bl.buffer_checks(checks):
            jax.make_jaxpr(jax.grad(lambda x: loop((1, x, jnp.zeros(4)))[1]))(1.0)
        assert len(traces) == expected


def test_a_value_crossing_a_trace_is_checked():
    """`_checked_store.CheckedStore` (a tree structure a rule reads after the trace
    that wrote it): read before written, or written otherwise by a second trace, is
    an error rather than a silent mix-up."""
    store = CheckedStore("the sweep's tree structure")
    with pytest.raises(AssertionError, match="read before"):
        store.get()
    store.set(jax.tree.structure((1, 2)))
    store.set(jax.tree.structure((3, 4)))  # the same structure again
    assert store.get() == jax.tree.structure((0, 0))
    with pytest.raises(AssertionError, match="changed between two traces"):
        store.set(jax.tree.structure((1, 2, 3)))


def test_fill_puts_values_where_the_mask_is_and_uses_every_one():
    """`_leaves.fill`: the flat list of values that exist (tangents of perturbed
    leaves) made whole, `absent(k)` elsewhere; a count that does not match is an
    error, not a silently shifted list."""
    assert fill([True, False, True], ["a", "b"]) == ["a", None, "b"]
    assert fill([False, True], [7], lambda k: -k) == [0, 7]
    with pytest.raises(AssertionError, match="2 values for 1 places"):
        fill([True, False], [1, 2])


def test_a_custom_jvp_spec_states_its_primal_whole():
    """`_jvp_primitive.custom_jvp_spec`: the batching rule's knowledge of the primal (its
    function and where each tangent belongs) is one `Primal`, never part of one; a
    tangent type per output tangent, and operands that match, or an error (a `Spec`
    that lost a field once switched batching to "every output batched")."""
    f32 = jax.core.ShapedArray((), jnp.float32)
    passes = Passes(lambda p, t: p + t, lambda p, t: p + t)
    primal = Primal(lambda p: p, tangent_inputs=(0,), tangent_outputs=(0,))
    spec = custom_jvp_spec(passes, primal, 1, (f32,), (f32,), frozenset())
    assert spec.primal is primal and spec.out_avals == (f32, f32)
    with pytest.raises(AssertionError, match="one tangent type per output"):
        custom_jvp_spec(passes, primal, 1, (f32,), (), frozenset())
    with pytest.raises(AssertionError, match="do not match the spec"):
        loop_jvp([jnp.float32(1.0)], [], spec)
    with pytest.raises(TypeError):
        Primal(lambda p: p, tangent_inputs=(0,))  # the outputs' part is not optional


def _one_number_gradient(width: int):
    """The lowered gradient of a 200-step loop on `width` numbers, `max_steps=4096`,
    90 checkpoints (equinox's default for that bound)."""

    def loss(a):
        def body(carry):
            x, i = carry
            return jnp.sin(x) * a + 0.01, i + 1

        init = (jnp.full((width,), 0.5), jnp.array(0))
        out = bl.while_loop(
            lambda c: c[1] < 200, body, init, max_steps=4096, checkpoints=90
        )
        return jnp.sum(out[0])

    return jax.jit(jax.grad(loss)).lower(jnp.array(0.9))


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="loops are kept in order for XLA's CPU runtime only (_cost_model)",
)
def test_small_loops_keep_every_array_in_order():
    """On a CPU, a differentiated loop whose arrays can all stay within
    `IN_ORDER_BYTES` keeps them so in every loop of its gradient (XLA's CPU runtime
    then runs each loop body in order on one thread); with 4 numbers a row per
    checkpoint alone is past it, and the storage is packed and tabled as before."""
    assert largest_array_in_loops(_one_number_gradient(1)) <= IN_ORDER_BYTES
    assert largest_array_in_loops(_one_number_gradient(4)) > IN_ORDER_BYTES


def test_primitive_parameters_print_by_name():
    """A jaxpr names what the loop's primitives compute, not Python addresses:
    `spec=Spec(LoopJVP, ...)` and `jvp_fn=LoopJVP.staged.jvp_fn`, `vmap(...)` of it
    once batched."""

    def f(x):
        def body(carry):
            return jnp.tanh(carry[0]), carry[1] + 1

        out = bl.while_loop(lambda c: c[1] < 3, body, (x, 0), max_steps=4)
        return jnp.sum(out[0])

    x = jnp.array([0.2, -0.1])
    texts = [
        str(jax.make_jaxpr(lambda x: jax.jvp(f, (x,), (x,)))(x)),
        str(jax.make_jaxpr(lambda x: jax.linearize(f, x)[1](x))(x)),
        str(jax.make_jaxpr(jax.vmap(lambda x: jax.linearize(f, x)[1](x)))(x[None])),
    ]
    assert "spec=Spec(LoopJVP, primals=" in texts[0]
    assert "jvp_fn=LoopJVP.staged.jvp_fn" in texts[1]
    assert "jvp_fn=vmap(LoopJVP.staged.jvp_fn)" in texts[2]
    for text in texts:
        assert "0x" not in text and "bound method" not in text
