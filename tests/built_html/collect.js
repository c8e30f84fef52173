// Run by tests/built_html/test_browser.py in each page (WebDriver executeAsyncScript):
// waits until MathJax, fonts and images are done, then reports what the browser shows.
// The last argument is WebDriver's callback.
const done = arguments[arguments.length - 1];

// Text that is code, not prose: TeX or pipes inside it are legitimate.
const CODE = "pre, code, script, style, textarea, mjx-container, .highlight, .linenos";

function visible(el) {
  return el.checkVisibility({ checkOpacity: true, checkVisibilityCSS: true });
}

function describe(el) {
  let name = el.tagName.toLowerCase();
  if (el.id) name += "#" + el.id;
  if (el.classList.length) name += "." + [...el.classList].slice(0, 3).join(".");
  const text = (el.innerText || el.textContent || "").replace(/\s+/g, " ").trim();
  return name + (text ? ` "${text.slice(0, 80)}"` : "");
}

// Text nodes a reader sees, outside code.
function proseNodes(root) {
  const out = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (!el || !node.textContent.trim() || el.closest(CODE) || !visible(el)) continue;
    out.push(node);
  }
  return out;
}

async function settle() {
  // MathJax: the bundled copy is loaded with `defer`, so it has run (or failed to load)
  // before the page's load event, where WebDriver hands over; then wait for its typeset.
  const hasMath = document.querySelector(".math") !== null;
  let mathjax = "absent";
  const t0 = performance.now();
  while (hasMath && performance.now() - t0 < 2000) {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      try {
        await MathJax.startup.promise;
        mathjax = "ok";
      } catch (e) {
        mathjax = "failed: " + e;
      }
      break;
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  if (hasMath && mathjax === "absent") mathjax = "not loaded";
  // Images: load every one (lazy ones too) and wait for each to finish or fail.
  await Promise.all(
    [...document.images].map((img) => {
      img.loading = "eager";
      return img.complete ? null : img.decode().catch(() => null);
    })
  );
  await document.fonts.ready;
  return mathjax;
}

function mathReport(mathjax) {
  const formulas = [...document.querySelectorAll(".math")];
  const untypeset = formulas
    .filter((el) => !el.querySelector("mjx-container"))
    .map((el) => el.textContent.trim().slice(0, 80));
  const errors = [];
  if (window.MathJax && MathJax.startup && MathJax.startup.document) {
    for (const item of MathJax.startup.document.math) {
      let bad = null;
      item.root.walkTree((node) => {
        if (node.isKind("merror")) bad = bad || "error";
        // noundefined: an unknown macro is shown as red text
        if (node.isKind("mtext") && node.attributes.get("mathcolor") === "red") {
          bad = bad || "undefined macro";
        }
      });
      if (bad) errors.push(`${bad}: ${String(item.math).trim().slice(0, 100)}`);
    }
  }
  return { mathjax, formulas: formulas.length, untypeset, errors };
}

// Raw TeX, raw pipe tables, object reprs: visible prose that should have been rendered.
function rawText() {
  const tex = /\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\\frac\{/;
  // a pipe table's rule row; the typographer may have made "---" an em dash
  const pipeRow = /\|\s*:?(-{3,}|[\u2013\u2014]+):?\s*\|/;
  const repr = /<(function|class|bound method|built-in function) [^>]*>|\bobject at 0x[0-9a-f]+/;
  const found = { tex: [], pipeTables: [], reprs: [] };
  for (const node of proseNodes(document.body)) {
    const text = node.textContent.replace(/\s+/g, " ");
    const where = describe(node.parentElement);
    if (tex.test(text)) found.tex.push(where);
    if (pipeRow.test(text)) found.pipeTables.push(where);
    if (repr.test(text)) found.reprs.push(where);
  }
  // object reprs in API signatures are <code>/<em> text: check those too
  for (const el of document.querySelectorAll("dt.sig")) {
    if (repr.test(el.textContent)) found.reprs.push(describe(el));
  }
  return found;
}

function outputsReport() {
  const outputs = [...document.querySelectorAll(".cell_output")];
  const empty = [];
  for (const box of document.querySelectorAll(".cell_output > .output")) {
    const hasContent =
      box.textContent.trim() || box.querySelector("img, table, svg, mjx-container, iframe");
    if (!hasContent) empty.push(describe(box));
  }
  return {
    texts: outputs.map((el) => el.textContent),
    tables: document.querySelectorAll(".cell_output table").length,
    empty,
  };
}

function linksReport() {
  return [...document.querySelectorAll("a[href]")]
    .filter((a) => !a.getAttribute("href").startsWith("javascript:"))
    .map((a) => ({ href: a.href, text: (a.textContent || "").trim().slice(0, 60) }));
}

function imagesReport() {
  return [...document.images].map((img) => ({
    src: img.currentSrc || img.src,
    complete: img.complete,
    naturalWidth: img.naturalWidth,
  }));
}

// Anything wider than its column. Inside an element that scrolls on its own (code
// blocks, wide tables and formulas given overflow-x: auto) it is fine: the reader
// scrolls that box, not the page.
function overflowReport() {
  const root = document.documentElement;
  const vw = root.clientWidth;
  const article = document.querySelector("article.bd-article") || document.body;
  const column = article.getBoundingClientRect();
  const right = Math.min(column.right, vw) + 1;
  const left = Math.max(column.left, 0) - 1;
  const offenders = [];
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const outside = (el) => {
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && (r.right > right || r.left < left);
  };
  for (const el of article.querySelectorAll("*")) {
    if (!outside(el) || !visible(el)) continue;
    // contained by a scrolling box that itself fits the column?
    let contained = false;
    for (let a = el.parentElement; a && a !== article; a = a.parentElement) {
      if (scrolls(a) && !outside(a)) {
        contained = true;
        break;
      }
      // clipped (overflow hidden) decorations, e.g. MathJax's screen-reader copy
      if (["hidden", "clip"].includes(getComputedStyle(a).overflowX) && a.closest("mjx-container")) {
        contained = true;
        break;
      }
    }
    if (contained) continue;
    // report the outermost offender only
    const parent = el.parentElement;
    if (parent && parent !== article && outside(parent) && article.contains(parent)) continue;
    const r = el.getBoundingClientRect();
    offenders.push(`${describe(el)} [${Math.round(r.left)}..${Math.round(r.right)} px]`);
  }
  // the page's contents (right-hand sidebar): names must wrap, not be cut off
  const toc = document.querySelector(".bd-sidebar-secondary");
  if (toc && visible(toc)) {
    const box = toc.getBoundingClientRect();
    for (const el of toc.querySelectorAll("a, code")) {
      const r = el.getBoundingClientRect();
      if (visible(el) && r.width > 0 && r.right > box.right + 1) {
        offenders.push(`contents sidebar: ${describe(el)} [..${Math.round(r.right)} px > ${Math.round(box.right)}]`);
      }
    }
  }
  return {
    viewport: vw,
    pageWidth: root.scrollWidth,
    column: [Math.round(column.left), Math.round(column.right)],
    offenders: offenders.slice(0, 20),
  };
}

// Scripts, styles and fonts the page loads from elsewhere (it must work offline).
function externalResources() {
  const local = location.origin;
  const urls = [
    ...[...document.querySelectorAll("script[src]")].map((el) => el.src),
    ...[...document.querySelectorAll("link[href]")]
      .filter((el) => /stylesheet|preload|icon|modulepreload/.test(el.rel))
      .map((el) => el.href),
    ...performance.getEntriesByType("resource").map((entry) => entry.name),
  ];
  return [...new Set(urls)].filter((url) => /^https?:/.test(url) && !url.startsWith(local));
}

function searchFields() {
  return [...document.querySelectorAll(".search-button-field, input[type=search]")]
    .filter(visible)
    .map(describe);
}

settle()
  .then((mathjax) =>
    done({
      title: document.title,
      math: mathReport(mathjax),
      raw: rawText(),
      outputs: outputsReport(),
      links: linksReport(),
      ids: [...document.querySelectorAll("[id], a[name]")].map((el) => el.id || el.name),
      images: imagesReport(),
      overflow: overflowReport(),
      searchFields: searchFields(),
      external: externalResources(),
      height: document.documentElement.scrollHeight,
    })
  )
  .catch((e) => done({ error: String(e && e.stack ? e.stack : e) }));
