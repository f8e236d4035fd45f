"""Draw the documentation's pictures and tables from the benchmark results.

    python benchmarks/plots.py

Reads `benchmarks/results/*.txt` and `*.json` (written by `while_loop.py`,
`recomputation.py` and `buffers.py`), writes PNGs into `docs/images/` and the
markdown tables the performance page includes into `docs/generated/`.
"""

import json
import pathlib

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from recomputation import markdown_table  # noqa: E402

from boundedloop._schedule import forward_placement, reverse_events  # noqa: E402


RESULTS = pathlib.Path("benchmarks/results")
IMAGES = pathlib.Path("docs/images")
GENERATED = pathlib.Path("docs/generated")


def tables():
    """Copy each benchmark's printed summary (its markdown tables) for the docs."""
    for name in ["while_loop", "buffers"]:
        text = (RESULTS / f"{name}.txt").read_text().splitlines()
        keep = [
            line
            for line in text
            if line.startswith("|") or not line.startswith(("{", "compiled"))
        ]
        start = next(i for i, line in enumerate(keep) if line.strip())
        (GENERATED / f"{name}.md").write_text("\n".join(keep[start:]).strip() + "\n")


def recomputation_table():
    rows = json.loads((RESULTS / "recomputation.json").read_text())
    lines = [markdown_table(rows)]
    (GENERATED / "recomputation.md").write_text("\n".join(lines) + "\n")


def gradient_time():
    data = json.loads((RESULTS / "while_loop.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = sorted(
        {r["kind"] for r in data["rows"]}, key=[r["kind"] for r in data["rows"]].index
    )
    for kind in kinds:
        rows = [
            r for r in data["rows"] if r["kind"] == kind and r["grad_x_s"] is not None
        ]
        ax.plot(
            [r["max_steps"] for r in rows],
            [r["grad_x_s"] * 1e3 for r in rows],
            "o-",
            label=kind,
        )
    ax.axhline(
        data["ideal"]["grad_x_s"] * 1e3,
        color="k",
        ls="--",
        label="lax.scan over the 8 steps (ideal)",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="max_steps (the loop always takes 8 steps)",
        ylabel="gradient time (ms)",
        title="Adaptive MLP: gradient time against max_steps",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMAGES / "gradient_time.png", dpi=120)


def recomputation():
    rows = json.loads((RESULTS / "recomputation.json").read_text())
    cs = sorted({r["c"] for r in rows})
    fig, axes = plt.subplots(1, len(cs), figsize=(3.2 * len(cs), 3.4), sharey=True)
    for ax, c in zip(axes, cs):
        mine = sorted((r for r in rows if r["c"] == c), key=lambda r: r["n"])
        ns = [r["n"] for r in mine]
        ax.plot(ns, [r["optimum"] for r in mine], "k--", label="optimum")
        ax.plot(ns, [r["boundedloop"] for r in mine], "o-", label="boundedloop")
        eq = [r for r in mine if r["equinox"] is not None]
        ax.plot(
            [r["n"] for r in eq],
            [r["equinox"] for r in eq],
            "s-",
            label="equinox checkpointed",
        )
        ax.set(xscale="log", yscale="log", xlabel="steps n", title=f"checkpoints = {c}")
    axes[0].set_ylabel("body evaluations per gradient")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMAGES / "recomputation.png", dpi=120)


def schedule(n=40, slots=4):
    events = [("forward", i) for i in range(n)] + reverse_events(
        forward_placement(n, slots), n, slots
    )
    colours = {"forward": "k", "advance": "tab:blue", "reverse": "tab:red"}
    fig, ax = plt.subplots(figsize=(6, 7))
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


if __name__ == "__main__":
    IMAGES.mkdir(parents=True, exist_ok=True)
    GENERATED.mkdir(parents=True, exist_ok=True)
    tables()
    recomputation_table()
    schedule()
    gradient_time()
    recomputation()
