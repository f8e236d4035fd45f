"""Sharding on 8 CPU devices, in a subprocess (`tests/scripts/multidevice.py`) started
with `XLA_FLAGS=--xla_force_host_platform_device_count=8`, so the device count of
this process is untouched. The script runs every check once; each test reads its
result. The checks that make a sharded program raise run in a process each, with a
short timeout: if one device raised alone, the others would wait for it until XLA
aborts the process."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


SCRIPT = pathlib.Path(__file__).parent / "scripts" / "multidevice.py"


def _run(*checks, timeout):
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *checks],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]), result.stderr


@pytest.fixture(scope="module")
def results():
    return _run(timeout=600)


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


def test_memory_budget_inside_shard_map(results):
    """A `memory=` budget inside `shard_map`: blocks of taped steps, and every step
    taped, each device with its own trip count."""
    _check(results, "shard_map_memory", 6)


@pytest.mark.parametrize(
    "name, cases",
    [("max_steps_check", 7), ("buffer_checks", 2), ("shard_map_checks", 7)],
)
def test_checks_raise_on_every_device(name, cases):
    """`bl.max_steps_check` and `bl.buffer_checks` firing in a sharded program raise
    a Python exception with their message within seconds, under `jax.jit` and
    inside `jax.shard_map` (each device with its own trip count): no device waits in
    a collective for one that raised, which made XLA abort the process."""
    _check(_run(name, timeout=120), name, cases)
