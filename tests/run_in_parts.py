"""Run the suite in parts that each end within a time limit, resuming where the last
part stopped: for hosts that hold a machine for a few minutes at a time (an
accelerator lent by the call) and a suite that takes longer there.

    python tests/run_in_parts.py --seconds 480 --state suite.json [pytest arguments]

from the project's root, where pytest finds its configuration. The first call
collects the tests (with the pytest arguments given, e.g. files or `-m`) into
`--state`; each call then runs the tests not yet run, by name, in one process
(`-n 0`: one process at a time can hold a TPU), with `-v`, and interrupts pytest
(as Ctrl-C does) when `--seconds` have passed, or once it has collected the tests
if it has not yet, and again every few seconds until it stops; it kills pytest when
`--grace` seconds (default 60) of interrupts have not stopped it (a test blocked in
a compiler or waiting on a device may never see them). Each part's pytest gets the
options given (not the paths, which were collected) and an empty stdin. The
outcome of each test that finished is kept in the state file, and the next call
goes on from there. A test cut off mid-run is run again from its start. A test
during which the process dies (an abort in a compiler, say) is recorded as CRASHED,
and the next part goes on after it. Each call prints the counts so far, the slowest
tests and the failures' names; the state keeps each test's seconds. Exits 0 when
every test has run and none failed, 1 when one failed (the outcome line says
which), 2 when tests are left to run.
"""

import argparse
import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time


OUTCOME = re.compile(r"^(\S+\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
FAILING = {"FAILED", "ERROR", "XPASS", "CRASHED"}
COLLECTED = re.compile(r"\bcollected \d+ items?\b")


def collect(pytest_args: list[str]) -> list[str]:
    """The node ids pytest collects with `pytest_args`."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0"]
        + ["-p", "no:cacheprovider", *pytest_args],
        capture_output=True,
        text=True,
    )
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    if result.returncode != 0 or not ids:
        sys.exit(f"collection failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return ids


def run_part(
    ids: list[str],
    seconds: float,
    took: dict | None = None,
    options: tuple[str, ...] | list[str] = (),
    grace: float = 60,
) -> dict:
    """Runs `ids` (with pytest's `options`) until they end or `seconds` pass; the
    outcome of each that ended, and CRASHED for the one running when the process
    died, if it did. A pytest that `grace` seconds of interrupts do not stop is
    killed, and the test it ran is run again next part. Where `took` is given, it
    gets the seconds each test that ended took (from the end of the one before, or
    from collection)."""
    took = {} if took is None else took
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider"]
    process = subprocess.Popen(
        [*command, "-v", "--tb=short", *options, *ids],
        stdin=subprocess.DEVNULL,  # a test that waits for input gets none, at once
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    outcomes = {}
    started = []  # `-v` prints a test's id as it starts, its outcome as it ends
    collected = threading.Event()

    last = [time.perf_counter()]

    def read():
        for line in process.stdout:
            sys.stdout.write(line)
            if COLLECTED.search(line):
                collected.set()
                last[0] = time.perf_counter()
            found = OUTCOME.match(line)
            if found:
                outcomes[found[1]] = found[2]
                now = time.perf_counter()
                took[found[1]] = round(now - last[0], 2)
                last[0] = now
            elif "::" in line:
                started.extend(t for t in ids if line.startswith(t + " "))

    reader = threading.Thread(target=read)
    reader.start()
    interrupted = False
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        _interrupt(process, collected, time.perf_counter() + grace)
        interrupted = True
    reader.join()
    # after our interrupt the test running was cut, not crashed, however the process
    # ended (JAX's exit handlers may take the repeated interrupt: on a TPU they did)
    died = process.returncode < 0 or process.returncode > 5  # not pytest's own codes
    if died and not interrupted and started and started[-1] not in outcomes:
        outcomes[started[-1]] = "CRASHED"
    return outcomes


def _interrupt(process, collected: threading.Event, kill_at: float) -> None:
    """Stops pytest as Ctrl-C does, once it has collected the tests (an interrupt
    while plugins import may be swallowed by one, or end the part before any test
    ran), and again every few seconds until it stops; kills it at `kill_at` (a test
    blocked in a compiler or a device wait may never see an interrupt)."""
    while not collected.wait(timeout=0.5) and process.poll() is None:
        if time.perf_counter() > kill_at:
            break
    while process.poll() is None:
        if time.perf_counter() > kill_at:
            print("\nrun in parts: pytest ignored interrupts; killed", flush=True)
            process.kill()
            process.wait()
            return
        process.send_signal(signal.SIGINT)  # pytest reports, then stops
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _selects(arg: str) -> bool:
    """Whether a pytest argument names tests: a path that exists, or a node id in
    one (not a value such as `-W`'s `ignore::UserWarning`)."""
    return not arg.startswith("-") and pathlib.Path(arg.split("::")[0]).exists()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument(
        "--grace",
        type=float,
        default=60,
        help="seconds of interrupts after --seconds before the part's pytest is killed",
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=5,
        help="seconds between collecting the tests and the first part",
    )
    args, pytest_args = parser.parse_known_args()
    # what selects tests (paths, node ids) is collected once; the rest (-W, -m's
    # value...) goes to each part's pytest as well
    options = [a for a in pytest_args if not _selects(a)]
    # a parent may ignore Ctrl-C (a pytest-xdist worker does), and an ignored SIGINT
    # is inherited: pytest would never see the interrupt. A handled one is not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    state_path = pathlib.Path(args.state)
    if state_path.exists():
        state = json.loads(state_path.read_text())
    else:
        state = {"tests": collect(pytest_args), "outcomes": {}}
        time.sleep(args.pause)  # a TPU may refuse a process started as one ends
    pending = [t for t in state["tests"] if t not in state["outcomes"]]
    if pending:
        took = state.setdefault("seconds", {})
        outcomes = run_part(pending, args.seconds, took, options, args.grace)
        state["outcomes"].update(outcomes)
        state_path.write_text(json.dumps(state, indent=1))
    outcomes = state["outcomes"]
    left = [t for t in state["tests"] if t not in outcomes]
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    failed = sorted(t for t, o in outcomes.items() if o in FAILING)
    print(f"\nrun in parts: {counts}, {len(left)} of {len(state['tests'])} left")
    slowest = sorted(state.get("seconds", {}).items(), key=lambda kv: -kv[1])[:5]
    print("slowest so far: " + ", ".join(f"{t} {s:.0f} s" for t, s in slowest))
    for test in failed:
        print(f"{outcomes[test]} {test}")
    sys.exit(1 if failed else 2 if left else 0)


if __name__ == "__main__":
    main()
