"""Every public name is documented on an API page."""

import pathlib
import re

import boundedloop as bl


API = pathlib.Path(__file__).parent.parent / "docs" / "api"


def public_names():
    return {n for n in dir(bl) if not n.startswith("_")}


def test_every_public_name_is_on_an_api_page():
    text = "\n".join(p.read_text() for p in API.glob("*.md"))
    documented = set(re.findall(r"::: boundedloop\.(\w+)", text))
    documented |= set(re.findall(r"`bl\.(\w+)`", text))
    missing = public_names() - documented
    assert not missing, f"public names missing from docs/api: {sorted(missing)}"
