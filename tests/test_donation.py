"""Donating buffers to a jitted training step (`bl.filter_jit(..., donate=...)`), so
that a long-running loop of steps updates its state in place. On CPU, JAX 0.10
honours donation: the donated inputs are deleted and the outputs reuse their
memory."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import boundedloop as bl

from .helpers import tree_allclose


STEPS = 16


def train_step(x, params, traj):
    """One step of training through a loop that fills `traj` in place. `x` (first)
    is data; `params` and `traj` are state, replaced by the step's outputs."""

    def loss(params, traj):
        def body(carry):
            h, traj, i = carry
            h = jnp.tanh(params["w"] * h + params["b"])
            return h, traj.at[i].set(h), i + 1

        h, traj, _ = bl.while_loop(
            lambda c: c[2] < STEPS,
            body,
            (x, traj, jnp.array(0)),
            max_steps=STEPS,
            checkpoints=4,
            buffers=lambda c: c[1],
        )
        return jnp.sum(h**2) + 0.1 * jnp.sum(traj), traj

    grads, traj = jax.grad(loss, has_aux=True)(params, traj)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return params, traj


# `x` is first, so "all-except-first" donates the state and keeps the data
donating_step = bl.filter_jit(train_step, donate="all-except-first")
plain_step = bl.filter_jit(train_step)


def state():
    params = {"w": jnp.full((4,), 0.7), "b": jnp.linspace(-0.1, 0.1, 4)}
    return params, jnp.zeros((STEPS, 4))


X = jnp.array([0.3, -0.2, 0.5, 0.1])


def test_donated_state_is_deleted_and_updated_in_place():
    params, traj = state()
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(params)]
    traj_pointer = traj.unsafe_buffer_pointer()
    new_params, new_traj = donating_step(X, params, traj)
    # the donated inputs are gone ...
    assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(params))
    assert traj.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        traj + 1
    # ... the data is not ...
    assert not X.is_deleted()
    # ... and the outputs live where the inputs were: updated in place
    assert new_traj.unsafe_buffer_pointer() == traj_pointer
    new_pointers = [
        a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(new_params)
    ]
    assert sorted(new_pointers) == sorted(pointers)
    # the same results as without donation
    assert tree_allclose((new_params, new_traj), plain_step(X, *state()))


def test_a_loop_of_donating_steps():
    params, traj = state()
    expected = state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "donated buffers were not usable"
        for _ in range(3):
            old = traj
            params, traj = donating_step(X, params, traj)
            assert old.is_deleted()
            expected = plain_step(X, *expected)
    assert tree_allclose((params, traj), expected)
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves(expected))


def test_donation_that_cannot_be_used():
    """An input with no output of its shape cannot be reused. `jax.jit` warns;
    `bl.filter_jit` (Equinox) silences that warning; neither deletes the input."""
    total = lambda a: jnp.sum(a)  # noqa: E731
    a = jnp.ones(8)
    with pytest.warns(UserWarning, match="donated buffers were not usable"):
        jax.jit(total, donate_argnums=0)(a)
    assert not a.is_deleted()
    b = jnp.ones(8)
    bl.filter_jit(total, donate="all")(b)  # filterwarnings=error: no warning
    assert not b.is_deleted()
