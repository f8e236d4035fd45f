"""Run a client library's own test files with its own adjoint and with ours swapped
in (`diffrax_plugin.py`, `optimistix_plugin.py`), and compare test by test.

    python tests/client_suites/run.py diffrax DIFFRAX_SOURCE test_adjoint.py \\
        [--timeout 600] [--typechecks] [--out benchmarks/results/diffrax_suite.json]
    python tests/client_suites/run.py optimistix OPTIMISTIX_SOURCE test_root_find.py \\
        --per-file --typechecks --recheck BOUNDEDLOOP_OPTIMISTIX_ADJOINT=lax \\
        [--out benchmarks/results/optimistix_suite.json]

`*_SOURCE` is a checkout of the client at the tag of the installed version (its test
folder is used). By default each test runs in its own process, because some of
diffrax's tests crash XLA's compiler or run out of memory with its default adjoint; a
crash or a timeout is recorded as such. `--per-file` runs each file in one process
(optimistix has 811 tests) and reads the outcomes from pytest's JUnit XML, falling
back to one process per test for a file whose process crashes or times out. Not part
of `python -m pytest`: it takes tens of minutes.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET


HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# where each client keeps its tests
TEST_FOLDER = {"diffrax": "test", "optimistix": "tests"}


def collect(source: pathlib.Path, folder: str, test_file: str) -> list[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            f"{folder}/{test_file}",
        ],
        cwd=source,
        capture_output=True,
        text=True,
    )
    return [line for line in out.stdout.splitlines() if "::" in line]


def pytest_command(client: str, ours: bool, typechecks: bool) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if ours:
        # by module name alone: optimistix's own tests are a package named `tests`
        command += ["-p", f"{client}_plugin"]
    if not typechecks:
        # diffrax's pytest configuration type-checks diffrax's own functions at run
        # time (jaxtyping + beartype); its save state's hints accept equinox's buffer
        # class only, so they reject `bl.Buffer` (see the diffrax guide)
        command += ["-o", "addopts="]
    return command


def run(command: list[str], source: pathlib.Path, timeout: float, extra_env=None):
    """**Returns:** the finished process and its seconds, or `None` on a timeout."""
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{ROOT}", **(extra_env or {}))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=source,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, timeout
    return done, round(time.perf_counter() - start, 1)


def run_one(source, test_id, command, timeout, extra_env=None) -> dict:
    done, seconds = run(command + [test_id], source, timeout, extra_env)
    if done is None:
        return dict(outcome="timeout", seconds=seconds)
    if done.returncode == 0:
        outcome = (
            "skipped"
            if " skipped" in done.stdout and " passed" not in done.stdout
            else "passed"
        )
    elif done.returncode == 1:
        outcome = "failed"
    else:
        outcome = f"crashed (exit {done.returncode})"
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return dict(outcome=outcome, seconds=seconds, tail=tail)


def _junit_outcomes(path: pathlib.Path, folder: str) -> dict[str, dict]:
    """Test id (as `--collect-only` prints it) to outcome, from a JUnit XML file."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name')}"
        outcome, message = "passed", []
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = [child.get("message", "")[:300]]
            elif child.tag == "skipped":
                outcome = "skipped"
        outcomes[test_id] = dict(
            outcome=outcome, seconds=round(float(case.get("time", 0)), 1), tail=message
        )
    return outcomes


def run_file(source, folder, test_file, test_ids, command, timeout) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = pathlib.Path(tmp) / "junit.xml"
        done, _ = run(
            command + [f"--junitxml={xml}", f"{folder}/{test_file}"], source, timeout
        )
        if done is not None and done.returncode in (0, 1) and xml.exists():
            outcomes = _junit_outcomes(xml, folder)
            missing = [t for t in test_ids if t not in outcomes]
            if not missing:
                return outcomes
            print(f"{test_file}: {len(missing)} ids not in the XML", flush=True)
    print(f"{test_file}: crashed or timed out; one process per test", flush=True)
    return {t: run_one(source, t, command, timeout) for t in test_ids}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("client", choices=sorted(TEST_FOLDER))
    parser.add_argument("source", type=pathlib.Path)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--per-file", action="store_true")
    parser.add_argument(
        "--recheck",
        metavar="KEY=VALUE",
        help="rerun the tests that pass with the client's adjoint and fail with ours "
        "with the plugin and this environment variable (a third column, 'recheck')",
    )
    parser.add_argument(
        "--typechecks",
        action="store_true",
        help="keep the client's run-time type checks of its own functions",
    )
    parser.add_argument(
        "--resume",
        type=pathlib.Path,
        help="an earlier run's --out: files whose tests it has are not run again",
    )
    args = parser.parse_args()
    folder = TEST_FOLDER[args.client]
    earlier = {}
    if args.resume is not None:
        earlier = {row["test"]: row for row in json.loads(args.resume.read_text())}
    results = []
    for test_file in args.files:
        test_ids = collect(args.source, folder, test_file)
        columns = {}
        if all(t in earlier for t in test_ids):
            columns = {
                label: {t: earlier[t][label] for t in test_ids}
                for label in ["default", "ours"]
            }
        for label, ours in [("default", False), ("ours", True)]:
            if label in columns:
                continue
            command = pytest_command(args.client, ours, args.typechecks)
            if args.per_file:
                columns[label] = run_file(
                    args.source, folder, test_file, test_ids, command, args.timeout
                )
            else:
                columns[label] = {
                    t: run_one(args.source, t, command, args.timeout) for t in test_ids
                }
        for test_id in test_ids:
            row = dict(test=test_id, **{k: v[test_id] for k, v in columns.items()})
            if args.recheck and row["ours"]["outcome"] != row["default"]["outcome"]:
                key, value = args.recheck.split("=", 1)
                command = pytest_command(args.client, True, args.typechecks)
                row["recheck"] = run_one(
                    args.source, test_id, command, args.timeout, {key: value}
                )
            results.append(row)
            cells = [
                row[k]["outcome"] for k in ["default", "ours", "recheck"] if k in row
            ]
            print(f"| {test_id} | {' | '.join(cells)} |", flush=True)
    for label in ["default", "ours"]:
        counts = {}
        for row in results:
            counts[row[label]["outcome"]] = counts.get(row[label]["outcome"], 0) + 1
        print(label, counts)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
