// embedpool pooler playground: plain browser JavaScript, no build step, no external requests.
// It uses only the public HTTP API of the server that serves it.
"use strict";

const $ = (id) => document.getElementById(id);
const DEFAULT_POOLERS = ["mean", "cls", "tokens", "cluster"];
const BYTES = { float32: (d) => 4 * d, float16: (d) => 2 * d, int8: (d) => d, binary: (d) => Math.ceil(d / 8) };
const state = { mode: "texts", info: null };

// ------------------------------------------------------------------ API
async function api(method, path, body) {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = typeof data.error === "string" ? data.error : (data.error && data.error.message) || response.statusText;
    throw new Error(`${method} ${path}: ${response.status} ${message}`);
  }
  return data;
}

// ------------------------------------------------------------------ scores
function dot(a, b) {
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i] * b[i];
  return s;
}

function cosine(a, b) {
  return dot(a, b) / (Math.sqrt(dot(a, a) * dot(b, b)) || 1);
}

// MaxSim of a's vectors against b's, as a mean over a's vectors (the /rerank score).
function maxsim(a, b) {
  let total = 0;
  for (const q of a) {
    let best = -Infinity;
    for (const d of b) best = Math.max(best, dot(q, d));
    total += best;
  }
  return total / a.length;
}

function similarity(a, b, multi) {
  return multi ? maxsim(a, b) : cosine(a, b);
}

// ------------------------------------------------------------------ rendering helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function heatColor(x) { // -> white (low) .. blue (high), on [0, 1] clamped
  const t = Math.max(0, Math.min(1, x));
  return `hsl(215, 80%, ${Math.round(97 - 52 * t)}%)`;
}

function short(text, n = 90) {
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

function ranking(ranks, texts) {
  const list = el("ol", { class: "ranking" });
  for (const r of ranks) {
    list.append(el("li", { "data-index": r.index, "data-score": String(r.score) },
      el("span", { class: "score", text: r.score.toFixed(4) }),
      el("span", { class: "text", title: texts[r.index], text: `T${r.index + 1} ${short(texts[r.index])}` })));
  }
  return list;
}

function heatmap(vectors, multi) {
  const n = vectors.length;
  const table = el("table", { class: "heatmap" });
  const head = el("tr", {}, el("th"));
  for (let j = 0; j < n; j++) head.append(el("th", { text: `T${j + 1}` }));
  table.append(head);
  const values = vectors.map((a) => vectors.map((b) => similarity(a, b, multi)));
  const off = values.flatMap((row, i) => row.filter((_, j) => j !== i));
  const lo = Math.min(...off), hi = Math.max(...off);
  for (let i = 0; i < n; i++) {
    const row = el("tr", {}, el("th", { text: `T${i + 1}` }));
    for (let j = 0; j < n; j++) {
      const v = values[i][j];
      const cell = el("td", { "data-row": i, "data-col": j, "data-score": String(v), title: v.toFixed(6), text: v.toFixed(2) });
      cell.style.background = i === j ? "#eef0f4" : heatColor(hi > lo ? (v - lo) / (hi - lo) : 0.5);
      if (i !== j && (v - lo) / ((hi - lo) || 1) > 0.6) cell.style.color = "#fff";
      row.append(cell);
    }
    table.append(row);
  }
  return table;
}

function sizes(embeddings, multi, precision) {
  const table = el("table", { class: "sizes" }, el("tr", {}, el("th", { text: "text" }), el("th", { text: "vectors" }),
    el("th", { text: `bytes (${precision})` })));
  let total = 0;
  embeddings.forEach((e, i) => {
    const count = multi ? e.length : 1;
    const dim = multi ? e[0].length : e.length;
    const bytes = count * BYTES[precision](dim);
    total += bytes;
    table.append(el("tr", { "data-text": i }, el("td", { text: `T${i + 1}` }), el("td", { class: "vectors", text: String(count) }),
      el("td", { class: "bytes", text: bytes.toLocaleString("en-US") })));
  });
  table.append(el("tr", {}, el("td", { text: "total" }), el("td"), el("td", { class: "bytes", text: total.toLocaleString("en-US") })));
  return table;
}

// ------------------------------------------------------------------ the two modes
function poolerCard(result, ranks, texts, precision) {
  const multi = result.multi_vector;
  return el("article", { class: "card", "data-pooler": result.pooler },
    el("h2", { text: result.pooler }),
    el("span", { class: "badge", text: multi ? "multi-vector" : "single vector" }),
    el("span", { class: "badge", text: multi ? "MaxSim" : "cosine" }),
    el("h3", { text: "ranked for the query (POST /rerank)" }), ranking(ranks, texts),
    el("h3", { text: "similarity of the texts" }), heatmap(result.embeddings, multi),
    el("h3", { text: "vectors per text" }), sizes(result.embeddings, multi, precision));
}

function chosenPoolers() {
  const ticked = [...document.querySelectorAll("#pooler-choices input:checked")].map((x) => x.value);
  const extra = $("extra-poolers").value.split(",").map((s) => s.trim()).filter(Boolean);
  return [...new Set([...ticked, ...extra])];
}

async function runTexts() {
  const query = $("query").value;
  const texts = $("texts").value.split("\n").map((s) => s.trim()).filter(Boolean);
  const poolers = chosenPoolers();
  if (!texts.length) throw new Error("give at least one text (one per line)");
  if (!poolers.length) throw new Error("choose at least one pooler");
  const embedded = await api("POST", "/embed", { inputs: texts, poolers, truncate: true });
  const cards = [];
  for (const result of embedded.results) {
    const ranks = await api("POST", "/rerank", { query, texts, pooler: result.pooler, truncate: true });
    cards.push(poolerCard(result, ranks, texts, $("precision").value));
  }
  $("results").replaceChildren(...cards);
}

async function runCollections() {
  const query = $("query").value;
  const names = [...document.querySelectorAll("#collection-choices input:checked")].map((x) => x.value);
  if (!names.length) throw new Error("choose at least one collection");
  const k = Number($("k").value) || 5;
  const cards = [];
  for (const name of names) {
    const info = await api("GET", `/collections/${encodeURIComponent(name)}`);
    const found = await api("POST", `/collections/${encodeURIComponent(name)}/search`, { query, k });
    const list = el("ol", { class: "ranking" });
    for (const hit of found.hits) {
      list.append(el("li", { "data-id": hit.id, "data-score": String(hit.score) },
        el("span", { class: "score", text: hit.score.toFixed(4) }),
        el("span", { class: "text", title: hit.text || "", text: `${hit.id} ${short(hit.text || "")}` })));
    }
    cards.push(el("article", { class: "card", "data-collection": name },
      el("h2", { text: name }), el("span", { class: "badge", text: info.pooler }),
      el("span", { class: "badge", text: `${info.kind} · ${info.documents} documents` }),
      el("h3", { text: "top results" }), list));
  }
  $("results").replaceChildren(...cards);
}

async function run() {
  const button = $("run");
  button.disabled = true;
  document.body.dataset.state = "running";
  $("error").hidden = true;
  try {
    await (state.mode === "texts" ? runTexts() : runCollections());
    document.body.dataset.state = "done";
  } catch (err) {
    $("error").textContent = err.message;
    $("error").hidden = false;
    document.body.dataset.state = "error";
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ set-up
function setMode(mode) {
  state.mode = mode;
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.mode === mode);
  $("texts-mode").hidden = mode !== "texts";
  $("collection-mode").hidden = mode !== "collection";
  if (mode === "collection") loadCollections().catch(showError);
}

function checkbox(container, value, checked, label = value) {
  const input = el("input", { type: "checkbox", value });
  input.checked = checked;
  container.append(el("label", {}, input, label));
}

async function loadCollections() {
  const { collections } = await api("GET", "/collections");
  const box = $("collection-choices");
  box.replaceChildren();
  if (!collections.length) box.append(el("span", { class: "muted", text: "none yet: create one with POST /collections" }));
  for (const c of collections) checkbox(box, c.name, false, `${c.name} (${c.pooler})`);
}

function showError(err) {
  $("error").textContent = err.message;
  $("error").hidden = false;
}

async function connect() {
  document.body.dataset.state = "connecting";
  $("error").hidden = true;
  try {
    state.info = await api("GET", "/info");
  } catch (err) {
    $("status").textContent = "not connected";
    showError(err);
    document.body.dataset.state = "error";
    return;
  }
  const info = state.info;
  $("status").textContent = `${info.model} · ${info.dim} dimensions · window ${info.max_length} tokens · ${info.status}`;
  const box = $("pooler-choices");
  box.replaceChildren();
  for (const p of info.poolers) {
    if (p.learned) continue; // attention, multilayer: need trained weights to differ from mean
    checkbox(box, p.name, DEFAULT_POOLERS.includes(p.name));
  }
  document.body.dataset.state = "ready";
}

function setup() {
  $("api-key").value = sessionStorage.getItem("embedpool-key") || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("embedpool-key", $("api-key").value);
    connect();
  });
  for (const tab of document.querySelectorAll(".tab")) tab.onclick = () => setMode(tab.dataset.mode);
  $("run").onclick = run;
  connect();
}

setup();
