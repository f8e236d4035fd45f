"""diffrax's own test files with our adjoint, as the diffrax guide runs them: every
test that passes with diffrax's adjoint passes with ours (type checks on). Behind
the `client` marker (about an hour on 2 cores), and only where a checkout of diffrax
at the installed version's tag is named by `DIFFRAX_SOURCE`:

    DIFFRAX_SOURCE=/tmp/diffrax python -m pytest -m client -n 0
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest


HERE = pathlib.Path(__file__).resolve().parent
DIFFRAX_FILES = [
    "test_progress_meter.py",
    "test_vmap.py",
    "test_saveat_solution.py",
    "test_adjoint.py",
    "test_event.py",
    "test_global_interpolation.py",
    "test_integrate.py",
]
# long, and not about derivatives (`test_against`: past 900 s with either adjoint)
LEFT_OUT = ["test_against", "test_ode_order", "test_sde_strong_order"]


@pytest.mark.client
def test_diffrax_suite_passes_where_diffrax_adjoint_does(tmp_path):
    source = os.environ.get("DIFFRAX_SOURCE")
    if not source:
        pytest.skip("set DIFFRAX_SOURCE to a checkout of diffrax at its installed tag")
    out = tmp_path / "diffrax_suite.json"
    command = [sys.executable, str(HERE / "client_suites" / "run.py"), "diffrax"]
    command += [source, *DIFFRAX_FILES, "--per-file", "--typechecks"]
    command += ["--replace-rca", "--timeout", "3600", "--out", str(out)]
    for text in LEFT_OUT:
        command += ["--exclude", text]
    subprocess.run(command, check=True)
    rows = json.loads(out.read_text())
    regressions = [
        r["test"]
        for r in rows
        if r["default"]["outcome"] == "passed" and r["ours"]["outcome"] != "passed"
    ]
    assert rows and not regressions
