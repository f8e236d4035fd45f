"""What the docs' tables share: reading a results file, writing figures, and laying
out markdown. Imports no JAX, so that `internal/tables.py` stays cheap to import."""

import json
import math
import pathlib


RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def load(name: str):
    """`benchmarks/results/<name>`, parsed: JSON, or a list for JSON lines."""
    text = (RESULTS / name).read_text()
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines()]
    return json.loads(text)


def index(rows: list[dict], *keys: str) -> dict[tuple, dict]:
    """`rows` by the tuple of their values for `keys`."""
    return {tuple(r[k] for k in keys): r for r in rows}


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
    """Milliseconds to three significant figures, in s from a second."""
    if float(f"{ms:.3g}") >= 1000:
        return f"{_significant(ms / 1000)} s"
    return f"{_significant(ms)} ms"


def seconds(s: float) -> str:
    """A time given in seconds, written as `milliseconds` writes it."""
    return milliseconds(s * 1e3)


def table(header: list, rows: list[list], left: int = 1, right: str = "---:") -> list:
    """A markdown table's lines: `rows` of cells (anything `str` writes) under
    `header`, the first `left` columns aligned left, the others by `right`."""
    align = ["---"] * left + [right] * (len(header) - left)
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def page(*blocks) -> str:
    """A generated file's text: `blocks` (a line, or a list of lines such as a
    `table`), a blank line between two, empty ones (`None`, `[]`) left out."""
    blocks = [[b] if isinstance(b, str) else b for b in blocks if b]
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"
