// Runs in a page of the book once MathJax is done (tools/check_book.py evaluates it).
// Returns the defects visible in the DOM, the per-page counts of blocks that scroll
// sideways, the figures shown (checked in Python from their files), the position of
// the article (to check the screenshot against) and every link.
(opts) => {
  const narrow = opts.narrow;
  const out = [];
  const add = (kind, detail) => out.push({kind, detail: String(detail).slice(0, 300)});
  const main = document.querySelector('main article, article, main, [role=main]')
               || document.body;
  const skip = el => el.closest('pre, code, script, style, textarea, mjx-container, '
                                + 'mjx-assistive-mml, .highlight, .MathJax_Preview');
  // raw TeX left in the text of the page
  const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT);
  const texRe = /(\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\\frac\{|\\mathcal\{)/;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.parentElement || skip(n.parentElement)) continue;
    const m = n.nodeValue.match(texRe);
    if (m) add('raw-tex', n.nodeValue.trim().slice(0, 160));
  }
  // math elements that did not become a formula
  const mathEls = main.querySelectorAll('div.math, span.math');
  for (const el of mathEls) {
    if (!el.querySelector('mjx-container') && el.textContent.trim())
      add('raw-tex', 'math not typeset: ' + el.textContent.trim().slice(0, 120));
  }
  if (mathEls.length && !(window.MathJax && window.MathJax.startup))
    add('raw-tex', 'page has ' + mathEls.length + ' formulas but MathJax did not load');
  for (const el of main.querySelectorAll('mjx-merror, [data-mjx-error]'))
    add('mathjax-error', el.getAttribute('data-mjx-error') || el.textContent);
  // images
  for (const img of document.images)
    if (!img.complete || img.naturalWidth === 0) add('broken-image',
    img.getAttribute('src'));
  // Markdown tables that stayed text
  const pipeRe = /\|\s*:?-{3,}:?\s*\|/;
  for (const p of main.querySelectorAll('p, div.output pre, div.cell_output pre')) {
    const t = p.textContent;
    if (pipeRe.test(t)) add('pipe-table', t.trim().slice(0, 160));
  }
  // Widths. A block fits when its content is no wider than the narrowest box it sits
  // in (itself, when it is a scroll box, and each ancestor up to the article) and
  // than the text column.
  const col = (document.querySelector('main article') || main).getBoundingClientRect();
  const scrolls = st => ['auto', 'scroll', 'hidden', 'clip'].includes(st.overflowX);
  const room = el => {
    let w = col.width;
    for (let b = el; b && b !== main.parentElement; b = b.parentElement) {
      if (b === el && !scrolls(getComputedStyle(b))) continue;
      if (b.clientWidth > 0) w = Math.min(w, b.clientWidth);
    }
    return w;
  };
  // On a phone a wide block may scroll inside a box that shows it does: a background
  // image (the book's CSS draws a shadow at each edge that hides more content).
  const cued = el => {
    for (let b = el; b && b !== main; b = b.parentElement) {
      const st = getComputedStyle(b);
      if (['auto', 'scroll'].includes(st.overflowX))
        return st.backgroundImage !== 'none'
               && b.getBoundingClientRect().width <= col.width + 1;
    }
    return false;
  };
  const counts = {equations: 0, tables: 0, code: 0};
  for (const c of main.querySelectorAll('mjx-container[display="true"]')) {
    const w = Math.max(c.scrollWidth,
                       ...[...c.querySelectorAll('mjx-math')].map(m =>
                       m.getBoundingClientRect().width));
    const r = room(c);
    if (w <= r + 1) continue;
    if (narrow && cued(c)) { counts.equations++; continue; }
    const src = c.closest('.math');
    const tex = c.querySelector('mjx-assistive-mml math');
    add('wide-equation', Math.round(w) + 'px > its box ' + Math.round(r) + 'px: '
        + (src && src.id ? src.id + ' ' : '')
        + (tex ? tex.textContent.slice(0, 80) : ''));
  }
  for (const t of main.querySelectorAll('table')) {
    if (t.closest('table.indextable') && narrow) continue;  // stacked by the CSS
    const w = scrolls(getComputedStyle(t)) ? t.scrollWidth  // borders not counted
      : t.getBoundingClientRect().width;
    const r = room(t);
    if (w <= r + 1) continue;
    if (narrow && cued(t)) { counts.tables++; continue; }
    const head = [...t.querySelectorAll('th')].map(h => h.textContent.trim());
    add('wide-table', Math.round(w) + 'px > its box ' + Math.round(r) + 'px: '
        + head.join(' | ').slice(0, 120));
  }
  // A table that names the columns holding its answer (classes kwng-answer-col-<i>,
  // written by studies.kit.tables.markdown_table) shows them on screen as the page
  // opens: inside the window and inside the box the table scrolls in, not scrolled to.
  for (const t of main.querySelectorAll('table.kwng-answer')) {
    const cols = [...t.classList].map(c => /^kwng-answer-col-(\d+)$/.exec(c))
      .filter(Boolean).map(m => +m[1]);
    const head = [...t.querySelectorAll('tr:first-child > th, thead th')]
      .map(h => h.textContent.trim());
    let right = window.innerWidth, left = 0;
    for (let b = t; b && b !== main.parentElement; b = b.parentElement) {
      const st = getComputedStyle(b);
      if (!scrolls(st) || !b.clientWidth) continue;
      const r = b.getBoundingClientRect();
      left = Math.max(left, r.left + b.clientLeft);
      right = Math.min(right, r.left + b.clientLeft + b.clientWidth);
    }
    for (const n of cols) {
      const cells = [...t.querySelectorAll(`tr > :nth-child(${n})`)];
      if (!cells.length) { add('hidden-answer', 'no column ' + n + ' in the table: '
                               + head.join(' | ').slice(0, 100)); continue; }
      const rs = cells.map(c => c.getBoundingClientRect());
      const hi = Math.max(...rs.map(r => r.right)), lo = Math.min(...rs.map(r => r.left));
      if (hi > right + 1 || lo < left - 1)
        add('hidden-answer', `column "${head[n - 1] || n}" spans ${Math.round(lo)}–`
            + `${Math.round(hi)}px, the screen shows ${Math.round(left)}–`
            + `${Math.round(right)}px: ` + head.join(' | ').slice(0, 100));
    }
  }
  for (const pre of main.querySelectorAll('pre')) {
    if (pre.scrollWidth <= pre.clientWidth + 1 || !pre.getClientRects().length) continue;
    if (narrow) { counts.code++; continue; }  // an 80-column line cannot fit a phone
    const lines = pre.textContent.split('\n');
    const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
    add('wide-code', pre.scrollWidth + 'px > ' + pre.clientWidth + 'px: '
        + longest.trim().slice(0, 120));
  }
  const pageW = Math.max(document.documentElement.scrollWidth,
                         document.body.scrollWidth);
  if (pageW > window.innerWidth + 1)
    add('wide-page', 'page ' + pageW + 'px > window ' + window.innerWidth + 'px');
  // code a reader sees: a cell whose code is not folded away shows its lines
  const cells = [...main.querySelectorAll('div.cell')];
  const src = el => { const i = el.querySelector('.cell_input');
                      return i ? i.textContent : ''; };
  if (opts.lines) {
    for (const cell of cells) {
      const pre = cell.querySelector('.cell_input pre');
      if (!pre || cell.classList.contains('tag_show-code')) continue;
      if (pre.closest('details:not([open])') || !pre.getClientRects().length) continue;
      const n = pre.textContent.replace(/\n+$/, '').split('\n').length;
      if (n > opts.maxLines)
        add('long-cell', n + ' lines of code shown: '
            + pre.textContent.trim().split('\n')[0].slice(0, 120));
    }
  }
  // figures: a cell that draws one shows an image; the page shows as many as it draws
  const own = new Set();
  for (const cell of cells)
    for (const m of src(cell).matchAll(/\bdef\s+(\w+)/g)) own.add(m[1]);
  const callRe = /(?:\b([A-Za-z_]\w*)\.)?\b((?:plot|fig)_\w+|subplots|figure)\s*\(/g;
  let calls = 0, images = 0;
  for (const cell of cells) {
    let n = 0;
    for (const m of src(cell).replace(/#.*$/gm, '').matchAll(callRe)) {
      const [, owner, name] = m;
      if (name === 'subplots' || name === 'figure') { if (owner === 'plt') n++; }
      else if (!own.has(name)) n++;
    }
    const o = cell.querySelector('.cell_output');
    const k = o ? o.querySelectorAll('img').length : 0;
    calls += n; images += k;
    // a figure handed to glue() is shown by a numbered figure elsewhere on the page
    if (n && !k && !/\bglue\(/.test(src(cell))) add('missing-figure', 'no image from: '
                     + src(cell).trim().split('\n').slice(0, 3).join(' / ')
                       .slice(0, 160));
  }
  images += [...main.querySelectorAll('figure img')].filter(i => !i.closest('div.cell'))
    .length;
  if (images < calls)
    add('figure-count', images + ' images for ' + calls + ' figure calls');
  // the figures a cell shows, at the width they are displayed
  const figures = [...main.querySelectorAll('div.cell_output img, figure img')]
    .filter(img => img.complete && img.naturalWidth > 0)
    .map(img => ({src: img.src, natural: img.naturalWidth,
                  shown: img.getBoundingClientRect().width}));
  // where the headings are (the first, and a few down the page), for the screenshot
  const heads = [...main.querySelectorAll('h1, h2')]
    .filter(h => h.getBoundingClientRect().width > 8);
  const picks = [...new Set([0, 1, Math.floor(heads.length / 2), heads.length - 1])]
    .filter(i => i >= 0 && i < heads.length);
  const anchors = picks.map((i, k) => {
    const r = heads[i].getBoundingClientRect();
    heads[i].setAttribute('data-kwng-anchor', String(k));
    return {k, x: r.left + window.scrollX, y: r.top + window.scrollY,
            w: r.width, h: r.height};
  });
  // links, checked by the caller against the files on disk
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  return {defects: out, counts, figures, anchors, links};
}
