"""Property tests: random trip counts, bounds, checkpoint counts, carries, buffers and
batching, against `lax.while_loop` (values, to a few eps) and `lax.scan` over the
trip count (gradients).

Compiling dominates the cost, so the structural choices (which carry, `max_steps`,
`checkpoints`, vmap or not) come from a fixed list of 24 configurations, each
compiled once (the forward, and the value and gradient) and given 9 examples (216 in
all), and everything hypothesis draws is runtime data: the trip count (a traced argument of the predicate), the initial
values and the parameters. The references are compiled once per carry kind (and
`max_steps`, for the forward). The gradient reference is the `lax.scan` of a fixed
`PAD` steps whose step `k` is the body if `k < trips` and the identity otherwise
(a `lax.cond`, so the skipped steps are exactly the identity in both directions):
the scan over the trip count, with the trip count as runtime data.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings, strategies as st
from jax import lax

import boundedloop as bl
from boundedloop._sweeps import _cost_model

from .helpers import accelerator_atol, ACCELERATOR_RTOL, on_host, tree_allclose


ROWS = 40  # buffer rows: more than any trip count drawn below
PAD = 40  # the gradient reference's scan length: more than any trip count
BATCH = 3


def set_ours(buf, i, value, pred):
    return buf.at[i].set(value, pred=pred)


def set_reference(buf, i, value, pred):
    return buf.at[i].set(jnp.where(pred, value, buf[i]))


class Kind(NamedTuple):
    """A carry pytree and a loop over it. `inputs(rng)` draws the traced initial
    arrays, `carry(inputs)` builds the carry (adding Python scalars, `None` leaves
    and counters), `body(w, set_row)` and `cond(n)` make the loop, `buffers` picks
    its in-place buffers (or is `None`)."""

    inputs: Any
    carry: Any
    body: Any
    cond: Any
    buffers: Any


# a tuple: a float vector, an int counter and a bool flag the body flips on data
def _tuple_body(w, set_row):
    del set_row

    def body(c):
        x, i, flag = c
        x = jnp.tanh(w[:3] * x + 0.1 * i.astype(jnp.float32)) + 0.05 * flag.astype(
            jnp.float32
        )
        return x, i + 1, x[0] > 0

    return body


TUPLE = Kind(
    inputs=lambda rng: {"x": rng.uniform(-1, 1, 3).astype(np.float32)},
    carry=lambda a: (a["x"], jnp.array(0), jnp.array(False)),
    body=_tuple_body,
    cond=lambda n: lambda c: c[1] < n,
    buffers=None,
)


# a dict with a weakly typed Python float and int, a Python bool, a `None` leaf and a
# float predicate: the trip count is whatever the threshold `0.75 n` makes it
def _dict_body(w, set_row):
    del set_row

    def body(c):
        v = jnp.sin(c["v"]) * w[0] + 0.1 * c["s"]
        s = c["s"] + 0.6 + 0.3 * jnp.tanh(v[0]) ** 2
        k = {"count": c["k"]["count"] + 1, "on": ~c["k"]["on"]}
        return {"s": s, "v": v, "none": None, "k": k}

    return body


DICT = Kind(
    inputs=lambda rng: {"v": rng.uniform(-1, 1, 2).astype(np.float32)},
    carry=lambda a: {
        "s": 0.0,
        "v": a["v"],
        "none": None,
        "k": {"count": 0, "on": True},
    },
    body=_dict_body,
    cond=lambda n: lambda c: c["s"] < 0.75 * n.astype(jnp.float32),
    buffers=None,
)


# a trajectory buffer: row `i` written every step, the previous row read back
def _buffer_body(w, set_row):
    def body(c):
        x, buf, i = c
        prev = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], x)
        new = jnp.tanh(prev * w[:2] + x)
        return 0.9 * x + 0.1 * new, set_row(buf, i, new, jnp.array(True)), i + 1

    return body


BUFFER = Kind(
    inputs=lambda rng: {
        "x": rng.uniform(-1, 1, 2).astype(np.float32),
        "buf": rng.uniform(-1, 1, (ROWS, 2)).astype(np.float32),
    },
    carry=lambda a: (a["x"], a["buf"], jnp.array(0)),
    body=_buffer_body,
    cond=lambda n: lambda c: c[2] < n,
    buffers=lambda c: c[1],
)


# a buffer in a dict, written only where a predicate holds, read at the last write
def _masked_body(w, set_row):
    def body(c):
        i, last = c["i"], c["last"]
        prev = jnp.where(last >= 0, c["traj"][jnp.maximum(last, 0)], c["acc"])
        new = jnp.sin(prev) * w[0] + 0.1 * c["acc"]
        write = i % 3 != 1
        return {
            "traj": set_row(c["traj"], i, new, write),
            "acc": c["acc"] + 0.5 * new,
            "i": i + 1,
            "last": jnp.where(write, i, last),
        }

    return body


MASKED = Kind(
    inputs=lambda rng: {
        "traj": rng.uniform(-1, 1, ROWS).astype(np.float32),
        "acc": np.float32(rng.uniform(-1, 1)),
    },
    carry=lambda a: {
        "traj": a["traj"],
        "acc": a["acc"],
        "i": jnp.array(0),
        "last": jnp.array(-1),
    },
    body=_masked_body,
    cond=lambda n: lambda c: c["i"] < n,
    buffers=lambda c: c["traj"],
)

KINDS = {"tuple": TUPLE, "dict": DICT, "buffer": BUFFER, "masked": MASKED}

# (kind, max_steps, checkpoints, vmapped): every (max_steps, checkpoints) pair twice,
# once unbatched and once batched, with different carries. It covers no loop at all,
# every step stored (by default or because `checkpoints >= max_steps`), one slot,
# online placement past the slots, and no bound.
CONFIGS = [
    ("tuple", 0, None, False),
    ("tuple", 5, 2, False),
    ("tuple", 23, None, False),
    ("dict", 1, 1, False),
    ("dict", 7, 7, False),
    ("dict", 12, 4, False),
    ("buffer", 1, None, False),
    ("buffer", 12, 1, False),
    ("buffer", None, 2, False),
    ("masked", 5, None, False),
    ("masked", 23, 3, False),
    ("masked", 23, 1, False),
    ("tuple", 1, None, True),
    ("tuple", 12, 1, True),
    ("tuple", 23, 3, True),
    ("dict", 5, None, True),
    ("dict", 23, 1, True),
    ("dict", None, 2, True),
    ("buffer", 0, None, True),
    ("buffer", 7, 7, True),
    ("buffer", 23, None, True),
    ("masked", 1, 1, True),
    ("masked", 5, 2, True),
    ("masked", 12, 4, True),
]
# the reverse sweep as one loop (`_reverse_sweep.drive`, a TPU's for costly steps),
# forced onto configurations without buffers (it takes no loop with buffers)
ONE_LOOP_CONFIGS = [
    ("tuple", 5, 2, False),
    ("dict", 12, 4, False),
    ("tuple", 23, 3, True),
    ("dict", None, 2, True),
]


def loss(out):
    floats = [v for v in jtu.tree_leaves(out) if jnp.issubdtype(v.dtype, jnp.floating)]
    return sum(jnp.sum(v**2) + 0.3 * jnp.sum(v) for v in floats)


def _run(kind_name, max_steps, checkpoints):
    kind = KINDS[kind_name]

    def run(inputs, w, n):
        return bl.while_loop(
            kind.cond(n),
            kind.body(w, set_ours),
            kind.carry(inputs),
            max_steps=max_steps,
            checkpoints=checkpoints,
            buffers=kind.buffers,
        )

    return run


def _batch(f, vmapped):
    return jax.jit(jax.vmap(f, in_axes=(0, None, 0)) if vmapped else f)


@functools.cache
def ours(kind_name, max_steps, checkpoints, vmapped):
    """The loop undifferentiated, compiled on its own (as the reference is)."""
    return _batch(_run(kind_name, max_steps, checkpoints), vmapped)


def _one_loop(f):
    """`f`, traced with every recomputing reverse sweep as one loop."""

    def forced(*args):
        rules = _cost_model.is_cheap, _cost_model.shares_one_step
        _cost_model.is_cheap = lambda body: False
        _cost_model.shares_one_step = lambda body, backend=None: True
        try:
            return f(*args)
        finally:
            _cost_model.is_cheap, _cost_model.shares_one_step = rules

    return forced


@functools.cache
def ours_grad(kind_name, max_steps, checkpoints, vmapped, one_loop=False):
    """The loss and its gradient; returns `((loss, final carry), grads)`; with
    `one_loop`, its reverse sweep forced to one loop."""
    run = _run(kind_name, max_steps, checkpoints)

    def value(inputs, w, n):
        out = run(inputs, w, n)
        return loss(out), out

    grad = jax.value_and_grad(value, argnums=(0, 1), has_aux=True)
    return _batch(_one_loop(grad) if one_loop else grad, vmapped)


@functools.cache
def reference_forward(kind_name, max_steps, vmapped):
    """`lax.while_loop` with a step counter; returns `(steps, final carry)`. On the
    host CPU backend, as every `lax` reference here (XLA on a TPU miscompiles some
    `lax` loops, the buffer kinds' among them)."""
    kind = KINDS[kind_name]

    def f(inputs, w, n):
        cond, body = kind.cond(n), kind.body(w, set_reference)
        bound = (lambda t: True) if max_steps is None else (lambda t: t < max_steps)
        return lax.while_loop(
            lambda s: jnp.logical_and(bound(s[0]), cond(s[1])),
            lambda s: (s[0] + 1, body(s[1])),
            (jnp.array(0), kind.carry(inputs)),
        )

    return on_host(_batch(f, vmapped))


@functools.cache
def reference_grad(kind_name):
    """The gradient of `lax.scan` over the first `trips` steps (see the top)."""
    kind = KINDS[kind_name]

    def value(inputs, w, trips):
        body = kind.body(w, set_reference)

        def step(carry, k):
            return lax.cond(k < trips, body, lambda c: c, carry), None

        final, _ = lax.scan(step, kind.carry(inputs), jnp.arange(PAD))
        return loss(final)

    return on_host(jax.jit(jax.grad(value, argnums=(0, 1))))


# Forward values against `lax.while_loop`, each compiled on its own: dtypes, weak
# types and the integer and boolean leaves exact, the floating leaves within a few
# float32 eps. Not bit for bit: the guard that hides the loop counters' initial
# values from XLA (`opaque_counters` in `_shard_map.py`) moves XLA's fusion
# boundaries, so the same math may round differently, by an ulp or so (3 ulps, 2 eps
# of the value, the most seen on CPU). Off the CPU the reference is still the host's,
# and the accelerator's `tanh` and `sin` round otherwise: its floor applies there.
FORWARD_TOL = 4 * float(np.finfo(np.float32).eps)


def assert_forward_equal(got, expected):
    rtol, atol = FORWARD_TOL, FORWARD_TOL
    if jax.default_backend() != "cpu":
        rtol = ACCELERATOR_RTOL
    assert jtu.tree_structure(got) == jtu.tree_structure(expected)
    for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(expected)):
        assert (a.dtype, a.shape, a.weak_type) == (b.dtype, b.shape, b.weak_type)
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=accelerator_atol(b, atol))
        else:
            np.testing.assert_array_equal(a, b)


def element(tree, b):
    return jtu.tree_map(lambda v: v[b], tree)


def _config_id(config):
    kind, max_steps, checkpoints, vmapped = config
    return f"{kind}-max{max_steps}-ckpt{checkpoints}" + ("-vmap" if vmapped else "")


def draw(config, data):
    """`(inputs, w, n)` for `config`, drawn (see the top)."""
    kind_name, max_steps, _, vmapped = config
    kind = KINDS[kind_name]
    top = (20 if max_steps is None else max_steps) + 3
    trips_st = st.integers(0, top)
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.uniform(-1.2, 1.2, 3).astype(np.float32))
    if vmapped:
        n = jnp.array(data.draw(st.lists(trips_st, min_size=BATCH, max_size=BATCH)))
        inputs = [kind.inputs(rng) for _ in range(BATCH)]
        inputs = jtu.tree_map(lambda *v: jnp.asarray(np.stack(v)), *inputs)
    else:
        n = jnp.array(data.draw(trips_st, label="n"))
        inputs = jtu.tree_map(jnp.asarray, kind.inputs(rng))
    return inputs, w, n


def assert_matches_lax(config, inputs, w, n, one_loop=False):
    """The primal under `grad` against `lax.while_loop`'s, and the gradients
    against `lax.scan`'s over each element's trip count."""
    kind_name, max_steps, checkpoints, vmapped = config
    steps, expected = reference_forward(kind_name, max_steps, vmapped)(inputs, w, n)
    # the primal under `grad` takes the same steps. It is compiled with the reverse
    # sweep into one program, where XLA may fuse (and round) differently: close, and
    # the integer and boolean leaves (the trip count among them) exact
    (_, primal), grads = ours_grad(*config, one_loop=one_loop)(inputs, w, n)
    assert tree_allclose(primal, expected, rtol=1e-6, atol=1e-7)
    for a, b in zip(jtu.tree_leaves(primal), jtu.tree_leaves(expected)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            assert np.array_equal(a, b)
    for b in range(BATCH) if vmapped else [None]:
        trips = int(steps if b is None else steps[b])
        assert max_steps is None or trips <= max_steps
        elem = (lambda t: t) if b is None else functools.partial(element, b=b)
        assert trips < PAD
        ref = reference_grad(kind_name)(elem(inputs), w, trips)
        assert tree_allclose(elem(grads[0]), ref[0]), (b, trips)
        # under vmap `w` is shared, so each element has its own gradient for it
        assert tree_allclose(elem(grads[1]), ref[1]), (b, trips)


EXAMPLES = settings(
    max_examples=9,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


# every configuration, 9 examples each: 216 in all
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@EXAMPLES
@given(data=st.data())
def test_loop_matches_lax(config, data):
    inputs, w, n = draw(config, data)
    out = ours(*config)(inputs, w, n)
    kind_name, max_steps, _, vmapped = config
    expected = reference_forward(kind_name, max_steps, vmapped)(inputs, w, n)[1]
    # forward: each compiled on its own, within a few eps (see `assert_forward_equal`)
    assert_forward_equal(out, expected)
    assert_matches_lax(config, inputs, w, n)


@pytest.mark.parametrize("config", ONE_LOOP_CONFIGS, ids=_config_id)
@EXAMPLES
@given(data=st.data())
def test_one_loop_matches_lax(config, data):
    """The reverse sweep as one loop, forced: the same gradients."""
    assert_matches_lax(config, *draw(config, data), one_loop=True)
