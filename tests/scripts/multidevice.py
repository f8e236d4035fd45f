"""Sharding checks on 8 CPU devices, run in a subprocess by `tests/test_multidevice.py`
with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set
before JAX starts, and must not change the device count of the other tests).

Each check runs separately and the script prints one JSON object, `{check: {"ok":
bool, "cases": int, "error": str | None}}`, as its last line:

- `jit`: a carry sharded over a mesh of 8 devices (`NamedSharding`, `Auto` axes)
  under `jax.jit`: forward and gradient equal the unsharded results and the
  `lax.while_loop` / `lax.scan` references, and keep their sharding.
- `jit_buffers`: the same with an in-place buffer in the carry, sharded along its
  second axis, and `bl.scan`.
- `explicit`: the `jit` check on a mesh with `Explicit` axes (`jax.make_mesh`'s
  default), under `jax.set_mesh`.
- `shard_map`: the loop inside `jax.shard_map`, each device running its own loop on
  its shard with its own trip count: forward and gradient equal the per-shard
  references.

The checks that make the program raise (`RAISING`: `bl.max_steps_check` and
`bl.buffer_checks` firing on a sharded carry, under `jax.jit` and inside
`jax.shard_map`) run only when named on the command line, each in a process of its
own with a short timeout: a check that raises on one device while the others wait
for it in a collective makes XLA abort the whole process after 40 seconds.
"""

import json
import sys
import time
import traceback

import jax


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import boundedloop as bl  # noqa: E402


assert jax.device_count() == 8, jax.devices()
AUTO = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
EXPLICIT = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
MAX_STEPS = 12
W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
X = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (16, 3)), jnp.float32)


class Checker:
    def __init__(self):
        self.cases = 0

    def close(self, name, got, expected, rtol=1e-5, atol=1e-6):
        assert jtu.tree_structure(got) == jtu.tree_structure(expected), name
        for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(expected)):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=name
            )
        self.cases += 1

    def sharding(self, name, array, sharding):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), (
            name,
            array.sharding,
            sharding,
        )
        self.cases += 1


def body(w):
    def step(carry):
        x, i = carry
        return jnp.tanh(x @ w + 0.1), i + 1

    return step


def run(x, w, n):
    # the whole (16, 3) batch is one carry; the loop runs n steps on all of it
    return bl.while_loop(
        lambda c: c[1] < n,
        body(w),
        (x, jnp.zeros_like(n)),
        max_steps=MAX_STEPS,
        checkpoints=3,
    )


def loss(x, w, n):
    return jnp.sum(run(x, w, n)[0] ** 2)


def reference(x, w, trips):
    final, _ = lax.scan(
        lambda c, _: (body(w)(c), None), (x, jnp.array(0)), length=trips
    )
    return final[0]


def reference_grad(x, w, trips):
    value = lambda x, w: jnp.sum(reference(x, w, trips) ** 2)  # noqa: E731
    return jax.grad(value, argnums=(0, 1))(x, w)


def check_jit(check, mesh):
    rows = NamedSharding(mesh, P("data"))  # leading axis split over the 8 devices
    replicated = NamedSharding(mesh, P())
    forward = jax.jit(run)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    x = jax.device_put(X, rows)
    w = jax.device_put(W, replicated)
    for n in [0, 5, MAX_STEPS, 20]:
        trips = min(n, MAX_STEPS)
        n = jax.device_put(jnp.array(n), replicated)
        out = forward(x, w, n)
        check.close(f"forward n={n}", out[0], reference(X, W, trips))
        check.close(f"forward n={n} vs unsharded", out, forward(X, W, n))
        check.sharding(f"forward n={n}", out[0], rows)
        g_x, g_w = grad(x, w, n)
        check.close(f"grad n={n}", (g_x, g_w), reference_grad(X, W, trips))
        check.close(f"grad n={n} vs unsharded", (g_x, g_w), grad(X, W, n))
        check.sharding(f"grad x n={n}", g_x, rows)
        check.sharding(f"grad w n={n}", g_w, replicated)


def check_jit_buffers(check):
    mesh = AUTO
    cols = NamedSharding(mesh, P(None, "data"))  # (steps, 16, 3): rows of each step
    rows = NamedSharding(mesh, P("data"))

    def traj_body(w):
        def step(carry):
            x, traj, i = carry
            x = jnp.tanh(x @ w + 0.1)
            return x, traj.at[i].set(x), i + 1

        return step

    def run_traj(x, traj, w, n):
        return bl.while_loop(
            lambda c: c[2] < n,
            traj_body(w),
            (x, traj, jnp.array(0)),
            max_steps=MAX_STEPS,
            checkpoints=2,
            buffers=lambda c: c[1],
        )

    def traj_loss(x, traj, w, n):
        _, traj, _ = run_traj(x, traj, w, n)
        return jnp.sum(jnp.sin(traj))

    def scan_loss(x, w):
        _, ys = bl.scan(lambda c, _: (body(w)((c, 0))[0],) * 2, x, length=7)
        return jnp.sum(jnp.sin(ys))

    def scan_reference_loss(x, w):
        _, ys = lax.scan(lambda c, _: (body(w)((c, 0))[0],) * 2, x, length=7)
        return jnp.sum(jnp.sin(ys))

    traj0 = jnp.zeros((MAX_STEPS, 16, 3))
    x = jax.device_put(X, rows)
    traj = jax.device_put(traj0, cols)
    forward = jax.jit(run_traj)
    grad = jax.jit(jax.grad(traj_loss, argnums=(0, 1, 2)))
    for n in [3, 20]:
        n = jnp.array(n)
        out = forward(x, traj, W, n)
        check.close(f"buffer forward n={n}", out, forward(X, traj0, W, n))
        check.sharding(f"buffer forward n={n}", out[1], cols)
        g = grad(x, traj, W, n)
        check.close(f"buffer grad n={n}", g, grad(X, traj0, W, n))
        check.sharding(f"buffer grad traj n={n}", g[1], cols)
    g = jax.jit(jax.grad(scan_loss, argnums=(0, 1)))(x, W)
    check.close("scan grad", g, jax.grad(scan_reference_loss, argnums=(0, 1))(X, W))
    check.sharding("scan grad x", g[0], rows)


def check_shard_map(check, max_steps=MAX_STEPS, memory=None):
    """`max_steps=None`: the forward decides its stores in the loop (a bound of
    `MAX_STEPS` replays a table of them). `memory`: a budget instead of 3
    checkpoints (taped blocks, or every step taped)."""
    mesh = AUTO
    name = "shard_map" if max_steps is not None else "shard_map unbounded"
    if memory is not None:
        name = f"shard_map memory={memory}"
    budget = dict(checkpoints=3) if memory is None else dict(memory=memory)

    def per_shard(x, w, n):
        # x: this device's (2, 3) rows; n: this device's trip count, shape (1,).
        # Two int32 counters, one varying over the mesh axis and one not, share a
        # packed row of the checkpoint storage
        def step(carry):
            x, i, j = carry
            return body(w)((x, i))[0], i + 1, j + 1

        carry = (x, jnp.zeros_like(n[0]), jnp.int32(0))
        out = bl.while_loop(
            lambda c: c[1] < n[0], step, carry, max_steps=max_steps, **budget
        )
        return out[0]

    def per_shard_loss(x, w, n):
        return lax.psum(jnp.sum(per_shard(x, w, n) ** 2), "data")

    specs = (P("data"), P(), P("data"))
    forward = jax.jit(
        jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=P("data"))
    )
    grad = jax.jit(
        jax.grad(
            jax.shard_map(per_shard_loss, mesh=mesh, in_specs=specs, out_specs=P()),
            argnums=(0, 1),
        )
    )
    ns = jnp.array([0, 3, 12, 7, 1, 20, 5, 9])  # one trip count per device
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    out = forward(x, W, ns)
    check.sharding(f"{name} forward", out, NamedSharding(mesh, P("data")))
    expected_out, expected_gx, expected_gw = [], [], jnp.zeros_like(W)
    for d, n in enumerate(ns.tolist()):
        rows, trips = X[2 * d : 2 * d + 2], min(n, max_steps or n)
        expected_out.append(reference(rows, W, trips))
        gx, gw = reference_grad(rows, W, trips)
        expected_gx.append(gx)
        expected_gw = expected_gw + gw
    check.close(f"{name} forward", out, jnp.concatenate(expected_out))
    g_x, g_w = grad(x, W, ns)
    expected = (jnp.concatenate(expected_gx), expected_gw)
    check.close(f"{name} grad", (g_x, g_w), expected)


def check_explicit(check):
    with jax.set_mesh(EXPLICIT):
        check_jit(check, EXPLICIT)


def raises(check, name, fn, match):
    """`fn()` raises an exception whose message contains `match`, promptly."""
    start = time.perf_counter()
    try:
        jax.block_until_ready(fn())
    except Exception as e:  # a JaxRuntimeError from the callback, naming our message
        assert match in str(e), (name, str(e)[:2000])
        assert time.perf_counter() - start < 20, (name, time.perf_counter() - start)
        check.cases += 1
        return
    raise AssertionError(f"{name}: no error")


def check_max_steps_check(check):
    """`bl.max_steps_check` firing in a program partitioned over the 8 devices:
    every device raises, none waits in a collective for one that did."""
    rows = NamedSharding(AUTO, P("data"))
    x = jax.device_put(X, rows)
    message = f"reached max_steps={MAX_STEPS} while `cond_fun` was still true"
    with bl.max_steps_check():
        forward = jax.jit(run)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        for n in [5, MAX_STEPS]:  # finishes by itself: no error, same results
            out = forward(x, W, jnp.array(n))
            check.close(f"checked forward n={n}", out[0], reference(X, W, n))
            g = grad(x, W, jnp.array(n))
            check.close(f"checked grad n={n}", g, reference_grad(X, W, n))
        for kind, fn in [("forward", forward), ("grad", grad)]:
            raises(check, kind, lambda: fn(x, W, jnp.array(20)), message)
        with jax.set_mesh(EXPLICIT):
            x = jax.device_put(X, NamedSharding(EXPLICIT, P("data")))
            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            raises(check, "explicit grad", lambda: grad(x, W, jnp.array(20)), message)


def check_buffer_checks(check):
    """`bl.buffer_checks` firing on a buffer sharded over the 8 devices."""
    cols = NamedSharding(AUTO, P(None, "data"))

    def run_traj(x, traj, last):
        # writes row min(i, last): row `last` twice when the loop goes past it
        def step(carry):
            x, traj, i = carry
            x = jnp.tanh(x @ W + 0.1)
            return x, traj.at[jnp.minimum(i, last)].set(x), i + 1

        out = bl.while_loop(
            lambda c: c[2] < 6,
            step,
            (x, traj, jnp.array(0)),
            max_steps=MAX_STEPS,
            checkpoints=2,
            buffers=lambda c: c[1],
        )
        return jnp.sum(jnp.sin(out[1]))

    x = jax.device_put(X, NamedSharding(AUTO, P("data")))
    traj = jax.device_put(jnp.zeros((MAX_STEPS, 16, 3)), cols)
    # (the checks check gradients: a loop's values are right whatever the rules)
    with bl.buffer_checks():
        grad = jax.jit(jax.grad(run_traj))
        unchecked = jax.jit(jax.grad(run_traj))(X, jnp.zeros((MAX_STEPS, 16, 3)), 9)
        check.close("checked buffer grad", grad(x, traj, jnp.array(9)), unchecked)
        raises(
            check,
            "buffer grad",
            lambda: grad(x, traj, jnp.array(2)),
            "location already written",
        )


def refused(check, name, fn, match):
    """`fn()` is refused when traced, with a `ValueError` containing `match`."""
    try:
        fn()
    except ValueError as e:
        assert match in str(e), (name, str(e)[:2000])
        check.cases += 1
        return
    raise AssertionError(f"{name}: not refused")


def check_shard_map_checks(check):
    """Both checks inside `jax.shard_map`, where each device takes its own number
    of steps: the devices agree on whether any ran out (or broke a buffer rule)
    before raising, all together."""
    mesh = AUTO

    def per_shard(x, w, n):
        out = bl.while_loop(
            lambda c: c[1] < n[0],
            body(w),
            (x, jnp.zeros_like(n[0])),
            max_steps=MAX_STEPS,
            checkpoints=3,
        )
        return lax.psum(jnp.sum(out[0] ** 2), "data")

    def per_shard_traj(x, n):
        # writes row min(i, 2) of its own buffer: twice where n > 3
        def step(carry):
            x, traj, i = carry
            return jnp.tanh(x @ W), traj.at[jnp.minimum(i, 2)].set(x), i + 1

        carry = (x, jnp.zeros((MAX_STEPS, 2, 3)), jnp.zeros_like(n[0]))
        out = bl.while_loop(
            lambda c: c[2] < n[0],
            step,
            carry,
            max_steps=MAX_STEPS,
            buffers=lambda c: c[1],
        )
        return lax.psum(jnp.sum(out[1]), "data")

    specs = (P("data"), P(), P("data"))
    loss = jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=P())
    traj_loss = jax.shard_map(
        per_shard_traj, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()
    )
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    fine = jnp.array([0, 3, 12, 7, 1, 9, 5, 9])
    one_out = fine.at[5].set(20)  # one device runs out of steps
    message = f"reached max_steps={MAX_STEPS} while `cond_fun` was still true"
    with bl.max_steps_check():
        forward, grad = jax.jit(loss), jax.jit(jax.grad(loss, argnums=(0, 1)))
        expected = sum(
            jnp.sum(reference(X[2 * d : 2 * d + 2], W, n) ** 2)
            for d, n in enumerate(fine.tolist())
        )
        check.close("shard_map checked forward", forward(x, W, fine), expected)
        for kind, fn in [("shard_map forward", forward), ("shard_map grad", grad)]:
            raises(check, kind, lambda: fn(x, W, one_out), message)
    with bl.buffer_checks():
        grad = jax.jit(jax.grad(traj_loss))
        few = jnp.array([0, 3, 1, 2, 3, 3, 1, 0])
        jax.block_until_ready(grad(x, few))
        check.cases += 1
        raises(
            check,
            "shard_map buffers",
            lambda: grad(x, few.at[3].set(5)),
            "location already written",
        )

    # where the devices cannot agree before raising, the check is refused
    def nested(x, w, n):
        def outer(carry):
            x, i = carry
            inner = (x, jnp.zeros_like(n[0]))
            x = bl.while_loop(lambda c: c[1] < n[0], body(w), inner, max_steps=3)[0]
            return x, i + 1

        return bl.while_loop(lambda c: c[1] < 2, outer, (x, 0), max_steps=3)[0]

    grid = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)

    def partly_manual(x, w, n):
        inner = (x, jnp.zeros_like(n[0]))
        return bl.while_loop(lambda c: c[1] < n[0], body(w), inner, max_steps=3)[0]

    with bl.max_steps_check():
        f = jax.shard_map(nested, mesh=mesh, in_specs=specs, out_specs=P("data"))
        refused(
            check,
            "nested",
            lambda: jax.jit(f).lower(x, W, fine),
            "cannot check a loop nested in the body of another loop",
        )
        f = jax.shard_map(
            partly_manual,
            mesh=grid,
            in_specs=(P("a"), P(), P("a")),
            out_specs=P("a"),
            axis_names={"a"},
        )
        refused(
            check,
            "partly manual",
            lambda: jax.jit(f).lower(X, W, jnp.array([3, 4])),
            "leaves mesh axes automatic",
        )


CHECKS = {
    "jit": lambda check: check_jit(check, AUTO),
    "jit_buffers": check_jit_buffers,
    "explicit": check_explicit,
    "shard_map": check_shard_map,
    "shard_map_unbounded": lambda check: check_shard_map(check, None),
    # blocks of taped steps (300 bytes), and every step taped (1 MB)
    "shard_map_memory": lambda check: (
        check_shard_map(check, memory=300),
        check_shard_map(check, memory="1 MB"),
    ),
}
RAISING = {
    "max_steps_check": check_max_steps_check,
    "buffer_checks": check_buffer_checks,
    "shard_map_checks": check_shard_map_checks,
}

selected = sys.argv[1:]
results = {}
for name, fn in {**CHECKS, **RAISING}.items():
    if name not in selected if selected else name in RAISING:
        continue
    check = Checker()
    try:
        fn(check)
        results[name] = {"ok": True, "cases": check.cases, "error": None}
    except Exception as e:  # reported, one check at a time
        error = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        traceback.print_exc()
        results[name] = {"ok": False, "cases": check.cases, "error": error}
print(json.dumps(results))
