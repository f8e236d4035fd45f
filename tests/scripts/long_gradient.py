"""The gradient of a long loop, for `tests/test_memory.py`: imported (`run`), or run
in a subprocess so that it can be stopped after a time limit, as
`long_gradient.py STEPS MAX_STEPS`.

Takes the gradient of `STEPS` steps of a small body (a 4-element carry) with 16
checkpoints, checks it is finite and equal to the gradient of a `lax.scan` over the
same steps (computed on the host CPU backend), and returns (prints) the seconds it
took."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import boundedloop as bl


theta = 0.01
# a slow rotation (norm-preserving, so the gradient neither vanishes nor explodes
# over many steps), perturbed by a parameterised nonlinearity
R = jnp.asarray(
    np.kron(
        np.eye(2), [[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]]
    ),
    jnp.float32,
)


def body(w):
    def step(carry):
        x, i = carry
        return R @ x + 1e-3 * jnp.sin(w * x), i + 1

    return step


def loss(x):
    return jnp.sum(x**2) + x[0]


def run(steps: int, max_steps: int) -> float:
    def ours(x, w, n):
        final = bl.while_loop(
            lambda c: c[1] < n,
            body(w),
            (x, jnp.array(0)),
            max_steps=max_steps,
            checkpoints=16,
        )
        return loss(final[0])

    def reference(x, w):
        final, _ = lax.scan(
            lambda c, _: (body(w)(c), None), (x, jnp.array(0)), length=steps
        )
        return loss(final[0])

    x = jnp.array([0.3, -0.2, 0.5, 0.1])
    w = jnp.array([1.0, 2.0, -1.0, 0.5])
    grad = jax.jit(jax.grad(ours, argnums=(0, 1))).lower(x, w, jnp.array(0)).compile()
    start = time.perf_counter()
    got = jax.block_until_ready(grad(x, w, jnp.array(steps)))
    seconds = time.perf_counter() - start
    # the reference on the host CPU backend, whatever the default one: XLA on a TPU
    # miscompiles some `lax` loops (as `tests.helpers.on_host` does; this script also
    # runs on its own, outside the `tests` package)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        expected = jax.jit(jax.grad(reference, argnums=(0, 1)))(
            jax.device_put(x, cpu), jax.device_put(w, cpu)
        )
    for a, b in zip(got, expected):
        assert np.all(np.isfinite(np.asarray(a))), got
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    return seconds


if __name__ == "__main__":
    steps = int(sys.argv[1])
    print(f"gradient of {steps} steps: {run(steps, int(sys.argv[2])):.3f} s")
