"""Transforms composed with `vmap`, generated: loop structures x which inputs are
batched x transform stacks, each against the same stack applied to a masked
`lax.scan` (`max_steps` steps, each the body where the predicate holds and the
identity after).

The loops carry what broke these compositions (issue 28): float leaves the body
passes on unchanged, perturbed or not (as diffrax's save buffers under
`SaveAt(t1)`), int and bool leaves, a step counter the trip count is compared with,
buffers written with `pred=` and read back, a buffer of one row written only after
the loop, and an inner loop writing the outer loop's buffer. The function under
`vmap` is drawn with or without a `jax.jit` of its own (`diffeqsolve` is jitted), and
any non-empty subset of its inputs is batched: the initial carry, the closed-over
parameters, the trip count.

The default run tests each stack on one structure (`QUICK`: the ten spread over the
kinds, the batched subsets and the inner `jit`); `-m slow` runs the long profile,
where hypothesis draws the structure too (`LONG_EXAMPLES` per stack).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings, strategies as st
from jax import lax

import boundedloop as bl

from .helpers import on_host, tree_allclose


MAX_STEPS = 5
ROWS = MAX_STEPS + 1
BATCH = 2
QUICK_EXAMPLES = 1
LONG_EXAMPLES = 12


def masked_scan(cond, body, init, *, max_steps, checkpoints=None, buffers=None):
    """The reference loop: the body where `cond` holds, the identity after."""
    del checkpoints, buffers

    def step(carry, _):
        return lax.cond(cond(carry), body, lambda c: c, carry), None

    return lax.scan(step, init, length=max_steps)[0]


def set_ours(buf, index, value, pred):
    return buf.at[index].set(value, pred=pred)


def set_reference(buf, index, value, pred):
    return buf.at[index].set(jnp.where(pred, value, buf[index]))


# Each kind is `(loop, set_row) -> f(x, w, n)`, a scalar: `x` the initial float
# state (2,), `w` closed-over parameters (2,), `n` the trip count (an int).


def passed_on(loop, set_row):
    """A counter, a float state, a time that is not perturbed, two float leaves the
    body passes on (one perturbed through `w`), and a bool flag."""
    del set_row

    def f(x, w, n):
        def body(c):
            i, y, t, fixed, scaled, flag = c
            y = jnp.tanh(w * y + 0.1 * fixed) + 0.05 * flag.astype(y.dtype)
            return i + 1, y, t + 0.25, fixed, scaled, y[0] > 0

        def cond(c):
            return (c[0] < n) & (c[2] < 10.0)

        init = (jnp.array(0), x, jnp.array(0.0), jnp.full(2, 0.5), 0.3 * w, False)
        i, y, t, fixed, scaled, _ = loop(
            cond, body, init, max_steps=MAX_STEPS, checkpoints=2
        )
        return jnp.sum(y**2) + fixed[i * 0] + jnp.sum(scaled * y) + t

    return f


def buffers(loop, set_row):
    """A trajectory written where a predicate holds and its last write read back
    (a slice), and a one-row output buffer written only after the loop."""

    def f(x, w, n):
        def body(c):
            y, traj, out, i, last = c
            prev = jnp.where(last >= 0, traj[jnp.maximum(last, 0), :], y)
            new = jnp.sin(prev) * w + 0.1 * y
            write = i % 3 != 1
            traj = set_row(traj, i, new, write)
            return 0.9 * y + 0.1 * new, traj, out, i + 1, jnp.where(write, i, last)

        init = (x, jnp.zeros((ROWS, 2)), jnp.zeros((1, 2)), jnp.array(0), -1)
        y, traj, out, i, _ = loop(
            lambda c: c[3] < n,
            body,
            init,
            max_steps=MAX_STEPS,
            checkpoints=2,
            buffers=lambda c: (c[1], c[2]),
        )
        out = out.at[0].set(y * i.astype(y.dtype))
        return jnp.sum(traj**2) + jnp.sum(out) + jnp.sum(y)

    return f


def nested(loop, set_row):
    """An inner loop writing the outer loop's buffer, row `i`, column `j`."""

    def f(x, w, n):
        def inner_body(c):
            y, traj, i, j = c
            y = jnp.tanh(w * y + 0.1)
            return y, set_row(traj, (i, j), y, jnp.array(True)), i, j + 1

        def outer_body(c):
            y, traj, i = c
            y, traj, _, _ = loop(
                lambda c: c[3] < 2,
                inner_body,
                (y, traj, i, jnp.array(0)),
                max_steps=3,
                checkpoints=1,
                buffers=lambda c: c[1],
            )
            return 0.8 * y, traj, i + 1

        y, traj, _ = loop(
            lambda c: c[2] < n,
            outer_body,
            (x, jnp.zeros((ROWS, 2, 2)), jnp.array(0)),
            max_steps=MAX_STEPS,
            checkpoints=2,
            buffers=lambda c: c[1],
        )
        return jnp.sum(y**2) + jnp.sum(jnp.sin(traj))

    return f


KINDS = {"passed_on": passed_on, "buffers": buffers, "nested": nested}


# Each stack is `(f, axes) -> g(x, w, n, tx, tw)`: `axes` are `vmap`'s in_axes for
# `(x, w, n)`, `tx` and `tw` tangents shaped like `x` and `w`.


def _batched(f, axes):
    return jax.vmap(f, in_axes=axes)


def grad_vmap(f, axes):
    def g(x, w, n, tx, tw):
        total = lambda x, w: jnp.sum(_batched(f, axes)(x, w, n))  # noqa: E731
        return jax.grad(total, argnums=(0, 1))(x, w)

    return g


def vmap_grad(f, axes):
    return lambda x, w, n, tx, tw: _batched(jax.grad(f, argnums=(0, 1)), axes)(x, w, n)


def vmap_vmap_grad(f, axes):
    grads = jax.grad(f, argnums=(0, 1))
    return lambda x, w, n, tx, tw: _batched(_batched(grads, axes), axes)(x, w, n)


def jvp_vmap(f, axes):
    def g(x, w, n, tx, tw):
        return jax.jvp(lambda x, w: _batched(f, axes)(x, w, n), (x, w), (tx, tw))

    return g


def vmap_jvp(f, axes):
    def one(x, w, n, tx, tw):
        return jax.jvp(lambda x, w: f(x, w, n), (x, w), (tx, tw))

    return jax.vmap(one, in_axes=axes + axes[:2])


def jacfwd_vmap(f, axes):
    def g(x, w, n, tx, tw):
        batch = lambda x, w: _batched(f, axes)(x, w, n)  # noqa: E731
        return jax.jacfwd(batch, argnums=(0, 1))(x, w)

    return g


def linearize_vmap(f, axes):
    def g(x, w, n, tx, tw):
        out, tangent = jax.linearize(lambda x, w: _batched(f, axes)(x, w, n), x, w)
        return out, tangent(tx, tw)

    return g


def hessian_vmap(f, axes):
    def g(x, w, n, tx, tw):
        total = lambda x, w: jnp.sum(_batched(f, axes)(x, w, n))  # noqa: E731
        return jax.hessian(total, argnums=(0, 1))(x, w)

    return g


def grad_grad_vmap(f, axes):
    """Reverse over reverse: a gradient penalty on a batch."""

    def g(x, w, n, tx, tw):
        def penalty(x, w):
            grads = jax.grad(lambda x, w: jnp.sum(_batched(f, axes)(x, w, n)), (0, 1))
            gx, gw = grads(x, w)
            return jnp.sum(gx**2) + jnp.sum(gw**2)

        return jax.grad(penalty, argnums=(0, 1))(x, w)

    return g


def grad_jvp_vmap(f, axes):
    """Reverse over forward."""

    def g(x, w, n, tx, tw):
        def tangent(x, w):
            out = jax.jvp(lambda x, w: _batched(f, axes)(x, w, n), (x, w), (tx, tw))
            return jnp.sum(out[1])

        return jax.grad(tangent, argnums=(0, 1))(x, w)

    return g


STACKS = {
    "grad_vmap": grad_vmap,
    "vmap_grad": vmap_grad,
    "vmap_vmap_grad": vmap_vmap_grad,
    "jvp_vmap": jvp_vmap,
    "vmap_jvp": vmap_jvp,
    "jacfwd_vmap": jacfwd_vmap,
    "linearize_vmap": linearize_vmap,
    "hessian_vmap": hessian_vmap,
    "grad_grad_vmap": grad_grad_vmap,
    "grad_jvp_vmap": grad_jvp_vmap,
}
# batch axes in front of each batched input (two for `vmap_vmap_grad`)
DEPTH = {"vmap_vmap_grad": 2}

# non-empty subsets of (x, w, n) to batch
AXES = [
    axes
    for axes in [(a, b, c) for a in (0, None) for b in (0, None) for c in (0, None)]
    if axes != (None, None, None)
]


@functools.cache
def compiled(kind, stack, axes, jit_inside, reference):
    loop, set_row = (
        (masked_scan, set_reference) if reference else (bl.while_loop, set_ours)
    )
    f = KINDS[kind](loop, set_row)
    if jit_inside:
        f = jax.jit(f)
    return jax.jit(STACKS[stack](f, axes))


def _inputs(rng, stack, axes, n_values):
    """`(x, w, n, tx, tw)` with batch axes in front of the batched inputs."""
    lead = (BATCH,) * DEPTH.get(stack, 1)

    def draw(shape, batched):
        full = lead + shape if batched else shape
        return jnp.asarray(rng.uniform(-1, 1, full).astype(np.float32))

    x, w = draw((2,), axes[0] == 0), draw((2,), axes[1] == 0)
    tx, tw = draw((2,), axes[0] == 0), draw((2,), axes[1] == 0)
    n = jnp.asarray(n_values[: int(np.prod(lead))]).reshape(lead)
    n = n if axes[2] == 0 else n.reshape(-1)[0]
    return x, w, n, tx, tw


def _check(stack, data, structure=None):
    if structure is None:
        kind = data.draw(st.sampled_from(sorted(KINDS)), label="kind")
        axes = data.draw(st.sampled_from(AXES), label="batched (x, w, n)")
        jit_inside = data.draw(st.booleans(), label="jit inside vmap")
    else:
        kind, axes, jit_inside = structure
    n_values = data.draw(
        st.lists(st.integers(0, MAX_STEPS + 1), min_size=4, max_size=4), label="n"
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    args = _inputs(rng, stack, axes, n_values)
    ours = compiled(kind, stack, axes, jit_inside, reference=False)(*args)
    expected = on_host(compiled(kind, stack, axes, jit_inside, reference=True))(*args)
    assert tree_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def _property(examples):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


# the default run: each stack on one structure, the structures spread over the
# kinds, the batched subsets and the `jit` inside (hypothesis draws the data)
QUICK = {
    stack: (sorted(KINDS)[k % 3], AXES[(2 * k + 1) % len(AXES)], k % 4 != 3)
    for k, stack in enumerate(sorted(STACKS))
}


@pytest.mark.parametrize("stack", sorted(STACKS))
@_property(QUICK_EXAMPLES)
@given(data=st.data())
def test_composition_matches_masked_scan(stack, data):
    _check(stack, data, QUICK[stack])


@pytest.mark.slow
@pytest.mark.parametrize("stack", sorted(STACKS))
@_property(LONG_EXAMPLES)
@given(data=st.data())
def test_composition_matches_masked_scan_long(stack, data):
    _check(stack, data)
