"""Where the chip's run time of the headline gradient goes, op by op (issue 53).

    python benchmarks/probes/tpu_op_profile.py [--rounds 3] [--top 25]
        [--batch 512 --width 4096] plain nested ...

Each structure's gradient at B=`--batch`, D=`--width` (`cheap_structure.headline`
with the structure `cheap_structure.FORCED` names, or `scan`: `lax.scan` over the
256 steps) is compiled, run twice to warm, then run `--rounds` times under
`jax.profiler.trace`. The device's "XLA Ops" events are summed per op and divided
by the rounds: the time per gradient, the events per gradient (a loop body's op
runs once an iteration), and the op's line of the optimized program, which says
its operands' memory space (`S(1)`: on chip). Printed: each structure's device
time by class of op, then its `--top` ops. On a CPU the events are those of XLA's
threads, where an executor's event spans the ops it runs.
"""

import argparse
import collections
import functools
import glob
import os
import re
import sys
import tempfile

import jax
from jax.profiler import ProfileData


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cheap_structure  # noqa: E402
import headline  # noqa: E402


CLASSES = [  # (class, pattern of the op's name), first match wins
    ("matrix products", r"convolution|dot"),
    ("copies", r"copy"),
    ("slices", r"slice"),
    ("control", r"^(while|cond|conditional|call|tuple|get-tuple-element)"),
    ("other fusions", r"fusion"),
    ("other", r""),
]


def op_lines(text: str) -> dict:
    """Each instruction's name -> its line in the optimized program `text`."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            out.setdefault(m.group(1), line.strip())
    return out


def device_ops(path: str):
    """`(name, duration in ns)` of each event on a device's "XLA Ops" line (on a
    CPU, of the events on XLA's threads)."""
    data = ProfileData.from_file(path)
    for plane in data.planes:
        for line in plane.lines:
            if (plane.name.startswith("/device:") and line.name == "XLA Ops") or (
                plane.name == "/host:CPU" and line.name.startswith("tf_XLA")
            ):
                for event in line.events:
                    yield event.name, event.duration_ns


def profile(kind: str, rounds: int, batch: int, width: int):
    args = (*headline.workload(batch, width), 256)
    if kind == "scan":
        grad = jax.jit(jax.grad(headline.loss_fn("scan", 256, 1024, 16)))
        compiled = grad.lower(*args).compile()
    else:
        make = functools.partial(cheap_structure.headline, batch=batch, width=width)
        compiled = cheap_structure.lower(make, kind)[0].compile()
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(rounds):
            jax.block_until_ready(compiled(*args))
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    total, count = collections.Counter(), collections.Counter()
    for name, ns in device_ops(path):
        # (a chip's event is named by the op's whole line: keep its name)
        name = re.match(r"%?([\w.\-]+)", name).group(1)
        total[name] += ns / rounds
        count[name] += 1 / rounds
    return total, count, op_lines(compiled.as_text())


def report(kind, total, count, lines, top):
    by_class = collections.Counter()
    for name, ns in total.items():
        op = re.sub(r"\.\d+$", "", name)
        cls = next(c for c, p in CLASSES if re.search(p, op))
        by_class[cls] += ns
    whole = sum(v for c, v in by_class.items() if c != "control")
    print(f"\n## {kind}: {whole / 1e6:.1f} ms of ops per gradient, loops and")
    print("conditionals excluded (their events span the ops inside them)")
    for cls, ns in by_class.most_common():
        print(f"  {cls:16s} {ns / 1e6:8.2f} ms")
    print(f"  top {top} ops: ms per gradient, events per gradient, HLO line")
    for name, ns in total.most_common(top):
        line = lines.get(name, "?")
        print(f"  {ns / 1e6:8.2f} {count[name]:7.0f}  {name}: {line[:400]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kinds", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--batch", type=int, default=512, help="the headline's B")
    parser.add_argument("--width", type=int, default=4096, help="the headline's D")
    args = parser.parse_args()
    for kind in args.kinds:
        report(kind, *profile(kind, args.rounds, args.batch, args.width), args.top)


if __name__ == "__main__":
    main()
