"""float64 checks, run in a subprocess by `tests/test_float64.py` so that
`jax_enable_x64` never leaks into the other tests.

Forward values against `lax.while_loop` / `lax.scan` (bit for bit, and so within any
tolerance) and gradients against `lax.scan` over the trip count, with relative
tolerance 1e-10: `bl.while_loop` with a buffer (checkpoints 1, 3, None; and 3 under
vmap) and `bl.scan` (checkpoints 1, 3, None). Prints the number of cases.
"""

import functools

import jax


jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import boundedloop as bl  # noqa: E402


RTOL = 1e-10
MAX_STEPS = 20
CASES = []


def check(name, got, expected, *, exact=False):
    got_leaves, expected_leaves = jtu.tree_leaves(got), jtu.tree_leaves(expected)
    assert jtu.tree_structure(got) == jtu.tree_structure(expected), name
    for a, b in zip(got_leaves, expected_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        if a.dtype.kind == "f":
            assert a.dtype == np.float64, (name, a.dtype)
        if exact or a.dtype.kind != "f":
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=0, err_msg=name)
    CASES.append(name)


W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
X0 = jnp.array([0.3, -0.2, 0.5])
assert W.dtype == jnp.float64


def body(w):
    def step(carry):
        x, traj, i = carry
        prev = jnp.where(i > 0, traj[jnp.maximum(i - 1, 0)], 0.0)
        x = jnp.tanh(w @ x + 0.1) + 1e-3 * prev
        return x, traj.at[i].set(x), i + 1

    return step


def init(x):
    return x, jnp.zeros((MAX_STEPS, 3)), jnp.array(0)


def loss(out):
    x, traj, _ = out
    return jnp.sum(x**2) + jnp.sum(jnp.sin(traj))


def make_while(checkpoints):
    def run(x, w, n):
        return bl.while_loop(
            lambda c: c[2] < n,
            body(w),
            init(x),
            max_steps=MAX_STEPS,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )

    return run


def lax_while(x, w, n):
    return lax.while_loop(lambda c: c[2] < jnp.minimum(n, MAX_STEPS), body(w), init(x))


def scan_reference(x, w, trips):
    final, _ = lax.scan(lambda c, _: (body(w)(c), None), init(x), length=trips)
    return final


@functools.cache
def reference_grad(trips):
    value = lambda x, w: loss(scan_reference(x, w, trips))  # noqa: E731
    return jax.jit(jax.grad(value, argnums=(0, 1)))


def grad_of(run):
    return jax.jit(jax.grad(lambda x, w, *a: loss(run(x, w, *a)), argnums=(0, 1)))


# the undifferentiated loop does not depend on `checkpoints`: one forward program
forward, forward_ref = jax.jit(make_while(None)), jax.jit(lax_while)
for n in [0, 1, 7, 20, 25]:
    n = jnp.array(n)
    check(
        f"while_loop n={n} forward",
        forward(X0, W, n),
        forward_ref(X0, W, n),
        exact=True,
    )
for checkpoints in [1, 3, None]:
    grad = grad_of(make_while(checkpoints))
    for n in [0, 1, 7, 20, 25]:
        trips = min(n, MAX_STEPS)
        check(
            f"while_loop checkpoints={checkpoints} n={n} grad",
            grad(X0, W, jnp.array(n)),
            reference_grad(trips)(X0, W),
        )

vmapped = jax.jit(jax.vmap(grad_of(make_while(3)), in_axes=(0, None, 0)))
ns = jnp.array([3, 20, 0, 11])
xs = jnp.stack([X0 * s for s in [1.0, -0.7, 0.4, 1.3]])
got = vmapped(xs, W, ns)
for b, n in enumerate(ns.tolist()):
    check(
        f"while_loop vmap checkpoints=3 n={n} grad",
        jtu.tree_map(lambda g: g[b], got),
        reference_grad(n)(xs[b], W),
    )


def scan_body(w):
    def f(c, xt):
        c = jnp.tanh(w @ c + xt)
        return c, jnp.sum(c**3)

    return f


XS = jnp.linspace(-0.5, 0.5, 3 * 17).reshape(17, 3)


def scan_loss(f):
    def value(x, w, xs):
        c, ys = f(scan_body(w), x, xs)
        return jnp.sum(c**2) + jnp.sum(jnp.cos(ys))

    return value


check(
    "scan forward",
    jax.jit(lambda x, w, xs: bl.scan(scan_body(w), x, xs))(X0, W, XS),
    jax.jit(lambda x, w, xs: lax.scan(scan_body(w), x, xs))(X0, W, XS),
    exact=True,
)
scan_reference_grad = jax.jit(jax.grad(scan_loss(lax.scan), argnums=(0, 1, 2)))
for checkpoints in [1, 3, None]:

    def ours(f, x, xs, checkpoints=checkpoints):
        return bl.scan(f, x, xs, checkpoints=checkpoints)

    check(
        f"scan checkpoints={checkpoints} grad",
        jax.jit(jax.grad(scan_loss(ours), argnums=(0, 1, 2)))(X0, W, XS),
        scan_reference_grad(X0, W, XS),
    )

print(f"float64: {len(CASES)} cases passed")
