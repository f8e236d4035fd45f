"""Tune two regularisation strengths of a logistic regression by Newton's
method, differentiating the validation loss through the 30 gradient-descent
steps that train it.

Training stops after a fixed 30 steps, well before it converges, so the
implicit function theorem (`optx.ImplicitAdjoint`, optimistix's default) would
give the derivative of a solution that was never reached. Differentiating
through the steps taken is what `optx.RecursiveCheckpointAdjoint` does, in
reverse mode (and forward over reverse, so `jax.hessian`); `CheckpointedAdjoint`
gives the same derivatives and forward mode too (`jax.jvp`, `jax.jacfwd`).

    python examples/optimistix_bilevel.py
"""

import jax
import jax.numpy as jnp
import optimistix as optx

from boundedloop.optimistix import CheckpointedAdjoint


STEPS = 30


def make_data(key, n=64, d=24):
    """A noisy linear classification problem, split in half: training and
    validation data."""
    k_w, k_x, k_noise = jax.random.split(key, 3)
    w_true = jax.random.normal(k_w, (d,)) * jnp.array(
        [3.0, 2.0] + [0.0] * (d - 2)
    )
    x = jax.random.normal(k_x, (n, d))
    logits = x @ w_true + jax.random.normal(k_noise, (n,))
    labels = (logits > 0).astype(jnp.float32)
    half = n // 2
    return (x[:half], labels[:half]), (x[half:], labels[half:])


def logistic_loss(w, x, labels):
    return jnp.mean(jnp.logaddexp(0.0, x @ w) - labels * (x @ w))


def train(log_strengths, train_data, adjoint):
    """`STEPS` steps of gradient descent on the penalised training loss
    (tolerances of zero: the solve always runs to `max_steps`, and reports
    `nonlinear_max_steps_reached`)."""
    ridge, smooth_l1 = jnp.exp(log_strengths)

    def penalised(w, args):
        x, labels = args
        penalty = ridge * jnp.sum(w**2) + smooth_l1 * jnp.sum(
            jnp.sqrt(w**2 + 1e-2)
        )
        return logistic_loss(w, x, labels) + penalty

    w0 = jnp.zeros(train_data[0].shape[1])
    solver = optx.GradientDescent(learning_rate=2.0, rtol=0.0, atol=0.0)
    sol = optx.minimise(
        penalised,
        solver,
        w0,
        args=train_data,
        max_steps=STEPS,
        throw=False,
        adjoint=adjoint,
    )
    return sol.value


def validation_loss(log_strengths, train_data, val_data, adjoint):
    return logistic_loss(train(log_strengths, train_data, adjoint), *val_data)


def main(outer_steps=6):
    train_data, val_data = make_data(jax.random.key(0))
    ours = CheckpointedAdjoint()

    def loss(log_strengths, adjoint=ours):
        return validation_loss(log_strengths, train_data, val_data, adjoint)

    value_grad_hessian = jax.jit(
        lambda h: (loss(h), jax.grad(loss)(h), jax.hessian(loss)(h))
    )
    h = jnp.log(jnp.array([1e-3, 1e-3]))  # weak penalties: overfits

    # the same derivatives as optimistix's own unrolled adjoint
    rca = optx.RecursiveCheckpointAdjoint()
    _, g, H = value_grad_hessian(h)
    g_rca, H_rca = jax.grad(loss)(h, rca), jax.hessian(loss)(h, rca)
    print(f"ours - RCA's: gradient {jnp.abs(g - g_rca).max():.1e}", end="")
    print(f", Hessian {jnp.abs(H - H_rca).max():.1e}")
    # forward mode: how each trained weight moves with the two strengths
    sensitivity = jax.jacfwd(train)(h, train_data, ours)
    print(f"d(weights)/d(log strengths): shape {sensitivity.shape}")
    try:
        jax.jacfwd(train)(h, train_data, rca)
    except TypeError as error:
        print(f"with RCA: {error}")

    losses = []
    for step in range(outer_steps + 1):
        value, g, H = value_grad_hessian(h)
        losses.append(float(value))
        print(
            f"step {step}  strengths {jnp.exp(h)}  validation loss {value:.4f}"
        )
        # Newton on the log-strengths, with the Hessian's eigenvalues made
        # positive (the loss is not convex in them) and steps of at most 1
        eigenvalues, vectors = jnp.linalg.eigh(H)
        newton = vectors @ ((vectors.T @ g) / (jnp.abs(eigenvalues) + 1e-3))
        h = h - newton / jnp.maximum(1.0, jnp.linalg.norm(newton))
    return losses


if __name__ == "__main__":
    main()
