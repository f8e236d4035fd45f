"""`tests/run_in_parts.py`: a part stopped by its time limit keeps the outcomes of
the tests that ended, and the next part runs the rest; a test that kills the
process is recorded and passed over."""

import json
import os
import pathlib
import subprocess
import sys


RUNNER = pathlib.Path(__file__).parent / "run_in_parts.py"

SUITE = """
import pathlib, time

def test_passes():
    pass

def test_held():  # runs while the file `hold` is there (at most a minute)
    hold = pathlib.Path(__file__).parent / "hold"
    for _ in range(600):
        if not hold.exists():
            break
        time.sleep(0.1)

def test_fails():
    assert False
"""


# the tiny suites' pytest loads xdist alone, not every installed plugin (the
# jaxtyping one imports JAX): 0.2 s a start rather than 1.3 s
QUICK_PYTEST = dict(
    os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTEST_ADDOPTS="-p xdist.plugin"
)


def _part(tmp_path, seconds, *options):
    """One part, run as from a process that ignores Ctrl-C, as a pytest-xdist
    worker may: an ignored SIGINT is inherited, and under CI's full suite the
    runner's pytest once ignored every interrupt (the held test ran its 60 s)."""
    runner = [sys.executable, str(RUNNER), "--seconds", str(seconds), "--pause", "0"]
    runner += [*options, "--state", "state.json", "test_tiny.py"]
    return subprocess.run(
        ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *runner],  # SIGINT ignored
        capture_output=True,
        cwd=tmp_path,
        env=QUICK_PYTEST,
        text=True,
        timeout=120,
    )


def test_a_part_cut_off_resumes_where_it_stopped(tmp_path):
    (tmp_path / "test_tiny.py").write_text(SUITE)
    (tmp_path / "hold").touch()
    first = _part(tmp_path, 6)
    _assert_cut(first, tmp_path)
    state = json.loads((tmp_path / "state.json").read_text())
    assert len(state["tests"]) == 3
    assert list(state["outcomes"].values()) == ["PASSED"]  # the held one was cut
    (tmp_path / "hold").unlink()
    second = _part(tmp_path, 60)
    assert second.returncode == 1, second.stdout[-2000:]  # one failed
    state = json.loads((tmp_path / "state.json").read_text())
    assert sorted(state["outcomes"].values()) == ["FAILED", "PASSED", "PASSED"]
    assert set(state["seconds"]) == set(state["outcomes"])  # each test's time
    last = second.stdout.splitlines()[-1]
    assert last.startswith("FAILED") and "test_fails" in last


SWALLOWS_INTERRUPTS = """
import time

try:
    time.sleep(3)  # a slow start, under load
except KeyboardInterrupt:
    pass  # as a plugin's import might
"""


def _assert_cut(part, tmp_path):
    """`part` ran `test_passes` and was cut off during `test_held`."""
    assert part.returncode == 2, part.stdout[-2000:]  # tests left
    outcomes = json.loads((tmp_path / "state.json").read_text())["outcomes"]
    assert outcomes == {"test_tiny.py::test_passes": "PASSED"}


DIES_ON_ITS_WAY_OUT = """
import atexit, os, signal

def pytest_keyboard_interrupt(excinfo):  # killed in its exit handlers
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_a_test_cut_off_is_not_a_crash_however_the_process_ends(tmp_path):
    """On a TPU, a part's pytest stopped by the interrupt then died in JAX's exit
    handlers (a second interrupt while the runtime shut down), and the test it cut
    was recorded as CRASHED. A test our interrupt cut is run again next part."""
    (tmp_path / "test_tiny.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(DIES_ON_ITS_WAY_OUT)
    (tmp_path / "hold").touch()
    _assert_cut(_part(tmp_path, 6), tmp_path)


def test_an_interrupt_during_start_up_is_not_lost(tmp_path):
    """An interrupt while pytest starts may be swallowed by a plugin's import, and
    the held test would then run to its end. The runner interrupts once tests are
    collected, and again until pytest stops."""
    (tmp_path / "test_tiny.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(SWALLOWS_INTERRUPTS)
    (tmp_path / "hold").touch()
    first = _part(tmp_path, 1)
    assert first.returncode == 2, first.stdout[-2000:]  # tests left
    outcomes = json.loads((tmp_path / "state.json").read_text())["outcomes"]
    assert "test_tiny.py::test_held" not in outcomes  # cut, not run to its end
    assert "test_tiny.py::test_fails" not in outcomes


CRASHING = """
import os

def test_before():
    pass

def test_aborts():  # as a compiler's failed check does: no outcome, no report
    os.abort()

def test_after():
    pass
"""


def test_a_test_that_kills_the_process_is_recorded_and_passed_over(tmp_path):
    (tmp_path / "test_tiny.py").write_text(CRASHING)
    first = _part(tmp_path, 60)
    assert first.returncode == 1, first.stdout[-2000:]
    outcomes = json.loads((tmp_path / "state.json").read_text())["outcomes"]
    assert outcomes == {
        "test_tiny.py::test_before": "PASSED",
        "test_tiny.py::test_aborts": "CRASHED",
    }
    second = _part(tmp_path, 60)
    assert second.returncode == 1, second.stdout[-2000:]  # the crash is a failure
    outcomes = json.loads((tmp_path / "state.json").read_text())["outcomes"]
    assert outcomes["test_tiny.py::test_after"] == "PASSED"
    assert second.stdout.splitlines()[-1] == "CRASHED test_tiny.py::test_aborts"


DEAF = """
import signal, time

def test_passes():
    pass

def test_deaf():  # as a test blocked in a compiler or a device wait: no interrupt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(60)

def test_after():
    pass
"""


def test_a_pytest_that_ignores_interrupts_is_killed_after_the_grace(tmp_path):
    """On a TPU a part's pytest took no interrupt for minutes, the device's limit
    killed the runner, and the part's outcomes were lost."""
    (tmp_path / "test_tiny.py").write_text(DEAF)
    part = _part(tmp_path, 4, "--grace", "3", "-W", "ignore::UserWarning")
    assert part.returncode == 2, part.stdout[-2000:]  # tests left
    assert "killed" in part.stdout
    assert "ERROR" not in part.stdout  # `-W`'s value reached pytest as an option
    outcomes = json.loads((tmp_path / "state.json").read_text())["outcomes"]
    assert outcomes == {"test_tiny.py::test_passes": "PASSED"}  # the deaf one reruns
