// actviz view: every layer over time, one statistic at a time; alerts on the same step axis; two runs side by
// side; a layer's histograms and feature maps at a step. A plain ES module drawn by hand on <canvas> and SVG,
// with no library and no build step. TensorBoard imports it in the actviz tab's iframe and calls render(),
// which fetches the views from the plugin's routes (actviz/view/plugin.py); an exported file (actviz export
// --html) inlines it after its data, a <script id="actviz-data"> holding the same views as JSON.

const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141], [39, 173, 129],
  [92, 200, 99], [170, 220, 50], [253, 231, 37]];
const NAN_COLOUR = "rgb(255,0,255)";
const MISSING_COLOUR = "rgb(225,225,225)";
const LABEL_WIDTH = 150;
const STYLE = `
  body { font: 13px system-ui, sans-serif; margin: 0; color: #202124; background: #fff; }
  .av-root { padding: 12px 16px; }
  .av-bar { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin-bottom: 10px; }
  .av-bar label { display: flex; gap: 4px; align-items: center; }
  .av-maps { display: flex; gap: 24px; flex-wrap: wrap; }
  .av-map h3, .av-panel h3 { font-size: 13px; margin: 4px 0; font-weight: 600; }
  .av-tip { position: fixed; pointer-events: none; background: rgba(32,33,36,.92); color: #fff; padding: 4px 7px;
    border-radius: 3px; font-size: 12px; white-space: pre; display: none; z-index: 10; }
  .av-divergence { margin: 6px 0; font-weight: 600; }
  .av-row { display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }
  .av-panel { border-top: 1px solid #ddd; margin-top: 12px; padding-top: 6px; }
  table.av-alerts { border-collapse: collapse; font-size: 12px; }
  table.av-alerts td, table.av-alerts th { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eee; }
  table.av-alerts tr.av-alert { cursor: pointer; }
  table.av-alerts tr.av-alert:hover { background: #fff3e0; }
  .av-root img { image-rendering: pixelated; border: 1px solid #ccc; }
  .av-note { color: #5f6368; font-size: 12px; }
`;

// -- where the views come from -------------------------------------------------------------------------------

function serverSource() {
  return {
    offline: false,
    async get(view, params = {}) {
      const response = await fetch(`./${view}?${new URLSearchParams(params)}`);
      if (!response.ok) throw new Error(`${view}: ${response.status} ${await response.text()}`);
      return response.json();
    },
  };
}

// The latest of the sorted steps at or before step, else the first after it (run_data.nearest_step).
function nearest(entries, step) {
  if (!entries || !entries.length) return null;
  let found = entries[0];
  for (const entry of entries) if (entry.step <= step) found = entry;
  return found;
}

function embeddedSource(data) {
  return {
    offline: true,
    async get(view, params = {}) {
      const run = params.run;
      if (view === "runs") return data.runs;
      if (view === "heatmap") return data.heatmaps[run][params.statistic];
      if (view === "alerts") return data.alerts[run] || [];
      if (view === "feature_maps") return ((data.feature_maps[run] || {})[params.layer]) || [];
      if (view === "cell") {
        const histograms = (data.histograms[run] || {})[params.layer] || {};
        const step = Number(params.step);
        return { run, layer: params.layer, step, activations: nearest(histograms.activations, step),
          gradients: nearest(histograms.gradients, step),
          feature_map: nearest(((data.feature_maps[run] || {})[params.layer]) || [], step) };
      }
      if (view === "compare") return data.divergences[`${params.a}\n${params.b}`] || { error: "not exported" };
      throw new Error(`unknown view ${view}`);
    },
  };
}

// -- numbers and colours ------------------------------------------------------------------------------------

function toNumber(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "string") return value === "NaN" ? NaN : (value === "Infinity" ? Infinity : -Infinity);
  return value;
}

function format(value) {
  if (value === null) return "none";
  if (!Number.isFinite(value)) return String(value);
  return Number(value.toPrecision(7)).toString();
}

function viridis(t) {
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const f = x - i;
  const c = VIRIDIS[i].map((low, k) => Math.round(low + f * (VIRIDIS[i + 1][k] - low)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// A log10 scale over |value| in whole decades: [low decade, high decade].
function scaleOf(maps) {
  let low = Infinity, high = -Infinity;
  for (const map of maps) {
    if (map.low !== null) low = Math.min(low, map.low);
    if (map.high !== null) high = Math.max(high, map.high);
  }
  if (!Number.isFinite(low)) return { low: -1, high: 0 };
  const lowDecade = Math.floor(Math.log10(low));
  return { low: lowDecade, high: Math.max(Math.ceil(Math.log10(high)), lowDecade + 1) };
}

function colour(value, scale) {
  if (value === null) return MISSING_COLOUR;
  if (Number.isNaN(value)) return NAN_COLOUR;
  if (value === 0) return viridis(0);
  if (!Number.isFinite(value)) return viridis(1);
  return viridis((Math.log10(Math.abs(value)) - scale.low) / (scale.high - scale.low));
}

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "style") node.style.cssText = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// -- the heat map ---------------------------------------------------------------------------------------------

function columnOf(map, step) {
  for (let c = 0; c < map.first_steps.length; c++) if (step <= map.last_steps[c]) return c;
  return map.first_steps.length - 1;
}

function drawHeatmap(box, map, scale, view, marks) {
  const rows = map.layers.length, columns = map.first_steps.length;
  const room = (box.clientWidth || 1000) / (view.compare ? 2 : 1) - LABEL_WIDTH - 90;
  const plotWidth = Math.max(200, Math.min(900, room));
  const cellWidth = Math.max(1, plotWidth / Math.max(columns, 1));
  const cellHeight = Math.max(3, Math.min(22, Math.floor(420 / Math.max(rows, 1))));
  const top = 18, left = LABEL_WIDTH, strip = 14;
  const width = left + cellWidth * columns + 70, height = top + rows * cellHeight + strip + 24;
  const canvas = element("canvas", { class: "av-heatmap", "data-run": map.run, "data-statistic": map.statistic });
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.ceil(width * ratio); canvas.height = Math.ceil(height * ratio);
  canvas.style.width = `${width}px`; canvas.style.height = `${height}px`;
  Object.assign(canvas.dataset, { left, top, cellWidth, cellHeight, rows, columns, stripTop: top + rows * cellHeight + 4 });
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < columns; c++) {
      g.fillStyle = colour(toNumber(map.max[r][c]), scale);
      g.fillRect(left + c * cellWidth, top + r * cellHeight, Math.ceil(cellWidth), cellHeight);
    }
  }
  g.fillStyle = "#202124"; g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle"; g.textAlign = "right";
  const every = Math.ceil(12 / cellHeight);
  for (let r = 0; r < rows; r += every) {
    const name = map.layers[r].length > 22 ? "…" + map.layers[r].slice(-21) : map.layers[r];
    g.fillText(name, left - 4, top + r * cellHeight + cellHeight / 2);
  }
  g.textAlign = "center"; g.textBaseline = "alphabetic";
  const ticks = Math.min(columns, 6);
  for (let k = 0; k < ticks; k++) {
    const c = Math.round(k * (columns - 1) / Math.max(ticks - 1, 1));
    g.fillText(String(map.first_steps[c]), left + (c + 0.5) * cellWidth, top - 5);
  }
  // alerts on the same step axis, under the grid
  const stripTop = top + rows * cellHeight + 4;
  g.fillStyle = "#f1f3f4"; g.fillRect(left, stripTop, cellWidth * columns, strip);
  for (const alert of marks.alerts) {
    const c = columnOf(map, alert.step);
    g.fillStyle = "#d93025";
    g.beginPath();
    const x = left + (c + 0.5) * cellWidth;
    g.moveTo(x, stripTop + 1); g.lineTo(x - 5, stripTop + strip - 1); g.lineTo(x + 5, stripTop + strip - 1); g.fill();
    const r = map.layers.indexOf(alert.layer);
    if (r >= 0) { g.strokeStyle = "#d93025"; g.lineWidth = 1; g.strokeRect(left + c * cellWidth, top + r * cellHeight, cellWidth, cellHeight); }
  }
  g.textAlign = "left"; g.fillStyle = "#5f6368";
  g.fillText("alerts", 4, stripTop + 11);
  // the colour bar: whole decades of |value|
  const barLeft = left + cellWidth * columns + 10, barHeight = Math.max(rows * cellHeight, 60);
  for (let y = 0; y < barHeight; y++) {
    g.fillStyle = viridis(1 - y / (barHeight - 1)); g.fillRect(barLeft, top + y, 12, 1);
  }
  g.fillStyle = "#202124"; g.textBaseline = "middle";
  for (let d = scale.low; d <= scale.high; d++) {
    const y = top + (1 - (d - scale.low) / (scale.high - scale.low)) * (barHeight - 1);
    g.fillText(`1e${d}`, barLeft + 15, y);
  }
  const selected = view.selected;
  for (const [mark, style] of [[marks.divergence, "#ff6d00"], [selected && selected.run === map.run ? selected : null, "#000"]]) {
    if (!mark) continue;
    const r = map.layers.indexOf(mark.layer), c = columnOf(map, mark.step);
    g.strokeStyle = style; g.lineWidth = 2;
    g.strokeRect(left + c * cellWidth - 1, top + (r < 0 ? 0 : r * cellHeight) - 1, cellWidth + 2, (r < 0 ? rows : 1) * cellHeight + 2);
  }
  if (selected && selected.run === map.run) Object.assign(canvas.dataset, { selectedLayer: selected.layer ?? "", selectedStep: selected.step });

  const cellAt = (event) => {
    const rect = canvas.getBoundingClientRect();
    const x = event.clientX - rect.left - left, y = event.clientY - rect.top - top;
    const c = Math.floor(x / cellWidth), r = Math.floor(y / cellHeight);
    if (x < 0 || c >= columns) return null;
    if (y >= rows * cellHeight + 4 && y < rows * cellHeight + 4 + strip) {
      const alert = marks.alerts.find((a) => columnOf(map, a.step) === c);
      return alert ? { alert } : null;
    }
    if (y < 0 || r >= rows) return null;
    return { r, c };
  };
  canvas.addEventListener("mousemove", (event) => {
    const at = cellAt(event);
    const tip = view.tip;
    if (!at) { tip.style.display = "none"; return; }
    if (at.alert) {
      tip.textContent = `alert at step ${at.alert.step}: ${at.alert.rule}${at.alert.layer ? " · " + at.alert.layer : ""}`;
      Object.assign(tip.dataset, { layer: at.alert.layer ?? "", step: at.alert.step, value: "" });
    } else {
      const first = map.first_steps[at.c], last = map.last_steps[at.c];
      const high = toNumber(map.max[at.r][at.c]), end = toNumber(map.last[at.r][at.c]);
      const steps = first === last ? `step ${first}` : `steps ${first}–${last} (max ${format(high)}, last ${format(end)})`;
      tip.textContent = `${map.layers[at.r]}\n${steps}\n${map.label}: ${format(high)}`;
      Object.assign(tip.dataset, { layer: map.layers[at.r], step: first === last ? first : `${first}-${last}`, value: format(high) });
    }
    tip.style.display = "block";
    const wide = event.clientX + 14 + tip.offsetWidth > window.innerWidth;  // near the right edge: on the left
    tip.style.left = `${wide ? event.clientX - 14 - tip.offsetWidth : event.clientX + 14}px`;
    tip.style.top = `${event.clientY + 10}px`;
  });
  canvas.addEventListener("mouseleave", () => { view.tip.style.display = "none"; });
  canvas.addEventListener("click", (event) => {
    const at = cellAt(event);
    if (!at) return;
    if (at.alert) view.select(map.run, at.alert.layer, at.alert.step);
    else view.select(map.run, map.layers[at.r], map.last_steps[at.c]);
  });
  return canvas;
}

// A picture enlarged by a whole factor, pixels kept square, to about 320 px on its long side.
function enlarged(image) {
  image.addEventListener("load", () => {
    const scale = Math.max(1, Math.floor(320 / Math.max(image.naturalWidth, image.naturalHeight, 1)));
    image.style.width = `${image.naturalWidth * scale}px`;
  });
  return image;
}

// -- a histogram as SVG bars ----------------------------------------------------------------------------------

function histogramSvg(title, entry) {
  const width = 300, height = 120, ns = "http://www.w3.org/2000/svg";
  const box = element("div", { class: "av-histogram" }, element("h3", {}, entry ? `${title} · step ${entry.step}` : `${title}: none kept`));
  if (!entry || !entry.buckets.length) return box;
  const buckets = entry.buckets.map((b) => b.map(toNumber));
  const low = buckets[0][0], high = buckets[buckets.length - 1][1];
  const most = Math.max(...buckets.map((b) => b[2]), 1e-12);
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", width); svg.setAttribute("height", height + 16);
  const span = high > low ? high - low : 1;
  for (const [left, right, count] of buckets) {
    const bar = document.createElementNS(ns, "rect");
    const x = ((left - low) / span) * width, w = Math.max(((right - left) / span) * width, 1);
    bar.setAttribute("x", x); bar.setAttribute("width", w);
    bar.setAttribute("y", height - (count / most) * height); bar.setAttribute("height", (count / most) * height);
    bar.setAttribute("fill", "#1a73e8");
    svg.append(bar);
  }
  for (const [x, text, anchor] of [[0, format(low), "start"], [width, format(high), "end"]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", x); label.setAttribute("y", height + 13); label.setAttribute("font-size", "11");
    label.setAttribute("text-anchor", anchor); label.textContent = text;
    svg.append(label);
  }
  box.append(svg);
  return box;
}

// -- the page -------------------------------------------------------------------------------------------------

export async function render(options = {}) {
  const embedded = document.getElementById("actviz-data");
  const source = options.source || (embedded ? embeddedSource(JSON.parse(embedded.textContent)) : serverSource());
  document.head.append(element("style", {}, STYLE));
  const root = element("div", { class: "av-root" });
  document.body.append(root);
  const tip = element("div", { class: "av-tip", id: "av-tip" });
  document.body.append(tip);
  const runs = await source.get("runs");
  if (!runs.length) {
    root.append(element("p", { class: "av-empty" }, "No actviz run here: no per-layer statistics (~activation_stats/, ~gradient_stats/). Log with actviz.watch(model, log_dir)."));
    return;
  }
  const byRun = Object.fromEntries(runs.map((r) => [r.run, r]));
  const runSelect = element("select", { id: "av-run" }, ...runs.map((r) => element("option", { value: r.run }, r.run)));
  const statisticSelect = element("select", { id: "av-statistic" });
  const compareSelect = element("select", { id: "av-compare" }, element("option", { value: "" }, "none"),
    ...runs.map((r) => element("option", { value: r.run }, r.run)));
  const maps = element("div", { class: "av-maps", id: "av-maps" });
  const divergence = element("div", { class: "av-divergence", id: "av-divergence" });
  const alertsBox = element("div", { class: "av-panel", id: "av-alerts" });
  const cellBox = element("div", { class: "av-panel", id: "av-cell" });
  const featureBox = element("div", { class: "av-panel av-feature", id: "av-feature-maps" });
  root.append(element("div", { class: "av-bar" },
    element("label", {}, "run ", runSelect), element("label", {}, "statistic ", statisticSelect),
    element("label", {}, "beside ", compareSelect),
    element("span", { class: "av-note" }, "colour: log10 |value| · magenta NaN · grey not logged · click a cell or an alert")),
  maps, divergence, alertsBox, cellBox, featureBox);

  const view = { tip, selected: null, compare: "", alerts: [], maps: [], featureLayer: null };

  function fillStatistics() {
    const run = byRun[runSelect.value];
    const keep = statisticSelect.value;
    statisticSelect.replaceChildren(...run.statistics.map((s) => element("option", { value: s.name }, s.label)));
    if (run.statistics.some((s) => s.name === keep)) statisticSelect.value = keep;
  }

  // Where two runs part, asked once per pair: the heat maps are drawn first, framed once it comes.
  const partings = new Map();
  function parting(a, b) {
    const key = `${a}\n${b}`;
    if (!partings.has(key)) partings.set(key, source.get("compare", { a, b }));
    return partings.get(key);
  }

  function describe(compared) {
    const parted = compared.first_divergence;
    divergence.textContent = compared.error ? compared.error : parted
      ? `the runs part at step ${parted.step}, layer ${parted.layer}: ${parted.statistic} ${format(toNumber(parted.a))} vs ${format(toNumber(parted.b))}`
      : `the runs agree over ${compared.common_steps} common logged steps`;
    Object.assign(divergence.dataset, { step: parted ? parted.step : "", layer: parted ? parted.layer : "" });
  }

  function paint(shown, parted) {
    const run = runSelect.value;
    const scale = scaleOf(shown);
    maps.replaceChildren(...shown.map((map) => {
      const alerts = map.run === run ? view.alerts : view.otherAlerts || [];
      const canvas = drawHeatmap(maps, map, scale, view, { alerts, divergence: parted });
      const steps = map.first_steps.length ? `steps ${map.first_steps[0]}–${map.last_steps[map.last_steps.length - 1]}` : "no steps";
      const binned = map.first_steps.some((s, c) => s !== map.last_steps[c]) ? `, ${map.first_steps.length} columns, each the max of its steps` : "";
      return element("div", { class: "av-map" }, element("h3", {}, `${map.run} · ${map.label} · ${map.layers.length} layers · ${steps}${binned}`), canvas);
    }));
  }

  async function drawMaps() {
    const run = runSelect.value, statistic = statisticSelect.value, other = compareSelect.value;
    view.compare = other && other !== run && byRun[other].statistics.some((s) => s.name === statistic) ? other : "";
    if (!view.compare) {
      view.maps = [await source.get("heatmap", { run, statistic })];
      divergence.textContent = ""; divergence.dataset.step = ""; divergence.dataset.layer = "";
      paint(view.maps, null);
      return;
    }
    const pending = parting(run, view.compare);
    view.maps = await Promise.all([source.get("heatmap", { run, statistic }), source.get("heatmap", { run: view.compare, statistic })]);
    const drawn = view.maps;
    if (!divergence.dataset.step) divergence.textContent = "looking for where the runs part…";
    paint(drawn, null);
    const compared = await pending;
    if (view.maps !== drawn) return;  // the page moved on meanwhile
    describe(compared);
    paint(drawn, compared.first_divergence);
  }

  async function loadAlerts() {
    view.alerts = await source.get("alerts", { run: runSelect.value });
    view.otherAlerts = compareSelect.value ? await source.get("alerts", { run: compareSelect.value }) : [];
    const rows = view.alerts.map((alert, index) => element("tr", {
      class: "av-alert", "data-index": index, "data-step": alert.step, "data-layer": alert.layer ?? "",
      onclick: () => view.select(runSelect.value, alert.layer, alert.step),
    }, element("td", {}, String(alert.step)), element("td", {}, alert.rule), element("td", {}, alert.layer ?? ""),
    element("td", {}, alert.message)));
    alertsBox.replaceChildren(element("h3", {}, `alerts (${view.alerts.length})`), rows.length
      ? element("table", { class: "av-alerts" }, element("tr", {}, ...["step", "rule", "layer", "message"].map((h) => element("th", {}, h))), ...rows)
      : element("span", { class: "av-note" }, "none"));
  }

  view.select = async (run, layer, step) => {
    const map = view.maps.find((m) => m.run === run) || view.maps[0];
    const known = map.layers.includes(layer) ? layer : null;
    view.selected = { run, layer: known, step };
    await drawMaps();
    if (!known) {
      cellBox.replaceChildren(element("h3", { id: "av-cell-title", "data-layer": "", "data-step": step }, `step ${step}${layer ? ` · ${layer} (not a row of this statistic)` : ""}`));
      return;
    }
    const cell = await source.get("cell", { run, layer: known, step });
    const picture = cell.feature_map
      ? element("div", {}, element("h3", {}, `feature map · step ${cell.feature_map.step}`), enlarged(element("img", { src: cell.feature_map.src, class: "av-cell-image", "data-step": cell.feature_map.step })))
      : element("div", { class: "av-note" }, "no feature map kept for this layer");
    cellBox.replaceChildren(
      element("h3", { id: "av-cell-title", "data-layer": known, "data-step": step, "data-run": run }, `${run} · ${known} · step ${step}`),
      element("div", { class: "av-row" }, histogramSvg("output", cell.activations), histogramSvg("gradient", cell.gradients), picture));
    await showFeatureMaps(known);
  };

  async function showFeatureMaps(layer) {
    const run = runSelect.value;
    const layers = byRun[run].layers;
    const select = element("select", { id: "av-feature-layer" }, ...layers.map((l) => element("option", { value: l }, l)));
    select.value = layer || view.featureLayer || layers[0];
    view.featureLayer = select.value;
    const pictures = await source.get("feature_maps", { run, layer: select.value });
    const slider = element("input", { type: "range", id: "av-feature-slider", min: 0, max: Math.max(pictures.length - 1, 0), step: 1 });
    const image = enlarged(element("img", { id: "av-feature-image" }));
    const caption = element("span", { id: "av-feature-step" });
    const index = view.selected && view.selected.layer === select.value ? pictures.indexOf(nearest(pictures, view.selected.step)) : pictures.length - 1;
    slider.value = Math.max(index, 0);
    const show = () => {
      const picture = pictures[Number(slider.value)];
      if (!picture) { caption.textContent = "no feature maps kept for this layer"; image.removeAttribute("src"); return; }
      image.src = picture.src; caption.textContent = `step ${picture.step} (${Number(slider.value) + 1} of ${pictures.length})`;
      caption.dataset.step = picture.step;
    };
    slider.addEventListener("input", show);
    select.addEventListener("change", () => showFeatureMaps(select.value));
    featureBox.replaceChildren(element("h3", {}, "feature maps by layer and step"),
      element("div", { class: "av-bar" }, element("label", {}, "layer ", select), slider, caption), image);
    show();
  }

  runSelect.addEventListener("change", async () => { fillStatistics(); view.selected = null; await loadAlerts(); await drawMaps(); await showFeatureMaps(null); });
  statisticSelect.addEventListener("change", drawMaps);
  compareSelect.addEventListener("change", async () => { await loadAlerts(); await drawMaps(); });
  window.addEventListener("resize", drawMaps);
  fillStatistics();
  await loadAlerts();
  await drawMaps();
  await showFeatureMaps(null);
  root.dataset.ready = "true";
}
