"""The docs' tables equal what `benchmarks/internal/tables.py` writes from
`benchmarks/results/`, and each is shown on some page, so that a figure cannot drift
from its results file (nor a table be edited by hand). Reads files only: nothing is
timed or compiled."""

import importlib.util
import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).parent.parent
GENERATED = ROOT / "docs" / "generated"


def _load_tables():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_tables", ROOT / "benchmarks" / "internal" / "tables.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load_tables()


def _pages():
    """Every docs page and the README, as text (generated files excluded)."""
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    return {
        p.relative_to(ROOT).as_posix(): p.read_text()
        for p in paths
        if GENERATED not in p.parents
    }


@pytest.mark.parametrize("name", sorted(tables.GENERATORS))
def test_generated_file_is_up_to_date(name):
    committed = (GENERATED / f"{name}.md").read_text()
    assert committed == tables.GENERATORS[name](), (
        f"docs/generated/{name}.md differs from what benchmarks/internal/tables.py writes "
        "from benchmarks/results/: run `python benchmarks/internal/tables.py` (and do not "
        "edit docs/generated/ by hand)"
    )


def test_every_generated_file_has_a_generator():
    on_disk = {p.stem for p in GENERATED.glob("*.md")}
    assert on_disk == set(tables.GENERATORS), (
        "docs/generated/ and benchmarks/internal/tables.GENERATORS differ: "
        f"{sorted(on_disk ^ set(tables.GENERATORS))}"
    )


@pytest.mark.parametrize("name", sorted(tables.GENERATORS))
def test_generated_file_is_included_by_a_page(name):
    marker = f'--8<-- "docs/generated/{name}.md"'
    including = [path for path, text in _pages().items() if marker in text]
    assert including, f"no docs page includes docs/generated/{name}.md ({marker})"


def test_every_include_names_a_generated_file():
    named = set()
    for text in _pages().values():
        named |= set(re.findall(r'--8<-- "docs/generated/([^"]+)\.md"', text))
    assert named <= set(tables.GENERATORS), sorted(named - set(tables.GENERATORS))


def test_write_tables_writes_each_generators_text(tmp_path):
    written = {p.stem: p.read_text() for p in tables.write_tables(tmp_path)}
    assert written == {name: g() for name, g in tables.GENERATORS.items()}


def test_readme_shows_the_accelerator_headline_as_generated():
    """The README cannot include a generated file (GitHub shows the include line),
    so it carries the accelerator's headline table as text: the same text."""
    assert tables.GENERATORS["headline_tpu"]() in (ROOT / "README.md").read_text(), (
        "README.md's accelerator table differs from docs/generated/headline_tpu.md"
    )
