"""The tables of the client suites: a client library's own test files, run with its
adjoint (`default`) and with ours by `tests/client_suites/run.py`, which writes
`benchmarks/results/<client>_suite.json` (per test, each one's outcome, and `alone`
where it was run again in a process of its own)."""

from _format import load, page, table


ADJOINTS = ("default", "ours")
# what each results file calls the client's own adjoint
THEIRS = {
    "diffrax_suite": "diffrax's adjoint",
    "optimistix_suite": "optimistix's adjoints",
}


def _outcome(cell: dict) -> str:
    """A test's outcome, or where its file's process crashed, its outcome alone."""
    return cell.get("alone", cell["outcome"])


def _said(cell: dict) -> str:
    if "alone" in cell:
        return f"{cell['outcome']} in its file's process but {cell['alone']} alone"
    return cell["outcome"]


def suite_findings(rows: list[dict]) -> dict:
    """`files`: each test file's tests and how many passed with each adjoint;
    `skipped`: the tests skipped with both; `different`: the others not passed."""
    files = {}
    for r in rows:
        counts = files.setdefault(r["test"].split("::")[0], [0] * (1 + len(ADJOINTS)))
        counts[0] += 1
        for i, who in enumerate(ADJOINTS, 1):
            counts[i] += _outcome(r[who]) == "passed"
    skipped = [
        r for r in rows if _outcome(r["default"]) == _outcome(r["ours"]) == "skipped"
    ]
    unlike = [r for r in rows if any(r[who]["outcome"] != "passed" for who in ADJOINTS)]
    different = [r for r in unlike if r not in skipped]
    return dict(files=files, skipped=skipped, different=different)


def client_suite_table(name: str, listed: int = 12) -> str:
    """`results/<name>.json` (`name` a key of `THEIRS`): how many of each test file's
    tests passed with each adjoint, and every test that did not pass with both,
    grouped by test function where more than `listed` did not."""
    found, theirs = suite_findings(load(f"{name}.json")), THEIRS[name]
    header = ["file", "tests", f"passed, {theirs}", "passed, `CheckpointedAdjoint`"]
    files = [[f"`{f.rsplit('/', 1)[-1]}`", *n] for f, n in found["files"].items()]

    def outcomes(r):
        said = f"{_said(r['default'])} with {theirs}, {_said(r['ours'])} with ours"
        if "recheck" in r:
            said += f", {r['recheck']['outcome']} unrolled on `lax.while_loop`"
        return said

    different = found["different"]
    if len(different) <= listed:
        listing = [f"- `{r['test'].split('::')[1]}`: {outcomes(r)}" for r in different]
    else:
        groups = {}
        for r in different:
            key = (r["test"].split("::")[1].split("[")[0], outcomes(r))
            groups[key] = groups.get(key, 0) + 1
        listing = [
            f"- `{function}`, {count} case{'s' * (count > 1)}: {said}"
            for (function, said), count in groups.items()
        ]
    skipped = ", ".join(f"`{r['test'].split('::')[1]}`" for r in found["skipped"])
    return page(
        table(header, files),
        "Not passed with both:" if different else None,
        listing,
        f"Skipped with both: {skipped}." if skipped else None,
    )
