"""Every table the docs show, `docs/generated/<name>.md` for each of `GENERATORS`,
from `benchmarks/results/` by a function beside the benchmark that measured it (its
module imported only then); times nothing. `tests/test_generated_docs.py` checks the
committed files. Internal: it reaches into every benchmark script.

    python benchmarks/internal/tables.py
"""

import importlib
import pathlib
import sys
from collections.abc import Callable


HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GENERATED = ROOT / "docs" / "generated"
for folder in (HERE.parent, HERE):  # the benchmarks import each other as scripts do
    if str(folder) not in sys.path:
        sys.path.append(str(folder))


def made_by(module: str, function: str, *args) -> Callable[[], str]:
    """`module.function(*args)`, the module imported when it is called."""
    return lambda: getattr(importlib.import_module(module), function)(*args)


# docs/generated/<name>.md for each name
GENERATORS = {
    "repetitions": made_by("recomputation", "repetitions_table"),
    "while_loop": made_by("while_loop", "while_loop_table"),
    "why_while_loop": made_by("while_loop", "why_while_loop_table"),
    "recomputation": made_by("recomputation", "recomputation_table"),
    "why_recomputation": made_by("recomputation", "why_recomputation_table"),
    "buffers": made_by("buffers", "buffers_table"),
    "buffer_checks": made_by("buffer_checks", "checks_table"),
    "buffer_checks_tpu": made_by("buffer_checks", "checks_table", "tpu"),
    "why_buffers": made_by("buffers", "why_buffers_table"),
    "cheap_steps": made_by("cheap_steps", "cheap_steps_table"),
    "forward_mode": made_by("cheap_steps", "forward_mode_table"),
    "diffrax_neural": made_by("diffrax_adjoint", "diffrax_table", "neural"),
    "diffrax_long": made_by("diffrax_adjoint", "diffrax_table", "long"),
    "diffrax_wide": made_by("diffrax_adjoint", "diffrax_table", "wide"),
    "diffrax_summary": made_by("diffrax_adjoint", "diffrax_summary_table"),
    "diffrax_suite": made_by("client_suites", "client_suite_table", "diffrax_suite"),
    "optimistix_suite": made_by(
        "client_suites", "client_suite_table", "optimistix_suite"
    ),
    "optimistix_adjoint": made_by("optimistix_adjoint", "optimistix_adjoint_table"),
    "distributed": made_by("distributed", "distributed_table"),
    "small_solves": made_by("small_solves", "small_solves_table"),
    "correct_on_tpu": made_by("correct_on_tpu", "correct_on_tpu_table", "tpu"),
    "correct_on_cpu": made_by("correct_on_tpu", "correct_on_tpu_table", "cpu"),
    "tpu_fuzz": made_by("correct_on_tpu", "tpu_fuzz_table"),
    "headline_tpu": made_by("headline", "headline_table"),
    "memory_curve_tpu": made_by("memory_curve", "memory_curve_table", "tpu"),
    "memory_curve_compile_tpu": made_by("memory_curve", "compile_pairs_table"),
    "memory_curve_cpu": made_by("memory_curve", "memory_curve_table", "cpu"),
    "split_table_tpu": made_by("split_table", "split_table_table"),
    "diffrax_neural_tpu": made_by("diffrax_adjoint", "diffrax_table", "neural_tpu"),
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
