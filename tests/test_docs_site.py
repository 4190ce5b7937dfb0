"""The built documentation site works opened from disk: every internal link names a file that
exists (no `page/` directory links), anchors exist, and the search box has its index."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src") and tag != "form":
                self.links.append(value)
            if name in ("id", "name"):
                self.ids.add(value)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed (make setup installs the docs group)")
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return out


@pytest.mark.slow
def test_every_internal_link_opens_a_file(site: Path) -> None:
    """From disk, a link must name a file: `getting-started.html`, never `getting-started/`."""
    # 404.html is for a web server (its links are absolute, from the site's root).
    pages = sorted(page for page in site.rglob("*.html") if page.name != "404.html")
    assert len(pages) > 20
    parsed: dict[Path, Links] = {}
    for page in pages:
        links = Links()
        links.feed(page.read_text(encoding="utf-8"))
        parsed[page] = links
    broken: list[str] = []
    for page, links in parsed.items():
        for link in links.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            where = f"{page.relative_to(site)} -> {link}"
            if target.is_dir() or not target.exists():
                broken.append(where)
            elif parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else set()
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no such anchor)")
    assert broken == []


@pytest.mark.slow
def test_the_search_box_works_from_disk(site: Path) -> None:
    """The search box is on every page, and mkdocs-material's offline plugin ships its index as
    a script with the worker shim (a page opened from disk cannot fetch search_index.json)."""
    for page in ("index.html", "concepts/values.html"):
        text = (site / page).read_text(encoding="utf-8")
        assert 'class="md-search"' in text
        assert re.search(r'<script src="[^"]*iframe-worker/shim"', text)
    assert (
        (site / "search" / "search_index.js")
        .read_text(encoding="utf-8")
        .startswith("var __index = {")
    )
