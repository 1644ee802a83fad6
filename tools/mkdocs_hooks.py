"""MkDocs hooks for the docs site: the Markdown under docs/ stays what a GitHub reader sees,
and the site is made from it without a copy of any page.

- The README is the site's home page: its ``docs/x.md`` links become ``x.md``.
- Pages link to files outside docs/ (``../bench/results/store.md``, ``../tests/...``) because on
  GitHub that is where the figures live; the site carries each such file under its repository
  path, so one link works in both places and a figure is never quoted from a copy.
- The API reference is generated from the public names of each package face (its ``__all__``)
  and their docstrings, so a new public name is documented by being exported.
"""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Package faces whose public names make the API reference, in the order of the layers (low first).
PACKAGES = ("store", "rendezvous", "timer", "snapshot", "metrics", "faults", "supervisor",
            "data", "inplace", "agent", "cli", "testing", "chaos")
_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _outside_targets(base: Path, text: str) -> set[str]:
    """Repository paths outside docs/ that a page in folder ``base`` links to."""
    found: set[str] = set()
    for m in _LINK.finditer(text):
        target = m.group(1)
        if "://" in target or target.startswith(("mailto:", "/")):
            continue
        path = (base / target).resolve()
        if path.is_file() and DOCS not in path.parents and ROOT in path.parents:
            found.add(path.relative_to(ROOT).as_posix())
    return found


def _api_page(package: str) -> str:
    module = importlib.import_module(f"elastictk.{package}")
    doc = inspect.getdoc(module) or ""
    lines = [f"# elastictk.{package}", "", doc.splitlines()[0] if doc else "", ""]
    for name in sorted(getattr(module, "__all__", [])):
        obj = getattr(module, name)
        home = getattr(obj, "__module__", None) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
        path = f"{home}.{name}" if home and home.startswith("elastictk.") else f"elastictk.{package}.{name}"
        lines += [f"::: {path}", "    options:", "      heading_level: 2", ""]
    return "\n".join(lines)


# What ``import elastictk`` itself offers (lazily: elastictk/__init__.py); each is documented
# under its short name, where users meet it, from the module that defines it.
TOP_NAMES = ("State", "run_elastic", "record", "section")
# Sphinx roles and literal-block markers that docstrings use: shown as code and a colon on the site.
_ROLE = re.compile(r":(?:data|func|class|meth|attr|mod|obj|exc|const):(?=<code>)")
_LITERAL = re.compile(r"::(?=</p>)")


def _top_page() -> str:
    import elastictk

    lines = ["# elastictk", "", "What `import elastictk` offers; the packages below it are in the "
             "[API reference](index.md).", ""]
    for name in TOP_NAMES:
        obj = getattr(elastictk, name, None)
        if obj is None:
            continue
        lines += [f"## elastictk.{name}", "", f"Defined in `{obj.__module__}`.", "",
                  f"::: {obj.__module__}.{name}", "    options:", "      show_root_full_path: false",
                  "      heading_level: 3", ""]
    return "\n".join(lines)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """The API reference in the sidebar: one page per package face, after the top-level names."""
    nav = config.nav or []
    for i, entry in enumerate(nav):
        if isinstance(entry, dict) and "API reference" in entry:
            nav[i] = {"API reference": ["api/index.md", {"elastictk": "api/elastictk.md"},
                                        *({f"elastictk.{p}": f"api/{p}.md"} for p in PACKAGES)]}
    return config


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files, **_: Any) -> str:
    if page.file.src_uri.startswith("api/"):
        html = _LITERAL.sub(":", _ROLE.sub("", html).replace("<p>::</p>", ""))
    return html


def on_files(files: Files, config: MkDocsConfig) -> Files:
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=readme))
    files.append(File.generated(config, "api/index.md", content="\n".join(
        ["# API reference", "",
         "Generated from the docstrings of each package's public names (its `__all__`).", ""]
        + ["- [`elastictk`](elastictk.md): `State`, `run_elastic`, `record`"]
        + [f"- [`elastictk.{p}`]({p}.md)" for p in PACKAGES])))
    files.append(File.generated(config, "api/elastictk.md", content=_top_page()))
    for package in PACKAGES:
        files.append(File.generated(config, f"api/{package}.md", content=_api_page(package)))
    outside: set[str] = set()
    for page in DOCS.glob("*.md"):
        outside |= _outside_targets(DOCS, page.read_text())
    outside |= _outside_targets(ROOT, readme) - {"README.md"}
    for rel in sorted(outside):
        files.append(File.generated(config, rel, abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files, **_: Any) -> str:
    if page.file.src_uri == "index.md":
        markdown = markdown.replace("](docs/", "](")
    # ../bench/results/x.md from a page at the docs root is bench/results/x.md in the site.
    return re.sub(r"\]\(\.\./", "](", markdown) if "/" not in page.file.src_uri else markdown
