"""Training a neural ODE with diffrax through `CheckpointedAdjoint`.

A small MLP vector field is fitted to trajectories of a damped rotation: a batch
of initial conditions, each observed at a few times. The loss solves the ODE for
the whole batch (`jax.vmap` inside the loss) with `diffrax.diffeqsolve`, an
adaptive Tsit5 solver whose loops run on `bl.while_loop` through
`boundedloop.diffrax.CheckpointedAdjoint`; optax's Adam takes the training
steps.

    python examples/neural_ode.py [--steps N]

Needs the `diffrax` extra and optax (`pip install -e ".[dev]"` has both)."""

import argparse

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg
import optax

import boundedloop as bl
from boundedloop.diffrax import CheckpointedAdjoint


T_END = 2.0
TS = jnp.linspace(0.0, T_END, 8)  # the observation times


def dataset(key, size=16):
    """Initial conditions and their exact states at `TS` under a damped
    rotation: shapes `(size, 2)` and `(size, len(TS), 2)`."""
    a = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])
    y0 = jax.random.normal(key, (size, 2))
    # the exact flow from 0 to each time in TS: shape (len(TS), 2, 2)
    flows = jax.vmap(lambda t: jax.scipy.linalg.expm(a * t))(TS)
    ys = jnp.einsum("tij,bj->bti", flows, y0)
    return y0, ys


def solve(model, y0):
    """The model's trajectory from `y0`, at the times `TS`: shape
    `(len(TS), 2)`."""
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, model: model(y)),
        diffrax.Tsit5(),
        t0=0.0,
        t1=T_END,
        dt0=0.1,
        y0=y0,
        args=model,
        saveat=diffrax.SaveAt(ts=TS),
        stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
        adjoint=CheckpointedAdjoint(),  # the one change from diffrax's default
        max_steps=256,
    )
    return sol.ys


def loss_fn(model, y0, ys):
    # the whole batch, vmapped inside the loss
    pred = jax.vmap(solve, in_axes=(None, 0))(model, y0)
    return jnp.mean((pred - ys) ** 2)


def main(steps=200, seed=0):
    data_key, model_key = jax.random.split(jax.random.key(seed))
    y0, ys = dataset(data_key)
    model = eqx.nn.MLP(2, 2, 16, 2, activation=jnp.tanh, key=model_key)
    optim = optax.adam(3e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @bl.filter_jit
    def train_step(model, opt_state, y0, ys):
        loss, grads = bl.filter_value_and_grad(loss_fn)(model, y0, ys)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for step in range(steps):
        model, opt_state, loss = train_step(model, opt_state, y0, ys)
        losses.append(float(loss))
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
