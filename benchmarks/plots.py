"""Draw the documentation's pictures and tables from the benchmark results.

    python benchmarks/plots.py [--no-schedule]

Reads `benchmarks/results/*.txt` and `*.json` (written by `while_loop.py`,
`recomputation.py`, `buffers.py` and `diffrax_adjoint.py`), writes PNGs into `docs/images/` and the
markdown tables the performance page includes into `docs/generated/`.
"""

import json
import pathlib
import sys

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tables import write_tables  # noqa: E402


RESULTS = pathlib.Path("benchmarks/results")
IMAGES = pathlib.Path("docs/images")
GENERATED = pathlib.Path("docs/generated")

# one fixed style per loop, the same in every figure: ours solid, others dashed
STYLE = {
    "boundedloop": dict(color="tab:blue", marker="o", ls="-", ms=8, lw=2.2),
    "boundedloop (default checkpoints)": dict(
        color="tab:cyan", marker="D", ls="-", ms=5, lw=1.5
    ),
    "equinox checkpointed": dict(color="tab:orange", marker="s", ls="--", ms=6),
    "equinox bounded": dict(color="tab:red", marker="v", ls="--", ms=6),
    "nested scan+cond": dict(color="tab:purple", marker="^", ls="--", ms=6),
    "fori_loop+cond": dict(color="tab:brown", marker="P", ls="--", ms=6),
}
plt.rcParams.update({"font.size": 11, "axes.grid": True, "grid.alpha": 0.3})


def nbytes(n) -> str:
    """Bytes, readably (kB, MB, GB: powers of 1000)."""
    if n is None:
        return "-"
    for unit, size in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)]:
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def buffers_table():
    """Copy the buffers benchmark's printed summary (its markdown table)."""
    text = (RESULTS / "buffers.txt").read_text().splitlines()
    keep = [line for line in text if not line.startswith(("{", "compiled"))]
    start = next(i for i, line in enumerate(keep) if line.strip())
    (GENERATED / "buffers.md").write_text("\n".join(keep[start:]).strip() + "\n")


def while_loop_tables():
    """The gradient-time benchmark as two narrow tables: time ratios, then memory
    and body evaluations for each `max_steps`."""
    data = json.loads((RESULTS / "while_loop.json").read_text())
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
    (GENERATED / "while_loop.md").write_text("\n".join(lines) + "\n")


def recomputation_table():
    """The counts with their ratio to the optimum in one cell, so that the table
    fits the page (`recomputation.markdown_table`, for the text file, has a column
    per ratio)."""
    rows = json.loads((RESULTS / "recomputation.json").read_text())

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
    (GENERATED / "recomputation.md").write_text("\n".join(lines) + "\n")


def gradient_time():
    """Gradient time over the ideal against `max_steps`: every loop on a log scale,
    then the checkpointed loops (which overlap there) on a linear one."""
    data = json.loads((RESULTS / "while_loop.json").read_text())
    ideal = data["ideal"]["grad_x_s"]
    kinds = list(dict.fromkeys(r["kind"] for r in data["rows"]))
    sizes = sorted({r["max_steps"] for r in data["rows"]})
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7.5, 8.5), height_ratios=[3, 2], sharex=True
    )
    zoom = [k for k in kinds if k.startswith(("boundedloop", "equinox checkpointed"))]
    for ax, shown in [(top, kinds), (bottom, zoom)]:
        for kind in shown:
            rows = [r for r in data["rows"] if r["kind"] == kind]
            done = [r for r in rows if r["grad_x_s"] is not None]
            oom = [r["max_steps"] for r in rows if r["grad_x_s"] is None]
            label = kind + (f" (out of memory from {oom[0]})" if oom else "")
            ax.plot(
                [r["max_steps"] for r in done],
                [r["grad_x_s"] / ideal for r in done],
                label=label if ax is top else None,
                **STYLE[kind],
            )
        ax.axhline(
            1.0,
            color="k",
            ls=":",
            lw=1.5,
            label="ideal: lax.scan over the 8 steps" if ax is top else None,
        )
    top.set(
        yscale="log",
        ylabel="gradient time / ideal",
        title="Adaptive MLP, 8 steps taken: gradient time against max_steps",
    )
    bottom.set(
        xscale="log",
        ylim=(0.9, 1.5),
        xlabel="max_steps (the loop always takes 8 steps)",
        ylabel="gradient time / ideal",
        title="The checkpointed loops, zoomed (linear scale)",
    )
    bottom.set_xticks(sizes, [str(m) for m in sizes])
    bottom.minorticks_off()
    fig.legend(loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(IMAGES / "gradient_time.png", dpi=110)
    plt.close(fig)


def recomputation():
    """Body evaluations over the optimum against the trip count, one line per loop
    and number of checkpoints: both loops on a log scale, then ours zoomed."""
    rows = json.loads((RESULTS / "recomputation.json").read_text())
    cs = sorted({r["c"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    colours = dict(zip(cs, ["tab:red", "tab:orange", "tab:green", "tab:blue"]))
    markers = dict(zip(cs, ["o", "s", "^", "D"]))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7.5, 9), height_ratios=[3, 2], sharex=True
    )
    for c in cs:
        mine = sorted((r for r in rows if r["c"] == c), key=lambda r: r["n"])
        style = dict(color=colours[c], marker=markers[c], ms=7)
        for ax in (top, bottom):
            ax.plot(
                [r["n"] for r in mine],
                [r["ours_over_optimum"] for r in mine],
                ls="-",
                lw=2,
                label=f"bl.while_loop, c = {c}" if ax is top else None,
                **style,
            )
        eq = [r for r in mine if r["equinox"] is not None]
        missing = [r["n"] for r in mine if r["equinox"] is None]
        top.plot(
            [r["n"] for r in eq],
            [r["equinox_over_optimum"] for r in eq],
            ls="--",
            lw=1.5,
            mfc="white",
            label=f"equinox checkpointed, c = {c}"
            + (f" (n = {missing[0]} not run)" if missing else ""),
            **style,
        )
    for ax in (top, bottom):
        ax.axhline(
            1.0,
            color="k",
            ls=":",
            lw=1.5,
            label="optimum (bl.scan attains it)" if ax is top else None,
        )
    top.set(
        yscale="log",
        ylabel="body evaluations / optimum",
        title="Body evaluations in one gradient, over the optimum",
    )
    top.set_yticks([1, 2, 5, 10], ["1", "2", "5", "10"])
    top.minorticks_off()
    bottom.set(
        xscale="log",
        ylim=(0.995, 1.03),
        xlabel="steps taken n",
        ylabel="body evaluations / optimum",
        title="bl.while_loop, zoomed (bl.scan is exactly 1 everywhere)",
    )
    bottom.set_xticks(ns, [str(n) for n in ns])
    bottom.minorticks_off()
    fig.legend(loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(IMAGES / "recomputation.png", dpi=110)
    plt.close(fig)


def schedule(n=40, slots=4):
    # the schedule itself is private; imported here so that the other figures do
    # not depend on it
    from boundedloop._schedule import forward_placement, reverse_events

    events = [("forward", i) for i in range(n)] + reverse_events(
        forward_placement(n, slots), n, slots
    )
    colours = {"forward": "k", "advance": "tab:blue", "reverse": "tab:red"}
    fig, ax = plt.subplots(figsize=(6, 7))
    ax.grid(False)  # the grey lines are the checkpoints
    for t, (kind, i) in enumerate(events):
        ax.plot(i, t, "o", ms=2.5, color=colours[kind])
    for p in forward_placement(n, slots):
        ax.axvline(p, color="0.8", lw=0.8, zorder=0)
    ax.invert_yaxis()
    ax.set(
        xlabel="step index",
        ylabel="body evaluation (time)",
        title=f"One gradient: n = {n} steps, {slots} slots\n"
        "black forward, blue recomputed, red reversed,\ngrey lines: forward checkpoints",
    )
    fig.tight_layout()
    fig.savefig(IMAGES / "schedule.png", dpi=120)


def diffrax_adjoints():
    """Time per call relative to diffrax's adjoint for the mode, the workloads of
    `diffrax_adjoint.py`."""
    runs = {}
    for workload in ("neural", "long", "wide"):
        path = RESULTS / f"diffrax_adjoint_{workload}.json"
        if path.exists():
            runs[workload] = json.loads(path.read_text())
    if not runs:
        return
    base = {
        "grad": "RecursiveCheckpointAdjoint()",
        "jvp": "ForwardMode()",
        "jacfwd": "ForwardMode()",
    }
    fig, axes = plt.subplots(
        1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False
    )
    for ax, (workload, run) in zip(axes[0], runs.items()):
        rows = run["rows"]
        ms = {(r["mode"], r["adjoint"]): r["ms"] for r in rows}
        labels, ratios, colours = [], [], []
        for r in rows:
            ratio = r["ms"] / ms[(r["mode"], base[r["mode"]])]
            labels.append(f"{r['mode']}: {r['adjoint']}")
            ratios.append(ratio)
            ours = r["adjoint"].startswith("CheckpointedAdjoint")
            colours.append("tab:blue" if ours else "tab:orange")
        y = range(len(labels))
        ax.barh(y, ratios, color=colours)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(list(y), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set(
            xlabel="time / diffrax's adjoint for the mode",
            title=f"{workload}: {run['steps']} steps",
        )
    fig.tight_layout()
    fig.savefig(IMAGES / "diffrax_adjoints.png", dpi=110)


if __name__ == "__main__":
    IMAGES.mkdir(parents=True, exist_ok=True)
    GENERATED.mkdir(parents=True, exist_ok=True)
    write_tables(GENERATED)
    buffers_table()
    while_loop_tables()
    recomputation_table()
    gradient_time()
    recomputation()
    diffrax_adjoints()
    if "--no-schedule" not in sys.argv:
        schedule()
