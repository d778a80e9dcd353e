// Render the pages' math ($...$ via pymdownx.arithmatex) with KaTeX, when `just docs`
// has put KaTeX in docs/vendor (it is fetched from npm, not committed). Without it the
// formulas stay readable as plain TeX.
document$.subscribe(() => {
  if (typeof renderMathInElement === "undefined") return;
  renderMathInElement(document.body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
});
