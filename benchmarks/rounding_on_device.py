"""Is a difference from the host our loop, or the device's arithmetic? The two
second-derivative and gradient cases that missed the tests' element-wise tolerance
on a TPU v5e at 51b94ec, computed four ways: ours and `lax.scan` over the same trip
count on the default backend, and `lax.scan` on the host CPU in float32 and in
float64 (the truth).

    python benchmarks/rounding_on_device.py [--out FILE]

Neither body reads a buffer, so neither is of the form XLA miscompiles on a TPU
(the docs page "Correct on TPU"): the device's own `lax.scan` is a fair reference
there. If ours matches it to a few float32 ulps of the result's scale while both
differ from float64 alike, the difference is the device's arithmetic (its `tanh`
near saturation, say), not the loop. Prints, per case, the largest difference of
each against float64 and of ours against the device's scan, each over the result's
largest magnitude; the results file (default
`benchmarks/results/rounding_on_device_<platform>.json`) holds them and the values.

- **hessian**: `jax.hessian` of `sum(x_n ** 2)` with respect to `(x0, W)`, `x <-
  tanh(W x + 0.1)` on 3 elements for 11 steps (`test_forward_mode.py`'s case
  `[3-20-11]`: 3 checkpoints, `max_steps=20`).
- **gradient**: the gradient with respect to `w` of `sum(x ** 2) + 0.3 sum(x)` after
  23 steps of `x <- tanh(w x + 0.1 i) + 0.05 [x_0 > 0]` (`test_properties.py`'s
  `tuple` kind, seed 112, the batch element with 23 trips; 3 checkpoints,
  `max_steps=23`); ours also under `vmap` with the batch's trip counts 0, 0 and 23,
  as the test ran it.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import boundedloop as bl


W = np.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
X0 = np.array([0.3, -0.2, 0.5])


def hessian_case(dtype, loop):
    def loss(x, w):
        def body(c):
            x, i = c
            return jnp.tanh(w @ x + 0.1), i + 1

        x, _ = loop(lambda c: c[1] < 11, body, (x, jnp.array(0)), 11, 20)
        return jnp.sum(x**2)

    return jax.hessian(loss, argnums=(0, 1))(
        jnp.asarray(X0, dtype), jnp.asarray(W, dtype)
    )


def gradient_case(dtype, loop, batched=False):
    rng = np.random.default_rng(112)
    w = rng.uniform(-1.2, 1.2, 3).astype(np.float32)
    x0s = np.stack([rng.uniform(-1, 1, 3).astype(np.float32) for _ in range(3)])

    def loss(w, x0, n):
        def body(c):
            x, i, flag = c
            x = jnp.tanh(w * x + 0.1 * i.astype(x.dtype)) + 0.05 * flag.astype(x.dtype)
            return x, i + 1, x[0] > 0

        init = (x0, jnp.array(0), jnp.array(False))
        x, _, _ = loop(lambda c: c[1] < n, body, init, 23, 23)
        return jnp.sum(x**2) + 0.3 * jnp.sum(x)

    w, x0s = jnp.asarray(w, dtype), jnp.asarray(x0s, dtype)
    if batched:  # as the test ran it: the batch's trip counts 0, 0 and 23
        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(
            w, x0s, jnp.array([0, 0, 23])
        )
        return grads[2]
    return jax.grad(loss)(w, x0s[2], 23)


def ours(cond, body, init, trips, max_steps):
    del trips
    return bl.while_loop(cond, body, init, max_steps=max_steps, checkpoints=3)


def scan(cond, body, init, trips, max_steps):
    del cond, max_steps
    return lax.scan(lambda c, _: (body(c), None), init, length=trips)[0]


def four_ways(case):
    """The case's result: ours and the scan on the default backend (float32), the
    scan on the host in float32 and in float64, each flattened to one vector."""
    flat = lambda tree: np.concatenate(  # noqa: E731
        [np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)]
    )
    results = {
        "ours": flat(jax.jit(lambda: case(jnp.float32, ours))()),
        "scan": flat(jax.jit(lambda: case(jnp.float32, scan))()),
    }
    if case is gradient_case:
        batched = jax.jit(lambda: case(jnp.float32, ours, batched=True))()
        results["ours, vmapped"] = flat(batched)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        results["host float32"] = flat(jax.jit(lambda: case(jnp.float32, scan))())
        with jax.enable_x64(True):
            results["host float64"] = flat(jax.jit(lambda: case(jnp.float64, scan))())
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    platform = jax.default_backend()
    rows = []
    for name, case in [("hessian", hessian_case), ("gradient", gradient_case)]:
        values = four_ways(case)
        truth = values["host float64"]
        scale = float(np.max(np.abs(truth)))
        row = {"case": name, "scale": scale}
        for kind in [k for k in values if k != "host float64"]:
            row[f"{kind} vs float64"] = (
                float(np.max(np.abs(values[kind] - truth))) / scale
            )
        row["ours vs scan"] = (
            float(np.max(np.abs(values["ours"] - values["scan"]))) / scale
        )
        row["values"] = {k: v.tolist() for k, v in values.items()}
        rows.append(row)
        print({k: v for k, v in row.items() if k != "values"}, flush=True)
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parent
        / "results"
        / f"rounding_on_device_{platform}.json"
    )
    out.write_text(
        json.dumps(
            {"platform": platform, "jax": jax.__version__, "rows": rows}, indent=1
        )
    )


if __name__ == "__main__":
    main()
