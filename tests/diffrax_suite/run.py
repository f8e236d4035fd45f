"""Run diffrax's own test files with its default adjoint and with
`CheckpointedAdjoint` swapped in (`plugin.py`), one test per process, and compare.

    python tests/diffrax_suite/run.py DIFFRAX_SOURCE test_adjoint.py test_saveat_solution.py \\
        [--timeout 600] [--typechecks] [--out benchmarks/results/diffrax_suite.json]

`DIFFRAX_SOURCE` is a checkout of diffrax at the tag of the installed version (its
`test/` folder is used). Each test runs in its own process because some of diffrax's
tests crash XLA's compiler or run out of memory with its default adjoint; a crash or
a timeout is recorded as such. Not part of `python -m pytest`: it takes tens of
minutes.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time


ROOT = pathlib.Path(__file__).resolve().parents[2]


def collect(source: pathlib.Path, test_file: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", f"test/{test_file}"],
        cwd=source,
        capture_output=True,
        text=True,
    )
    return [line for line in out.stdout.splitlines() if "::" in line]


def run_one(
    source: pathlib.Path, test_id: str, ours: bool, timeout: float, typechecks: bool
) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id]
    if ours:
        command[4:4] = ["-p", "tests.diffrax_suite.plugin"]
    if not typechecks:
        # diffrax's pytest configuration type-checks diffrax's own functions at run
        # time (jaxtyping + beartype); its save state's hints accept equinox's buffer
        # class only, so they reject `bl.Buffer` (see the diffrax guide)
        command[4:4] = ["-o", "addopts="]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
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
        return dict(outcome="timeout", seconds=timeout)
    seconds = time.perf_counter() - start
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
    return dict(outcome=outcome, seconds=round(seconds, 1), tail=tail)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=pathlib.Path)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--typechecks",
        action="store_true",
        help="keep diffrax's run-time type checks of its own functions",
    )
    args = parser.parse_args()
    results = []
    for test_file in args.files:
        for test_id in collect(args.source, test_file):
            row = dict(test=test_id)
            for label, ours in [("default", False), ("ours", True)]:
                row[label] = run_one(
                    args.source, test_id, ours, args.timeout, args.typechecks
                )
            results.append(row)
            print(
                f"| {test_id} | {row['default']['outcome']} | {row['ours']['outcome']} |",
                flush=True,
            )
    for label in ["default", "ours"]:
        counts = {}
        for row in results:
            counts[row[label]["outcome"]] = counts.get(row[label]["outcome"], 0) + 1
        print(label, counts)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
