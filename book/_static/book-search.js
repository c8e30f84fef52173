// Search result snippets. Sphinx builds each snippet from the text of the page's
// [role="main"] element, which in this theme also holds the article's header buttons
// ("Colab", ".ipynb", ".md", ".pdf"), the print-only table of contents and the
// previous/next links, and keeps formulas as raw TeX ("\(L\)"). Before Sphinx takes the
// text: strip that chrome, and turn each formula into plain text (the search page runs
// no MathJax, and a snippet may cut a formula in half), so a snippet quotes the chapter.
(function () {
  "use strict";
  const CHROME = [
    ".bd-header-article", // launch / download / full-screen buttons
    "#jb-print-toc", // table of contents shown only in print
    ".prev-next-area", // previous / next chapter links
    ".bd-sidebar-secondary", // "Contents" of the page
    ".toggle-details__summary", // "Show code cell source" and the like
    ".headerlink",
  ].join(", ");

  const SYMBOLS = {
    alpha: "α", beta: "β", gamma: "γ", delta: "δ", epsilon: "ε", varepsilon: "ε",
    eta: "η", theta: "θ", lambda: "λ", mu: "μ", pi: "π", rho: "ρ", sigma: "σ",
    tau: "τ", phi: "φ", varphi: "φ", omega: "ω", Theta: "Θ", Delta: "Δ", Sigma: "Σ",
    Omega: "Ω", cdot: "·", times: "×", dots: "…", ldots: "…", cdots: "⋯", le: "≤",
    leq: "≤", ge: "≥", geq: "≥", ne: "≠", neq: "≠", approx: "≈", to: "→",
    rightarrow: "→", leftarrow: "←", infty: "∞", sum: "∑", prod: "∏", sqrt: "√",
    in: "∈", top: "⊤", pm: "±", log: "log", exp: "exp", sin: "sin", cos: "cos",
    max: "max", min: "min", softmax: "softmax", quad: " ", qquad: " ",
  };

  // "\(\theta_j = \text{base}^{-2j/d}\)" -> "θ_j = base^-2j/d"
  function texToText(tex) {
    return tex
      .replace(/^\s*(\\\(|\\\[|\$\$)/, "")
      .replace(/(\\\)|\\\]|\$\$)\s*$/, "")
      .replace(/\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}/g, "($1)/($2)")
      .replace(/\\(?:mathrm|text|textrm|mathbf|mathit|mathcal|operatorname|boldsymbol)\s*\{([^{}]*)\}/g, "$1")
      .replace(/\\\\/g, " ")
      .replace(/\\([A-Za-z]+)/g, (m, name) => SYMBOLS[name] || "")
      .replace(/\\[,;:! ]/g, " ")
      .replace(/\\([{}|_^%$#&])/g, "$1")
      .replace(/[{}]/g, "")
      .replace(/\s+/g, " ")
      .trim();
  }

  function patch() {
    if (typeof Search === "undefined" || !Search.htmlToText) return false;
    if (Search._bookPatched) return true;
    const original = Search.htmlToText;
    Search.htmlToText = function (htmlString, anchor) {
      const doc = new DOMParser().parseFromString(htmlString, "text/html");
      doc.querySelectorAll(CHROME).forEach((el) => el.remove());
      doc.querySelectorAll(".math").forEach((el) => {
        el.textContent = texToText(el.textContent);
      });
      const text = original.call(this, doc.documentElement.outerHTML, anchor);
      return text.replace(/\s+/g, " ").trim();
    };
    Search._bookPatched = true;
    return true;
  }

  if (!patch()) document.addEventListener("DOMContentLoaded", patch);
})();
