"""The built documentation site: it builds without a warning, works opened from disk (every
internal link names a file that exists, no `page/` directory links, anchors exist, the search box
finds pages), and speaks to users about the product, not about the work that made it."""

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
def build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The site, built as `make docs` builds it (strict, and not --quiet, which hid warnings),
    and what the build printed."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed (make setup installs the docs group)")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = built.stdout + built.stderr
    assert built.returncode == 0, log
    return out, log


@pytest.fixture(scope="module")
def site(build: tuple[Path, str]) -> Path:
    return build[0]


@pytest.mark.slow
def test_the_build_prints_no_warning(build: tuple[Path, str]) -> None:
    """`mkdocs build --strict` prints no WARNING (a plugin's warning included): the check that
    `make test` runs fails on whatever `make docs` fails on."""
    warnings = [line for line in build[1].splitlines() if "WARNING" in line]
    assert warnings == []


@pytest.mark.slow
def test_the_makefile_builds_the_docs_without_quiet() -> None:
    """`make docs-check` and `make docs` run mkdocs without --quiet (which hid the warnings a
    strict build fails on) and fail on a WARNING line."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipes = re.findall(r"^(docs(?:-check)?):.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert {name for name, _ in recipes} == {"docs", "docs-check"}
    for name, recipe in recipes:
        assert "--quiet" not in recipe, name
        assert "grep -q WARNING" in recipe, name
    assert "--quiet" not in re.search(r"^MKDOCS_BUILD = .*$", makefile, re.MULTILINE)[0]  # type: ignore[index]


# Phrases of working notes, not of a product page: "session" alone is a product word here
# (SessionManager, speech sessions), so only the phrases are searched.
WORKING_NOTES = re.compile(
    r"\b(this|our|my) (branch|issue|worktree|pull request|PR|ticket)\b"
    r"|\bthe (issue|worktree|pull request|ticket)\b|\bissue ?#\d+|\bissue's\b"
    r"|\bthis session\b|\bnot on this\b|\bTODO\b|\bFIXME\b|\bXXX\b|\bworktrees?\b"
    # A helper or a coordinator as the people who wrote it (not the fsync helper process, the
    # tests' helpers.py, or a coordinator agent's decision).
    r"|\b(helper|coordinator)s?\b(?! process|\.py|'s decision)"
    r"|\bhonestly\b|\b(first|second|third) wave\b",
    re.IGNORECASE,
)


class Text(HTMLParser):
    """The text a reader sees in a page: no script, style or hidden search data."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self.skipping += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self.skipping:
            self.skipping -= 1

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data)


@pytest.mark.slow
def test_the_pages_carry_no_working_notes(site: Path) -> None:
    """No page of the built site talks about a branch, an issue, a helper, a TODO: the docs
    speak to users about the product."""
    found: list[str] = []
    for page in sorted(site.rglob("*.html")):
        reader = Text()
        reader.feed(page.read_text(encoding="utf-8"))
        text = " ".join(" ".join(reader.parts).split())
        for match in WORKING_NOTES.finditer(text):
            start = max(0, match.start() - 60)
            found.append(f"{page.relative_to(site)}: ...{text[start : match.end() + 60]}...")
    assert found == [], "\n".join(found)


def test_the_working_notes_pattern_finds_what_it_should() -> None:
    """The pattern finds the notes that were in the pages, and not the product's own words."""
    for note in (
        "the SQLite backend is not on this branch",
        "The issue's targets, honestly:",
        "before issue #21's changes",
        "TODO: say more",
        "what this session did",
        "the helper that wrote it",
        "ask the coordinator",
    ):
        assert WORKING_NOTES.search(note), note
    for product in (
        "a fork never overwrites another branch's values",
        "the result's `succeeded` says which branch ran",
        "`SessionManager`: sessions, session state, messages",
        "a speech session runs",
        "a small helper process, the fsync agent",
        "add a maker to BACKEND_MAKERS in tests/helpers.py",
        "assign_task is a coordinator's decision",
        "the branch that ran",
    ):
        assert not WORKING_NOTES.search(product), product


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
    a script with the worker shim (a page opened from disk cannot fetch search_index.json); the
    shim is the site's own file, never fetched from the web."""
    for page in ("index.html", "concepts/values.html"):
        text = (site / page).read_text(encoding="utf-8")
        assert 'class="md-search"' in text
        shims = re.findall(r'<script src="([^"]*iframe-worker[^"]*)"', text)
        assert len(shims) == 1
        assert not urlsplit(shims[0]).scheme, shims  # a file of the site, not a web address
        assert (site / page).parent.joinpath(shims[0]).resolve().is_file()
    assert (
        (site / "search" / "search_index.js")
        .read_text(encoding="utf-8")
        .startswith("var __index = {")
    )


@pytest.mark.slow
async def test_the_search_box_finds_pages_in_a_browser_from_disk(
    site: Path, tmp_path: Path
) -> None:
    """In chromium, with the site opened from disk (file://), typing in the search box lists
    matching pages: it does not stay at "Initializing search"."""
    from tests.ui._cdp import Chromium, Page, chromium_path

    executable = chromium_path()
    if executable is None:
        if os.environ.get("AGENTICSTATE_REQUIRE_BROWSER") == "1":
            pytest.fail("AGENTICSTATE_REQUIRE_BROWSER=1 but no chromium")
        pytest.skip("no chromium: run scripts/install-chromium.sh")
    browser = Chromium(executable, tmp_path / "profile")
    try:
        page = await Page.open(browser)
        await page.send("Page.navigate", url=(site / "index.html").as_uri())
        await page.wait_for("document.readyState === 'complete'", 20)
        await page.evaluate(
            "(() => { const box = document.querySelector('.md-search__input'); box.focus();"
            " box.value = 'SQLite'; box.dispatchEvent(new Event('input', {bubbles: true}));"
            " box.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true})); return true })()"
        )
        found = await page.wait_for(
            "document.querySelectorAll('.md-search-result__item').length", 20
        )
        assert found > 0
        meta = await page.evaluate("document.querySelector('.md-search-result__meta').textContent")
        assert "matching document" in meta
        await page.close()
    finally:
        browser.close()
