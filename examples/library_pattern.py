"""The library pattern: accept any user callable, stay jittable end to end.

`solve` below is what a library author writes: a fixed-point solver that takes a
user's function (a plain function, a closure, or a `jax.tree_util.Partial`
holding arrays and non-array configuration). It never calls `jax.jit` itself and
never asks which arguments are static. The user jits and differentiates the
whole thing with `bl.filter_jit` / `bl.filter_grad`; arrays inside the `Partial`
are traced and get gradients, everything else is static.

    python examples/library_pattern.py
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import boundedloop as bl


# ---- library code ------------------------------------------------------------


class _FixedPoint(bl.LoopModule):
    # the user's callable: its arrays are traced, the rest is static
    fn: Callable
    tol: float

    def cond(self, carry):
        _, change, _ = carry
        return change > self.tol

    def body(self, carry):
        y, _, steps = carry
        new = self.fn(y)
        return new, jnp.max(jnp.abs(new - y)), steps + 1


def solve(fn: Callable, y0: jax.Array, *, max_steps: int, tol: float = 1e-6):
    """Iterate `y <- fn(y)` from `y0` until it stops changing (or `max_steps`).

    **Returns:** `(y, steps)`: the fixed point and how many steps it took.
    """
    y, _, steps = _FixedPoint(fn, tol).run(
        (y0, jnp.array(jnp.inf), 0), max_steps=max_steps, checkpoints=8
    )
    return y, steps


# ---- user code ---------------------------------------------------------------


def damped_update(weights, mode, y):
    """A contraction whose form depends on a static string."""
    z = weights["a"] @ y + weights["b"]
    return jnp.tanh(z) if mode == "tanh" else jax.nn.sigmoid(z)


def main():
    k1, k2 = jax.random.split(jax.random.key(0))
    weights = {
        "a": 0.4 * jax.random.normal(k1, (4, 4)) / 2.0,
        "b": jax.random.normal(k2, (4,)),
    }
    fn = jtu.Partial(damped_update, weights, "tanh")
    y0 = jnp.zeros(4)

    @bl.filter_jit
    def loss(fn, y0):
        y, _ = solve(fn, y0, max_steps=200)
        return jnp.sum(y**2)

    value, grads = bl.filter_jit(bl.filter_value_and_grad(loss))(fn, y0)
    _, steps = bl.filter_jit(solve)(fn, y0, max_steps=200)
    print(f"fixed point reached in {int(steps)} steps, loss {float(value):.6f}")

    # reference: the same iteration unrolled for the known number of steps
    def unrolled(weights):
        y = y0
        for _ in range(int(steps)):
            y = damped_update(weights, "tanh", y)
        return jnp.sum(y**2)

    expected = jax.grad(unrolled)(weights)
    got = grads.args[0]
    err = max(float(jnp.max(jnp.abs(got[k] - expected[k]))) for k in weights)
    print(
        "gradient w.r.t. the Partial's arrays matches the unrolled loop to "
        f"{err:.1e}"
    )
    # a different static configuration retraces; new array values do not
    fn2 = jtu.Partial(damped_update, weights, "sigmoid")
    print(f"sigmoid variant: loss {float(loss(fn2, y0)):.6f}")
    return err


if __name__ == "__main__":
    main()
