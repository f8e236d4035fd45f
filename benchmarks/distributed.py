"""The stop condition's cost across processes: `jit` + `vmap` over a globally sharded
batch against `vmap` inside `shard_map`, under `jax.distributed`.

    python benchmarks/distributed.py [--processes 2] [--rounds 40] [--out FILE] > benchmarks/results/distributed.txt

Starts `--processes` copies of itself on this machine, each with 2 CPU devices
(`--xla_force_host_platform_device_count=2`), joined by `jax.distributed.initialize`
over 127.0.0.1 with the gloo CPU collectives (process 0 runs the coordinator, bound
to loopback). The batch, 8 elements per device, is sharded over every device of
every process; each element runs Euler steps `x + 0.01 tanh(W x + b)` (width 32)
for its own trip count, drawn from [1, 100], `max_steps=1000`, 8 checkpoints:

- `jit(vmap)`: `jax.jit(jax.vmap(loop))` on the global batch. The batched loop runs
  while any element of the global batch is unfinished, so every step ends with the
  stop condition reduced across all devices (an all-reduce between the processes).
- `shard_map(vmap)`: `jax.vmap(loop)` inside `jax.shard_map`: each device runs until
  its own elements are done, with no collective inside the loop.

Both are timed per forward and per gradient (of the batch-mean loss with respect to
the parameters), as medians of `--rounds` interleaved rounds after a warm-up, in
process 0 (every process makes the same calls, each waiting for its result). The
two variants' results are checked equal first. Also reported: the number of
`all-reduce` operations in each compiled forward and how many of them are in a
`while` loop's condition (run once per step), and the machine's load average before
the run: run it when nothing else is busy (on 2 cores a load above 1 slows both
variants). Writes JSON to `--out` (default `benchmarks/results/distributed.json`,
which `distributed_table` below turns into the scaling-out guide's table) and prints
a markdown table. Each worker has a watchdog; the parent waits with a timeout and
ends a worker left running by its PID.
"""

import argparse
import faulthandler
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

from _format import index, load, page, seconds, table


WIDTH = 32
PER_DEVICE = 8
MAX_STEPS = 1000
MAX_TRIPS = 100
CHECKPOINTS = 8
DEADLINE_S = 600
VARIANTS = ("jit(vmap)", "shard_map(vmap)")


def all_reduce_counts(hlo):
    """`all-reduce` ops in compiled HLO text: in all, and in `while` conditions."""
    conditions = set(re.findall(r"condition=%?([\w.\-]+)", hlo))
    in_conditions = 0
    for computation in re.split(r"\n(?=%|ENTRY )", hlo):  # one computation each
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", computation)
        if name and name.group(1) in conditions:
            in_conditions += computation.count("all-reduce(")
    return hlo.count("all-reduce("), in_conditions


def worker(port, process_id, processes, rounds, json_path):
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)  # the watchdog
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=60,
        shutdown_timeout_seconds=60,
    )
    import jax.numpy as jnp
    import numpy as np
    from _common import euler_step, interleaved_medians, write_results
    from jax.experimental.multihost_utils import process_allgather
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import boundedloop as bl

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))
    batch = PER_DEVICE * jax.device_count()
    rng = np.random.default_rng(0)  # the same global data in every process
    x = rng.normal(size=(batch, WIDTH)).astype(np.float32)
    y = rng.normal(size=(batch, WIDTH)).astype(np.float32)
    ns = rng.integers(1, MAX_TRIPS + 1, batch).astype(np.int32)
    w = (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    b = np.zeros(WIDTH, np.float32)

    def global_array(data):
        part = len(data) // processes
        local = data[process_id * part : (process_id + 1) * part]
        return jax.make_array_from_process_local_data(rows, local, data.shape)

    def run(params, x, n):
        final, _ = bl.while_loop(
            lambda c: c[1] < n,
            euler_step(*params),
            (x, jnp.zeros_like(n)),
            max_steps=MAX_STEPS,
            checkpoints=CHECKPOINTS,
        )
        return final

    batched = jax.vmap(run, in_axes=(None, 0, 0))

    def mean_loss(params, x, y, n):
        return jnp.mean(jnp.sum((batched(params, x, n) - y) ** 2, axis=-1))

    def local_loss(params, x, y, n):
        return jax.lax.pmean(mean_loss(params, x, y, n), "data")

    def sharded(f, out_specs):
        specs = (P(), P("data"), P("data"), P("data"))
        return jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_specs)

    forward = lambda p, x, y, n: batched(p, x, n)  # noqa: E731
    fns = {
        ("jit(vmap)", "forward"): jax.jit(forward),
        ("shard_map(vmap)", "forward"): jax.jit(sharded(forward, P("data"))),
        ("jit(vmap)", "gradient"): jax.jit(jax.grad(mean_loss)),
        ("shard_map(vmap)", "gradient"): jax.jit(jax.grad(sharded(local_loss, P()))),
    }
    params = jax.device_put((jnp.asarray(w), jnp.asarray(b)), NamedSharding(mesh, P()))
    args = (params, global_array(x), global_array(y), global_array(ns))
    results = {k: process_allgather(f(*args), tiled=True) for k, f in fns.items()}
    for kind in ["forward", "gradient"]:
        got, expected = (results[(v, kind)] for v in VARIANTS)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6, err_msg=kind)
    hlo = {k: fns[k].lower(*args).compile().as_text() for k in fns}
    interleaved_medians(fns, {k: args for k in fns}, 5)  # warm-up
    medians = interleaved_medians(fns, {k: args for k in fns}, rounds)
    if process_id == 0:
        rows = []
        for (variant, kind), seconds in medians.items():
            total, in_conditions = all_reduce_counts(hlo[(variant, kind)])
            rows.append(dict(variant=variant, kind=kind, seconds=seconds))
            rows[-1].update(
                all_reduce=total, all_reduce_in_loop_conditions=in_conditions
            )
        write_results(
            json_path,
            processes=processes,
            local_devices=jax.local_device_count(),
            batch=batch,
            width=WIDTH,
            max_trips=MAX_TRIPS,
            longest_trip=int(ns.max()),
            max_steps=MAX_STEPS,
            checkpoints=CHECKPOINTS,
            rounds=rounds,
            rows=rows,
        )
    jax.distributed.shutdown()


def launch(processes, rounds):
    """Runs the workers; returns process 0's results."""
    load = os.getloadavg()[0]  # time only on a quiet machine: see the docstring
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    env["JAX_PLATFORMS"] = "cpu"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bl-distributed-"))
    json_path = tmp / "results.json"
    workers = []
    try:
        for i in range(processes):
            out, err = tmp / f"{i}.out", tmp / f"{i}.err"
            cmd = [sys.executable, __file__, "--worker", str(port), str(i)]
            cmd += ["--processes", str(processes), "--rounds", str(rounds)]
            cmd += ["--json", str(json_path)]
            with open(out, "w") as stdout, open(err, "w") as stderr:
                process = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
            workers.append((process, out, err))
        deadline = time.monotonic() + DEADLINE_S + 30
        for process, *_ in workers:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for process, *_ in workers:
            if process.poll() is None:
                process.kill()  # by its own PID
                process.wait(timeout=30)
    if any(process.returncode != 0 for process, *_ in workers):
        for i, (process, out, err) in enumerate(workers):
            print(f"--- process {i}: exit {process.returncode}", file=sys.stderr)
            print(out.read_text(), err.read_text(), sep="\n", file=sys.stderr)
        sys.exit(1)
    return {**json.loads(json_path.read_text()), "load_average": load}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/distributed.json")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("PORT", "ID"))
    parser.add_argument("--json", help="where process 0 writes (set by the parent)")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.processes, args.rounds, args.json)
        return
    results = launch(args.processes, args.rounds)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    r = results
    print(
        f"{r['processes']} processes x {r['local_devices']} CPU devices (gloo over "
        f"127.0.0.1); batch {r['batch']}, Euler steps of width {r['width']}, trip "
        f"counts in [1, {r['max_trips']}] (longest {r['longest_trip']}), "
        f"max_steps={r['max_steps']}, checkpoints={r['checkpoints']}; medians of "
        f"{r['rounds']} interleaved rounds, in process 0; load average (1 min) "
        f"before the run {r['load_average']:.2f}.\n"
    )
    print(distributed_table(r), end="")


# --- the docs' table (`benchmarks/internal/tables.py` writes it) ------------------------


def distributed_table(results=None) -> str:
    """Under `jax.distributed`: time per call of `jit(vmap)` and `shard_map(vmap)`,
    forward and gradient, and the all-reduce ops in each compiled loop condition
    (the scaling-out guide); of `results`, by default `distributed.json`'s."""
    by = index((results or load("distributed.json"))["rows"], "variant", "kind")
    rows = []
    for kind in ("forward", "gradient"):
        batched, per_device = (by[(v, kind)] for v in VARIANTS)
        rows.append(
            [kind, seconds(batched["seconds"]), seconds(per_device["seconds"])]
            + [f"{batched['seconds'] / per_device['seconds']:.3g}"]
            + [
                f"{batched['all_reduce_in_loop_conditions']} / "
                f"{per_device['all_reduce_in_loop_conditions']}"
            ]
        )
    header = ["per call", "`jit(vmap)`", "`shard_map(vmap)`", "ratio"]
    header.append("all-reduces in loop conditions")
    return page(table(header, rows))


if __name__ == "__main__":
    main()
