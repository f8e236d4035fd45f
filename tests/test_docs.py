"""The docs: every public name is documented on an API page, the built site shows
each example's code (a snippet marker that stopped being one is not an error for
`mkdocs build --strict`, so it is checked here), and code fits the page."""

import ast
import html.parser
import os
import pathlib
import re
import subprocess
import sys

import pytest

import boundedloop as bl


ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"
EXAMPLES = ROOT / "examples"
EXAMPLE_PAGES = ROOT / "docs" / "examples"


def public_names():
    return {n for n in dir(bl) if not n.startswith("_")}


def test_every_public_name_is_on_an_api_page():
    text = "\n".join(p.read_text() for p in API.glob("*.md"))
    documented = set(re.findall(r"::: boundedloop\.(\w+)", text))
    documented |= set(re.findall(r"`bl\.(\w+)`", text))
    missing = public_names() - documented
    assert not missing, f"public names missing from docs/api: {sorted(missing)}"


class _PageText(html.parser.HTMLParser):
    """A rendered page's text, and the text of each of its `<pre>` blocks (with
    the syntax highlighter's tags dropped and entities decoded)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.text = []
        self.code_blocks = []
        self._block = None

    def handle_starttag(self, tag, attrs):
        if tag == "pre":
            self._block = []

    def handle_endtag(self, tag):
        if tag == "pre" and self._block is not None:
            self.code_blocks.append("".join(self._block))
            self._block = None

    def handle_data(self, data):
        self.text.append(data)
        if self._block is not None:
            self._block.append(data)


def _parse(path):
    parser = _PageText()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once by `mkdocs build --strict` (about 2 s)."""
    pytest.importorskip("mkdocs")
    site_dir = tmp_path_factory.mktemp("site")
    # NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life notice (see mkdocs.yml)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return site_dir


def _examples():
    return sorted(p.stem for p in EXAMPLES.glob("*.py"))


def test_every_example_has_a_page():
    pages = {p.stem for p in EXAMPLE_PAGES.glob("*.md")}
    missing = set(_examples()) - pages
    assert not missing, f"examples without a page in docs/examples: {sorted(missing)}"


@pytest.mark.parametrize("name", _examples())
def test_example_page_shows_its_code(site, name):
    source = (EXAMPLES / f"{name}.py").read_text(encoding="utf-8")
    page = _parse(site / "examples" / name / "index.html")
    code = "\n".join(page.code_blocks)
    defined = [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    assert defined, f"examples/{name}.py defines no top-level function or class"
    missing = [n for n in defined if not re.search(rf"\b(def|class) {n}\b", code)]
    assert not missing, (
        f"docs/examples/{name}.md's page lacks {missing} from examples/{name}.py: "
        f'is its `--8<-- "examples/{name}.py"` line intact?'
    )
    assert any(source.strip() in block for block in page.code_blocks), (
        f"docs/examples/{name}.md's page does not show examples/{name}.py verbatim"
    )


def test_no_page_shows_a_snippet_marker(site):
    # `--8<--` is pymdownx.snippets' marker; a formatter once turned it into
    # `--8 < --"...`, which the build passes through as text
    marker = re.compile(r"-\s*-\s*8\s*<")
    shown = []
    for path in sorted(site.rglob("*.html")):
        text = "".join(_parse(path).text)
        for match in marker.finditer(text):
            line = text[match.start() : text.find("\n", match.start())]
            shown.append(f"{path.relative_to(site)}: {line.strip()}")
    assert not shown, "snippet markers shown as text:\n" + "\n".join(shown)


# the widest code line a page shows without a horizontal scroll bar at a 1280 px
# window (Material's content column; measured with headless Chromium)
CODE_COLUMNS = 80


def _fenced_code_lines(text):
    """`(line number, line)` of each line inside a fenced code block."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None:
            if marker:
                fence = marker.group(1)
        elif marker and line.strip() == fence:
            fence = None
        else:
            yield number, line


def test_code_fits_the_page():
    """Code blocks in the docs, and the examples they show whole, fit in
    `CODE_COLUMNS` columns (the tables in `docs/generated/` are not code)."""
    wide = []
    for path in sorted(DOCS.rglob("*.md")):
        if "generated" in path.relative_to(DOCS).parts:
            continue
        for number, line in _fenced_code_lines(path.read_text(encoding="utf-8")):
            if len(line) > CODE_COLUMNS:
                wide.append(f"{path.relative_to(ROOT)}:{number}: {len(line)} columns")
    for path in sorted(EXAMPLES.glob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > CODE_COLUMNS:
                wide.append(f"{path.relative_to(ROOT)}:{number}: {len(line)} columns")
    assert not wide, (
        f"code lines wider than {CODE_COLUMNS} columns scroll sideways on the site "
        "at a 1280 px window:\n" + "\n".join(wide)
    )
