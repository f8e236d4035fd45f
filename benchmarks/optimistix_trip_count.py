"""Why the optimistix guide's second derivative differs between a TPU and the host:
BFGS stops at another step, and the derivative of an unrolled solve follows it.

    python benchmarks/optimistix_trip_count.py

The guide's solve (BFGS at rtol = atol = 1e-6, `max_steps=64`) at `a = 1` and at the
next float32 above it, on the default backend and the host CPU: BFGS's steps, the
solution, and the gradient and Hessian of its sum with respect to `a` through
`CheckpointedAdjoint(checkpoints=64)` (every step stored, the one form that compiled
on the TPU v5e). A line per backend and `a` (`results/optimistix_trip_count_tpu.txt`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

from boundedloop.optimistix import CheckpointedAdjoint


def valley(y, a):
    terms = a * (y[1:] - y[:-1] ** 2) ** 2 + (1 - y[:-1]) ** 2
    return jnp.sum(terms) + 0.1 * a * y[0]


def solve(a, adjoint):
    y0 = jnp.array([-1.0, 1.5, 0.5], a.dtype)
    solver = optx.BFGS(rtol=1e-6, atol=1e-6)
    return optx.minimise(
        valley, solver, y0, args=a, max_steps=64, throw=False, adjoint=adjoint
    )


def solution_sum(a):
    return jnp.sum(solve(a, CheckpointedAdjoint(checkpoints=64)).value)


def main():
    recursive = optx.RecursiveCheckpointAdjoint()
    for device in dict.fromkeys([jax.devices()[0], jax.devices("cpu")[0]]):
        with jax.default_device(device):
            for a0 in [1.0, float(np.nextafter(np.float32(1), np.float32(2)))]:
                a = jax.device_put(jnp.array(a0, jnp.float32), device)
                solution = jax.jit(lambda a: solve(a, recursive))(a)
                grad = jax.jit(jax.grad(solution_sum))(a)
                hessian = jax.jit(jax.hessian(solution_sum))(a)
                said = ["steps", int(solution.stats["num_steps"])]
                said += ["value", np.asarray(solution.value).tolist()]
                said += ["grad", float(grad), "hessian", float(hessian)]
                print(device.platform, a0, *said, flush=True)


if __name__ == "__main__":
    main()
