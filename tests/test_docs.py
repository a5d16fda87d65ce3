"""The documentation site's structure: every strategy has a page, every page is in the navigation.

Fast checks on the sources (no MkDocs build: CI runs ``mkdocs build --strict`` in ``.ci/run``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lightning_sync.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


class _MkDocsLoader(yaml.SafeLoader):
    """Reads mkdocs.yml, whose ``!relative`` / ``!ENV`` tags plain YAML does not know (their values are not needed)."""


_MkDocsLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkDocsLoader)


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _pattern(line: str) -> re.Pattern[str]:
    """A gitignore-style line of ``exclude_docs`` / ``not_in_nav`` as a regex over docs-relative paths."""
    anchored = line.startswith("/")
    body = line.strip("/")
    regex = re.escape(body).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
    regex = ("^" if anchored else "^(?:.*/)?") + regex + ("(?:/.*)?$" if line.endswith("/") else "$")
    return re.compile(regex)


def _matches(setting: str | None, path: str) -> bool:
    lines = [line.strip() for line in (setting or "").splitlines() if line.strip() and not line.startswith("#")]
    return any(_pattern(line).match(path) for line in lines)


def _site_pages(config: dict) -> list[str]:
    """Every Markdown file MkDocs builds as a page (docs-relative, posix)."""
    pages = []
    for path in sorted(DOCS.rglob("*.md")):
        rel = path.relative_to(DOCS).as_posix()
        if not _matches(config.get("exclude_docs"), rel):
            pages.append(rel)
    return pages


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda cls: cls.strategy_name)
def test_every_strategy_has_a_page_with_its_api_in_the_nav(strategy):
    page = f"strategies/{strategy.strategy_name}.md"
    assert (DOCS / page).is_file(), (
        f"{strategy.__name__} has no page {page} (docs/strategies/, see docs/contributing.md)"
    )
    assert f"::: lightning_sync.strategies.{strategy.__name__}" in (DOCS / page).read_text(), (
        f"{page} lacks its API block '::: lightning_sync.strategies.{strategy.__name__}'"
    )
    assert page in _nav_pages(_config()["nav"]), f"{page} is not in mkdocs.yml's nav"


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    config = _config()
    nav = _nav_pages(config["nav"])
    missing = [p for p in nav if not p.startswith(("http://", "https://")) and not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    outside = [p for p in _site_pages(config) if p not in nav and not _matches(config.get("not_in_nav"), p)]
    assert not outside, f"pages under docs/ that are not in mkdocs.yml's nav (add them, or to not_in_nav): {outside}"
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def test_relative_links_point_at_files_that_are_built():
    """MkDocs only logs (INFO) a link to a file it excludes from the site; on the site that link is broken."""
    config = _config()
    broken = []
    for page in _site_pages(config):
        text = re.sub(r"(?ms)^```.*?^```", "", (DOCS / page).read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"^[a-z]+:", path):
                continue
            resolved = (DOCS / page).parent / path
            rel = resolved.resolve().relative_to(DOCS.resolve()).as_posix() if resolved.exists() else None
            if rel is None or (rel.endswith(".md") and _matches(config.get("exclude_docs"), rel)):
                broken.append(f"{page}: {target}")
    assert not broken, f"links to files the site does not have: {broken}"
