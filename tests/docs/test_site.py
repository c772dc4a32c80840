"""The documentation site (mkdocs.yml): it builds in strict mode, its API reference names every public
name, strictness really fails a broken link, anchor or reference, and every public object has a docstring."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import griffe
import pytest

pytestmark = pytest.mark.xdist_group("docs_site")  # its module-scoped site build runs once, on one worker

ROOT = Path(__file__).resolve().parents[2]

# Each API page and the public modules it documents: every name a module exports (its __all__, else its
# public top-level definitions) must have its anchor there. A module exported by one of these and
# documented on no page of its own (bagua.torch_api's subpackages) is walked as part of its parent.
PAGES = {
    "bagua": ["bagua"],
    "parallel": ["bagua.parallel"],
    "algorithms": ["bagua.algorithms"],
    "comm": ["bagua.comm"],
    "comm_hooks": ["bagua.comm_hooks"],
    "data": ["bagua.data", "bagua.data.stores"],
    "optim": ["bagua.optim"],
    "checkpoint": ["bagua.checkpoint", "bagua.distributed.run", "bagua.distributed.launch"],
    "advise": ["bagua.advise"],
    "lightning": ["bagua.lightning", "lightning_bagua"],
    "torch_api": ["bagua.torch_api"],
}
PAGE_ROOTS = {module for modules in PAGES.values() for module in modules}


def build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site_dir`` (the output says each warning)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about its successor
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    result = build(ROOT / "mkdocs.yml", site_dir)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    return site_dir


@functools.cache
def _package(top: str) -> griffe.Module:
    return griffe.load(top, search_paths=[ROOT])


def _static(path: str) -> griffe.Object:
    """The object at ``path`` as the source declares it (Griffe's static view)."""
    top, _, rest = path.partition(".")
    return _package(top)[rest] if rest else _package(top)


def exported(module) -> list[str]:
    """The names ``module`` makes public: its ``__all__``, else what it defines (not imports) without a
    leading underscore."""
    if hasattr(module, "__all__"):
        return [name for name in module.__all__ if not (name.startswith("__") and name.endswith("__"))]
    return [
        name for name, member in _static(module.__name__).members.items()
        if not name.startswith("_") and not member.is_alias and not member.is_module
    ]


def walk(module_name: str):
    """(dotted name, object) for ``module_name`` and everything it exports, into exported subpackages
    that have no page of their own."""
    module = importlib.import_module(module_name)
    yield module_name, module
    for name in exported(module):
        value = getattr(module, name)
        path = f"{module_name}.{name}"
        if inspect.ismodule(value):
            if value.__name__ not in PAGE_ROOTS and value.__name__.startswith(module_name + "."):
                yield from walk(value.__name__)
        else:
            yield path, value


def _defined_at(value) -> str:
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"


def test_site_builds_strict(site):
    """It builds, and every page renders from file:// with no network: no font, script, stylesheet or
    image from another host (docs/assets/iframe-worker.js runs search without the offline plugin's CDN shim)."""
    pages = sorted(site.rglob("*.html"))
    assert site / "index.html" in pages and site / "api" / "bagua.html" in pages
    assert (site / "search" / "search_index.js").is_file(), "no search index for file:// (the offline plugin)"
    for page in pages:
        remote = re.findall(r'<(?:script|link|img)\b[^>]*(?:src|href)="((?:https?:)?//[^"]+)"', page.read_text())
        assert not remote, f"{page.relative_to(site)} loads {remote}"


def test_every_api_page_is_checked():
    pages = {page.stem for page in (ROOT / "docs" / "api").glob("*.md")} - {"index"}
    assert pages == set(PAGES), "docs/api/ and PAGES (the modules each page documents) disagree"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_api_page_documents_every_export(site, page):
    html = (site / "api" / f"{page}.html").read_text()
    anchors = set(re.findall(r'id="([\w.]+)"', html))
    missing = [
        path for module in PAGES[page] for path, value in walk(module)
        if path not in anchors and _defined_at(value) not in anchors  # a re-export, documented where it is defined
    ]
    assert not missing, f"api/{page}.html has no entry for {missing} (a name without a docstring is not rendered)"


def test_api_pages_read_as_markdown(site):
    """The docstrings' reST habits (``Example::``, ``====`` tables, ``:class:`` roles) are rewritten
    (docs/rst_docstrings.py), and their examples come out as highlighted code."""
    for page in PAGES:
        html = (site / "api" / f"{page}.html").read_text()
        article = re.sub(r"<[^>]+>", "", html.split("<article", 1)[1].split("</article>", 1)[0])
        for leftover in ("Example::", "====", ":class:`", ":func:`"):
            assert leftover not in article, f"api/{page}.html shows {leftover!r} raw"
    parallel = (site / "api" / "parallel.html").read_text()
    assert parallel.count('<div class="highlight"><pre><span></span><code><span class=') >= 5, \
        "the examples are not highlighted code blocks"


@pytest.mark.parametrize("markdown, warning", [
    ("See [the guide](no_such_guide.md).", "no_such_guide.md"),
    ("See [home](#no-such-heading).", "no-such-heading"),
    ("See [the wrapper][bagua.NoSuchClass].", "bagua.NoSuchClass"),
])
def test_strict_build_fails_on_a_broken_reference(tmp_path, markdown, warning):
    """The site's own settings (inherited from mkdocs.yml) turn a broken link, anchor or API
    reference into a failed build, named in the output."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\n{markdown}\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav:\n  - index.md\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0, f"a broken reference built:\n{result.stderr}"
    assert warning in result.stderr


def _own_doc(value) -> str:
    doc = value.__dict__.get("__doc__") if inspect.isclass(value) else getattr(value, "__doc__", None)
    if inspect.isclass(value) and doc and doc.startswith(f"{value.__name__}("):
        return ""  # a dataclass's generated signature, not a docstring
    return (doc or "").strip()


def _constant_doc(path: str) -> str:
    """A module-level value's docstring (the string literal under its assignment: only the source has it)."""
    docstring = _static(path).docstring
    return docstring.value.strip() if docstring else ""


def undocumented() -> list[str]:
    """Every public object without a docstring: the modules of PAGES, what they export, and the
    public methods and properties of the exported classes (a method may take its base's docstring)."""
    missing, seen = [], set()
    for module_name in sorted(PAGE_ROOTS):
        for path, value in walk(module_name):
            is_object = inspect.ismodule(value) or inspect.isclass(value) or callable(value)
            key = id(value) if is_object else path  # equal constants may be one object
            if key in seen:
                continue
            seen.add(key)
            if not (_own_doc(value) if is_object else _constant_doc(path)):
                missing.append(path)
            if inspect.isclass(value):
                for name, member in vars(value).items():
                    if name.startswith("_") or not (callable(member) or isinstance(member, (property, classmethod, staticmethod))):
                        continue
                    if not inspect.getdoc(getattr(value, name)):
                        missing.append(f"{path}.{name}")
    return missing


def test_every_public_object_has_a_docstring():
    missing = undocumented()
    assert not missing, f"{len(missing)} public objects have no docstring:\n  " + "\n  ".join(missing)
