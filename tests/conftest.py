import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# tests compare with references at float32 tolerances; a TPU's matmuls default to
# bfloat16 passes (a CPU's are float32 already, so this changes nothing there)
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(5678), 1000))
    return lambda: next(keys)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say which tests the default markers leave out (`pyproject.toml`), and how to
    run them (under xdist the count is the workers', so none is given)."""
    del exitstatus
    if config.getoption("markexpr") == "not slow and not client":
        terminalreporter.write_line(
            "Left out by default: the long profiles (run them with `python -m "
            "pytest -m slow`) and the client libraries' own suites (`python -m "
            "pytest -m client`; docs/development.md)."
        )
