"""Training through an adaptive-step ODE solver.

The model is a neural vector field `f(y)` (an `eqx.nn.MLP`) integrated from 0 to
`T` by an adaptive Heun-Euler solver: each step estimates its own error and the
step size follows, so every trajectory takes its own number of steps (printed
before and after training). The loop is a `bl.LoopModule`; training is
`bl.filter_value_and_grad` + optax under `bl.filter_jit`, vmapped over a batch
of initial conditions.

    python examples/train.py [--steps N]
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg
import optax

import boundedloop as bl


class AdaptiveHeun(bl.LoopModule):
    """Integrates `dy/dt = vector_field(y)` from `t = 0` to `t_end`."""

    vector_field: eqx.nn.MLP
    t_end: float = 2.0
    tol: float = 1e-3

    def cond(self, carry):
        t, _, _, _ = carry
        return t < self.t_end

    def body(self, carry):
        t, y, h, steps = carry
        h = jnp.minimum(h, self.t_end - t)
        k1 = self.vector_field(y)
        k2 = self.vector_field(y + h * k1)
        y_heun = y + 0.5 * h * (k1 + k2)
        error = jnp.max(jnp.abs(0.5 * h * (k2 - k1))) + 1e-12
        accept = error <= self.tol
        t = jnp.where(accept, t + h, t)
        y = jnp.where(accept, y_heun, y)
        # stop_gradient: the step-size controller is not part of the model
        factor = jax.lax.stop_gradient(
            jnp.clip(0.9 * jnp.sqrt(self.tol / error), 0.2, 5.0)
        )
        return t, y, h * factor, steps + 1

    def solve(self, y0, max_steps=256):
        """The state at `t_end`, the time reached and the number of loop steps
        (each an accepted or a rejected step)."""
        t, y, _, steps = self.run(
            (0.0, y0, 0.1, 0), max_steps=max_steps, checkpoints=8
        )
        return y, t, steps


def dataset(key, size=32, t_end=2.0):
    """Initial conditions and their exact states at `t_end` under a damped
    rotation."""
    a = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])
    y0 = jax.random.normal(key, (size, 2))
    y1 = y0 @ jax.scipy.linalg.expm(a * t_end).T
    return y0, y1


def main(steps=300, seed=0):
    data_key, model_key = jax.random.split(jax.random.key(seed))
    y0, y1 = dataset(data_key)
    model = AdaptiveHeun(
        eqx.nn.MLP(2, 2, 32, 2, activation=jnp.tanh, key=model_key)
    )
    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    def report_steps(model, when):
        solve_batch = bl.filter_jit(lambda m, y: jax.vmap(m.solve)(y))
        _, t, steps = solve_batch(model, y0)
        t_min, t_max = float(jnp.min(t)), float(jnp.max(t))
        print(f"{when}: final time {t_min:.3f} .. {t_max:.3f}")
        print(
            "  loop steps per trajectory (max_steps=256), "
            f"{int(jnp.min(steps))} .. {int(jnp.max(steps))}:"
        )
        for row in range(0, len(steps), 16):
            print(
                "  " + " ".join(f"{int(n):3d}" for n in steps[row : row + 16])
            )
        return steps

    def loss_fn(model, y0, y1):
        pred, _, _ = jax.vmap(model.solve)(y0)
        return jnp.mean((pred - y1) ** 2)

    @bl.filter_jit
    def train_step(model, opt_state, y0, y1):
        loss, grads = bl.filter_value_and_grad(loss_fn)(model, y0, y1)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    report_steps(model, "before training")
    losses = []
    for step in range(steps):
        model, opt_state, loss = train_step(model, opt_state, y0, y1)
        losses.append(float(loss))
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)
    report_steps(model, "after training")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    main(parser.parse_args().steps)
