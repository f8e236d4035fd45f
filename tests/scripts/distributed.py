"""Multi-process checks under `jax.distributed`, run by `tests/test_distributed.py`.

    python tests/scripts/distributed.py PORT PROCESS_ID NUM_PROCESSES OUT_JSON DEADLINE_S

One process per "host", each with 2 CPU devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=2`, set by the caller), joined by
`jax.distributed.initialize` over 127.0.0.1 with the gloo CPU collectives that ship
with jaxlib; process 0 runs the coordinator, bound to loopback only.

Phase 1 (collectives): every process runs every computation on the global mesh, in
the same order, and gathers each result to the host (`process_allgather`). A
computation that raises is recorded and the next one still runs, so the processes
keep making the same collective calls. Phase 2 (no collectives): each process
compares the gathered results with references it computes alone, on its own first
device: the same `bl` program on the unsharded global arrays (one process, no
sharding), and `lax` loops. A wrong result in one process therefore cannot leave
the other waiting in a collective. A watchdog ends the process, with every thread's
traceback on stderr, if it is still running after DEADLINE_S seconds (a worker that
died mid-collective leaves its peer waiting; the watchdog ends that wait).

Writes `{check: {"ok": bool, "cases": int, "error": str | None}}` to OUT_JSON:

- `vmap`: `jax.jit(jax.vmap(loop))` over a batch sharded across both processes, one
  trip count per element: final carries and trip counts.
- `training`: three data-parallel SGD steps, `jax.grad` of a batch-mean loss through
  the vmapped loop with the parameters replicated (the gradient is averaged over
  the global batch): parameters and losses after each step.
- `shard_map`: the loop inside `jax.shard_map` over the 4 global devices, each with
  its own trip count: forward and gradient (`psum` of the per-device losses).
- `shard_map_vmap`: the pattern `docs/guides/scaling-out.md` recommends,
  `jax.vmap(loop)` inside `jax.shard_map`, each device stopping when its own
  elements are done: the forward, and three steps of the guide's complete example
  (its code block, executed: `global_batch`, `make_train_step`).
- `buffers`: a trajectory buffer (`buffers=`) in each element of the sharded,
  vmapped batch: forward (final state and trajectory) and gradient.
"""

import faulthandler
import json
import pathlib
import re
import sys
import time
import traceback


START = time.perf_counter()
PORT, PROCESS_ID, NUM_PROCESSES = (int(a) for a in sys.argv[1:4])
OUT_JSON, DEADLINE_S = sys.argv[4], float(sys.argv[5])
GUIDE = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "scaling-out.md"
# the watchdog: a C thread that dumps every thread's traceback and exits, even while
# the main thread waits inside a collective
faulthandler.dump_traceback_later(DEADLINE_S, exit=True)

import jax  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{PORT}",
    coordinator_bind_address=f"127.0.0.1:{PORT}",  # loopback only
    num_processes=NUM_PROCESSES,
    process_id=PROCESS_ID,
    initialization_timeout=60,
    shutdown_timeout_seconds=30,
)

import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental.multihost_utils import process_allgather  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import boundedloop as bl  # noqa: E402


assert jax.process_count() == NUM_PROCESSES, jax.process_count()
assert jax.local_device_count() == 2, jax.local_devices()
DEVICES = jax.device_count()
MESH = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Auto,))
ROWS = NamedSharding(MESH, P("data"))
REPLICATED = NamedSharding(MESH, P())
MAX_STEPS = 12
BATCH = 4 * DEVICES
W = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
_rng = np.random.default_rng(0)  # the same global data in every process
X = _rng.uniform(-1, 1, (BATCH, 3)).astype(np.float32)
Y = _rng.uniform(-1, 1, (BATCH, 3)).astype(np.float32)
B = jnp.array([0.1, -0.2, 0.05])
# one trip count per element: 0, past max_steps, and everything between
NS = np.array([0, 20] + [(5 * k) % 13 for k in range(BATCH - 2)], np.int32)
NS_DEVICE = np.array([0, 3, 12, 20, 7, 1, 9, 5][:DEVICES], np.int32)


def local_rows(data):
    """This process's part of the global `data`, as a host would load only its own
    part of a data set."""
    per_process = len(data) // NUM_PROCESSES
    return data[PROCESS_ID * per_process : (PROCESS_ID + 1) * per_process]


def global_array(data):
    """One array over every device of every process, from this process's rows."""
    return jax.make_array_from_process_local_data(ROWS, local_rows(data), data.shape)


def step_of(w):
    def step(carry):
        x, i = carry
        return jnp.tanh(x @ w + 0.1), i + 1

    return step


def run(x, w, n):
    """One element: x (3,) stepped until its counter reaches n (at most MAX_STEPS)."""
    return bl.while_loop(
        lambda c: c[1] < n,
        step_of(w),
        (x, jnp.zeros_like(n)),
        max_steps=MAX_STEPS,
        checkpoints=3,
    )


def lax_run(x, w, n):
    """The reference: `lax.while_loop` over min(n, MAX_STEPS) steps."""
    trips = jnp.minimum(n, MAX_STEPS)
    return lax.while_loop(lambda c: c[1] < trips, step_of(w), (x, jnp.zeros_like(n)))


def masked_scan(x, w, n):
    """The differentiable reference: MAX_STEPS steps, those past n masked out."""

    def scan_step(x, i):
        new = step_of(w)((x, i))[0]
        x = jnp.where(i < n, new, x)
        return x, x

    return lax.scan(scan_step, x, jnp.arange(MAX_STEPS))


def batch_loss(w, x, y, n):
    final, _ = jax.vmap(run, in_axes=(0, None, 0))(x, w, n)
    return jnp.mean(jnp.sum((final - y) ** 2, axis=-1))


def masked_batch_loss(w, x, y, n):
    final, _ = jax.vmap(masked_scan, in_axes=(0, None, 0))(x, w, n)
    return jnp.mean(jnp.sum((final - y) ** 2, axis=-1))


def sgd(loss, learning_rate=0.5):
    @jax.jit
    def train_step(params, x, y, n):
        value, grads = jax.value_and_grad(loss)(params, x, y, n)
        params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
        return params, value

    return training(train_step)


def training(train_step, steps=3):
    def train(params, x, y, n):
        losses = []
        for _ in range(steps):
            # every process waits for each step: with several CPU devices per
            # process, JAX 0.10.2 can hang when many steps are in flight
            params, value = jax.block_until_ready(train_step(params, x, y, n))
            losses.append(value)
        return params, jnp.stack(losses)

    return train


def guide_example():
    """The complete example of `docs/guides/scaling-out.md`, run as a module (its
    `main` is not called): its functions, by name."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    (code,) = [block for block in blocks if "def make_train_step" in block]
    namespace = {"__name__": "scaling_out_guide"}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace


def euler_masked(params, x, n):
    """The reference for the guide's `solve`: `max(NS)` Euler steps, those past n
    masked out."""
    w, b = params

    def scan_step(x, i):
        return jnp.where(i < n, x + 0.01 * jnp.tanh(w @ x + b), x), None

    return lax.scan(scan_step, x, jnp.arange(NS.max()))[0]


def mean_loss_of(solve):
    def loss(params, x, y, n):
        final = jax.vmap(solve, in_axes=(None, 0, 0))(params, x, n)
        return jnp.mean(jnp.sum((final - y) ** 2, axis=-1))

    return loss


def per_device(x, w, n):
    """Inside `shard_map`: this device's rows, its own trip count n (shape (1,))."""
    final, _ = bl.while_loop(
        lambda c: c[1] < n[0],
        step_of(w),
        (x, jnp.zeros_like(n[0])),
        max_steps=MAX_STEPS,
        checkpoints=3,
    )
    return final


def per_device_loss(x, w, n):
    return lax.psum(jnp.sum(per_device(x, w, n) ** 2), "data")


def local_loss(w, x, y, n):
    """Inside `shard_map`: this device's rows, one trip count per row."""
    final, _ = jax.vmap(run, in_axes=(0, None, 0))(x, w, n)
    return lax.pmean(jnp.mean(jnp.sum((final - y) ** 2, axis=-1)), "data")


def run_traj(x, w, n):
    """One element, writing its state at every step into a (MAX_STEPS, 3) buffer."""

    def step(carry):
        x, traj, i = carry
        x = step_of(w)((x, i))[0]
        return x, traj.at[i].set(x), i + 1

    x, traj, _ = bl.while_loop(
        lambda c: c[2] < n,
        step,
        (x, jnp.zeros((MAX_STEPS, 3)), jnp.zeros_like(n)),
        max_steps=MAX_STEPS,
        checkpoints=2,
        buffers=lambda c: c[1],
    )
    return x, traj


def masked_traj(x, w, n):
    """The reference: rows of the trajectory past the trip count stay zero."""
    final, xs = masked_scan(x, w, n)
    return final, jnp.where((jnp.arange(MAX_STEPS) < n)[:, None], xs, 0.0)


def traj_loss(run_one):
    def loss(x, w, n):
        final, traj = jax.vmap(run_one, in_axes=(0, None, 0))(x, w, n)
        return jnp.sum(final**2) + jnp.sum(jnp.sin(traj))

    return loss


# phase 1: the computations on the global mesh, each gathered to numpy


def compute_vmap():
    forward = jax.jit(jax.vmap(run, in_axes=(0, None, 0)))
    out = forward(global_array(X), W, global_array(NS))
    assert out[0].sharding.is_equivalent_to(ROWS, 2), out[0].sharding
    return process_allgather(out, tiled=True)


def compute_training():
    x, y, n = global_array(X), global_array(Y), global_array(NS)
    w = jax.device_put(W, REPLICATED)
    return process_allgather(sgd(batch_loss)(w, x, y, n), tiled=True)


def compute_shard_map():
    specs = (P("data"), P(), P("data"))
    forward = jax.jit(
        jax.shard_map(per_device, mesh=MESH, in_specs=specs, out_specs=P("data"))
    )
    loss = jax.shard_map(per_device_loss, mesh=MESH, in_specs=specs, out_specs=P())
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    x, n = global_array(X), global_array(NS_DEVICE)
    return process_allgather((forward(x, W, n), grad(x, W, n)), tiled=True)


def compute_shard_map_vmap():
    forward = jax.jit(
        jax.shard_map(
            jax.vmap(run, in_axes=(0, None, 0)),
            mesh=MESH,
            in_specs=(P("data"), P(), P("data")),
            out_specs=P("data"),
        )
    )
    x, y, n = global_array(X), global_array(Y), global_array(NS)
    out = forward(x, W, n)
    guide = guide_example()
    x, y, n = guide["global_batch"](MESH, [local_rows(a) for a in (X, Y, NS)])
    params = jax.device_put((W, B), REPLICATED)
    trained = training(guide["make_train_step"](MESH))(params, x, y, n)
    return process_allgather((out, trained), tiled=True)


def compute_buffers():
    forward = jax.jit(jax.vmap(run_traj, in_axes=(0, None, 0)))
    grad = jax.jit(jax.grad(traj_loss(run_traj), argnums=(0, 1)))
    x, n = global_array(X), global_array(NS)
    return process_allgather((forward(x, W, n), grad(x, W, n)), tiled=True)


# phase 2: references computed in this process alone, on its first device


# How far a forward result may move when only its layout changes: a batch spread
# over devices and processes, or run as `shard_map` parts, against the whole batch
# on one device. XLA compiles each shape on its own, and its CPU kernels may
# vectorise a shard otherwise than the whole batch (another order or fusion of the
# 3-term dot product, with or without FMA): a different rounding of the same
# operations, at most about an ulp of the terms per step. Every state here lies in
# [-1, 1] (`tanh`), so the ulp that counts is that of 1.0, 2**-23; one seen on an
# AVX-512 Xeon. A difference made in one step is carried through the next ones (at
# most 12), damped by `tanh` and mixed by `W`: 8 ulps leave room for a few such
# steps and stay well below the gradients' tolerance. Integers stay exact.
FORWARD_ULPS = 8


class Checker:
    def __init__(self):
        self.cases = 0

    def close(self, name, got, expected, *, ulps=None):
        """`ulps=0`: equal bit for bit (the same program on the same shapes);
        `ulps=k`: floats within `k` float32 ulps of 1.0 (`FORWARD_ULPS`: a forward
        pass whose layout alone differs); `None`: float32 tolerance (a gradient sums
        over the batch in another order when the batch is spread over devices)."""
        assert jtu.tree_structure(got) == jtu.tree_structure(expected), name
        if ulps is None:
            tolerance = dict(rtol=1e-5, atol=1e-6)
        else:
            tolerance = dict(rtol=0, atol=ulps * float(np.finfo(np.float32).eps))
        for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(expected)):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a, b)
            if np.issubdtype(a.dtype, np.integer):
                np.testing.assert_array_equal(a, b, err_msg=name)
            else:
                np.testing.assert_allclose(a, b, **tolerance, err_msg=name)
        self.cases += 1


def local(tree):
    """`tree` committed to this process's first device: a single-device program."""
    return jax.device_put(tree, jax.local_devices()[0])


def check_vmap(check, got):
    x, w, n = local((X, W, NS))
    single = jax.jit(jax.vmap(run, in_axes=(0, None, 0)))(x, w, n)
    reference = jax.jit(jax.vmap(lax_run, (0, None, 0)))(x, w, n)
    check.close("vmap vs one process", got, single, ulps=FORWARD_ULPS)
    # the same batch on the same device: the loop equals `lax.while_loop` bit for bit
    check.close("one process vs lax.while_loop", single, reference, ulps=0)


def check_training(check, got):
    w, x, y, n = local((W, X, Y, NS))
    check.close("training vs one process", got, sgd(batch_loss)(w, x, y, n))
    check.close("training vs masked scan", got, sgd(masked_batch_loss)(w, x, y, n))


def check_shard_map(check, got):
    x, w, ns = local((X, W, NS_DEVICE))
    rows = BATCH // DEVICES
    # the devices' loops, side by side in one process: vmapped over the devices
    parts = x.reshape(DEVICES, rows, 3)
    single = jax.jit(jax.vmap(per_device, in_axes=(0, None, 0)))(parts, w, ns[:, None])
    got_forward, got_grad = got
    single = single.reshape(x.shape)
    check.close("shard_map vs one process", got_forward, single, ulps=FORWARD_ULPS)
    # the masked reference, each row with its device's trip count
    n_rows = jnp.repeat(ns, rows)

    def masked(x, w):
        return jax.vmap(lambda r, n: masked_scan(r, w, n)[0])(x, n_rows)

    check.close("shard_map vs masked scan", got_forward, jax.jit(masked)(x, w))
    loss = lambda x, w: jnp.sum(masked(x, w) ** 2)  # noqa: E731
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    check.close("shard_map grad vs masked scan", got_grad, expected)


def check_shard_map_vmap(check, got):
    x, w, b, y, n = local((X, W, B, Y, NS))
    got_forward, got_training = got
    single = jax.jit(jax.vmap(run, in_axes=(0, None, 0)))(x, w, n)
    check.close(
        "shard_map(vmap) vs one process", got_forward, single, ulps=FORWARD_ULPS
    )
    guide = guide_example()
    expected = sgd(mean_loss_of(guide["solve"]), 0.1)((w, b), x, y, n)
    check.close("guide training vs one process", got_training, expected)
    expected = sgd(mean_loss_of(euler_masked), 0.1)((w, b), x, y, n)
    check.close("guide training vs masked scan", got_training, expected)


def check_buffers(check, got):
    x, w, n = local((X, W, NS))
    forward = jax.jit(jax.vmap(run_traj, in_axes=(0, None, 0)))
    grad = jax.jit(jax.grad(traj_loss(run_traj), argnums=(0, 1)))
    got_forward, got_grad = got
    single = forward(x, w, n)
    check.close("buffers vs one process", got_forward, single, ulps=FORWARD_ULPS)
    check.close("buffer grad vs one process", got_grad, grad(x, w, n))
    reference = jax.jit(jax.vmap(masked_traj, in_axes=(0, None, 0)))(x, w, n)
    check.close("buffers vs masked scan", got_forward, reference)
    reference = jax.jit(jax.grad(traj_loss(masked_traj), argnums=(0, 1)))(x, w, n)
    check.close("buffer grad vs masked scan", got_grad, reference)


CHECKS = {
    "vmap": (compute_vmap, check_vmap),
    "training": (compute_training, check_training),
    "shard_map": (compute_shard_map, check_shard_map),
    "shard_map_vmap": (compute_shard_map_vmap, check_shard_map_vmap),
    "buffers": (compute_buffers, check_buffers),
}


def error_line(e):
    """The exception's type and message, its blank lines dropped, shortened."""
    lines = [line for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    return "\n".join(lines)[:1500]


def timed(name, fn, *args):
    """`fn(*args)`, its wall time printed (the test shows it on failure)."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)


gathered, results = {}, {}
for name, (compute, _) in CHECKS.items():
    try:
        gathered[name] = timed(f"compute {name}", compute)
    except Exception as e:  # recorded; the next computation still runs everywhere
        traceback.print_exc()
        results[name] = {"ok": False, "cases": 0, "error": error_line(e)}
for name, (_, check_fn) in CHECKS.items():
    if name not in gathered:
        continue
    check = Checker()
    try:
        timed(f"check {name}", check_fn, check, gathered[name])
        results[name] = {"ok": True, "cases": check.cases, "error": None}
    except Exception as e:  # reported, one check at a time
        traceback.print_exc()
        results[name] = {"ok": False, "cases": check.cases, "error": error_line(e)}
with open(OUT_JSON, "w") as f:
    json.dump(results, f)
jax.distributed.shutdown()
print(
    f"process {PROCESS_ID}: done after {time.perf_counter() - START:.1f} s", flush=True
)
