"""The stop condition's cost across processes under `jax.distributed` (copies of
this script, 2 CPU devices each, gloo over 127.0.0.1): on a sharded batch of Euler
loops (8 per device, width 32, trip counts in [1, 100], `max_steps=1000`, 8
checkpoints), `jit(vmap)`, which runs until every element of the global batch is done
(an all-reduce between the processes every step), against `vmap` inside `shard_map`,
each device stopping on its own. Forward and gradient time (interleaved medians in
process 0, after checking both agree), the compiled all-reduces (in loop conditions)
and the load average before the run: run it on a quiet machine.

    python benchmarks/distributed.py [--processes 2] [--rounds 40] [--out FILE] > benchmarks/results/distributed.txt

writes `benchmarks/results/distributed.json`.
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
    address = f"127.0.0.1:{port}"
    timeouts = dict(initialization_timeout=60, shutdown_timeout_seconds=60)
    jax.distributed.initialize(
        address, processes, process_id, coordinator_bind_address=address, **timeouts
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
        step, init = euler_step(*params), (x, jnp.zeros_like(n))
        kw = dict(max_steps=MAX_STEPS, checkpoints=CHECKPOINTS)
        return bl.while_loop(lambda c: c[1] < n, step, init, **kw)[0]

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
            total, looped = all_reduce_counts(hlo[(variant, kind)])
            rows.append(dict(variant=variant, kind=kind, seconds=seconds))
            rows[-1].update(all_reduce=total, all_reduce_in_loop_conditions=looped)
        setup = dict(processes=processes, local_devices=jax.local_device_count())
        setup.update(batch=batch, width=WIDTH, max_trips=MAX_TRIPS)
        setup.update(longest_trip=int(ns.max()), max_steps=MAX_STEPS)
        setup.update(checkpoints=CHECKPOINTS, rounds=rounds)
        write_results(json_path, **setup, rows=rows)
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
    """Each variant's time and loop-condition all-reduces (the scaling-out guide)."""
    by = index((results or load("distributed.json"))["rows"], "variant", "kind")
    rows = []
    for kind in ("forward", "gradient"):
        batched, per_device = (by[(v, kind)] for v in VARIANTS)
        looped = [r["all_reduce_in_loop_conditions"] for r in (batched, per_device)]
        rows.append(
            [kind, seconds(batched["seconds"]), seconds(per_device["seconds"])]
            + [f"{batched['seconds'] / per_device['seconds']:.3g}"]
            + [f"{looped[0]} / {looped[1]}"]
        )
    header = ["per call", "`jit(vmap)`", "`shard_map(vmap)`", "ratio"]
    header.append("all-reduces in loop conditions")
    return page(table(header, rows))


if __name__ == "__main__":
    main()
