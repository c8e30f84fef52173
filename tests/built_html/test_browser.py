"""The built book as a reader sees it: every page opened in headless Chromium.

Run after `jupyter-book build`:

    python -m pytest tests/built_html -q --html-dir _build/html

The book is served on 127.0.0.1 and the browser can reach nothing else (every other
host name fails to resolve), as on a machine without a network. Each page of the toc is
opened at 1280 px and at 400 px (a phone) and checked:

- MathJax (the copy bundled in book/_static/mathjax) has typeset every formula, none
  with an error, and no raw TeX (``\\(``, ``$$``) is visible;
- every Markdown table a notebook cell displays is an HTML table, and no raw pipe table
  is visible anywhere;
- every local link and anchor resolves; every image loads;
- nothing is wider than the text column (or the phone's screen) except inside a box
  that scrolls on its own (code, wide tables, long formulas);
- no stored output shows a traceback, a machine path or progress-bar characters, and
  no output box is empty; no object repr (``<function ...>``) is shown;
- one search field per page, and search results quote the chapters, not the buttons.

Screenshots of every page at both widths go to ``_build/screenshots/`` (next to the
HTML folder), so anyone can look at what the browser saw.

The tests are skipped without --html-dir. With it, a missing Chromium, chromedriver or
Selenium is a failure, not a skip: CI (.ci/run) installs Debian's ``chromium`` and
``chromium-driver``; set CHROME_BIN / CHROMEDRIVER to use other binaries.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.built_html.conftest import ROOT, toc_pages

WIDTHS = (1280, 400)
HEIGHT = 900
COLLECT_JS = (Path(__file__).with_name("collect.js")).read_text(encoding="utf-8")
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    # No network but the book's own server: a CDN script would fail to load here.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]

TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
MACHINE_PATH = re.compile(r"/home/|/tmp/|/work/|/root/|/Users/|\b[A-Za-z]:\\")
# block elements (tqdm's bars: full and partial blocks) and tqdm's "NN%|" prefix
PROGRESS_BAR = re.compile(r"[\u2580-\u259f]|\d%\|")
PIPE_TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)+\|?\s*$", re.M)


# --------------------------------------------------------------------------- fixtures


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass


@pytest.fixture(scope="session")
def server(site):
    """The built book over HTTP on 127.0.0.1 (a free port), in a thread."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def _which(env: str, names: tuple[str, ...]) -> str | None:
    if os.environ.get(env):
        return os.environ[env]
    return next((path for name in names if (path := shutil.which(name))), None)


@pytest.fixture(scope="session")
def browser(site):
    """Headless Chromium driven by Selenium; fails (does not skip) when either is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is not installed: pip install -e '.[test]'")
    chrome = _which("CHROME_BIN", ("chromium", "chromium-browser", "google-chrome", "chrome"))
    driver_bin = _which("CHROMEDRIVER", ("chromedriver",))
    if not chrome or not driver_bin:
        pytest.fail(
            "the browser checks need Chromium and chromedriver "
            "(Debian: apt-get install chromium chromium-driver; .ci/run installs them), "
            f"found browser={chrome!r}, driver={driver_bin!r}"
        )
    profile = tempfile.mkdtemp(prefix="book-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    window = f"--window-size={WIDTHS[0]},{HEIGHT}"
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", window]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(driver_bin))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _set_width(driver, width: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": width < 600},
    )


def _screenshot(driver, path: Path, width: int, height: int) -> None:
    """The whole page, top to bottom (not just the window).

    The window is made as tall as the page and scrolled to the top first: capturing
    "beyond the viewport" of a normal window shifted the theme's sticky sidebar and
    cut the page's left edge off in the picture (not in the page).
    """
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": max(HEIGHT, height), "deviceScaleFactor": 1,
         "mobile": width < 600},
    )
    driver.execute_script("window.scrollTo(0, 0)")
    try:
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
    finally:
        _set_width(driver, width)
    path.write_bytes(base64.b64decode(shot["data"]))


@pytest.fixture(scope="session")
def pages(site, server, browser) -> dict[tuple[str, int], dict]:
    """What the browser reports for every toc page at every width (see collect.js)."""
    shots = site.parent / "screenshots"
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    seen = {}
    for width in WIDTHS:
        _set_width(browser, width)
        for page in toc_pages():
            browser.get(f"{server}{page}.html")
            report = browser.execute_async_script(COLLECT_JS)
            assert "error" not in report, f"{page}: collect.js failed: {report.get('error')}"
            name = page.replace("/", "_")
            _screenshot(browser, shots / f"{name}-{width}.png", width, report["height"])
            seen[(page, width)] = report
    return seen


def _failures(pages: dict, check) -> list[str]:
    problems = []
    for (page, width), report in pages.items():
        problems += [f"{page} @{width}px: {p}" for p in check(report, page, width)]
    return problems


def _assert_none(problems: list[str], what: str) -> None:
    shown = "\n  ".join(problems[:40])
    more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
    assert not problems, f"{what} ({len(problems)}):\n  {shown}{more}"


# ------------------------------------------------------------------------------ tests


def test_nothing_is_loaded_from_the_network(pages):
    def check(report, page, width):
        return [f"loads {url}" for url in report["external"]]

    _assert_none(_failures(pages, check), "scripts, styles or fonts from elsewhere")


def test_every_formula_is_typeset(pages):
    def check(report, page, width):
        math = report["math"]
        out = []
        if math["formulas"] and math["mathjax"] != "ok":
            out.append(f"MathJax {math['mathjax']} ({math['formulas']} formulas left as TeX)")
        out += [f"not typeset: {tex}" for tex in math["untypeset"][:5]]
        out += [f"MathJax {err}" for err in math["errors"]]
        out += [f"raw TeX visible in {where}" for where in report["raw"]["tex"][:5]]
        return out

    _assert_none(_failures(pages, check), "formulas not rendered")
    assert sum(r["math"]["formulas"] for r in pages.values()) > 0, "no formula found at all"


def _markdown_tables_in_outputs(page: str) -> int:
    """How many Markdown tables the notebook's stored outputs display."""
    path = ROOT / f"{page}.ipynb"
    if not path.exists():
        return 0
    count = 0
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            markdown = output.get("data", {}).get("text/markdown")
            if markdown is not None:
                text = "".join(markdown) if isinstance(markdown, list) else markdown
                count += len(PIPE_TABLE_RULE.findall(text))
    return count


def test_every_markdown_table_is_an_html_table(pages):
    def check(report, page, width):
        out = [f"raw pipe table in {where}" for where in report["raw"]["pipeTables"]]
        wanted = _markdown_tables_in_outputs(page)
        if report["outputs"]["tables"] < wanted:
            out.append(
                f"{wanted} Markdown tables in the notebook's outputs, "
                f"{report['outputs']['tables']} HTML tables in the page's outputs"
            )
        return out

    _assert_none(_failures(pages, check), "tables not rendered")


@functools.cache
def _fetch(url: str) -> tuple[int, frozenset[str]]:
    """HTTP status of a local URL and the ids its HTML defines."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, frozenset()
    ids = set()
    if url.endswith((".html", "/")):
        text = body.decode("utf-8", "replace")
        ids = {html.unescape(m) for m in re.findall(r'\b(?:id|name)="([^"]+)"', text)}
    return status, frozenset(ids)


def test_every_local_link_and_anchor_resolves(pages, server):
    def check(report, page, width):
        if width != WIDTHS[0]:
            return []  # the same links at every width
        out = []
        for link in report["links"]:
            href = link["href"]
            if not href.startswith(server):
                continue  # external (Colab, GitHub, papers): not reachable offline
            target, _, fragment = href.partition("#")
            fragment = urllib.parse.unquote(fragment)
            status, ids = _fetch(target)
            if status != 200:
                out.append(f"link {link['text']!r} -> {href[len(server) :]}: HTTP {status}")
            elif fragment and target.endswith(".html") and fragment not in ids:
                out.append(f"link {link['text']!r} -> {href[len(server) :]}: no such anchor")
        return out

    _assert_none(_failures(pages, check), "broken local links")
    assert any(r["links"] for r in pages.values())


def test_every_image_loads(pages):
    def check(report, page, width):
        return [
            f"image does not load: {img['src']}"
            for img in report["images"]
            if not img["complete"] or img["naturalWidth"] == 0
        ]

    _assert_none(_failures(pages, check), "images")
    assert any(r["images"] for r in pages.values()), "the book shows no image at all"


def test_nothing_is_wider_than_the_column(pages):
    def check(report, page, width):
        overflow = report["overflow"]
        out = []
        if overflow["pageWidth"] > overflow["viewport"]:
            wide, screen = overflow["pageWidth"], overflow["viewport"]
            out.append(f"page is {wide} px wide ({screen} px screen)")
        out += [f"wider than the column {overflow['column']}: {o}" for o in overflow["offenders"]]
        return out

    _assert_none(_failures(pages, check), "content wider than its column")


def test_stored_outputs_are_clean(pages):
    def check(report, page, width):
        if width != WIDTHS[0]:
            return []
        out = []
        for text in report["outputs"]["texts"]:
            for name, pattern in (
                ("a traceback", TRACEBACK),
                ("a machine path", MACHINE_PATH),
                ("progress-bar characters", PROGRESS_BAR),
            ):
                if match := pattern.search(text):
                    start = max(match.start() - 40, 0)
                    snippet = text[start : match.end() + 40].replace("\n", " ")
                    out.append(f"output shows {name}: ...{snippet}...")
        out += [f"empty output box {box}" for box in report["outputs"]["empty"]]
        out += [f"object repr shown in {where}" for where in report["raw"]["reprs"]]
        return out

    _assert_none(_failures(pages, check), "stored outputs")


def test_one_search_field_per_page(pages):
    def check(report, page, width):
        fields = report["searchFields"]
        return [f"{len(fields)} search fields: {fields}"] if len(fields) > 1 else []

    _assert_none(_failures(pages, check), "search fields")


# Words that only the theme's buttons and contents lists put next to each other.
CHROME_IN_SNIPPET = re.compile(
    r"(^|\s|\.\.\.)\.(ipynb|md|pdf)\b|\bColab\s+\.ipynb|^\.\.\.\s*Contents\b"
)


@pytest.mark.parametrize("query", ["Colab", "slopes", "base"])
def test_search_results_quote_the_chapters(browser, server, query):
    _set_width(browser, WIDTHS[0])
    browser.get(f"{server}search.html?q={urllib.parse.quote(query)}")
    deadline = time.monotonic() + 30
    snippets: list[str] = []
    while time.monotonic() < deadline:
        status, wanted, snippets = browser.execute_script(
            """
            const items = [...document.querySelectorAll('#search-results li')];
            const pages = items.filter((li) => !li.querySelector(':scope > span'));
            return [
              (document.querySelector('.search-summary') || {}).innerText || '',
              pages.length,
              pages.map((li) => (li.querySelector('p.context') || {}).innerText)
                   .filter((t) => t !== undefined),
            ];
            """
        )
        if status.startswith("Search finished") and len(snippets) == wanted:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"search for {query!r} did not finish: {status!r}, {len(snippets)}/{wanted}")
    assert snippets, f"no page matches {query!r}"
    bad = [s for s in snippets if CHROME_IN_SNIPPET.search(s)]
    assert not bad, f"snippets quote the theme's buttons or contents, not the page: {bad}"
    raw = browser.execute_async_script(COLLECT_JS)["raw"]["tex"]
    assert not raw, f"raw TeX in search results: {raw}"
    titles = browser.execute_script(
        "return [...document.querySelectorAll('#search-results li > a')].map((a) => a.innerText)"
    )
    tex_titles = [t for t in titles if re.search(r"\\[A-Za-z]+|\$", t)]
    assert not tex_titles, f"TeX in search result titles (a heading with math?): {tex_titles}"


#: Pages that must hold an interactive figure (tutorial_pkg.plotting.slider_figure).
INTERACTIVE_PAGES = ("book/01_sinusoidal", "book/02_rope", "book/03_alibi")


def test_interactive_figures_respond_to_their_slider(browser, server):
    """Each interactive figure is drawn by the bundled script (no network), and moving its
    slider to the last frame redraws every curve and the value shown beside it."""
    _set_width(browser, WIDTHS[0])
    found = {}
    for page in toc_pages():
        browser.get(f"{server}{page}.html")
        figures = browser.execute_script(
            "return [...document.querySelectorAll('.pe-slider-figure')].map((f) => f.id)")
        found[page] = figures
        for name in figures:
            state = browser.execute_script(
                """
                const box = document.getElementById(arguments[0]);
                const input = box.querySelector('input[type=range]');
                const read = () => [[...box.querySelectorAll('polyline.pe-curve')]
                                      .map((p) => p.getAttribute('points')),
                                    (box.querySelector('output') || {}).textContent];
                if (!input) return {drawn: false, text: box.textContent};
                const before = read();
                input.value = input.max;
                input.dispatchEvent(new Event('input'));
                return {drawn: true, before: before, after: read(), frames: Number(input.max) + 1};
                """, name)
            assert state["drawn"], f"{page}#{name} was not drawn: {state['text']!r}"
            (curves0, value0), (curves1, value1) = state["before"], state["after"]
            assert state["frames"] > 1 and curves0 and all(curves0), f"{page}#{name}: empty"
            assert value1 != value0, f"{page}#{name}: the slider's value did not change"
            assert any(a != b for a, b in zip(curves0, curves1, strict=True)), (
                f"{page}#{name}: no curve changed with the slider")
    missing = [p for p in INTERACTIVE_PAGES if not found.get(p)]
    assert not missing, f"pages without an interactive figure: {missing}"
