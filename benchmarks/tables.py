"""Every table the documentation shows, written from `benchmarks/results/` (or, for
the repetitions table, computed from a formula), without timing anything:

    python benchmarks/tables.py

writes one markdown file per entry of `GENERATORS` into `docs/generated/`; the docs
pages include them with `--8<-- "docs/generated/<name>.md"`, and
`tests/test_generated_docs.py` checks that the committed files equal what this
writes, so a figure on a page cannot drift from its results file. Rerun a benchmark,
then this script, then commit both. `benchmarks/plots.py` calls this too, so that
one command redraws the pictures and rewrites the tables.

The measurements are read from the `.json` files; the `.txt` file of the same run is
read only for the workload's description where the `.json` does not record it (the
checkpoint count of `buffers.py`, `max_steps` and the rounds of
`diffrax_adjoint.py`).
"""

import json
import math
import pathlib
import re


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GENERATED = ROOT / "docs" / "generated"

STEPS = (10, 100, 1000, 10000, 100000)
CHECKPOINTS = (2, 4, 8, 16, 32)


def _json(name: str):
    return json.loads((RESULTS / name).read_text())


def _txt_field(name: str, pattern: str) -> str:
    """The first group of `pattern` in `benchmarks/results/<name>`."""
    match = re.search(pattern, (RESULTS / name).read_text())
    if match is None:
        raise ValueError(f"{pattern!r} not found in benchmarks/results/{name}")
    return match.group(1)


def nbytes(n) -> str:
    """Bytes, readably (kB, MB, GB: powers of 1000)."""
    if n is None:
        return "-"
    for unit, size in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)]:
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _significant(v: float, figures: int = 3) -> str:
    """`v` to `figures` significant figures, trailing zeros kept, no exponent."""
    v = float(f"{v:.{figures}g}")
    return f"{v:.{max(0, figures - 1 - math.floor(math.log10(abs(v))))}f}"


def milliseconds(ms: float) -> str:
    """A time given in milliseconds, to three significant figures, in ms below a
    second and in s from there."""
    if float(f"{ms:.3g}") >= 1000:
        return f"{_significant(ms / 1000)} s"
    return f"{_significant(ms)} ms"


def _table(header, rows, align) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def _text(lines) -> str:
    return "\n".join(lines) + "\n"


# --- choosing checkpoints: a formula -------------------------------------------


def repetitions(n: int, c: int) -> int:
    """The smallest integer `r >= 0` with `binomial(c + r, r) >= n`."""
    r = 0
    while math.comb(c + r, r) < n:
        r += 1
    return r


def repetitions_table(steps=STEPS, checkpoints=CHECKPOINTS) -> str:
    """For `n` steps and `c` checkpoints, the smallest `r` with
    `binomial(c + r, r) >= n` (the binomial checkpointing bound: a gradient then
    recomputes fewer than `r n` steps). One row per `n`, one column per `c`."""
    return _text(
        _table(
            ["steps `n`", *(f"r for c = {c}" for c in checkpoints)],
            [[n, *(repetitions(n, c) for c in checkpoints)] for n in steps],
            ["---:"] * (len(checkpoints) + 1),
        )
    )


# --- benchmarks/while_loop.py -------------------------------------------------

# how `docs/why-boundedloop.md` names the loops of `while_loop.py`
WHY_LOOP_NAMES = {
    "boundedloop": "bl.while_loop",
    "boundedloop (default checkpoints)": "bl.while_loop, default checkpoints",
    "equinox checkpointed": "equinox checkpointed",
    "equinox bounded": "equinox bounded",
    "nested scan+cond": "nested lax.scan + lax.cond",
    "fori_loop+cond": "lax.fori_loop + lax.cond",
}


def while_loop_table() -> str:
    """The gradient-time benchmark as narrow tables: time ratios, then memory and
    body evaluations for each `max_steps` (the performance page)."""
    data = _json("while_loop.json")
    ideal, rows = data["ideal"], data["rows"]
    sizes = sorted({r["max_steps"] for r in rows})
    lines = [
        f"Adaptive MLP, 8 steps taken, checkpoints={data['checkpoints']}; ratios "
        f"within one run. The ideal, `lax.scan` over exactly the 8 steps: gradient "
        f"{ideal['grad_x_s'] * 1e3:.2f} ms; `lax.while_loop` forward "
        f"{data['lax_while_loop']['forward_s'] * 1e3:.2f} ms. OOM: the gradient "
        "did not fit in memory. Gradient time, ratios (grad: with respect to `x`; "
        "grad_w: with respect to the weights):",
        "",
        f"| loop | grad {sizes[-1]} / {sizes[0]} | grad / ideal @{sizes[0]} "
        f"| grad / ideal @{sizes[-1]} | grad_w / ideal @{sizes[-1]} |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in data["summary"]:
        lines.append(
            f"| {s['kind']} | {s['grad_last_over_first']} | "
            f"{s['grad_over_ideal_first']} | {s['grad_over_ideal_last']} | "
            f"{s['gradw_over_ideal_last']} |"
        )
    lines += [
        "",
        "Forward (undifferentiated) time over `lax.while_loop`'s, and the gradient's "
        "compile time, ratios:",
        "",
        f"| loop | forward / `lax.while_loop` @{sizes[-1]} "
        f"| gradient compile time {sizes[-1]} / {sizes[0]} |",
        "|---|---:|---:|",
    ]
    for s in data["summary"]:
        lines.append(
            f"| {s['kind']} | {s['forward_over_while_last']} | "
            f"{s['compile_last_over_first']} |"
        )
    for title, key, fmt in [
        ("Compiled temporary memory of the gradient", "grad_temp_bytes", nbytes),
        (
            "Body evaluations in one gradient (-: not run, out of memory)",
            "body_evals_per_grad",
            lambda v: "-" if v is None else str(v),
        ),
    ]:
        lines += [
            "",
            f"{title}, by `max_steps`:",
            "",
            "| loop | " + " | ".join(str(m) for m in sizes) + " |",
            "|---|" + "---:|" * len(sizes),
        ]
        for s in data["summary"]:
            by_size = {r["max_steps"]: r for r in rows if r["kind"] == s["kind"]}
            cells = " | ".join(fmt(by_size[m].get(key)) for m in sizes)
            lines.append(f"| {s['kind']} | {cells} |")
    return _text(lines)


def why_while_loop_table() -> str:
    """The same benchmark, one row per loop: is the gradient flat in `max_steps`
    (the why page)."""
    data = _json("while_loop.json")
    rows = data["rows"]
    first, last = min(r["max_steps"] for r in rows), max(r["max_steps"] for r in rows)

    def ratio(v):
        return "out of memory" if v == "OOM" else v

    out = []
    for s in data["summary"]:
        at_last = next(
            r for r in rows if r["kind"] == s["kind"] and r["max_steps"] == last
        )
        out.append(
            [
                WHY_LOOP_NAMES[s["kind"]],
                ratio(s["grad_last_over_first"]),
                ratio(s["grad_over_ideal_last"]),
                at_last["grad_temp_bytes"],
            ]
        )
    return _text(
        _table(
            [
                "loop",
                f"gradient time, max_steps {last} / {first}",
                f"gradient / ideal at {last}",
                f"temp memory at {last} (bytes)",
            ],
            out,
            ["---", "---:", "---:", "---:"],
        )
    )


# --- benchmarks/recomputation.py ----------------------------------------------

# the cells `docs/why-boundedloop.md` compares, as (steps n, checkpoints c)
WHY_RECOMPUTATION_CELLS = ((10000, 4), (1000, 2), (1000, 4), (10000, 8), (10000, 16))


def recomputation_table() -> str:
    """Body evaluations per gradient, with their ratio to the optimum in one cell so
    that the table fits the page (`recomputation.markdown_table`, for the text
    file, has a column per ratio)."""
    rows = _json("recomputation.json")

    def cell(count, optimum):
        return "not run" if count is None else f"{count} ({count / optimum:.3f})"

    lines = [
        "Body evaluations in one gradient, and in brackets their ratio to the optimum:",
        "",
        "| n | c | optimum | bl.while_loop | bl.scan | equinox checkpointed |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["n"], r["c"])):
        cells = " | ".join(
            cell(r[k], r["optimum"]) for k in ("boundedloop", "scan", "equinox")
        )
        lines.append(f"| {r['n']} | {r['c']} | {r['optimum']} | {cells} |")
    return _text(lines)


def why_recomputation_table() -> str:
    """The cells where the two checkpointed loops differ most, with equinox's
    count over ours (the why page)."""
    by_cell = {(r["n"], r["c"]): r for r in _json("recomputation.json")}
    out = []
    for n, c in WHY_RECOMPUTATION_CELLS:
        r = by_cell[(n, c)]
        theirs = r["equinox"]
        out.append(
            [
                n,
                c,
                r["optimum"],
                r["boundedloop"],
                "not run" if theirs is None else theirs,
                "-" if theirs is None else f"{theirs / r['boundedloop']:.3g}",
            ]
        )
    return _text(
        _table(
            [
                "steps n",
                "checkpoints c",
                "optimum",
                "bl.while_loop",
                "equinox checkpointed",
                "equinox / ours",
            ],
            out,
            ["---:"] * 6,
        )
    )


# --- benchmarks/buffers.py ----------------------------------------------------


def _buffers():
    """The rows of `buffers.json` by kind and size, the sizes, and the caption."""
    rows = _json("buffers.json")
    sizes = sorted({r["rows"] for r in rows})
    by = {(r["kind"], r["rows"]): r for r in rows}
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    width = rows[0]["buffer_bytes"] // (4 * rows[0]["rows"])
    checkpoints = _txt_field("buffers.txt", r"checkpoints=(\d+)")
    return by, kinds, sizes, width, checkpoints


def buffers_table() -> str:
    """Gradient time per step of a loop writing one row per step, with buffers and
    with the array carried (the performance page)."""
    by, kinds, sizes, width, checkpoints = _buffers()
    first, last = sizes[0], sizes[-1]
    out = []
    for kind in kinds:
        top = by[(kind, last)]
        out.append(
            [
                kind,
                *(f"{by[(kind, m)]['per_step_us']:.1f}" for m in sizes),
                f"{top['per_step_us'] / by[(kind, first)]['per_step_us']:.2f}",
                f"{top['temp_bytes'] / top['buffer_bytes']:.2f}",
            ]
        )
    return _text(
        [
            f"Gradient of an M-step loop writing one row of an (M, {width}) float32 "
            f"buffer per step, checkpoints={checkpoints}; ratios within this run.",
            "",
            *_table(
                [
                    "loop",
                    *(f"us/step M={m}" for m in sizes),
                    f"per-step {last}/{first}",
                    f"temp memory / buffer size at M={last}",
                ],
                out,
                ["---"] + ["---:"] * (len(sizes) + 2),
            ),
        ]
    )


# how `docs/why-boundedloop.md` names the loops of `buffers.py`, in its order
WHY_BUFFER_NAMES = {
    "boundedloop buffers": "bl.while_loop, buffers=",
    "equinox buffers": "equinox checkpointed, buffers=",
    "boundedloop carried": "bl.while_loop, array carried",
    "equinox carried": "equinox checkpointed, array carried",
}


def _buffer_sizes(ours, theirs) -> str:
    mine, other = (
        round(r["temp_bytes"] / r["buffer_bytes"], 1) for r in (ours, theirs)
    )
    if mine == other:
        return f"{mine:g} buffer sizes of temporary memory, as equinox's does"
    return f"{mine:g} buffer sizes of temporary memory to equinox's {other:g}"


def why_buffers_table() -> str:
    """The buffers benchmark with ours and equinox's side by side, and the two
    comparisons the why page draws from it."""
    by, _, sizes, _, _ = _buffers()
    last = sizes[-1]
    out = []
    for kind, name in WHY_BUFFER_NAMES.items():
        top = by[(kind, last)]
        out.append(
            [
                name,
                *(f"{by[(kind, m)]['per_step_us']:.1f}" for m in sizes),
                f"{top['temp_bytes'] / top['buffer_bytes']:.2f}",
            ]
        )
    lines = _table(
        [
            "loop",
            f"us/step, M = {sizes[0]}",
            *(f"M = {m}" for m in sizes[1:]),
            f"temp memory / buffer size, M = {last}",
        ],
        out,
        ["---"] + ["---:"] * (len(sizes) + 1),
    )
    lines.append("")
    for how, what in [("buffers", "With buffers"), ("carried", "Carrying the array")]:
        ours, theirs = by[(f"boundedloop {how}", last)], by[(f"equinox {how}", last)]
        lines.append(
            f"- {what}, at `M = {last}` ours takes "
            f"{ours['per_step_us'] / theirs['per_step_us']:.2f} times equinox's time "
            f"per step ({ours['per_step_us']:.1f} us against "
            f"{theirs['per_step_us']:.1f}; {milliseconds(ours['grad_s'] * 1e3)} "
            f"against {milliseconds(theirs['grad_s'] * 1e3)} for the whole "
            f"gradient) and holds {_buffer_sizes(ours, theirs)}."
        )
    return _text(lines)


# --- benchmarks/cheap_steps.py and forward_mode.py ------------------------------


def cheap_steps_table() -> str:
    """Many cheap steps: gradient time of ours, equinox's, ours storing every step
    and the ideal scan, for each `n` (the why page)."""
    data = _json("cheap_steps.json")
    c = data["checkpoints"]
    by = {(r["kind"], r["n"]): r for r in data["rows"]}
    ns = sorted({r["n"] for r in data["rows"]})
    out = []
    for n in ns:
        ours = by[(f"boundedloop checkpoints={c}", n)]
        theirs = by[(f"equinox checkpointed checkpoints={c}", n)]
        every = by[("boundedloop store all", n)]
        ideal = by[("lax.scan (ideal)", n)]
        out.append(
            [
                n,
                f"{milliseconds(ours['grad_s'] * 1e3)} "
                f"({ours['grad_over_ideal']:.2f}x ideal)",
                f"{milliseconds(theirs['grad_s'] * 1e3)} "
                f"({theirs['grad_over_ideal']:.3g}x)",
                f"{theirs['grad_s'] / ours['grad_s']:.2g}",
                f"{milliseconds(every['grad_s'] * 1e3)} "
                f"({every['grad_over_ideal']:.2f}x)",
                milliseconds(ideal["grad_s"] * 1e3),
            ]
        )
    return _text(
        _table(
            [
                "n",
                "bl.while_loop",
                "equinox checkpointed",
                "equinox / ours",
                "bl.while_loop storing every step",
                "ideal `lax.scan`",
            ],
            out,
            ["---:"] * 6,
        )
    )


def forward_mode_table() -> str:
    """Forward-mode time over `lax.while_loop`'s JVP, for each loop and `n` (the
    why page)."""
    rows = _json("forward_mode.json")["rows"]
    by = {(r["kind"], r["mode"], r["n"]): r for r in rows}
    ns = sorted({r["n"] for r in rows})
    kinds = [k for k in dict.fromkeys(r["kind"] for r in rows) if k != "lax.while_loop"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    names = {
        k: k.replace("boundedloop", "bl.while_loop,").replace(
            "store all", "storing every step"
        )
        for k in kinds
    }
    out = [
        [
            names[kind],
            n,
            *(f"{by[(kind, mode, n)]['over_reference']:.2f}" for mode in modes),
        ]
        for kind in kinds
        for n in ns
    ]
    return _text(
        _table(
            ["loop", "n", *(f"`jax.{mode}`" for mode in modes)],
            out,
            ["---", "---:"] + ["---:"] * len(modes),
        )
    )


# --- benchmarks/diffrax_adjoint.py --------------------------------------------

DIFFRAX_WORKLOADS = ("neural", "long", "wide")
# diffrax's own adjoint for each mode: the ratios are to its time
DIFFRAX_BASE = {
    "grad": "RecursiveCheckpointAdjoint()",
    "jvp": "ForwardMode()",
    "jacfwd": "ForwardMode()",
}
DIFFRAX_MODES = ("grad", "jvp", "jacfwd")


def _diffrax(workload: str):
    """The rows of one workload (by (mode, adjoint)), its steps, `max_steps` and
    rounds."""
    name = f"diffrax_adjoint_{workload}"
    run = _json(f"{name}.json")
    max_steps = int(_txt_field(f"{name}.txt", r"steps taken, max_steps=(\d+)"))
    rounds = int(_txt_field(f"{name}.txt", r"medians of (\d+) interleaved rounds"))
    rows = {(r["mode"], r["adjoint"]): r for r in run["rows"]}
    return rows, run["steps"], max_steps, rounds


def _diffrax_adjoint_name(adjoint: str, max_steps: int) -> str:
    if adjoint == "CheckpointedAdjoint(store all)":
        return f"`CheckpointedAdjoint({max_steps})` (every step)"
    return f"`{adjoint}`"


def diffrax_table(workload: str) -> str:
    """One workload of the diffrax benchmark: each mode and adjoint, its time and
    its ratios to diffrax's adjoint for the mode (the diffrax guide)."""
    rows, steps, max_steps, rounds = _diffrax(workload)
    ordered = sorted(rows.values(), key=lambda r: DIFFRAX_MODES.index(r["mode"]))
    out = []
    for r in ordered:
        base = rows[(r["mode"], DIFFRAX_BASE[r["mode"]])]
        compile_s = r["trace_lower_s"] + r["compile_s"]
        out.append(
            [
                f"`{r['mode']}`",
                _diffrax_adjoint_name(r["adjoint"], max_steps),
                milliseconds(r["ms"]),
                f"{r['ms'] / base['ms']:.2f}",
                f"{compile_s / (base['trace_lower_s'] + base['compile_s']):.2f}",
                nbytes(r["temp_bytes"]),
            ]
        )
    ours, theirs = (
        rows[("grad", "CheckpointedAdjoint(16)")],
        rows[("grad", "RecursiveCheckpointAdjoint(16)")],
    )
    return _text(
        [
            f"{steps} steps of `max_steps={max_steps}`; medians of {rounds} "
            f"interleaved rounds (`benchmarks/results/diffrax_adjoint_{workload}.json`):",
            "",
            *_table(
                [
                    "mode",
                    "adjoint",
                    "time",
                    "ratio",
                    "trace + compile ratio",
                    "temp memory",
                ],
                out,
                ["---", "---", "---:", "---:", "---:", "---:"],
            ),
            "",
            "At the same checkpoint count, `CheckpointedAdjoint(16)` takes "
            f"{ours['ms'] / theirs['ms']:.2f} times `RecursiveCheckpointAdjoint(16)`'s "
            f"time ({milliseconds(ours['ms'])} against {milliseconds(theirs['ms'])}).",
        ]
    )


# the comparisons of `diffrax_summary_table`: (row label, mode, ours, theirs)
DIFFRAX_SUMMARY = (
    (
        "`grad`, defaults",
        "grad",
        "CheckpointedAdjoint()",
        "RecursiveCheckpointAdjoint()",
    ),
    (
        "`grad`, 16 checkpoints each",
        "grad",
        "CheckpointedAdjoint(16)",
        "RecursiveCheckpointAdjoint(16)",
    ),
    (
        "`grad`, ours storing every step",
        "grad",
        "CheckpointedAdjoint(store all)",
        "RecursiveCheckpointAdjoint()",
    ),
    ("`jvp`", "jvp", "CheckpointedAdjoint()", "ForwardMode()"),
    ("`jacfwd`", "jacfwd", "CheckpointedAdjoint()", "ForwardMode()"),
)


def diffrax_summary_table() -> str:
    """Every workload of the diffrax benchmark in one table of ratios, a column
    per workload (the why page)."""
    runs = {w: _diffrax(w) for w in DIFFRAX_WORKLOADS}

    def ratio(rows, mode, ours, theirs):
        if (mode, ours) not in rows or (mode, theirs) not in rows:
            return "-"
        return f"{rows[(mode, ours)]['ms'] / rows[(mode, theirs)]['ms']:.2f}"

    out = [["steps taken", *(run[1] for run in runs.values())]]
    for label, mode, ours, theirs in DIFFRAX_SUMMARY:
        out.append(
            [label, *(ratio(run[0], mode, ours, theirs) for run in runs.values())]
        )
    return _text(
        _table(
            ["workload", *runs],
            out,
            ["---"] + ["---:"] * len(runs),
        )
    )


def _suite_outcome(cell: dict) -> str:
    """A test's outcome, or where its file's process crashed, its outcome alone."""
    return cell.get("alone", cell["outcome"])


def _suite_said(cell: dict) -> str:
    if "alone" in cell:
        return f"{cell['outcome']} in its file's process but {cell['alone']} alone"
    return cell["outcome"]


def client_suite_table(name: str, theirs: str, listed: int = 12) -> str:
    """A client's own test files with each adjoint (`tests/client_suites/run.py`):
    how many of each file's tests passed (alone, where a file's process crashed),
    and every test that did not pass with both, grouped by test function where more
    than `listed` did not.

    **Arguments:**

    - `name`: the results file, `benchmarks/results/<name>.json`.
    - `theirs`: what the client's own adjoint is called in the table.
    """
    rows = _json(f"{name}.json")
    files = list(dict.fromkeys(r["test"].split("::")[0] for r in rows))
    out = []
    for f in files:
        mine = [r for r in rows if r["test"].split("::")[0] == f]
        out.append(
            [
                f"`{f.rsplit('/', 1)[-1]}`",
                len(mine),
                *(
                    sum(_suite_outcome(r[who]) == "passed" for r in mine)
                    for who in ("default", "ours")
                ),
            ]
        )
    lines = _table(
        ["file", "tests", f"passed, {theirs}", "passed, `CheckpointedAdjoint`"],
        out,
        ["---", "---:", "---:", "---:"],
    )
    both_skipped = [
        r
        for r in rows
        if _suite_outcome(r["default"]) == _suite_outcome(r["ours"]) == "skipped"
    ]
    different = [
        r
        for r in rows
        if r not in both_skipped
        and (r["default"]["outcome"] != "passed" or r["ours"]["outcome"] != "passed")
    ]

    def outcomes(r):
        said = (
            f"{_suite_said(r['default'])} with {theirs}, "
            f"{_suite_said(r['ours'])} with ours"
        )
        if "recheck" in r:
            said += f", {r['recheck']['outcome']} unrolled on `lax.while_loop`"
        return said

    if different:
        lines += ["", "Not passed with both:", ""]
        if len(different) <= listed:
            lines += [
                f"- `{r['test'].split('::')[1]}`: {outcomes(r)}" for r in different
            ]
        else:
            groups = {}
            for r in different:
                function = r["test"].split("::")[1].split("[")[0]
                key = (function, outcomes(r))
                groups[key] = groups.get(key, 0) + 1
            lines += [
                f"- `{function}`, {count} case{'s' * (count > 1)}: {said}"
                for (function, said), count in groups.items()
            ]
    if both_skipped:
        names = ", ".join(f"`{r['test'].split('::')[1]}`" for r in both_skipped)
        lines += ["", f"Skipped with both: {names}."]
    return _text(lines)


# --- optimistix: benchmarks/optimistix_adjoint.py -------------------------------


def optimistix_adjoint_table() -> str:
    """Gradient, forward mode and compile of optimistix solves with each adjoint
    (the optimistix guide): two tables."""
    data = _json("optimistix_adjoint.json")
    problems = {k: v for k, v in data.items() if isinstance(v, dict) and "steps" in v}
    per_call, forward_and_compile = [], []
    for problem, row in problems.items():
        grad, fwd, comp = (
            row[k] for k in ("gradient_seconds", "jacfwd_seconds", "compile_seconds")
        )
        per_call.append(
            [
                problem,
                row["steps"],
                *(milliseconds(grad[k] * 1e3) for k in ("ours", "RCA", "implicit")),
                f"{grad['ours'] / grad['RCA']:.2f}",
            ]
        )
        forward_and_compile.append(
            [
                problem,
                *(milliseconds(fwd[k] * 1e3) for k in ("ours", "implicit")),
                *(f"{comp[k]:.2f} s" for k in ("ours", "RCA", "implicit")),
                f"{comp['ours'] / comp['RCA']:.2f}",
            ]
        )
    lines = ["Gradient, per call:", ""]
    lines += _table(
        ["problem (unknowns)", "steps", "ours", "RCA", "implicit", "ours / RCA"],
        per_call,
        ["---", "---:", "---:", "---:", "---:", "---:"],
    )
    lines += [
        "",
        "`jax.jacfwd` per call (RCA has none), and the gradient's compile:",
        "",
    ]
    lines += _table(
        [
            "problem (unknowns)",
            "`jacfwd`, ours",
            "`jacfwd`, implicit",
            "compile, ours",
            "RCA",
            "implicit",
            "ours / RCA",
        ],
        forward_and_compile,
        ["---"] + ["---:"] * 6,
    )
    return _text(lines)


# --- scaling out: benchmarks/distributed.py ------------------------------------


def distributed_table() -> str:
    """Under `jax.distributed`: time per call of `jit(vmap)` and `shard_map(vmap)`,
    forward and gradient, and the all-reduce ops in each compiled loop condition
    (the scaling-out guide)."""
    data = _json("distributed.json")
    by = {(r["variant"], r["kind"]): r for r in data["rows"]}
    out = []
    for kind in ("forward", "gradient"):
        batched, per_device = (by[(v, kind)] for v in ("jit(vmap)", "shard_map(vmap)"))
        out.append(
            [
                kind,
                milliseconds(batched["seconds"] * 1e3),
                milliseconds(per_device["seconds"] * 1e3),
                f"{batched['seconds'] / per_device['seconds']:.3g}",
                f"{batched['all_reduce_in_loop_conditions']} / "
                f"{per_device['all_reduce_in_loop_conditions']}",
            ]
        )
    header = [
        "per call",
        "`jit(vmap)`",
        "`shard_map(vmap)`",
        "ratio",
        "all-reduces in loop conditions",
    ]
    return _text(_table(header, out, ["---"] + ["---:"] * 4))


# --- small solves on CPU: benchmarks/small_solves.py ----------------------------


def small_solves_table() -> str:
    """The gradient of a 100-step Tsit5 solve on 1 to 64 elements, ours against
    `RecursiveCheckpointAdjoint()`, with XLA's CPU limit for compiling a while loop
    into one kernel at its default and raised (the performance page)."""
    runs = [_json("small_solves.json"), _json("small_solves_hoisted.json")]
    out = []
    for size in runs[0]["fixed_cost"]:
        row = [size]
        for run in runs:
            cell = run["fixed_cost"][size]
            row += [
                milliseconds(cell["RCA"] * 1e3),
                milliseconds(cell["ours"] * 1e3),
                f"{cell['ratio']:.2f}",
            ]
        out.append(row)
    header = [
        "state",
        "RCA, default limit",
        "ours",
        "ratio",
        "RCA, 65536 bytes",
        "ours",
        "ratio",
    ]
    return _text(_table(header, out, ["---:"] * 7))


# --- correct on TPU: correct_on_tpu.py, the fuzzer's findings --------------------

TRANSFORM_NAMES = ("jit", "jvp", "jacfwd", "jacrev", "grad", "vmap(jvp)", "hessian")


def _error_cell(v) -> str:
    """An error, or the exception a loop raised for that transform."""
    if isinstance(v, str):
        return f"raises {v}"
    return "0" if v == 0 else f"{v:.0e}"


def correct_on_tpu_errors(payload: dict) -> list[str]:
    rows = [
        [f"`{loop}`", *(_error_cell(row[k]) for k in TRANSFORM_NAMES)]
        for loop, row in payload["errors"].items()
    ]
    align = ["---"] + ["--:"] * len(TRANSFORM_NAMES)
    return _table(["loop", *TRANSFORM_NAMES], rows, align)


def correct_on_tpu_cost(payload: dict) -> list[str]:
    rows = []
    for workload, r in payload["cost"].items():
        shape = r["shape"]
        what = (
            f"{workload}: batch {shape['batch']}, width {shape['width']}, "
            f"{shape['steps']} of {shape['max_steps']} steps"
        )
        for kind in ("forward", "gradient"):
            on, off = f"{kind}, guard on", f"{kind}, guard off"
            time, compile_s = r["time_s"], r["compile_s"]
            rows.append(
                [
                    what,
                    kind,
                    f"{time[on] / time[off]:.3f} ({milliseconds(time[on] * 1e3)})",
                    f"{compile_s[on] / compile_s[off]:.2f} ({compile_s[on]:.2f} s)",
                    f"{nbytes(r['temp_bytes'][on])} / {nbytes(r['temp_bytes'][off])}",
                ]
            )
    header = [
        "workload",
        "program",
        "time, on/off",
        "XLA compile, on/off",
        "temp, on / off",
    ]
    return _table(header, rows, ["---", "---", "--:", "--:", "--:"])


def correct_on_tpu_table(backend: str) -> str:
    payload = _json(f"correct_on_tpu_{backend}.json")
    device = payload["devices"][0].split("(")[0]
    lines = [
        f"Run on {device} (JAX {payload['jax']}): the largest absolute error against "
        "the same transform of the loop unrolled in Python on the host CPU.",
        "",
        *correct_on_tpu_errors(payload),
        "",
        "What the guard costs: ours with it on over ours with it off, in one process "
        "(time: interleaved medians after warm-up; compile: medians of alternating "
        "repetitions):",
        "",
        *correct_on_tpu_cost(payload),
    ]
    return _text(lines)


def fuzz_findings(path: str = "fuzz_tpu.jsonl") -> dict:
    """The fuzzer's findings: bodies run, the largest error of ours, and for each
    way of guarding a read of an earlier step's row, how many single-read bodies of
    two or more steps `lax.fori_loop` got right and wrong."""
    found = [json.loads(line) for line in (RESULTS / path).read_text().splitlines()]
    forms = {}
    # bodies of two or more steps, by (a read of the previous row guarded by `i > 0`,
    # `lax` wrong)
    by_guard = {(a, b): 0 for a in (True, False) for b in (True, False)}
    for f in found:
        p = f["program"]
        trip = p["steps"] if p["max_steps"] is None else min(p["steps"], p["max_steps"])
        if trip < 2:
            continue
        if len(p["reads"]) == 1:
            lag, test, _ = p["reads"][0]
            forms.setdefault((lag, test), [0, 0])[f["lax"] > 1e-3] += 1
        after_zero = any(
            lag == 1 and test in (">", "cond") for lag, test, _ in p["reads"]
        )
        by_guard[after_zero, f["lax"] > 1e-3] += 1
    return {
        "by_guard": by_guard,
        "bodies": len(found),
        "backend": found[0]["backend"],
        "ours_max": max(f["ours"] for f in found),
        "lax_wrong": sum(f["lax"] > 1e-3 for f in found),
        "forms": forms,
    }


GUARDS_WRITTEN = {
    ">": "i > {k}",
    ">=": "i >= {n}",
    "!<": "~(i < {n})",
    "-0": "i - {n} >= 0",
    "cond": "lax.cond(i > {k}, ...)",
}


def tpu_fuzz_table() -> str:
    f, cpu = fuzz_findings(), fuzz_findings("fuzz_cpu.jsonl")
    rows = [
        [
            f"`{GUARDS_WRITTEN[test].format(k=lag - 1, n=lag)}` before `buf[i - {lag}]`",
            right,
            wrong,
        ]
        for (lag, test), (right, wrong) in sorted(f["forms"].items())
    ]
    lines = [
        f"{f['bodies']} random bodies on the {f['backend'].upper()}. Ours: largest "
        f"error {f['ours_max']:.1e} against complex-step NumPy, none wrong. "
        f"`lax.fori_loop`: {f['lax_wrong']} wrong (error above 1e-3). The bodies with "
        "one read and two or more steps, by how the read is guarded:",
        "",
        *_table(["guard", "lax right", "lax wrong"], rows, ["---", "--:", "--:"]),
        "",
        "All bodies of two or more steps (one or two reads), by whether one of their "
        "reads of the previous row is guarded by `i > 0` (`where` or `lax.cond`):",
        "",
        *_table(
            ["a read guarded by `i > 0`", "lax right", "lax wrong"],
            [
                [label, f["by_guard"][flag, False], f["by_guard"][flag, True]]
                for flag, label in ((True, "yes"), (False, "no"))
            ],
            ["---", "--:", "--:"],
        ),
        "",
        f"The same fuzzer on the {cpu['backend'].upper()}, {cpu['bodies']} bodies: "
        f"ours, largest error {cpu['ours_max']:.1e}; `lax.fori_loop`, "
        f"{cpu['lax_wrong']} wrong.",
    ]
    return _text(lines)


# --- all of them ----------------------------------------------------------------

# docs/generated/<name>.md for each name
# --- the accelerator's headline: a tape that does not fit (headline.py) --------

HEADLINE_KINDS = {
    "scan": "`lax.scan`, every step stored",
    "scan_offload": "`lax.scan`, steps offloaded to host memory",
    "equinox": "equinox checkpointed",
    "boundedloop": "`bl.while_loop`",
}


def _headline(platform: str, part: str = ""):
    run = _json(f"headline{part}_{platform}.json")
    return run, f"one {run['device_kind']} chip"


def _headline_cell(row) -> str:
    """Time per gradient and compiled temporary memory, or why there is none."""
    if "error" in row:
        needed = re.search(
            r"\((\d+\.?\d*)G\) exceeds available HBM \((\d+\.?\d*)G\)", row["error"]
        )
        if needed:
            return f"does not fit: needs {needed[1]} GB of {needed[2]} GB"
        return "failed: " + row["error"].split(":")[0]
    cell = f"{milliseconds(row['grad_s'] * 1e3)}, {nbytes(row['temp_bytes'])}"
    if row.get("host_temp_bytes"):
        cell += f" + {nbytes(row['host_temp_bytes'])} on host"
    return cell


def headline_table(platform: str = "tpu") -> str:
    """The gradient whose store-every-step tape does not fit in the accelerator's
    memory, four ways: time and memory at two trip counts (README, performance
    page)."""
    run, device = _headline(platform)
    rows = [r for r in run["gradient"]]
    cases = sorted({(r["n"], r["max_steps"]) for r in rows})
    out = []
    for kind, label in HEADLINE_KINDS.items():
        for checkpoints in sorted(
            {r["checkpoints"] for r in rows if r["kind"] == kind}
        ):
            cells = {
                (r["n"], r["max_steps"]): r
                for r in rows
                if r["kind"] == kind and r["checkpoints"] == checkpoints
            }
            name = (
                label
                if kind.startswith("scan")
                else f"{label}, {checkpoints} checkpoints"
            )
            out.append(
                [
                    name,
                    *(_headline_cell(cells[c]) if c in cells else "-" for c in cases),
                ]
            )
    by = {(r["kind"], r["n"], r["checkpoints"]): r for r in rows if "error" not in r}
    n_small, n_large = cases[0][0], cases[-1][0]
    ours, eqx, off = (
        by[(k, n_large, 16)] for k in ("boundedloop", "equinox", "scan_offload")
    )
    return _text(
        [
            f"On {device} (JAX {run['jax']}): the gradient with respect to `W` of "
            f"`x <- tanh(x @ W)` on a float32 state of {run['batch']} x {run['width']}, "
            "stopping when a counter reaches a traced `n`. Time per gradient (median "
            f"of {run['rounds']} interleaved rounds after warm-up) and the compiled "
            "program's temporary memory (`benchmarks/headline.py`, "
            f"`benchmarks/results/headline_{platform}.json`); `lax.scan` runs exactly "
            "`n` steps, known when it is traced:",
            "",
            *_table(
                ["gradient", *(f"`n={n}`, `max_steps={m}`" for n, m in cases)],
                out,
                ["---", *("---:" for _ in cases)],
            ),
            "",
            f"At `n={n_large}` ours takes {ours['grad_s'] / eqx['grad_s']:.2f} times "
            f"equinox's time in {eqx['temp_bytes'] / ours['temp_bytes']:.1f} times less "
            f"memory, and {ours['grad_s'] / off['grad_s']:.2f} times the offloading "
            f"scan's time with no host memory; at `n={n_small}`, "
            f"{by[('boundedloop', n_small, 16)]['grad_s'] / by[('equinox', n_small, 16)]['grad_s']:.2f} "
            "times equinox's.",
        ]
    )


COMPILE_KINDS = {
    "boundedloop": "`bl.while_loop`",
    "equinox": "equinox checkpointed",
    "lax": "`lax.while_loop`",
    "scan": "`lax.scan`",
}


def compile_table(platform: str = "tpu") -> str:
    """Trace, lower and XLA compile of the headline's programs, gradient and forward
    only, with the while loops in the compiled program (performance page), from
    `headline.py --only compile`."""
    run, device = _headline(platform, "_compile")
    rows = {(r["mode"], r["kind"]): r for r in run["compile"]}
    base = {"grad": "equinox", "forward": "lax"}
    out = []
    for mode in ("grad", "forward"):
        for kind, label in COMPILE_KINDS.items():
            r = rows.get((mode, kind))
            if r is None:
                continue
            ratio = r["xla_s"] / rows[(mode, base[mode])]["xla_s"]
            each = [repetition["xla_s"] for repetition in r["repetitions"]]
            name = label + (f" ({r['scan_length']} steps)" if r["scan_length"] else "")
            out.append(
                [
                    "gradient" if mode == "grad" else "forward",
                    name,
                    f"{r['xla_s']:.2f} s",
                    f"{min(each):.2f} to {max(each):.2f} s",
                    f"{ratio:.2f}",
                    f"{r['trace_s'] + r['lower_s']:.2f} s",
                    r["whiles"],
                    r["hlo_lines"],
                ]
            )
    any_row = run["compile"][0]
    return _text(
        [
            f"On {device}: the headline's program at `n={any_row['n']}`, "
            f"`max_steps={any_row['max_steps']}`, {any_row['checkpoints']} checkpoints; "
            f"medians of {run['repeats']} alternating repetitions after a warm-up "
            "compile of each. Ratio: XLA compile time over equinox's for the "
            "gradient, over `lax.while_loop`'s for the forward pass.",
            "",
            *_table(
                [
                    "program",
                    "loop",
                    "XLA compile",
                    "each repetition",
                    "ratio",
                    "trace + lower",
                    "while loops",
                    "HLO lines",
                ],
                out,
                ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"],
            ),
        ]
    )


GENERATORS = {
    "repetitions": repetitions_table,
    "while_loop": while_loop_table,
    "why_while_loop": why_while_loop_table,
    "recomputation": recomputation_table,
    "why_recomputation": why_recomputation_table,
    "buffers": buffers_table,
    "why_buffers": why_buffers_table,
    "cheap_steps": cheap_steps_table,
    "forward_mode": forward_mode_table,
    "diffrax_neural": lambda: diffrax_table("neural"),
    "diffrax_long": lambda: diffrax_table("long"),
    "diffrax_wide": lambda: diffrax_table("wide"),
    "diffrax_summary": diffrax_summary_table,
    "diffrax_suite": lambda: client_suite_table("diffrax_suite", "diffrax's adjoint"),
    "optimistix_suite": lambda: client_suite_table(
        "optimistix_suite", "optimistix's adjoints"
    ),
    "optimistix_adjoint": optimistix_adjoint_table,
    "distributed": distributed_table,
    "small_solves": small_solves_table,
    "correct_on_tpu": lambda: correct_on_tpu_table("tpu"),
    "correct_on_cpu": lambda: correct_on_tpu_table("cpu"),
    "tpu_fuzz": tpu_fuzz_table,
    "headline_tpu": headline_table,
    "compile_tpu": compile_table,
    "diffrax_neural_tpu": lambda: diffrax_table("neural_tpu"),
}


def write_tables(directory: pathlib.Path = GENERATED) -> list[pathlib.Path]:
    """Write every generated page into `directory`; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, generate in GENERATORS.items():
        path = directory / f"{name}.md"
        path.write_text(generate())
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_tables():
        print(f"wrote {path.relative_to(ROOT)}")
