"""Checks of the built book (run after `jupyter-book build`, with --html-dir _build/html).

Every page in _toc.yml exists, every image a page references exists, no page shows raw
`$$`, an unrendered directive or a Python traceback, the intro links every chapter and the
API page documents every public name. What a real browser shows is checked in
test_browser.py.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path

import tutorial_pkg
from tests.built_html.conftest import toc_pages as _toc_pages

# The `site` fixture (the built book, --html-dir) is in tests/built_html/conftest.py.


class _Page(HTMLParser):
    """Visible text (without scripts, styles, code) and image/link targets of a page."""

    def __init__(self):
        super().__init__()
        self.text, self.code, self.images, self.links = [], [], [], []
        self._skip = 0
        self._in_code = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "style"):
            self._skip += 1
        if tag in ("pre", "code"):
            self._in_code += 1
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        if tag in ("pre", "code"):
            self._in_code -= 1

    def handle_data(self, data):
        if self._skip:
            return
        (self.code if self._in_code else self.text).append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _html_files(site: Path) -> list[Path]:
    return [site / f"{p}.html" for p in _toc_pages()]


def test_every_toc_page_was_built(site):
    for path in _html_files(site):
        assert path.exists(), f"missing page {path.relative_to(site)}"


def test_every_image_exists(site):
    count = 0
    for path in _html_files(site):
        for src in _parse(path).images:
            if src.startswith(("http:", "https:", "data:")):
                continue
            target = (path.parent / html.unescape(src.split("#")[0])).resolve()
            assert target.exists(), f"{path.name}: image {src} not found"
            count += 1
    assert count > 0, "the book shows no figure at all"


def test_no_raw_math_directives_or_tracebacks(site):
    directive = re.compile(r"```\{|^:::\{|\{eval-rst\}|\{literalinclude\}|\{cite", re.M)
    for path in _html_files(site):
        page = _parse(path)
        prose = "".join(page.text)
        assert "$$" not in prose, f"{path.name}: raw $$ math left unrendered"
        assert not directive.search(prose), f"{path.name}: unrendered directive"
        everything = prose + "".join(page.code)
        assert "Traceback (most recent call last)" not in everything, f"{path.name}: traceback"


def test_intro_links_every_chapter(site):
    links = set(_parse(site / "book" / "intro.html").links)
    for page in _toc_pages()[1:]:
        name = Path(page).name
        if name == "references":
            continue
        assert any(link.split("#")[0].endswith(f"{name}.html") for link in links), name


def test_api_page_lists_the_public_api(site):
    text = (site / "book" / "api.html").read_text(encoding="utf-8")
    missing = [
        name
        for name in tutorial_pkg.__all__
        if not re.search(rf'id="(module-)?[\w.]*\.{name}"', text)  # modules: "module-..."
    ]
    assert not missing, f"api.html does not document: {missing}"


def test_api_entries_list_parameters_before_returns(site):
    text = (site / "book" / "api.html").read_text(encoding="utf-8")
    wrong = []
    for entry in re.split(r'<dt class="sig sig-object py" id="', text)[1:]:
        name = entry.split('"', 1)[0]
        body = entry.split('<dt class="sig sig-object py"', 1)[0]
        fields = re.findall(r'<dt class="field-(?:odd|even)">([^<]+)<', body)
        if "Parameters" in fields and "Returns" in fields:
            if fields.index("Returns") < fields.index("Parameters"):
                wrong.append(f"{name}: {fields}")
    assert not wrong, "Returns listed before Parameters:\n" + "\n".join(wrong)
