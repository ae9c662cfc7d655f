// actstore explorer: fills the server-rendered page from the JSON API under /api/.
// Every string from the store is written with textContent (never as markup), so a prompt holding
// <script> is shown as text.  Each view's state is in its URL (path and query string).
"use strict";

const V = document.getElementById("view");
const D = V ? V.dataset : {};
const S = encodeURIComponent(D.store || "");
const Q = new URLSearchParams(location.search);
const content = document.getElementById("content");

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "text") e.textContent = String(v);
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of kids) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
const svgEl = (tag, attrs) => {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
};

async function api(path, params) {
  const qs = params ? "?" + new URLSearchParams(Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== "")) : "";
  const r = await fetch(`/api/s/${S}${path}${qs}`);
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

function fmt(v, d = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") {
    if (!isFinite(v)) return "–";
    if (Number.isInteger(v)) return String(v);
    if (v !== 0 && (Math.abs(v) >= 1e6 || Math.abs(v) < 1e-3)) return v.toExponential(2);
    return v.toFixed(d);
  }
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (Array.isArray(v)) return "[" + v.slice(0, 8).map((x) => fmt(x, d)).join(", ") + (v.length > 8 ? ", …" : "") + "]";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}
const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
const ci = (v, lohi) => `${pct(v)} [${pct(lohi && lohi[0])}, ${pct(lohi && lohi[1])}]`;

function link(href, text) { return el("a", { href, text }); }
const storeUrl = (p) => `/s/${S}${p}`;
const promptUrl = (id, extra) => storeUrl(`/prompt/${encodeURIComponent(id)}`) + (extra ? "?" + new URLSearchParams(extra) : "");

function table(rows, cols, opts = {}) {
  const t = el("table", { class: "data" + (opts.cls ? " " + opts.cls : ""), id: opts.id });
  const head = el("tr");
  for (const c of cols) head.append(el("th", { text: (opts.headers || {})[c] || c }));
  t.append(el("thead", {}, head));
  const body = el("tbody");
  for (const r of rows) {
    const tr = el("tr");
    for (const c of cols) {
      const cell = (opts.cell && opts.cell(c, r)) ?? fmt(r[c]);
      // a long text (a prompt, a JSON value) is cut to one line of a wide column, the whole of it in
      // the cell's title (shown on hover) and its text (copied, searched): one row stays one line
      const text = cell instanceof Node ? cell.textContent : String(cell);
      const long = text.length > 40;
      tr.append(el("td", { class: long ? "long" : null, title: long ? text : null }, cell));
    }
    body.append(tr);
  }
  t.append(body);
  if (!rows.length) body.append(el("tr", {}, el("td", { colspan: cols.length, class: "empty", text: "none" })));
  return t;
}

function section(title, ...kids) { return el("section", {}, el("h2", { text: title }), ...kids); }
function note(text) { return el("p", { class: "note", text }); }
function failed(e) { return el("p", { class: "error", text: String(e.message || e) }); }

// Diverging: red positive, blue negative; sequential (attention, tracing): green.  Behind text
// (token rows) the strongest colour stays light (alpha <= 0.55), so that the dark text on it
// keeps a contrast of at least 5:1.
function colour(v, lim, diverging = true, strongest = 0.85) {
  if (v === null || v === undefined || !isFinite(v) || !lim) return "#f4f4f4";
  const a = (strongest * Math.min(1, Math.abs(v) / lim)).toFixed(3);
  if (!diverging) return `rgba(44, 160, 44, ${a})`;
  return v > 0 ? `rgba(214, 39, 40, ${a})` : `rgba(31, 119, 180, ${a})`;
}

// A colour bar: the scale of colour() from -lim (or 0) to lim, with its ends labelled.
function colourBar(lim, diverging = true, strongest = 0.85, label = "") {
  const bar = el("span", { class: "cbar" });
  const n = 11;
  for (let i = 0; i < n; i++) {
    const v = diverging ? -lim + (2 * lim * i) / (n - 1) : (lim * i) / (n - 1);
    bar.append(el("span", { class: "cstep", style: `background:${colour(v, lim, diverging, strongest)}`, title: fmt(v, 4) }));
  }
  return el("span", { class: "colourbar" }, el("span", { text: fmt(diverging ? -lim : 0, 3) + " " }), bar, el("span", { text: " " + fmt(lim, 3) + (label ? " " + label : "") }));
}

// Whitespace made visible: a space is ␣, a newline ↵, a tab ⇥ (the token's own text is in its title).
function visible(text) {
  return String(text ?? "").replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
}

// A layer x head heatmap; cells carry data-layer, data-head and data-value.
function heatmap(grid, opts = {}) {
  const flat = grid.flat().filter((v) => v !== null && isFinite(v));
  const lim = flat.length ? Math.max(...flat.map(Math.abs)) : 0;
  const hot = flat.length ? Math.max(...flat) : null;
  const t = el("table", { class: "heat", id: opts.id });
  const head = el("tr", {}, el("th", { text: opts.corner || "layer \\ head" }));
  const n = grid.length ? grid[0].length : 0;
  for (let h = 0; h < n; h++) head.append(el("th", { text: opts.colLabel ? opts.colLabel(h) : h }));
  t.append(head);
  grid.forEach((row, l) => {
    const tr = el("tr", {}, el("th", { text: opts.rowLabel ? opts.rowLabel(l) : l }));
    row.forEach((v, h) => {
      const td = el("td", {
        "data-layer": l, "data-head": h, "data-value": v === null ? "" : v,
        title: `${opts.rowName || "layer"} ${l}, ${opts.colName || "head"} ${h}: ${fmt(v, 4)}`,
        style: `background:${colour(v, lim, opts.diverging !== false)}`,
        class: (opts.onClick ? "click" : "") + (v !== null && v === hot ? " hottest" : "") + (opts.selected && opts.selected[0] === l && opts.selected[1] === h ? " selected" : ""),
      });
      if (opts.onClick) td.addEventListener("click", () => opts.onClick(l, h));
      tr.append(td);
    });
    t.append(tr);
  });
  const legend = el("p", { class: "legend", text: `max |value| ${fmt(lim, 4)}${opts.diverging !== false ? " · red positive, blue negative" : ""} ` });
  legend.append(colourBar(lim, opts.diverging !== false));
  return el("div", { class: "heatwrap" }, t, legend);
}

function pager(page, hasMore, go) {
  const p = el("div", { class: "pager" });
  p.append(el("button", { text: "◀ previous", disabled: page > 0 ? null : "disabled", on: { click: () => go(page - 1) } }));
  p.append(el("span", { text: ` page ${page + 1} ` }));
  p.append(el("button", { text: "next ▶", disabled: hasMore ? null : "disabled", on: { click: () => go(page + 1) } }));
  return p;
}

function setQuery(params) {
  const u = new URL(location.href);
  for (const [k, v] of Object.entries(params)) (v === null || v === undefined || v === "") ? u.searchParams.delete(k) : u.searchParams.set(k, v);
  history.replaceState(null, "", u);
}

// ------------------------------------------------------------------------------ views
const VIEWS = {};

VIEWS.store = async () => {
  const d = await api("/summary");
  if (D.corpus) return corpusHome(d);
  const g = d.geometry;
  const kv = [
    ["model", `${d.model} (${d.architecture})`], ["format", `v${d.format}`], ["rows", `${d.rows} of ${d.examples} examples, ${d.segments} segments${d.complete ? "" : " (incomplete)"}`],
    ["geometry", `L=${g.n_layers} H=${g.n_heads} H_kv=${g.n_kv_heads} d_head=${g.d_head} d_model=${g.d_model} d_mlp=${g.d_mlp} vocab=${g.vocab_size}`],
    ["storage dtype", d.storage_dtype], ["size on disk", d.size], ["of which weights", d.weights_size], ["url", d.url],
  ];
  content.replaceChildren(
    section("Store", table(kv.map(([k, v]) => ({ k, v })), ["k", "v"], { cls: "kv", headers: { k: "", v: "" } })),
    section("Analyses", table(Object.entries(d.analyses).map(([kind, runs]) => ({ kind, runs })), ["kind", "runs"])),
    section(`Relations (${d.relations.length})`, table(d.relations, Object.keys(d.relations[0] || { relation_id: 0 }), {
      id: "relations", cell: (c, r) => (c === "relation_id" ? link(storeUrl(`/relation/${encodeURIComponent(r.relation_id)}`), r.relation_id) : null),
    })),
    section("Tables", table(d.tables, ["table", "kind", "files", "rows"], { cell: (c, r) => (c === "table" ? link(storeUrl(`/table/${encodeURIComponent(r.table)}`), r.table) : null) })),
    section(`Runs (${d.n_runs})`, table(d.runs, ["run_id", "kind", "started", "seconds"])),
  );
};

async function headscoreSection(rel, run, target) {
  const d = await api("/headscores", { relation: rel, run });
  if (!d.grid) return section("HeadScore", note(d.note));
  const runSel = el("select", { id: "hs-run", on: { change: (e) => { setQuery({ run: e.target.value }); target.replaceChildren(); headscoreSection(rel, e.target.value, target).then((s) => target.replaceChildren(s)); } } });
  for (const r of d.runs) runSel.append(el("option", { value: r, text: r, selected: r === d.run_id ? "selected" : null }));
  const go = (l, h) => { location.href = storeUrl(`/head/${l}/${h}`) + "?" + new URLSearchParams(Object.entries({ relation: rel || "", run: d.run_id }).filter(([, v]) => v)); };
  return section(`HeadScore ${rel ? "of " + rel : "over all relations"} (layer × head)`,
    el("p", {}, "run ", runSel, ` · ${d.kind || ""} · ${d.n} predictions · click a head for its view`),
    heatmap(d.grid, { id: "headscore", onClick: d.per_layer ? null : go, colLabel: d.per_layer ? () => "layer" : null }));
}

VIEWS.relation = async () => {
  const rel = D.relation;
  const d = await api(`/relations/${encodeURIComponent(rel)}`, { run: Q.get("run") });
  const probes = table(d.probes, ["run_id", "kind", "setting", "n_queries", "accuracy", "f1", "run_accuracy"], {
    id: "probes", headers: { accuracy: "accuracy [95% CI]", f1: "F1 [95% CI]", run_accuracy: "run accuracy [95% CI]" },
    cell: (c, r) => (c === "accuracy" ? ci(r.accuracy, r.accuracy_ci95) : c === "f1" ? ci(r.f1, r.f1_ci95) : c === "run_accuracy" ? ci(r.run_accuracy, r.run_ci95) : null),
  });
  const conf = el("div", { class: "row" },
    el("div", {}, el("h3", { text: "its queries predicted as" }), table(d.confusions.predicted_as, ["relation_id", "relation_name", "n"])),
    el("div", {}, el("h3", { text: "other relations predicted as this one" }), table(d.confusions.mistaken_for_it, ["relation_id", "n"])));
  const pcols = d.predictors.length ? Object.keys(d.predictors[0]) : ["run_id", ...d.predictor_columns];
  const hs = el("div", { id: "hs-section" });
  const prompts = el("div", { id: "prompts" });
  content.replaceChildren(
    section("Probe accuracy and F1 per run", probes),
    section(`Confusions${d.confusion_run ? " (run " + d.confusion_run + ")" : ""}`, conf),
    section("Predictors", table(d.predictors, pcols)),
    hs,
    section(`Prompts (${d.prompts})`, prompts),
  );
  await Promise.all([
    promptList(prompts, rel),
    headscoreSection(rel, Q.get("run"), hs).then((s) => hs.replaceChildren(s)).catch((e) => hs.replaceChildren(failed(e))),
  ]);
};

async function promptList(target, rel) {
  const form = el("form", { class: "search" });
  const input = el("input", { type: "search", name: "q", value: Q.get("q") || "", placeholder: "search the prompts' text", id: "prompt-search" });
  form.append(input, el("button", { type: "submit", text: "search" }));
  const list = el("div");
  target.replaceChildren(form, list);
  // Without search text: pages by number.  With it: each answer says where the next page starts
  // (`next`, an example id); the ids of the pages seen are kept for "previous".
  const starts = [];
  const load = async (page) => {
    const q = input.value;
    setQuery({ q, page: !q && page ? page : null });
    const after = q ? (starts[page] ?? null) : null;
    const d = await api("/prompts", { relation: rel, q, page: q ? null : page, after, size: 25 });
    let count = `${d.total} prompts`;
    let more = (page + 1) * d.size < d.total;
    if (q) {
      starts[page + 1] = d.next;
      more = d.next !== null && d.next !== undefined;
      count = d.total !== null ? `${d.total} prompts contain "${q}"`
        : `${d.matched} matches among ${d.searched} of ${d.of} prompts searched by this page${more ? " (the next page searches on)" : ""}`;
    }
    list.replaceChildren(
      el("p", { text: count, id: "prompt-count" }),
      table(d.rows, Object.keys(d.rows[0] || { example_id: 0, text: 0 }), { id: "prompt-table", cell: (c, r) => (c === "example_id" ? link(promptUrl(r.example_id), r.example_id) : null) }),
      pager(page, more, load),
    );
  };
  form.addEventListener("submit", (e) => { e.preventDefault(); starts.length = 0; load(0).catch((x) => list.replaceChildren(failed(x))); });
  await load(Q.get("q") ? 0 : Number(Q.get("page") || 0));
}

VIEWS.heads = async () => {
  const rel = Q.get("relation");
  content.replaceChildren(await headscoreSection(rel, Q.get("run"), content));
};

VIEWS.head = async () => {
  const l = D.layer, h = D.head;
  const d = await api(`/heads/${l}/${h}`);
  const rel = Q.get("relation");
  const kids = [];
  if (d.headscores) kids.push(section(`Stored HeadScore per relation (run ${d.headscore_run})`, table(d.headscores, ["relation_id", "score", "n"], { id: "head-headscores", cell: (c, r) => (c === "relation_id" ? link(storeUrl(`/relation/${encodeURIComponent(r.relation_id)}`), r.relation_id) : null) })));
  if (d.maps) kids.push(section(`MAPS static scores (run ${d.maps_run})`, table(d.maps, Object.keys(d.maps[0] || { relation: 0, score: 0 }))));
  if (d.salient) kids.push(section("Salient tokens and top mappings", table(d.salient, Object.keys(d.salient[0] || { token: 0 }))));
  if (d.dynamic) kids.push(section("MAPS dynamic scores", table(d.dynamic, Object.keys(d.dynamic[0] || { relation: 0 }))));
  const sampled = d.sampled.rows < d.sampled.of ? ` (a sample of ${d.sampled.rows} of ${d.sampled.of} rows)` : ` (all ${d.sampled.of} rows)`;
  const top = rel ? d.top_prompts.filter((p) => p.relation_id === rel).concat(d.top_prompts.filter((p) => p.relation_id !== rel)) : d.top_prompts;
  kids.push(section("Prompts where this head's output is largest: |z_h W_O,h|" + sampled,
    table(top, ["example_id", "relation_id", "norm", "text"], { id: "top-prompts", cell: (c, r) => (c === "example_id" ? link(promptUrl(r.example_id, { layer: l, head: h }), r.example_id) : null) })));
  kids.push(section("Mean contribution norm per relation" + sampled, table(d.norm_per_relation, ["relation_id", "mean_norm", "n"])));
  content.replaceChildren(...kids);
};

function tokenRow(tokens, values, opts = {}) {
  const finite = values.filter((v) => v !== null && isFinite(v));
  const lim = finite.length ? Math.max(...finite.map(Math.abs)) : 0;
  const p = el("p", { class: "tokens", id: opts.id });
  tokens.forEach((t, j) => {
    const v = j < values.length ? values[j] : null;
    p.append(el("span", {
      class: "tok", "data-pos": j, "data-value": v === null ? "" : v, text: visible(t.text),
      title: `${j}: ${JSON.stringify(t.token)} ${fmt(v, 5)}`, style: `background:${colour(v, lim, opts.diverging !== false, 0.55)}`,
    }));
  });
  if (lim) p.append(el("span", { class: "legend" }, " ", colourBar(lim, opts.diverging !== false, 0.55)));
  return p;
}

VIEWS.prompt = async () => {
  const ex = D.exampleId;
  // both requests at once: the contributions may re-train the prediction's episode on the server
  const first = api(`/prompts/${encodeURIComponent(ex)}/contributions`, { run: Q.get("run"), layer: Q.get("layer"), head: Q.get("head") });
  first.catch(() => null);
  const d = await api(`/prompts/${encodeURIComponent(ex)}`);
  const e = d.example;
  const meta = table([e], Object.keys(e).filter((k) => k !== "text"), { id: "prompt-meta" });
  const kids = [section("Prompt", el("p", { class: "tokens plain", id: "prompt-tokens" }, ...d.tokens.map((t) => el("span", { class: "tok", text: t.text, title: `${t.position}: ${JSON.stringify(t.token)}` }))), meta)];
  const contrib = el("div", { id: "contrib" });
  kids.push(contrib);
  if (d.token_scores && d.token_scores.length) {
    const ts = d.token_scores[0];
    kids.push(section(`Stored TokenScore, summed over the probed layers (run ${ts.run_id}, episode ${ts.episode}: ${ts.relation_id} predicted as ${ts.predicted})`, tokenRow(d.tokens, ts.scores, { id: "stored-tokenscore" })));
  }
  if (d.predictions && d.predictions.length) kids.push(section("Probe predictions of this prompt", table(d.predictions, ["run_id", "n", "accuracy", "most_predicted", "mean_prob"])));
  for (const t of d.tracing) kids.push(section(`Causal tracing: ${t.component} (${t.value}, run ${t.run_id})`, heatmap(t.grid, { rowName: "position", colName: "layer", corner: "token \\ layer", diverging: false, rowLabel: (p) => (d.tokens[p] ? d.tokens[p].text : p) })));
  for (const t of d.patching) kids.push(section(`Activation patching: ${t.component} recovery (run ${t.run_id})`, heatmap(t.grid, { diverging: true, colLabel: t.grid[0] && t.grid[0].length === 1 ? () => "all" : null })));
  content.replaceChildren(...kids);
  await contributions(contrib, d, Q.get("run"), Q.get("layer"), Q.get("head"), first);
};

async function contributions(target, d, run, layer, head, pending) {
  let c;
  try { c = await (pending || api(`/prompts/${encodeURIComponent(D.exampleId)}/contributions`, { run, layer, head })); }
  catch (e) { target.replaceChildren(section("Per-source-token contributions", failed(e))); return; }
  setQuery({ run: c.run_id, layer: c.layer, head: c.head });
  const again = (r, l, h) => contributions(target, d, r, l, h);
  const kids = [];
  const lsel = el("select", { id: "c-layer" }), hsel = el("select", { id: "c-head" });
  for (let l = 0; l < d.layers; l++) lsel.append(el("option", { value: l, text: l, selected: l === c.layer ? "selected" : null }));
  for (let h = 0; h < d.heads; h++) hsel.append(el("option", { value: h, text: h, selected: h === c.head ? "selected" : null }));
  const change = () => again(c.run_id, lsel.value, hsel.value);
  lsel.addEventListener("change", change); hsel.addEventListener("change", change);
  const controls = el("p", {}, "layer ", lsel, " head ", hsel);
  if (c.runs.length) {
    const rsel = el("select", { id: "c-run", on: { change: (ev) => again(ev.target.value, null, null) } });
    for (const r of c.runs) rsel.append(el("option", { value: r, text: r, selected: r === c.run_id ? "selected" : null }));
    controls.prepend("probe run ", rsel, " ");
  }
  const what = c.mode === "probe"
    ? `Head ${c.layer}.${c.head}: each source token's contribution A·V·W_O read along the probe direction of this prompt's prediction (${c.relation_id} → ${c.predicted}, p=${typeof c.probability === "number" ? c.probability.toFixed(3) : "–"}, ${c.kind}, episode ${c.episode}); sum ${fmt(c.head_sum, 5)}`
    : `Head ${c.layer}.${c.head}: ${c.note}`;
  kids.push(controls, el("p", { class: "note", id: "contrib-caption", text: what }));
  kids.push(tokenRow(d.tokens.slice(0, c.n_src), c.values, { id: "contrib-tokens" }));
  const rows = c.values.map((v, j) => ({ position: j, token: d.tokens[j] ? d.tokens[j].text : "", contribution: v, attention: c.attention[j] }));
  kids.push(el("div", { class: "row" },
    table(rows, ["position", "token", "contribution", "attention"], { id: "contrib-table", cell: (col, r) => (col === "contribution" ? el("span", { "data-value": r.contribution, text: fmt(r.contribution, 6) }) : null) }),
    el("div", {}, el("h3", { text: "attention pattern A_h(t, j)" }), tokenRow(d.tokens.slice(0, c.n_src), c.attention, { id: "attention-tokens", diverging: false }))));
  if (c.mode === "probe") {
    kids.push(el("h3", { text: "This prediction's HeadScore (layer × head): click a head" }));
    kids.push(heatmap(c.headscore_grid, { id: "prompt-headscore", selected: [c.layer, c.per_layer ? 0 : c.head], onClick: (l, h) => again(c.run_id, l, c.per_layer ? c.head : h) }));
    kids.push(el("h3", { text: "TokenScore per probed layer (sum over heads)" }));
    c.token_scores.layers.forEach((l, i) => kids.push(el("div", { class: "tsrow" }, el("span", { class: "lbl", text: `layer ${l}` }), tokenRow(d.tokens.slice(0, c.n_src), c.token_scores.scores[i]))));
  }
  target.replaceChildren(section("Per-source-token contributions", ...kids));
}

VIEWS.methods = async () => {
  const page = Number(Q.get("page") || 0);
  const d = await api("/methods", { run: Q.get("run"), page, size: 50 });
  if (!d.run_id) { content.replaceChildren(note(d.note)); return; }
  const facts = d.facts.map((f) => ({ ...f, ...Object.fromEntries(d.methods.map((m) => [m, f.key_layer[m]])) }));
  content.replaceChildren(
    section(`Agreement between methods (run ${d.run_id})`, table(d.agreement, d.columns, { id: "agreement" })),
    section(`Per-fact key layer of each method (${d.total} facts)`, table(facts, ["example_id", "relation_id", "subject", "object", ...d.methods], { id: "facts", cell: (c, r) => (c === "example_id" ? link(promptUrl(r.example_id), r.example_id) : null) }),
      pager(page, (page + 1) * 50 < d.total, (p) => { setQuery({ page: p }); location.reload(); })),
  );
};

VIEWS.sql = async () => {
  const ta = el("textarea", { id: "sql-input", name: "q", rows: 5, spellcheck: "false" });
  ta.value = Q.get("q") || "SELECT relation_id, count(*) AS n FROM examples GROUP BY 1 ORDER BY 2 DESC";
  const out = el("div", { id: "sql-result" });
  const dl = el("p", { class: "downloads" });
  const run = async (page) => {
    setQuery({ q: ta.value, page: page || null });
    out.replaceChildren(el("p", { class: "loading", text: "running…" }));
    try {
      const d = await api("/sql", { q: ta.value, page, size: 100 });
      const rows = d.rows.map((r) => Object.fromEntries(d.columns.map((c, i) => [i, r[i]])));
      out.replaceChildren(table(rows, d.columns.map((_, i) => i), { id: "sql-table", headers: Object.fromEntries(d.columns.map((c, i) => [i, c])) }), pager(d.page, d.more, run));
      const q = encodeURIComponent(ta.value);
      dl.replaceChildren("download: ", el("a", { href: `/api/s/${S}/sql?format=csv&q=${q}`, id: "dl-csv", text: "CSV" }), " · ", el("a", { href: `/api/s/${S}/sql?format=parquet&q=${q}`, id: "dl-parquet", text: "Parquet" }));
    } catch (e) { out.replaceChildren(failed(e)); dl.replaceChildren(); }
  };
  const btn = el("button", { id: "sql-run", text: "run", on: { click: () => run(0) } });
  content.replaceChildren(section("SQL console (one read-only SELECT; the same sandbox as actstore sql)", ta, el("p", {}, btn), dl, out));
  if (Q.get("q")) await run(Number(Q.get("page") || 0));
};

// 20 colours (Tableau 20); past 20 categories the colours repeat with another marker shape (circle,
// square, triangle, diamond), so that no two categories share colour and shape (80 in all; more than
// that is said under the plot).
// (its 10 strong colours first, then their 10 light ones, so that a few categories are far apart)
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
  "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"];
const SHAPES = ["circle", "square", "triangle", "diamond"];
function marker(i, x, y, r) {
  const shape = SHAPES[Math.floor(i / PALETTE.length) % SHAPES.length], fill = PALETTE[i % PALETTE.length];
  if (shape === "circle") return svgEl("circle", { cx: x, cy: y, r, fill });
  if (shape === "square") return svgEl("rect", { x: x - r, y: y - r, width: 2 * r, height: 2 * r, fill });
  const pts = shape === "triangle" ? [[x, y - r * 1.2], [x + r * 1.1, y + r * 0.8], [x - r * 1.1, y + r * 0.8]] : [[x, y - r * 1.3], [x + r * 1.1, y], [x, y + r * 1.3], [x - r * 1.1, y]];
  return svgEl("polygon", { points: pts.map((p) => p.join(",")).join(" "), fill });
}
function markerSwatch(i) { const s = svgEl("svg", { width: 12, height: 12, class: "sw" }); s.append(marker(i, 6, 6, 5)); return s; }

VIEWS.features = async () => {
  const form = el("form", { class: "search", id: "features-form" });
  const field = (name, def, attrs = {}) => el("label", {}, name + " ", el("input", { name, value: Q.get(name) || def, size: 10, ...attrs }));
  const kind = el("select", { name: "kind" });
  for (const k of ["attn_head", "attn", "z", "attn_entity", "mlp", "mlp_group", "resid"]) kind.append(el("option", { value: k, text: k, selected: (Q.get("kind") || "attn_head") === k ? "selected" : null }));
  form.append(el("label", {}, "kind ", kind), field("layer", ""), field("head", ""), field("relations", ""), field("n", "500"), el("button", { type: "submit", text: "project" }));
  const out = el("div", { id: "features-plot" });
  content.replaceChildren(section("Features: PCA (2-D) of one kind at one layer, coloured by relation", form, out));
  const draw = async () => {
    const p = Object.fromEntries(new FormData(form));
    setQuery(p);
    out.replaceChildren(el("p", { class: "loading", text: "computing…" }));
    try {
      const d = await api("/features", p);
      const rels = [...new Set(d.points.map((q) => q.relation_id))].sort();
      const W = 720, H = 480, pad = 20, axis = 22;
      const xs = d.points.map((q) => q.x), ys = d.points.map((q) => q.y);
      const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
      const sx = (x) => axis + pad + ((x - x0) / (x1 - x0 || 1)) * (W - axis - 2 * pad), sy = (y) => H - axis - pad - ((y - y0) / (y1 - y0 || 1)) * (H - axis - 2 * pad);
      const svg = svgEl("svg", { width: W, height: H, class: "scatter" });
      // the axes: which principal component, and the share of the variance it explains
      const label = (text, attrs) => { const t = svgEl("text", { class: "axis", ...attrs }); t.textContent = text; svg.append(t); };
      label(`PC1 (${pct(d.explained[0])} of the variance)`, { x: W / 2, y: H - 6, "text-anchor": "middle" });
      label(`PC2 (${pct(d.explained[1])})`, { x: 14, y: H / 2, "text-anchor": "middle", transform: `rotate(-90 14 ${H / 2})` });
      for (const q of d.points) {
        const c = marker(rels.indexOf(q.relation_id), sx(q.x), sy(q.y), 4);
        c.setAttribute("data-example", q.example_id);
        const t = svgEl("title", {}); t.textContent = `${q.example_id} ${q.relation_id}: ${q.text}`; c.append(t);
        c.addEventListener("click", () => { location.href = promptUrl(q.example_id); });
        svg.append(c);
      }
      const legend = el("p", { class: "legend" });
      rels.forEach((r, i) => legend.append(markerSwatch(i), el("span", { text: ` ${r}  ` })));
      if (rels.length > PALETTE.length) legend.append(el("span", { class: "note", text: ` · ${rels.length} relations, ${PALETTE.length} colours: past ${PALETTE.length} a colour repeats with another marker shape${rels.length > PALETTE.length * SHAPES.length ? ` (past ${PALETTE.length * SHAPES.length}, colour and shape repeat too)` : ""}` }));
      out.replaceChildren(el("p", { text: `${d.n} prompts · ${d.kind} layer ${d.layer}${d.head !== null ? " head " + d.head : ""} · explained variance ${pct(d.explained[0])}, ${pct(d.explained[1])} · hover a point for its prompt, click to open it` }), svg, legend);
    } catch (e) { out.replaceChildren(failed(e)); }
  };
  form.addEventListener("submit", (e) => { e.preventDefault(); draw(); });
  await draw();
};

VIEWS.table = async () => {
  const page = Number(Q.get("page") || 0);
  const d = await api(`/tables/${encodeURIComponent(D.table)}`, { page, size: 50 });
  content.replaceChildren(section(`${d.total} rows`, table(d.rows, d.columns, { id: "table-rows" }), pager(page, (page + 1) * d.size < d.total, (p) => { setQuery({ page: p }); location.reload(); })));
};

// ------------------------------------------------------------------------------ corpus stores
// A corpus store (--positions all): a row is one token of a document.  Its home lists the documents,
// tokens, kinds and layers kept and the precomputed top-k runs, with a search over token text; its
// unit pages (MLP neuron, head, direction) show the top contexts, a histogram and the logit effects.
const unitUrl = (kind, layer, index, dir) => storeUrl(`/unit/${kind}/${layer}/${index}`) + (dir ? "?" + new URLSearchParams({ direction: dir }) : "");
const docUrl = (doc, extra) => storeUrl(`/document/${encodeURIComponent(doc)}`) + (extra ? "?" + new URLSearchParams(Object.entries(extra).filter(([, v]) => v !== null && v !== undefined && v !== "")) : "");

// A context: tokens coloured by the unit's value (the top token outlined), each a link to its document.
function contextRow(toks, lim, doc, unit) {
  const p = el("span", { class: "tokens ctx" });
  for (const t of toks) {
    p.append(el("span", {
      class: "tok" + (t.at ? " at" : ""), "data-value": t.value ?? "", text: visible(t.token),
      title: `${JSON.stringify(t.token)} ${fmt(t.value, 4)}`, style: `background:${colour(t.value, lim, true, 0.55)}`,
    }));
  }
  return p;
}

async function corpusHome(d0) {
  const d = await api("/corpus");
  const g = d.geometry;
  const kept = Object.entries(d.kept).map(([kind, layers]) => ({ kind, layers: layers.join(", ") }));
  const kv = [["model", `${d0.model} (${d0.architecture})`], ["documents", d.documents], ["tokens", d.tokens], ["dataset", d.dataset], ["context length", d.context_length],
    ["attention sources", d.sources ? `the top ${d.sources} per token and head (a document shows a head's pattern)` : "none (ingest with --sources K to keep them)"],
    ["geometry", `L=${g.n_layers} H=${g.n_heads} d_head=${g.d_head} d_model=${g.d_model} d_mlp=${g.d_mlp} vocab=${g.vocab_size}`], ["storage dtype", d0.storage_dtype], ["size on disk", d0.size], ["of which weights", d0.weights_size], ["url", d0.url]];
  // units to open: the first neurons and heads of each layer kept, and each direction served
  const units = el("div", { id: "units" });
  for (const l of d.kept.mlp || []) units.append(el("p", {}, `MLP layer ${l}: `, ...Array.from({ length: Math.min(8, g.d_mlp) }, (_, i) => [link(unitUrl("mlp", l, i), `neuron ${i}`), " "]).flat(), "…"));
  for (const l of d.kept.z || []) units.append(el("p", {}, `heads of layer ${l}: `, ...Array.from({ length: g.n_heads }, (_, h) => [link(unitUrl("head", l, h), `${l}.${h}`), " "]).flat()));
  for (const [name, info] of Object.entries(d.directions)) for (const l of d.kept.resid || []) units.append(el("p", {}, `direction ${name} (${info.units}) at residual ${l}: `, ...Array.from({ length: Math.min(8, info.units) }, (_, i) => [link(unitUrl("direction", l, i, name), `${name}[${i}]`), " "]).flat()));
  const form = el("form", { class: "search", id: "unit-form" });
  const kind = el("select", { name: "kind" }); for (const k of ["mlp", "head", "direction"]) kind.append(el("option", { value: k, text: k }));
  const inp = (name, size = 5) => el("input", { name, size });
  form.append(el("label", {}, "unit ", kind), el("label", {}, "layer ", inp("layer")), el("label", {}, "index ", inp("index")), el("label", {}, "direction ", inp("direction", 12)), el("button", { type: "submit", text: "open" }));
  form.addEventListener("submit", (e) => { e.preventDefault(); const f = Object.fromEntries(new FormData(form)); location.href = unitUrl(f.kind, f.layer, f.index, f.kind !== "mlp" && f.direction ? f.direction : null); });
  const sform = el("form", { class: "search", id: "token-search" }, el("label", {}, "token text ", el("input", { type: "search", name: "q", value: Q.get("q") || "" })), el("button", { type: "submit", text: "search" }));
  const hits = el("div", { id: "token-hits" });
  const search = async (q) => {
    if (!q) return;
    const r = await api("/tokens", { q, size: 50 });
    hits.replaceChildren(table(r.hits, ["row", "document", "position", "context"], {
      cell: (c, h) => c === "document" ? link(docUrl(h.document, { row: h.row }), h.document) : c === "context" ? el("span", { class: "tokens" }, visible(h.before), el("b", { text: visible(h.token) }), visible(h.after)) : null,
    }), note(`${r.hits.length} positions (the first 50 at most)`));
  };
  sform.addEventListener("submit", (e) => { e.preventDefault(); const q = new FormData(sform).get("q"); setQuery({ q }); search(q); });
  content.replaceChildren(
    section("Corpus", table(kv.map(([k, v]) => ({ k, v })), ["k", "v"], { cls: "kv", headers: { k: "", v: "" } })),
    section("Kept at every position", table(kept, ["kind", "layers"], { id: "kept" })),
    section(`Precomputed top-k runs (${d.topk.length})`, d.topk.length ? table(d.topk, ["run_id", "kind", "layer", "units", "k"], { id: "topk-runs",
      cell: (c, r) => c === "layer" ? link(unitUrl(r.kind === "attn_head" ? "head" : r.kind, r.layer, 0), r.layer) : null }) : note("none: unit pages compute their top contexts on demand (actstore topk STORE --kind mlp --layer L precomputes them)")),
    section("Units", units, form),
    section("Search the tokens", sform, hits),
    section("Documents", table(d.first_documents, ["document", "tokens"], { id: "documents", cell: (c, r) => c === "document" ? link(docUrl(r.document), r.document) : null }), note(d.documents > 50 ? `the first 50 of ${d.documents}` : "")),
    section("Tables", table(d0.tables, ["table", "kind", "files", "rows"], { cell: (c, r) => (c === "table" ? link(storeUrl(`/table/${encodeURIComponent(r.table)}`), r.table) : null) })),
    section(`Runs (${d0.n_runs})`, table(d0.runs, ["run_id", "kind", "started", "seconds"])),
  );
  if (Q.get("q")) await search(Q.get("q"));
}

function histogram(h, id) {
  const W = 520, H = 140, pad = 24;
  const svg = svgEl("svg", { width: W, height: H + pad, class: "hist", id });
  const max = Math.max(1, ...h.counts);
  const bw = (W - pad) / Math.max(1, h.counts.length);
  h.counts.forEach((c, i) => {
    const r = svgEl("rect", { x: pad + i * bw, y: H - (H - 10) * (c / max), width: Math.max(1, bw - 1), height: (H - 10) * (c / max), fill: h.edges[i + 1] > 0 ? "#d62728" : "#1f77b4" });
    const t = svgEl("title", {}); t.textContent = `${fmt(h.edges[i], 4)} .. ${fmt(h.edges[i + 1], 4)}: ${c}`; r.append(t); svg.append(r);
  });
  const lab = (text, x, anchor) => { const t = svgEl("text", { x, y: H + 16, "text-anchor": anchor, class: "axis" }); t.textContent = text; svg.append(t); };
  if (h.edges.length) { lab(fmt(h.edges[0], 3), pad, "start"); lab(fmt(h.edges[h.edges.length - 1], 3), W, "end"); }
  return svg;
}

VIEWS.unit = async () => {
  const dir = Q.get("direction");
  const d = await api(`/units/${D.kind}/${D.layer}/${D.index}`, { direction: dir });
  const lim = Math.max(1e-12, ...d.top.flatMap((t) => (t.tokens || []).map((x) => Math.abs(x.value ?? 0))));
  const rows = d.top.map((t, i) => ({ rank: i, value: t.value, document: t.document, position: t.position, context: t }));
  const kids = [
    el("p", { class: "sub", id: "unit-label", text: `${d.label} · top contexts ${d.source}` }),
    section(`Top ${d.top.length} activating contexts`, table(rows, ["rank", "value", "document", "context"], { id: "top-contexts",
      cell: (c, r) => c === "document" ? link(docUrl(r.document, { row: r.context.row, kind: d.kind, layer: d.layer, index: d.index, direction: dir }), r.document) : c === "context" ? contextRow(r.context.tokens || [], lim) : null }),
    el("p", { class: "legend" }, "the unit's value on each token of the context (the top token outlined): ", colourBar(lim, true, 0.55))),
  ];
  const h = d.histogram;
  kids.push(section("Activation histogram", histogram(h, "histogram"), note(`${h.n} positions (a block sample of the store's ${h.of}) · active (${h.active_rule}): ${pct(h.active)}`)));
  if (d.logits) {
    kids.push(section(`Logit effects (through the ${d.logits.through})`, el("div", { class: "row" },
      el("div", {}, el("h3", { text: "promoted" }), table(d.logits.promoted.map((r) => ({ ...r, token: visible(r.token) })), ["token", "token_id", "logit"], { id: "promoted" })),
      el("div", {}, el("h3", { text: "suppressed" }), table(d.logits.suppressed.map((r) => ({ ...r, token: visible(r.token) })), ["token", "token_id", "logit"], { id: "suppressed" })))));
  } else kids.push(section("Logit effects", note(d.logits_note || "the store holds no unembedding")));
  content.replaceChildren(...kids);
};

VIEWS.document = async () => {
  const p = { kind: Q.get("kind"), layer: Q.get("layer"), index: Q.get("index"), direction: Q.get("direction") };
  const d = await api(`/documents/${D.document}`, p);
  const at = Number(Q.get("row"));
  const vals = d.values || [];
  const finite = vals.filter((v) => v !== null && isFinite(v));
  const lim = finite.length ? Math.max(...finite.map(Math.abs)) : 0;
  const tp = el("p", { class: "tokens", id: "doc-tokens" });
  d.tokens.forEach((t, j) => {
    if (t.space_before) tp.append(" ");
    const v = d.values ? vals[j] : null;
    tp.append(el("span", { class: "tok" + (t.row === at ? " at" : ""), "data-row": t.row, "data-value": v ?? "", text: visible(t.token),
      title: `row ${t.row} ${JSON.stringify(t.token)}${d.values ? " " + fmt(v, 4) : ""}`, style: `background:${colour(v, lim, true, 0.55)}` }));
  });
  const form = el("form", { class: "search", id: "doc-unit" });
  const kind = el("select", { name: "kind" }); for (const k of ["", "mlp", "head", "direction"]) kind.append(el("option", { value: k, text: k || "(none)", selected: (p.kind || "") === k ? "selected" : null }));
  const inp = (name, size = 5) => el("input", { name, size, value: p[name] || "" });
  form.append(el("label", {}, "unit ", kind), el("label", {}, "layer ", inp("layer")), el("label", {}, "index ", inp("index")), el("label", {}, "direction ", inp("direction", 12)), el("button", { type: "submit", text: "colour" }));
  form.addEventListener("submit", (e) => { e.preventDefault(); const f = Object.fromEntries(new FormData(form)); location.href = docUrl(D.document, { ...f, row: Q.get("row") }); });
  const kids = [section(d.unit ? `Tokens coloured by ${d.unit}` : "Tokens (choose a unit to colour them)", form, tp,
    lim ? el("p", { class: "legend" }, colourBar(lim, true, 0.55, "· red positive, blue negative")) : null,
    d.more ? note("the document's first tokens only") : null,
    d.unit ? el("p", {}, link(unitUrl(p.kind, p.layer, p.index, p.direction), `the ${d.unit} unit page`)) : null)];
  kids.push(await attentionSection(d.attention));
  content.replaceChildren(...kids);
};

// A head's attention pattern over the document (CircuitsVis-like), from the stored top-K sources:
// a query x key grid (green: the weight, 0 .. the largest shown), each token's kept mass beside its row, and the text
// coloured by the weights from one token (click a row or a token to choose it).
async function attentionSection(info) {
  if (!info || !info.sources) return section("Attention pattern", note(info ? info.note : "no attention stored"));
  const layer = Q.get("att_layer") ?? String(info.layers[0]);
  const head = Q.get("att_head") ?? "0";
  const form = el("form", { class: "search", id: "att-form" });
  const ls = el("select", { name: "att_layer" }); for (const l of info.layers) ls.append(el("option", { value: l, text: l, selected: String(l) === layer ? "selected" : null }));
  const hs = el("select", { name: "att_head" }); for (let h = 0; h < info.heads; h++) hs.append(el("option", { value: h, text: h, selected: String(h) === head ? "selected" : null }));
  form.append(el("label", {}, "layer ", ls), el("label", {}, "head ", hs), el("button", { type: "submit", text: "show" }));
  form.addEventListener("submit", (e) => { e.preventDefault(); const f = Object.fromEntries(new FormData(form)); setQuery(f); location.reload(); });
  let a;
  try { a = await api(`/documents/${D.document}/attention`, { layer, head, start: Q.get("att_start") ?? "0" }); } catch (e) { return section("Attention pattern", form, failed(e)); }
  const lim = Math.max(1e-6, a.max_weight), n = a.tokens.length, c = Math.max(3, Math.min(14, Math.floor(560 / Math.max(1, n)))), mw = 60;
  const labels = n <= 80, left = labels ? 96 : 4, top = labels ? 64 : 0;  // token labels on both axes
  const svg = svgEl("svg", { width: left + n * c + 8 + mw, height: top + n * c + 4, id: "att-grid", class: "attgrid" });
  svg.append(svgEl("rect", { x: left, y: top, width: n * c, height: n * c, fill: "#fafafa", stroke: "#ccc" }));
  const short = (t) => { const v = visible(t); return v.length > 12 ? v.slice(0, 11) + "…" : v; };
  if (labels) a.tokens.forEach((t, j) => {
    const rl = svgEl("text", { x: left - 4, y: top + j * c + c * 0.8, "text-anchor": "end", class: "axis" }); rl.textContent = short(t); svg.append(rl);
    const cx = left + j * c + c * 0.7, cl = svgEl("text", { x: cx, y: top - 4, transform: `rotate(-60 ${cx} ${top - 4})`, class: "axis" }); cl.textContent = short(t); svg.append(cl);
  });
  const strip = el("p", { class: "tokens plain", id: "att-tokens" });
  const spans = a.tokens.map((t, j) => el("span", { class: "tok", "data-index": j, "data-row": a.rows[j], text: visible(t), title: `row ${a.rows[j]} ${JSON.stringify(t)}` }));
  const info2 = el("p", { class: "note", id: "att-from" });
  const mark = svgEl("rect", { x: left - 1, width: n * c + 2, height: c, fill: "none", stroke: "#111", "stroke-width": 1.5, id: "att-chosen" });
  const choose = (t) => {
    mark.setAttribute("y", top + t * c);
    const w = new Map(a.sources[t].map(([j, v]) => [j, v]));
    spans.forEach((sp, j) => { sp.style.background = j === t ? "" : colour(w.get(j) ?? null, lim, false, 0.55); sp.classList.toggle("at", j === t); sp.dataset.weight = w.get(j) ?? ""; });
    info2.textContent = `weights from token ${a.start + t} (${visible(a.tokens[t])}, row ${a.rows[t]}): kept mass ${fmt(a.mass[t], 3)} on ${a.sources[t].length} source(s)`;
  };
  spans.forEach((sp, j) => { sp.addEventListener("click", () => choose(j)); strip.append(sp); });
  a.sources.forEach((src, t) => {
    for (const [j, w] of src) {
      const r = svgEl("rect", { x: left + j * c, y: top + t * c, width: c, height: c, fill: colour(w, lim, false, 1), class: "att", "data-t": t, "data-j": j, "data-weight": w });
      const tt = svgEl("title", {}); tt.textContent = `${visible(a.tokens[t])} (${a.start + t}) <- ${visible(a.tokens[j])} (${a.start + j}): ${fmt(w, 4)}`; r.append(tt); svg.append(r);
    }
    const m = svgEl("rect", { x: left + n * c + 8, y: top + t * c, width: Math.max(0.5, mw * a.mass[t]), height: Math.max(1, c - 1), fill: "#888", class: "mass", "data-t": t, "data-mass": a.mass[t] });
    const mt = svgEl("title", {}); mt.textContent = `kept mass ${fmt(a.mass[t], 4)}`; m.append(mt); svg.append(m);
    const hit = svgEl("rect", { x: left, y: top + t * c, width: n * c, height: c, fill: "transparent" });
    hit.addEventListener("click", () => choose(t)); svg.append(hit);
  });
  for (let t = 1; t < n; t++) if (a.windows[t] !== a.windows[t - 1]) svg.append(svgEl("line", { x1: left, x2: left + n * c, y1: top + t * c, y2: top + t * c, stroke: "#999", "stroke-dasharray": "2,2" }));
  svg.append(mark);  // the chosen query token's row, outlined
  const at = a.rows.indexOf(Number(Q.get("row")));
  choose(at >= 0 ? at : n - 1);
  return section(`Attention pattern of head ${a.layer}.${a.head}`, form,
    el("p", { class: "sub", id: "att-kept", text: `kept: ${a.kept}. Rows are query tokens, columns key tokens (document order); the grey bar beside a row is its kept mass (1 = all of it); the outlined row is the chosen token's.` }),
    el("div", { class: "row" }, svg),
    el("p", { class: "legend", id: "att-legend" }, "attention weight (the scale ends at the largest kept weight shown): ", colourBar(lim, false, 1), " · text below: weights from the chosen token (outlined) ", colourBar(lim, false, 0.55)),
    info2, strip,
    a.start || a.more ? el("div", { id: "att-pages" }, note(`tokens ${a.start}..${a.start + n - 1} of the document (${a.page_tokens} at a time; sources before token ${a.start} count in the kept mass but are not drawn)`),
      el("div", { class: "pager" }, ...[["◀ earlier", a.start > 0, Math.max(0, a.start - a.page_tokens)], ["later ▶", a.more, a.start + n]].map(([text, on, to]) =>
        el("button", { text, disabled: on ? null : "disabled", on: { click: () => { setQuery({ att_start: to }); location.reload(); } } })))) : null);
}

if (V && VIEWS[D.view]) {
  VIEWS[D.view]().then(() => document.body.setAttribute("data-ready", "1")).catch((e) => { content.replaceChildren(failed(e)); document.body.setAttribute("data-ready", "error"); });
}
