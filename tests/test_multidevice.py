"""Sharding on 8 CPU devices, in a subprocess (`tests/scripts/multidevice.py`) started
with `XLA_FLAGS=--xla_force_host_platform_device_count=8`, so the device count of
this process is untouched. The script runs every check once; each test reads its
result."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


SCRIPT = pathlib.Path(__file__).parent / "scripts" / "multidevice.py"


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]), result.stderr


def _check(results, name, cases):
    out, stderr = results
    assert out[name]["ok"], f"{out[name]['error']}\n\n{stderr}"
    assert out[name]["cases"] == cases


def test_sharded_carry_under_jit(results):
    """Forward and gradient equal the unsharded ones and keep their sharding."""
    _check(results, "jit", 28)


def test_sharded_buffer_and_scan_under_jit(results):
    _check(results, "jit_buffers", 10)


def test_explicit_axes_mesh(results):
    _check(results, "explicit", 28)


def test_loop_inside_shard_map(results):
    _check(results, "shard_map", 3)


def test_unbounded_loop_inside_shard_map(results):
    """The store rule that runs in the loop, inside `shard_map`."""
    _check(results, "shard_map_unbounded", 3)
