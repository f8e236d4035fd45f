"""Run a client library's own test files with its own adjoint and with ours swapped
in (`diffrax_plugin.py`, `optimistix_plugin.py`), and compare test by test.

    python tests/client_suites/run.py diffrax DIFFRAX_SOURCE test_adjoint.py \\
        [--timeout 600] [--typechecks] [--replace-rca] [--exclude test_against] \\
        [--out benchmarks/results/diffrax_suite.json]
    python tests/client_suites/run.py optimistix OPTIMISTIX_SOURCE test_root_find.py \\
        --per-file --typechecks --recheck BOUNDEDLOOP_OPTIMISTIX_ADJOINT=lax \\
        [--out benchmarks/results/optimistix_suite.json]

`*_SOURCE` is a checkout of the client at the tag of the installed version (its test
folder is used). By default each test runs in its own process, because some of
diffrax's tests crash XLA's compiler or run out of memory with its default adjoint; a
crash or a timeout is recorded as such. `--per-file` runs each file in one process
(optimistix has 811 tests) and reads the outcomes as pytest prints them; a crash or
a timeout is recorded for the test that was running, and a new process runs the
rest (`--timeout` is then per process). A test whose file's process crashed is then
run once in a process of its own (its `alone` outcome). Not part
of `python -m pytest`: it takes tens of minutes.
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time


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


_OUTCOME_LINE = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# the short summary's `FAILED id - message`
_SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+::.*?) - (.*)$")
_OUTCOMES = dict(
    PASSED="passed",
    FAILED="failed",
    ERROR="failed",
    SKIPPED="skipped",
    XFAIL="skipped",
    XPASS="passed",
)


def run_file(source, test_ids, command, timeout) -> dict[str, dict]:
    """Run `test_ids` in one process, reading each outcome as pytest prints it; where
    the process crashes or times out, the test it was running is recorded so and a
    new process runs the rest."""
    outcomes, remaining = {}, list(test_ids)
    while remaining:
        # -vv: one line per test, against the command's -q
        done, seconds = run(command + ["-vv", "-rfE"] + remaining, source, timeout)
        stdout = "" if done is None else done.stdout
        for line in stdout.splitlines():
            match = _OUTCOME_LINE.match(line)
            if match and match.group(1) in remaining:
                outcomes[match.group(1)] = dict(outcome=_OUTCOMES[match.group(2)])
            match = _SUMMARY_LINE.match(line)
            if match and match.group(1) in outcomes:
                outcomes[match.group(1)]["tail"] = [match.group(2)[:300]]
        remaining = [t for t in remaining if t not in outcomes]
        if remaining and (done is None or done.returncode not in (0, 1)):
            # the first test without an outcome is the one that was running
            status = "timeout" if done is None else f"crashed (exit {done.returncode})"
            outcomes[remaining.pop(0)] = dict(outcome=status, seconds=seconds)
            print(f"{status}; a new process for the {len(remaining)} left", flush=True)
        elif remaining:
            for test_id in remaining:  # collected by us, not run by pytest
                outcomes[test_id] = dict(outcome="not run")
            remaining = []
    return outcomes


def _outcome(cell: dict) -> str:
    """A test's outcome, or where its long process crashed, its outcome alone."""
    return cell.get("alone", cell["outcome"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("client", choices=sorted(TEST_FOLDER))
    parser.add_argument("source", type=pathlib.Path)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--per-file", action="store_true")
    parser.add_argument(
        "--select",
        metavar="TEXT",
        help="only the tests whose ids contain TEXT (as `-k`, without its grammar)",
    )
    parser.add_argument(
        "--exclude",
        metavar="TEXT",
        action="append",
        default=[],
        help="leave out the tests whose ids contain TEXT (may be repeated)",
    )
    parser.add_argument(
        "--replace-rca",
        action="store_true",
        help="diffrax: tests that name `RecursiveCheckpointAdjoint` get ours too "
        "(`BOUNDEDLOOP_REPLACE_RCA=1`, read by `diffrax_plugin.py`)",
    )
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
    if args.replace_rca:
        # read only by the plugin, which runs only in the processes of our adjoint
        os.environ["BOUNDEDLOOP_REPLACE_RCA"] = "1"
    earlier = {}
    if args.resume is not None:
        earlier = {row["test"]: row for row in json.loads(args.resume.read_text())}
    results = []
    for test_file in args.files:
        test_ids = collect(args.source, folder, test_file)
        if args.select:
            test_ids = [t for t in test_ids if args.select in t]
        test_ids = [t for t in test_ids if not any(x in t for x in args.exclude)]
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
                columns[label] = run_file(args.source, test_ids, command, args.timeout)
            else:
                columns[label] = {
                    t: run_one(args.source, t, command, args.timeout) for t in test_ids
                }
        for test_id in test_ids:
            row = dict(test=test_id, **{k: v[test_id] for k, v in columns.items()})
            for label, ours in [("default", False), ("ours", True)]:
                cell = row[label]
                crashed = cell["outcome"].startswith("crashed")
                if args.per_file and crashed and "alone" not in cell:
                    # a crash in a long process: the same test in a process alone
                    command = pytest_command(args.client, ours, args.typechecks)
                    alone = run_one(args.source, test_id, command, args.timeout)
                    cell["alone"] = alone["outcome"]
            differs = _outcome(row["ours"]) != _outcome(row["default"])
            if "recheck" in earlier.get(test_id, {}):
                row["recheck"] = earlier[test_id]["recheck"]
            elif args.recheck and differs:
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
        if args.out:  # after each file, so that a long run keeps what it has
            pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    for label in ["default", "ours"]:
        counts = {}
        for row in results:
            counts[row[label]["outcome"]] = counts.get(row[label]["outcome"], 0) + 1
        print(label, counts)


if __name__ == "__main__":
    main()
