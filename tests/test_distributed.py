"""Two processes under `jax.distributed`, 2 CPU devices each, over 127.0.0.1 with the
gloo collectives: the loop's results equal one process's (`tests/scripts/
distributed.py` runs every check; each test reads its result from both processes).

The workers write their output to files (a failure shows the mismatch and each
worker's last `TAIL_LINES` lines), each has a watchdog that ends it after `DEADLINE_S`, every wait here has a timeout, and a
worker still running after it is killed by its own PID."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest


SCRIPT = pathlib.Path(__file__).parent / "scripts" / "distributed.py"
NUM_PROCESSES = 2
DEADLINE_S = 150  # each worker's watchdog
WAIT_S = DEADLINE_S + 30  # this process's wait for all of them
TAIL_LINES = 30  # of each worker's output, shown on a failure


@pytest.fixture(scope="module")
def free_port():
    """A TCP port free on 127.0.0.1 now (the coordinator binds it a moment later).
    Skips where the host allows no such socket (some sandboxed accelerator hosts):
    `jax.distributed` cannot run there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:
        pytest.skip(f"no TCP socket on 127.0.0.1 on this host ({e})")


def _output(workers):
    """The last `TAIL_LINES` lines each worker wrote (its timings, or the traceback
    that ended it), stdout then stderr."""
    text = []
    for i, (_, out, err, _) in enumerate(workers):
        lines = []
        for path in (out, err):
            lines += path.read_text().splitlines() if path.exists() else []
        tail = "\n".join(lines[-TAIL_LINES:]) or "(no output)"
        text.append(f"--- process {i}, last {TAIL_LINES} lines ---\n{tail}")
    return "\n".join(text)


@pytest.fixture(scope="module")
def results(tmp_path_factory, free_port):
    """Starts the workers, waits for them (at most `WAIT_S` in all), and returns
    each one's result dictionary and their output."""
    tmp = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    env["JAX_PLATFORMS"] = "cpu"
    workers = []
    try:
        for i in range(NUM_PROCESSES):
            out, err, res = (tmp / f"{i}.{kind}" for kind in ("out", "err", "json"))
            with open(out, "w") as stdout, open(err, "w") as stderr:
                args = [free_port, i, NUM_PROCESSES, res, DEADLINE_S]
                process = subprocess.Popen(
                    [sys.executable, str(SCRIPT), *map(str, args)],
                    stdout=stdout,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
            workers.append((process, out, err, res))
        deadline = time.monotonic() + WAIT_S
        for process, *_ in workers:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass  # reported below, with the output
    finally:
        for process, *_ in workers:
            if process.poll() is None:
                process.kill()  # this worker's own PID
                process.wait(timeout=30)
    output = _output(workers)
    codes = [process.returncode for process, *_ in workers]
    assert codes == [0] * NUM_PROCESSES, f"exit codes {codes}\n{output}"
    return [json.loads(res.read_text()) for *_, res in workers], output


@pytest.mark.parametrize(
    "name, cases",
    [
        ("vmap", 2),
        ("training", 2),
        ("shard_map", 3),
        ("shard_map_vmap", 3),
        ("buffers", 4),
    ],
)
def test_equals_one_process(results, name, cases):
    """`vmap`: jit + vmap over a batch sharded across the processes, one trip count
    per element; `training`: data-parallel SGD steps, the gradient through the loop
    averaged over the global batch; `shard_map`: one loop per device with its own
    trip count, forward and gradient; `shard_map_vmap`: the guide's pattern, `vmap`
    inside `shard_map`, forward and its complete example's training steps; `buffers`: a trajectory buffer per element of
    the sharded batch, forward and gradient. Each equals the same program in one
    process and a `lax` reference, in every process: a forward pass within
    `FORWARD_ULPS` float32 ulps (only the layout differs: the script says why),
    gradients to float32 tolerance, and one process's loop equals
    `lax.while_loop` bit for bit (the same shapes on the same device)."""
    per_process, output = results
    for i, out in enumerate(per_process):
        assert out[name]["ok"], f"process {i}: {out[name]['error']}\n{output}"
        assert out[name]["cases"] == cases, f"process {i}: {out[name]}\n{output}"
