"""The distribution's name and every install hint: ``pip install bagua`` is the archived original.

Every hint that error messages, warnings, docs and benchmarks give names this distribution (or a
clone, ``pip install -e``) and an extra that pyproject.toml defines; found by scanning the source.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from bagua._install import DISTRIBUTION, install_hint

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
SOURCES = [p for d in ("bagua", "kernels", "lightning_bagua", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]
DOCS = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
# a command line: pip install [-e] then a quoted or bare requirement, with its extras
COMMAND = re.compile(r"""pip install (-e )?(['"]?)([\w.-]+)(?:\[([\w,]+)\])?\2""")
HINT_CALL = re.compile(r"""install_hint\((['"])(\w+)\1\)""")


def test_the_distribution_is_not_the_archived_originals_name():
    assert PYPROJECT["project"]["name"] == DISTRIBUTION == "bagua-torch"
    assert "lightning_bagua" in PYPROJECT["tool"]["setuptools"]["packages"]
    (everything,) = PYPROJECT["project"]["optional-dependencies"]["all"]
    name, extras = re.fullmatch(r"([\w-]+)\[([\w,]+)\]", everything).groups()
    assert name == DISTRIBUTION and set(extras.split(",")) == EXTRAS - {"all"}


def test_every_install_hint_names_this_distribution_and_an_extra_that_exists():
    commands, calls = [], []
    for path in SOURCES + DOCS:
        text = path.read_text()
        commands += [(path.name, m) for m in COMMAND.finditer(text)]
        calls += [(path.name, m.group(2)) for m in HINT_CALL.finditer(text)]
    assert len(calls) >= 6 and len(commands) >= 8, "the scan found the hints"
    for where, m in commands:
        editable, target, extras = m.group(1), m.group(3), m.group(4)
        if target in ("bagua", "bagua-torch", ".") or extras:
            assert target == ("." if editable else DISTRIBUTION) or _warns_about_the_original(m), (where, m.group(0))
        assert set((extras or "").split(",")) - {""} <= EXTRAS, (where, m.group(0))
    for where, extra in calls:
        assert extra in EXTRAS, (where, extra)


def test_the_hint_reads_for_the_index_and_for_a_clone():
    assert install_hint("lightning") == "pip install 'bagua-torch[lightning]' (in a clone: pip install -e '.[lightning]')"


def _warns_about_the_original(m: re.Match) -> bool:
    """The README's one mention of ``pip install bagua``: that it installs the archived original."""
    return m.group(0) == "pip install bagua" and m.string[m.end():m.end() + 40].startswith("` installs the archived original")
