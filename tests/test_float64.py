"""float64: forward and gradients to a relative tolerance of 1e-10, in a subprocess
(`tests/scripts/float64.py`) so that `jax_enable_x64` never leaks into other tests."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp


SCRIPT = pathlib.Path(__file__).parent / "scripts" / "float64.py"


def test_float64_matches_references():
    # on the host CPU, as `test_multidevice.py` runs: this process may hold the
    # accelerator (a TPU opens in one process only), and TPUs have no float64
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"float64: (\d+) cases passed", result.stdout)
    assert match and int(match.group(1)) == 28, result.stdout
    # and this process is still in float32
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(1.0).dtype == jnp.float32
