// The attention explorer: translate with POST /translate, fetch every attention weight of the first sentence with
// POST /attention, and draw one heatmap (kind, layer, head or the mean of heads) as an HTML table.
"use strict";

const $ = (id) => document.getElementById(id);
let attention = null; // the /attention response: pieces and weights [layer][head][query][key]

async function postJSON(path, body) {
  const response = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
                                      body: JSON.stringify(body)});
  const data = await response.json();
  if (!response.ok) throw new Error((data.field ? data.field + ": " : "") + (data.error || response.statusText));
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// Light to dark blue, like matplotlib's "Blues": weight 0 is almost white, 1 is dark.
function colour(weight) {
  const w = Math.max(0, Math.min(1, weight));
  const from = [247, 251, 255], to = [8, 48, 107];
  const rgb = from.map((c, i) => Math.round(c + (to[i] - c) * Math.sqrt(w)));
  return `rgb(${rgb.join(",")})`;
}

function labels(kind) {
  if (kind === "encoder_self") return [attention.src_pieces, attention.src_pieces];
  if (kind === "decoder_self") return [attention.tgt_in_pieces, attention.tgt_in_pieces];
  return [attention.tgt_out_pieces, attention.src_pieces];
}

// The (query x key) matrix of the chosen kind, layer and head; "mean" averages the heads.
function currentMatrix() {
  const heads = attention[$("kind").value][Number($("layer").value)];
  const head = $("head").value;
  if (head !== "mean") return heads[Number(head)];
  return heads[0].map((row, q) => row.map((_, k) => heads.reduce((sum, h) => sum + h[q][k], 0) / heads.length));
}

function fillSelect(select, values, texts, keep) {
  const previous = select.value;
  select.innerHTML = "";
  values.forEach((value, i) => select.add(new Option(texts[i], String(value))));
  if (keep && values.map(String).includes(previous)) select.value = previous;
}

function setupControls() {
  const kind = $("kind").value;
  const nLayers = attention[kind].length, nHeads = attention[kind][0].length;
  const layers = [...Array(nLayers).keys()];
  fillSelect($("layer"), layers, layers.map(String), true);
  if (!$("layer").dataset.touched) $("layer").value = String(nLayers - 1);
  const heads = [...Array(nHeads).keys(), "mean"];
  fillSelect($("head"), heads, heads.map((h) => (h === "mean" ? "mean of heads" : String(h))), true);
}

function pieceSpans(container, pieces, onHover) {
  container.innerHTML = "";
  pieces.forEach((piece, i) => {
    const span = document.createElement("span");
    span.className = "piece";
    span.textContent = piece;
    span.dataset.index = i;
    if (onHover) span.addEventListener("mouseenter", () => onHover(i));
    container.appendChild(span);
  });
}

// Shade the key pieces (strip and column headers) by the weights of query row `q`.
function highlight(q) {
  const row = currentMatrix()[q];
  document.querySelectorAll("#key-pieces .piece, #heatmap th.col").forEach((el) => {
    const w = row[Number(el.dataset.index)];
    el.style.setProperty("--w", w.toFixed(3));
    el.dataset.highlight = String(w);
  });
  document.querySelectorAll("#query-pieces .piece, #heatmap th.row").forEach((el) => {
    el.classList.toggle("active", Number(el.dataset.index) === q);
  });
}

function draw() {
  const kind = $("kind").value;
  const [rows, cols] = labels(kind);
  const matrix = currentMatrix();
  const names = {cross: ["target", "source"], encoder_self: ["source", "source"], decoder_self: ["target", "target"]};
  $("query-label").textContent = names[kind][0] + " (query)";
  $("key-label").textContent = names[kind][1] + " (key)";
  pieceSpans($("query-pieces"), rows, highlight);
  pieceSpans($("key-pieces"), cols, null);

  const table = $("heatmap");
  table.innerHTML = "";
  const head = table.createTHead().insertRow();
  head.appendChild(document.createElement("th"));
  cols.forEach((piece, k) => {
    const th = document.createElement("th");
    th.className = "col";
    th.textContent = piece;
    th.dataset.index = k;
    head.appendChild(th);
  });
  const body = table.createTBody();
  rows.forEach((piece, q) => {
    const tr = body.insertRow();
    tr.className = "row";
    const th = document.createElement("th");
    th.className = "row";
    th.textContent = piece;
    th.dataset.index = q;
    tr.appendChild(th);
    matrix[q].forEach((w, k) => {
      const td = tr.insertCell();
      td.className = "cell";
      td.dataset.weight = String(w);
      td.style.background = colour(w);
      td.title = `${piece} → ${cols[k]}: ${w.toFixed(3)}`;
    });
    tr.addEventListener("mouseenter", () => highlight(q));
  });
}

function renderTranslations(result) {
  const list = $("translations");
  list.innerHTML = "";
  result.translations.forEach((text, i) => {
    const li = document.createElement("li");
    li.textContent = text;
    if (result.n_best && result.n_best[i].length > 1) {
      const ol = document.createElement("ol");
      ol.className = "n-best";
      result.n_best[i].forEach((h) => {
        const item = document.createElement("li");
        const score = document.createElement("span");
        score.className = "score";
        score.textContent = h.score.toFixed(3);
        item.append(score, h.text);
        ol.appendChild(item);
      });
      li.appendChild(ol);
    }
    list.appendChild(li);
  });
  $("output-section").hidden = false;
}

async function translate() {
  const lines = $("source").value.split("\n").map((s) => s.trim()).filter((s) => s);
  if (!lines.length) { showError("type a sentence first"); return; }
  const beam = Number($("beam-size").value), nBest = Number($("n-best").value);
  showError("");
  $("translate").disabled = true;
  $("status").textContent = "translating…";
  try {
    const result = await postJSON("/translate", {text: lines, beam_size: beam, n_best: nBest, ...targetLanguage()});
    renderTranslations(result);
    $("status").textContent = `${result.elapsed_ms.toFixed(0)} ms`;
    try {
      attention = await postJSON("/attention", {text: lines[0], beam_size: beam, ...targetLanguage()});
      setupControls();
      draw();
      $("explorer").hidden = false;
    } catch (err) {
      $("explorer").hidden = true;
      showError("attention: " + err.message);
    }
  } catch (err) {
    showError(err.message);
    $("status").textContent = "";
  } finally {
    $("translate").disabled = false;
  }
}

// The language to translate into: the "into" choice, among the model's target languages (one for a bilingual model).
function targetLanguage() {
  return {tgt_lang: $("tgt-lang-select").value};
}

async function describeModel() {
  try {
    const health = await (await fetch("/health")).json();
    const m = health.model, languages = health.languages;
    const params = m.parameters ? `${(m.parameters / 1e6).toFixed(1)}M parameters, ` : "";
    const src = languages.src_langs.join(", "), tgt = languages.tgt_langs.join(", ");
    const select = $("tgt-lang-select");
    languages.tgt_langs.forEach((lang) => select.add(new Option(lang, lang)));
    select.addEventListener("change", () => { $("tgt-lang").textContent = select.value; });
    $("model-info").textContent = `${src} → ${tgt} · ${m.checkpoint} · ${params}d_model ${m.d_model}, ` +
      `${m.n_encoder_layers}+${m.n_decoder_layers} layers, ${m.n_heads} heads · ${m.engine} on ${health.device}`;
    $("src-lang").textContent = src;
    $("tgt-lang").textContent = select.value;
    $("beam-size").value = health.decoding.beam_size;
    $("beam-size").max = health.limits.max_beam_size;
    $("n-best").max = health.limits.max_beam_size;
  } catch (err) {
    $("model-info").textContent = "the server did not answer /health";
  }
}

$("translate").addEventListener("click", translate);
$("source").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate(); });
$("kind").addEventListener("change", () => { setupControls(); draw(); });
$("layer").addEventListener("change", () => { $("layer").dataset.touched = "1"; draw(); });
$("head").addEventListener("change", draw);
describeModel();
