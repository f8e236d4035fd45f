"""Tables the documentation computes from formulas rather than measures.

    python benchmarks/tables.py

Writes `docs/generated/repetitions.md`, included by
`docs/guides/choosing-checkpoints.md`: for `n` steps and `c` checkpoints, the
smallest `r` with `binomial(c + r, r) >= n` (the binomial checkpointing bound: a
gradient then recomputes fewer than `r n` steps). `benchmarks/plots.py` calls this
too, so one command regenerates every generated page.
"""

import math
import pathlib


GENERATED = pathlib.Path(__file__).resolve().parent.parent / "docs" / "generated"

STEPS = (10, 100, 1000, 10000, 100000)
CHECKPOINTS = (2, 4, 8, 16, 32)


def repetitions(n: int, c: int) -> int:
    """The smallest integer `r >= 0` with `binomial(c + r, r) >= n`."""
    r = 0
    while math.comb(c + r, r) < n:
        r += 1
    return r


def repetitions_table(steps=STEPS, checkpoints=CHECKPOINTS) -> str:
    """Markdown: one row per number of steps `n`, one column per `c`."""
    lines = [
        "| steps `n` | " + " | ".join(f"r for c = {c}" for c in checkpoints) + " |",
        "|---:|" + "---:|" * len(checkpoints),
    ]
    for n in steps:
        cells = " | ".join(str(repetitions(n, c)) for c in checkpoints)
        lines.append(f"| {n} | {cells} |")
    return "\n".join(lines) + "\n"


def write_tables(directory: pathlib.Path = GENERATED) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "repetitions.md").write_text(repetitions_table())


if __name__ == "__main__":
    write_tables()
    print(f"wrote {GENERATED / 'repetitions.md'}")
