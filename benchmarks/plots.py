"""Write the documentation's tables (`internal/tables.py`) and draw its pictures
into `docs/images/` from the results of `while_loop.py`, `recomputation.py` and
`diffrax_adjoint.py`, and the schedule's reference; times nothing.

    python benchmarks/plots.py
"""

import pathlib
import sys

import matplotlib


sys.path.append(str(pathlib.Path(__file__).parent / "internal"))  # `tables`
matplotlib.use("Agg")
import matplotlib.patches as mpatches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from _format import load, RESULTS  # noqa: E402
from diffrax_adjoint import adjoint_name, load_run, ratios  # noqa: E402
from tables import write_tables  # noqa: E402


IMAGES = pathlib.Path("docs/images")

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


def zoom_limits(values, lo, hi, margin=0.005):
    """`(lo, hi)`, widened where needed so that a zoomed axis shows every value."""
    return min(lo, min(values) - margin), max(hi, max(values) + margin)


def two_panels(height):
    """A figure of a tall panel over a short one, sharing the x axis."""
    return plt.subplots(2, 1, figsize=(7.5, height), height_ratios=[3, 2], sharex=True)


def ones(axes, label):
    """The line at 1 on both `axes`, named `label` in the legend."""
    for ax in axes:
        ax.axhline(
            1.0, color="k", ls=":", lw=1.5, label=label if ax is axes[0] else None
        )


def finish(fig, bottom_axes, xs, name, bottom):
    """Tick `xs`, add the legend below `bottom`, save as `docs/images/<name>`."""
    bottom_axes.set_xticks(xs, [str(x) for x in xs])
    bottom_axes.minorticks_off()
    fig.legend(loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(IMAGES / name, dpi=110)
    plt.close(fig)


def gradient_time():
    """Gradient time over the ideal against `max_steps`: every loop on a log scale,
    then the checkpointed loops (which overlap there) on a linear one."""
    data = load("while_loop.json")
    ideal = data["ideal"]["grad_x_s"]
    kinds = list(dict.fromkeys(r["kind"] for r in data["rows"]))
    sizes = sorted({r["max_steps"] for r in data["rows"]})
    fig, (top, bottom) = two_panels(8.5)
    zoom = [k for k in kinds if k.startswith(("boundedloop", "equinox checkpointed"))]
    zoomed = [
        r["grad_x_s"] / ideal
        for r in data["rows"]
        if r["kind"] in zoom and r["grad_x_s"] is not None
    ]
    for ax, shown in [(top, kinds), (bottom, zoom)]:
        for kind in shown:
            rows = [r for r in data["rows"] if r["kind"] == kind]
            done = [r for r in rows if r["grad_x_s"] is not None]
            oom = [r["max_steps"] for r in rows if r["grad_x_s"] is None]
            label = kind + (f" (out of memory from {oom[0]})" if oom else "")
            xs = [r["max_steps"] for r in done]
            ys = [r["grad_x_s"] / ideal for r in done]
            ax.plot(xs, ys, label=label if ax is top else None, **STYLE[kind])
    ones((top, bottom), "ideal: lax.scan over the 8 steps")
    top.set(
        yscale="log",
        ylabel="gradient time / ideal",
        title="Adaptive MLP, 8 steps taken: gradient time against max_steps",
    )
    bottom.set(
        xscale="log",
        ylim=zoom_limits(zoomed, 0.9, 1.5, margin=0.02),
        xlabel="max_steps (the loop always takes 8 steps)",
        ylabel="gradient time / ideal",
        title="The checkpointed loops, zoomed (linear scale)",
    )
    finish(fig, bottom, sizes, "gradient_time.png", 0.1)


def recomputation():
    """Body evaluations over the optimum against the trip count, one line per loop
    and number of checkpoints: both loops on a log scale, then ours zoomed."""
    rows = load("recomputation.json")
    cs = sorted({r["c"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    colours = dict(zip(cs, ["tab:red", "tab:orange", "tab:green", "tab:blue"]))
    markers = dict(zip(cs, ["o", "s", "^", "D"]))
    fig, (top, bottom) = two_panels(9)
    for c in cs:
        mine = sorted((r for r in rows if r["c"] == c), key=lambda r: r["n"])
        style = dict(color=colours[c], marker=markers[c], ms=7)
        xs, ys = [r["n"] for r in mine], [r["ours_over_optimum"] for r in mine]
        for ax in (top, bottom):
            label = f"bl.while_loop, c = {c}" if ax is top else None
            ax.plot(xs, ys, ls="-", lw=2, label=label, **style)
        eq = [r for r in mine if r["equinox"] is not None]
        missing = [r["n"] for r in mine if r["equinox"] is None]
        label = f"equinox checkpointed, c = {c}"
        label += f" (n = {missing[0]} not run)" if missing else ""
        xs, ys = [r["n"] for r in eq], [r["equinox_over_optimum"] for r in eq]
        top.plot(xs, ys, ls="--", lw=1.5, mfc="white", label=label, **style)
    ones((top, bottom), "optimum (bl.scan attains it)")
    top.set(
        yscale="log",
        ylabel="body evaluations / optimum",
        title="Body evaluations in one gradient, over the optimum",
    )
    top.set_yticks([1, 2, 5, 10], ["1", "2", "5", "10"])
    top.minorticks_off()
    bottom.set(
        xscale="log",
        ylim=zoom_limits([r["ours_over_optimum"] for r in rows], 0.995, 1.03),
        xlabel="steps taken n",
        ylabel="body evaluations / optimum",
        title="bl.while_loop, zoomed (bl.scan is exactly 1 everywhere)",
    )
    finish(fig, bottom, ns, "recomputation.png", 0.12)


def schedule(n=40, slots=4):
    # the schedule itself is private; imported here so that the other figures do
    # not depend on it
    from tests.schedule_reference import forward_placement, reverse_events

    placement = forward_placement(n, slots)
    events = [("forward", i) for i in range(n)] + reverse_events(placement, n, slots)
    colours = {"forward": "k", "advance": "tab:blue", "reverse": "tab:red"}
    fig, ax = plt.subplots(figsize=(6, 7))
    ax.grid(False)  # the grey lines are the checkpoints
    for t, (kind, i) in enumerate(events):
        ax.plot(i, t, "o", ms=2.5, color=colours[kind])
    for p in placement:
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
    """Time over diffrax's adjoint for the mode, a panel per workload, the bars as
    in the diffrax guide's tables."""
    runs = ("neural", "long", "wide")
    workloads = [w for w in runs if (RESULTS / f"diffrax_adjoint_{w}.json").exists()]
    if not workloads:
        return
    runs = {w: load_run(w) for w in workloads}
    heights = [len(run["rows"]) for run in runs.values()]
    size = (7.5, 1.2 * len(runs) + 0.33 * sum(heights))
    tall = [h + 2.5 for h in heights]
    fig, axes = plt.subplots(
        len(runs), 1, figsize=size, height_ratios=tall, squeeze=False
    )
    colour = {True: "tab:blue", False: "tab:orange"}
    for ax, (workload, run) in zip(axes[:, 0], runs.items()):
        max_steps, to_base = run["max_steps"], ratios(run["rows"])
        labels, times, colours = [], [], []
        for (mode, adjoint), (time, _) in to_base.items():
            name = adjoint_name(adjoint, max_steps).replace("`", "")
            labels.append(f"{mode}: {name}")
            times.append(time)
            colours.append(colour[adjoint.startswith("CheckpointedAdjoint")])
        y = range(len(labels))
        ax.barh(y, times, color=colours)
        for i, ratio in zip(y, times):
            at = dict(xytext=(3, 0), textcoords="offset points", va="center")
            ax.annotate(f"{ratio:.2f}", (ratio, i), **at, fontsize=9)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(list(y), labels, fontsize=10)
        ax.invert_yaxis()
        ax.set_xlim(0, max(times) * 1.12)
        ax.grid(axis="y", visible=False)
        title = f"{workload}: {run['steps']} steps of max_steps={max_steps}"
        ax.set_title(title, fontsize=11)
    axes[-1, 0].set_xlabel("time / diffrax's adjoint for the mode (lower is faster)")
    handles = [
        mpatches.Patch(color=colour[True], label="boundedloop's adjoint"),
        mpatches.Patch(color=colour[False], label="diffrax's adjoints"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(IMAGES / "diffrax_adjoints.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    IMAGES.mkdir(parents=True, exist_ok=True)
    write_tables()
    gradient_time()
    recomputation()
    diffrax_adjoints()
    schedule()
