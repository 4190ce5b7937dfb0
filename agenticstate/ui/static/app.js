// agenticstate inspector: plain JS, no build step. Every value is put in the page with
// textContent (never innerHTML), so a stored value cannot run script in the inspector.
//
// Every view has an address: `#/<tab>`, `#/<tab>/<item>` for what is selected in it, and
// `?glob=` for the key list's and the live stream's glob (`#/keys/agent%3A1?glob=agent%3A*`).
// The page changes the address and follows it (hashchange), so reload, back and a shared link
// all show the same view.
"use strict";

const $ = (selector) => document.querySelector(selector);
let info = { allow_writes: false, refresh_ms: 2000 };
let refreshTimer = null;
let stream = null;
let streamPattern = null;
let listedPattern = null;

const TABS = ["keys", "stream", "teams", "workflows", "agents", "knowledge", "tools", "sessions", "speech"];
let route = { tab: null, item: null, glob: null };
// tab -> its last route, so a tab's link opens it as it was left (kept across reloads).
const remembered = (() => {
  try {
    return JSON.parse(sessionStorage.getItem("agenticstate-routes")) || {};
  } catch (error) {
    return {};
  }
})();

const DEMO_HINT =
  " For a sample: `agenticstate demo` writes one of everything into .state/demo/state.db; " +
  "`agenticstate --url sqlite://.state/demo/state.db ui` shows it.";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "style") node.style.cssText = value; // CSSOM: allowed by the page's CSP
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function showError(message) {
  const box = $("#error");
  box.textContent = message || "";
  box.hidden = !message;
}

// Records a tab left out because they do not read as what it shows (a foreign value, a field
// from a newer release): each with its key, shown above the tab so one never hides the rest.
let problems = [];

async function api(path, options) {
  const response = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(body.error || response.statusText);
  if (Array.isArray(body.problems)) problems = problems.concat(body.problems);
  return body;
}

function problemsText() {
  if (!problems.length) return "";
  const listed = problems.map((p) => (p.key ? p.key + ": " : "") + p.error);
  return "Left out " + problems.length + " record(s) that do not read: " + listed.join("; ");
}

const time = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "");
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "");
const pct = (x) => (x === null || x === undefined ? "" : (100 * x).toFixed(0) + "%");
const ms = (x) => (x === null || x === undefined ? "" : x.toFixed(1));
const words = (name) => String(name).replaceAll("_", " ");

function bytes(n) {
  if (n === null || n === undefined) return "";
  if (n < 1024) return n + " B";
  if (n < 1024 * 1024) return (n / 1024).toFixed(1) + " KB";
  return (n / 1024 / 1024).toFixed(1) + " MB";
}

function ttl(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 120) return seconds.toFixed(0) + " s";
  if (seconds < 7200) return (seconds / 60).toFixed(0) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

// A table's rows; when there are none, one row across all columns that says what would be
// there and how it gets there.
function fill(tbody, rows, empty) {
  if (rows.length || !empty) {
    tbody.replaceChildren(...rows);
    return;
  }
  const columns = tbody.closest("table").querySelectorAll("thead th").length;
  tbody.replaceChildren(el("tr", { class: "empty" }, el("td", { colspan: columns }, ...rich(empty))));
}

// Replace a node's children, leaving out the absent ones (replaceChildren would write "null").
function show(node, ...children) {
  node.replaceChildren(...children.filter((child) => child !== null && child !== undefined));
}

const emptyNote = (text) => el("p", { class: "empty muted" }, ...rich(text));

// Text with `code` spans: each part a text node (never markup), the code ones in <code>.
function rich(text) {
  return String(text).split("`").map((part, n) => (n % 2 ? el("code", {}, part) : part));
}

// A row that selects `item` in the current tab (its address changes, the view follows).
function pickRow(item, attrs, ...cells) {
  return el(
    "tr",
    Object.assign({ class: "pick" + (route.item === item ? " selected" : ""), onclick: () => select(item) }, attrs),
    ...cells,
  );
}

// -- addresses --------------------------------------------------------------------------------

// A part of an address, decoded; one that does not decode (a bare `%` typed by hand:
// `#/keys/100%`) is taken as written, so the page still loads.
function decoded(text) {
  try {
    return decodeURIComponent(text);
  } catch (error) {
    return text;
  }
}

function parseHash() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, query] = hash.split("?");
  const [tab, ...rest] = path.split("/");
  const params = new URLSearchParams(query || "");
  return {
    tab: TABS.includes(tab) ? tab : "keys",
    item: rest.length && rest.join("/") ? decoded(rest.join("/")) : null,
    glob: params.get("glob"),
  };
}

function hashOf(target) {
  let hash = "#/" + target.tab;
  if (target.item !== null && target.item !== undefined) hash += "/" + encodeURIComponent(target.item);
  if (target.glob && target.glob !== "*") hash += "?glob=" + encodeURIComponent(target.glob);
  return hash;
}

function go(target) {
  const hash = hashOf(target);
  if (location.hash === hash) follow();
  else location.hash = hash; // a history entry: back returns to the previous view
}

const select = (item) => go({ tab: route.tab, item, glob: route.glob });

async function follow() {
  const target = parseHash();
  const tabChanged = target.tab !== route.tab;
  route = target;
  remembered[route.tab] = route;
  try {
    sessionStorage.setItem("agenticstate-routes", JSON.stringify(remembered));
  } catch (error) {
    // storage refused (a private window): the links still open each tab
  }
  for (const link of document.querySelectorAll("#tabs a")) {
    link.classList.toggle("active", link.dataset.tab === route.tab);
    link.setAttribute("href", hashOf(remembered[link.dataset.tab] || { tab: link.dataset.tab }));
  }
  for (const section of document.querySelectorAll(".tab")) {
    section.classList.toggle("active", section.id === "tab-" + route.tab);
  }
  if (route.tab === "keys") {
    const pattern = route.glob || "*";
    $("#key-pattern").value = pattern;
    if (listedPattern !== pattern || tabChanged) await listKeys();
    else markSelected("#key-table", "key");
    if (route.item !== null) await showValue(route.item);
    else $("#value-panel").replaceChildren(el("p", { class: "muted" }, "Select a key to see its value and its retained versions."));
  }
  if (route.tab === "stream") {
    const pattern = route.glob || "*";
    $("#stream-pattern").value = pattern;
    if (!stream || streamPattern !== pattern) watch(pattern);
  }
  clearInterval(refreshTimer);
  if (LOADERS[route.tab]) {
    await refresh(!tabChanged);
    refreshTimer = setInterval(() => refresh(false), info.refresh_ms);
  }
  document.body.dataset.route = hashOf(route);
}

function markSelected(table, attribute) {
  for (const row of document.querySelectorAll(table + " tbody tr")) {
    row.classList.toggle("selected", row.dataset[attribute] === route.item);
  }
}

// -- keys and values ------------------------------------------------------------------------

// The change feed's size, in the header: refreshed with the key list.
async function showFeed() {
  const data = await api("/api/feed");
  const shown = $("#feed");
  if (data.feed === null) {
    shown.textContent = "no change feed";
    shown.dataset.bytes = "";
    return;
  }
  shown.textContent =
    "feed: " + data.feed.changes + " change" + (data.feed.changes === 1 ? "" : "s") +
    ", " + bytes(data.feed.bytes);
  shown.dataset.bytes = String(data.feed.bytes);
  shown.dataset.changes = String(data.feed.changes);
}

async function listKeys() {
  const pattern = route.glob || "*";
  try {
    const data = await api("/api/keys?pattern=" + encodeURIComponent(pattern));
    const empty =
      pattern === "*"
        ? "The store is empty. Keys appear here as applications write them (or " +
          "`agenticstate --url URL set KEY VALUE`), with their version, time to live and size." +
          DEMO_HINT
        : "No key matches " + pattern + ". Try a wider glob (`*` lists every key).";
    fill(
      $("#key-table tbody"),
      data.keys.map((row) =>
        pickRow(
          row.key,
          { "data-key": row.key },
          el("td", { class: "key" }, row.key),
          el("td", {}, row.version),
          el("td", {}, ttl(row.ttl)),
          el("td", {}, bytes(row.size)),
          el("td", {}, when(row.updated_at)),
        ),
      ),
      empty,
    );
    $("#key-count").textContent =
      data.keys.length + " key" + (data.keys.length === 1 ? "" : "s") +
      (data.more ? " (first " + data.limit + "; narrow the glob)" : "");
    $("#key-table").dataset.pattern = data.pattern;
    listedPattern = data.pattern;
    await showFeed();
    showError("");
  } catch (error) {
    showError(error.message);
  }
}

async function showValue(key) {
  markSelected("#key-table", "key");
  const panel = $("#value-panel");
  try {
    const data = await api("/api/value?key=" + encodeURIComponent(key));
    const children = [
      el("h3", { class: "key" }, data.key),
      el(
        "p",
        { class: "muted" },
        "version " + data.version + " · " + bytes(data.size) + " stored · updated " +
          when(data.updated_at) + " · created " + when(data.created_at) +
          (data.ttl === null ? "" : " · expires in " + ttl(data.ttl)),
      ),
      el("pre", { id: "value-json" }, data.json),
    ];
    if (data.truncated) children.push(el("p", { class: "muted" }, "(cut: the value is larger)"));
    let versions = [];
    try {
      versions = (await api("/api/history?key=" + encodeURIComponent(key))).versions;
    } catch (error) {
      versions = []; // deleted in between: the value above says what there was
    }
    children.push(el("h4", {}, "History"), historyView(data, versions));
    if (data.writable && !data.truncated) children.push(editor(data));
    panel.replaceChildren(...children);
    panel.dataset.key = data.key;
    panel.dataset.version = data.version;
  } catch (error) {
    panel.replaceChildren(el("p", { class: "error" }, error.message));
    panel.dataset.key = key;
  }
}

const oneLine = (text) => text.replace(/\s+/g, " ").slice(0, 80);

function historyView(data, versions) {
  if (versions.length <= 1) {
    return el(
      "p",
      { id: "value-history", class: "muted" },
      "Only the current version (" + data.version + ") is retained. Earlier versions of a key " +
        "are kept by the processes that write it, when their StateConfig(history={pattern: depth}) " +
        "names the key.",
    );
  }
  const rows = versions.map((v, n) =>
    el(
      "tr",
      { "data-version": v.version },
      el("td", {}, v.version + (n === 0 ? " (current)" : "")),
      el("td", {}, when(v.updated_at)),
      el(
        "td",
        {},
        el(
          "details",
          {},
          el("summary", { class: "mono" }, oneLine(v.json)),
          el("pre", {}, v.json + (v.truncated ? "\n(cut)" : "")),
        ),
      ),
    ),
  );
  return el(
    "div",
    { id: "value-history" },
    el(
      "p",
      { class: "muted" },
      versions.length + " retained versions, newest first" +
        (versions.length >= 20 ? " (the newest 20)" : "") + ":",
    ),
    el("table", { class: "versions" }, el("thead", {}, el("tr", {}, el("th", {}, "Version"), el("th", {}, "Written"), el("th", {}, "Value"))), el("tbody", {}, ...rows)),
  );
}

function editor(data) {
  const area = el("textarea", { id: "value-edit", spellcheck: "false" });
  area.value = data.json;
  const status = el("span", { class: "muted" });
  const send = async (method, body) => {
    try {
      await api("/api/value", {
        method,
        headers: { "content-type": "application/json" },
        body: JSON.stringify(Object.assign({ key: data.key, expected_version: data.version }, body)),
      });
      await listKeys();
      if (method === "PUT") await showValue(data.key);
      else $("#value-panel").replaceChildren(el("p", { class: "muted" }, "deleted " + data.key));
    } catch (error) {
      status.textContent = error.message;
    }
  };
  const save = () => {
    let value;
    try {
      value = JSON.parse(area.value);
    } catch (error) {
      status.textContent = "not valid JSON: " + error.message;
      return;
    }
    send("PUT", { value });
  };
  const remove = () => {
    if (confirm("Delete " + data.key + " (version " + data.version + ")?")) send("DELETE", {});
  };
  return el(
    "div",
    {},
    el("h4", {}, "Edit (saved only if still at version " + data.version + ")"),
    area,
    el("button", { onclick: save }, "Save"),
    " ",
    el("button", { onclick: remove }, "Delete"),
    " ",
    status,
  );
}

// -- the live stream ------------------------------------------------------------------------

function watch(pattern) {
  if (stream) stream.close();
  streamPattern = pattern;
  const status = $("#stream-status");
  const body = $("#stream-table tbody");
  fill(body, [], "Waiting for changes to keys matching " + pattern + ": every write and delete shows here as it commits, newest first.");
  status.textContent = "connecting…";
  stream = new EventSource("/api/stream?pattern=" + encodeURIComponent(pattern));
  stream.addEventListener("ready", () => {
    status.textContent = "watching " + pattern;
    $("#stream-table").dataset.watching = pattern;
  });
  stream.addEventListener("closed", (event) => {
    const reason = JSON.parse(event.data).reason;
    status.textContent =
      reason === "shutdown" ? "the inspector stopped" : "stream closed (" + reason + "); press Watch";
    stream.close();
    stream = null;
  });
  stream.onerror = () => {
    status.textContent = "reconnecting…";
  };
  stream.onmessage = (event) => {
    const change = JSON.parse(event.data);
    const waiting = body.querySelector("tr.empty");
    if (waiting) waiting.remove();
    body.prepend(
      el(
        "tr",
        { class: "op-" + change.op, "data-key": change.key },
        el("td", {}, time(change.timestamp)),
        el("td", {}, change.op),
        el("td", { class: "key" }, change.key),
        el("td", {}, change.version),
        el("td", { class: "mono" }, change.old),
        el("td", { class: "mono" }, change.new),
      ),
    );
    while (body.children.length > 500) body.lastElementChild.remove();
  };
}

// -- teams and queues -----------------------------------------------------------------------

// Each series has its own colour, width and dash, drawn widest first: two series at the same
// values stay visible (a thin dashed line over a wide solid one), and each line ends in a label
// with its name and latest value, moved apart where they would overlap.
const SERIES = [
  { name: "pending", color: "#1565c0", width: 6, dash: "", opacity: 0.55 },
  { name: "in_progress", color: "#ef6c00", width: 3, dash: "9 5", opacity: 1 },
  { name: "dead_letter", color: "#c62828", width: 2.5, dash: "2 4", opacity: 1 },
  { name: "expired_leases", color: "#6a1b9a", width: 1.5, dash: "12 4 2 4", opacity: 1 },
];
const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceTicks(top) {
  const raw = top / 4;
  const magnitude = 10 ** Math.floor(Math.log10(Math.max(raw, 1)));
  const step = Math.max(1, [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw));
  const ticks = [];
  for (let v = 0; v <= top + step / 2; v += step) ticks.push(v);
  if (ticks[ticks.length - 1] < top) ticks.push(ticks[ticks.length - 1] + step);
  return ticks;
}

function chart(samples, interval) {
  const width = 860, height = 250;
  const left = 46, right = 128, top = 12, bottom = 44;
  const plotW = width - left - right, plotH = height - top - bottom;
  const root = svg("svg", {
    viewBox: "0 0 " + width + " " + height,
    class: "queue-chart",
    role: "img",
    "aria-label": "queue counts over time",
  });
  const highest = Math.max(1, ...samples.flatMap((s) => SERIES.map((series) => s[series.name])));
  const ticks = niceTicks(highest);
  const ceiling = ticks[ticks.length - 1];
  const y = (value) => top + plotH - (value * plotH) / ceiling;
  const n = samples.length;
  const x = (i) => left + (n === 1 ? plotW : (i * plotW) / (n - 1));
  for (const tick of ticks) {
    root.append(svg("line", { x1: left, x2: left + plotW, y1: y(tick), y2: y(tick), class: "grid" }));
    root.append(svg("text", { x: left - 6, y: y(tick) + 4, "text-anchor": "end", class: "tick" }, String(tick)));
  }
  root.append(svg("path", { d: "M" + left + " " + top + " V" + (top + plotH) + " H" + (left + plotW), class: "axis" }));
  root.append(
    svg("text", { x: 12, y: top + plotH / 2, transform: "rotate(-90 12 " + (top + plotH / 2) + ")", "text-anchor": "middle", class: "axis-title" }, "tasks"),
  );
  if (n) {
    const marks = n === 1 ? [0] : [0, Math.floor((n - 1) / 2), n - 1];
    for (const i of [...new Set(marks)]) {
      const anchor = i === 0 && n > 1 ? "start" : i === n - 1 ? "end" : "middle";
      root.append(svg("text", { x: x(i), y: top + plotH + 16, "text-anchor": anchor, class: "tick" }, time(samples[i].at)));
    }
  }
  root.append(
    svg(
      "text",
      { x: left + plotW / 2, y: height - 6, "text-anchor": "middle", class: "axis-title" },
      "time (a point every " + interval + " s, since the inspector started)",
    ),
  );
  const labels = [];
  for (const series of SERIES) {
    const points = samples.map((s, i) => x(i).toFixed(1) + "," + y(s[series.name]).toFixed(1));
    root.append(
      svg("polyline", {
        points: points.join(" "),
        stroke: series.color,
        "stroke-width": series.width,
        "stroke-dasharray": series.dash,
        "stroke-opacity": series.opacity,
        "stroke-linejoin": "round",
        fill: "none",
        "data-series": series.name,
      }),
    );
    if (n) {
      const last = samples[n - 1][series.name];
      root.append(svg("circle", { cx: x(n - 1), cy: y(last), r: 3, fill: series.color }));
      labels.push({ series, value: last, y: y(last) });
    }
  }
  // The end labels, top to bottom, at least a line apart (equal values would overlap).
  labels.sort((a, b) => a.y - b.y);
  let floor = -Infinity;
  for (const label of labels) {
    label.at = Math.max(label.y, floor + 15);
    floor = label.at;
  }
  const overflow = floor - (top + plotH + 4);
  for (const label of labels) {
    const at = overflow > 0 ? label.at - overflow : label.at;
    root.append(
      svg(
        "text",
        { x: left + plotW + 8, y: at + 4, fill: label.series.color, class: "end-label", "data-series": label.series.name },
        words(label.series.name) + " " + label.value,
      ),
    );
  }
  return root;
}

function legend() {
  return el(
    "div",
    { class: "legend" },
    ...SERIES.map((series) => {
      const sample = svg("svg", { width: 28, height: 10, class: "sw" });
      sample.append(
        svg("line", {
          x1: 0, x2: 28, y1: 5, y2: 5,
          stroke: series.color,
          "stroke-width": Math.min(series.width, 5),
          "stroke-dasharray": series.dash,
          "stroke-opacity": series.opacity,
        }),
      );
      return el("span", {}, sample, " " + words(series.name));
    }),
  );
}

async function loadTeams(scroll) {
  const data = await api("/api/teams");
  const cards = data.teams.map((team) =>
    el(
      "div",
      { class: "card team" + (route.item === team.team_id ? " selected" : ""), "data-team": team.team_id },
      el("h3", {}, el("a", { href: hashOf({ tab: "teams", item: team.team_id }) }, "Team " + team.team_id)),
      el(
        "div",
        { class: "counts" },
        ...[
          ["pending", team.pending],
          ["in progress", team.in_progress],
          ["completed", team.completed],
          ["dead letters", team.dead_letter],
          ["expired leases", team.expired_leases],
        ].map(([name, count]) => el("span", {}, el("b", {}, count), " " + name)),
        el("span", { class: "muted" }, team.next_lease_expiry ? "next lease expiry " + time(team.next_lease_expiry) : ""),
      ),
      team.samples.length
        ? chart(team.samples, data.sample_interval)
        : emptyNote("The chart starts with the inspector: its first point comes within " + data.sample_interval + " s."),
      legend(),
      el(
        "p",
        { class: "muted" },
        "Agents: " + (team.agents.map((a) => a.agent_id + " (" + a.status + ")").join(", ") || "none"),
      ),
      team.dead_letters.length
        ? el("p", {}, "Dead letters: " + team.dead_letters.map((t) => t.task_id + (t.error ? " – " + t.error : "")).join("; "))
        : null,
    ),
  );
  $("#teams").replaceChildren(
    ...(cards.length
      ? cards
      : [
          emptyNote(
            "No teams. A team appears here once an application creates one on this store " +
              "(`OrchestrationStateManager.create_team`): its agents, its queue's counts, a chart of " +
              "the queue over time and its dead letters." + DEMO_HINT,
          ),
        ]),
  );
  if (scroll) reveal(".team.selected");
}

function reveal(selector) {
  const node = $(selector);
  if (node) node.scrollIntoView({ block: "nearest" });
}

// -- workflows, agents, knowledge, tools, sessions, speech -----------------------------------

async function loadWorkflows(scroll) {
  const data = await api("/api/workflows");
  const cards = data.workflows.map((w) => {
    const total = Math.max(w.total_steps, w.steps.length);
    const byNumber = new Map(w.steps.map((s) => [s.step_number, s]));
    const boxes = [];
    for (let n = 1; n <= total; n++) {
      const step = byNumber.get(n);
      const status = step ? step.status : "pending";
      const title = (step && step.name ? step.name + ": " : "step " + n + ": ") + status +
        (step && step.duration_ms !== null ? " in " + step.duration_ms.toFixed(0) + " ms" : "") +
        (step && step.error ? " (" + step.error + ")" : "");
      const grow = step && step.duration_ms ? Math.max(1, Math.log10(1 + step.duration_ms)) : 1;
      boxes.push(el("div", { class: "step s-" + status, title, style: "flex-grow:" + grow }, n));
    }
    return el(
      "div",
      { class: "card workflow" + (route.item === w.workflow_id ? " selected" : ""), "data-workflow": w.workflow_id },
      el(
        "h3",
        {},
        el("a", { href: hashOf({ tab: "workflows", item: w.workflow_id }) }, w.name || w.workflow_id),
        w.name ? el("span", { class: "muted" }, " " + w.workflow_id) : null,
        " · " + w.status + " · step " + w.current_step + "/" + w.total_steps,
      ),
      el("div", { class: "timeline" }, ...boxes),
      w.error ? el("p", { class: "error" }, w.error) : null,
      el(
        "p",
        { class: "muted" },
        "Checkpoints: " +
          (w.checkpoints.map((c) => c.checkpoint_id + " @ step " + c.step + " (" + time(c.timestamp) + ")").join(", ") || "none"),
      ),
    );
  });
  $("#workflows").replaceChildren(
    ...(cards.length
      ? cards
      : [
          emptyNote(
            "No workflows. A workflow appears here once an application creates one on this store " +
              "(`WorkflowStateManager.create`): its status, a timeline of its steps and its checkpoints." +
              DEMO_HINT,
          ),
        ]),
  );
  if (scroll) reveal(".workflow.selected");
}

async function loadAgents() {
  const data = await api("/api/agents");
  fill(
    $("#agents-table tbody"),
    data.agents.map((a) =>
      pickRow(
        a.agent_id,
        { "data-agent": a.agent_id },
        el("td", { class: "key" }, a.agent_id),
        el("td", {}, a.snapshots),
        el("td", {}, a.checkpoint_count),
        el("td", {}, a.checkpoints.length ? a.checkpoints[0].checkpoint_id + " (step " + a.checkpoints[0].step + ")" : "-"),
        el("td", {}, a.recovery ? recoverySummary(a.recovery) : "-"),
      ),
    ),
    "No agents. An agent appears here once an application saves a snapshot or a checkpoint " +
      "for it (`AgentStateStore.save_snapshot`, `save_checkpoint`), with its recovery attempts " +
      "(`AgentRecoveryManager`)." + DEMO_HINT,
  );
  const panel = $("#agent-panel");
  const agent = data.agents.find((a) => a.agent_id === route.item);
  if (!agent) {
    panel.replaceChildren(
      el("p", { class: "muted" }, route.item === null ? "Select an agent to see its checkpoints and recovery record." : "No agent " + route.item + "."),
    );
    return;
  }
  const snapshot = agent.latest_snapshot;
  show(
    panel,
    el("h3", { class: "key" }, agent.agent_id),
    el(
      "p",
      { class: "muted" },
      snapshot
        ? "latest snapshot " + snapshot.snapshot_id + " at " + when(snapshot.timestamp) +
            (snapshot.step === null ? "" : ", step " + snapshot.step) + ", " + snapshot.messages + " messages"
        : "no snapshot",
    ),
    snapshot ? el("pre", {}, snapshot.metadata) : null,
    el("h4", {}, "Recovery"),
    el("p", {}, agent.recovery ? recoverySummary(agent.recovery) + recoveryDetail(agent.recovery) : "never recovered"),
    el("h4", {}, "Checkpoints (" + agent.checkpoint_count + ", newest first)"),
    agent.checkpoints.length
      ? el(
          "table",
          { class: "checkpoints" },
          el("thead", {}, el("tr", {}, el("th", {}, "Checkpoint"), el("th", {}, "Step"), el("th", {}, "Taken"), el("th", {}, "State"))),
          el(
            "tbody",
            {},
            ...agent.checkpoints.map((c) =>
              el(
                "tr",
                { "data-checkpoint": c.checkpoint_id },
                el("td", { class: "key" }, c.checkpoint_id + (c.recoverable ? "" : " (not recoverable)")),
                el("td", {}, c.step),
                el("td", { title: when(c.timestamp) }, time(c.timestamp)),
                el("td", {}, el("details", {}, el("summary", { class: "mono" }, oneLine(c.state)), el("pre", {}, c.state))),
              ),
            ),
          ),
        )
      : el("p", { class: "muted" }, "no checkpoint"),
  );
}

function recoverySummary(r) {
  const attempts = r.attempts + " failed attempt" + (r.attempts === 1 ? "" : "s");
  return r.recovered_at ? "recovered " + time(r.recovered_at) + (r.attempts ? ", " + attempts + " since" : "") : attempts;
}

function recoveryDetail(r) {
  return (r.last_checkpoint_id ? " from " + r.last_checkpoint_id : "") + (r.last_error ? "; last error " + r.last_error : "");
}

async function loadKnowledge() {
  const data = await api("/api/knowledge");
  fill(
    $("#knowledge-table tbody"),
    data.knowledge.map((k) =>
      pickRow(
        k.knowledge_base_id,
        { "data-kb": k.knowledge_base_id },
        el("td", { class: "key" }, k.knowledge_base_id),
        el("td", {}, k.documents),
        el("td", {}, k.embeddings),
        el("td", {}, k.pending),
        el("td", {}, k.failed),
        el("td", {}, k.progress ? words(k.progress.status) + " " + pct(k.progress.percent) : "-"),
        el("td", {}, k.sources.length + (k.sync_status ? " (" + k.sync_status + ")" : "")),
      ),
    ),
    "No knowledge bases. A knowledge base appears here once an application records its " +
      "indexing progress or a source on this store (`KnowledgeStateManager." +
      "update_indexing_progress`, `update_source_state`): documents, embeddings, the indexing run " +
      "and each source's sync status." + DEMO_HINT,
  );
  const panel = $("#knowledge-panel");
  const kb = data.knowledge.find((k) => k.knowledge_base_id === route.item);
  if (!kb) {
    panel.replaceChildren(
      el("p", { class: "muted" }, route.item === null ? "Select a knowledge base to see its indexing run and its sources." : "No knowledge base " + route.item + "."),
    );
    return;
  }
  const p = kb.progress;
  show(
    panel,
    el("h3", { class: "key" }, kb.knowledge_base_id),
    el(
      "p",
      { class: "muted" },
      kb.documents + " documents, " + kb.embeddings + " embeddings, " + kb.storage_mb.toFixed(2) + " MiB" +
        (kb.last_updated ? ", updated " + when(kb.last_updated) : ""),
    ),
    el("h4", {}, "Indexing run"),
    p
      ? el(
          "div",
          { class: "progress-run" },
          el("div", { class: "bar-outer" }, el("div", { class: "bar-inner s-" + p.status, style: "width:" + (100 * p.percent).toFixed(1) + "%" })),
          el(
            "p",
            {},
            words(p.status) + ": " + p.processed + " processed, " + p.failed + " failed" +
              (p.total ? " of " + p.total : "") + (p.completed_at ? ", finished " + when(p.completed_at) : "") +
              (p.error ? " (" + p.error + ")" : ""),
          ),
        )
      : el("p", { class: "muted" }, "no indexing run recorded"),
    el("h4", {}, "Sources"),
    kb.sources.length
      ? el(
          "table",
          { class: "sources" },
          el("thead", {}, el("tr", {}, el("th", {}, "Source"), el("th", {}, "Synced"), el("th", {}, "Pending"), el("th", {}, "Sync"))),
          el(
            "tbody",
            {},
            ...kb.sources.map((s) =>
              el(
                "tr",
                { "data-source": s.source_id },
                el("td", { class: "key" }, s.source_id),
                el("td", {}, s.documents_synced),
                el("td", {}, s.documents_pending),
                el("td", {}, s.sync_status + (s.last_sync ? " at " + time(s.last_sync) : "") + (s.error ? " (" + s.error + ")" : "")),
              ),
            ),
          ),
        )
      : el("p", { class: "muted" }, "no source recorded"),
  );
}

async function loadTools() {
  const data = await api("/api/tools");
  fill(
    $("#tools-table tbody"),
    data.tools.map((t) =>
      pickRow(
        t.tool,
        { "data-tool": t.tool },
        el("td", { class: "key" }, t.tool),
        el("td", {}, t.runs),
        el("td", {}, pct(t.success_rate)),
        el("td", {}, pct(t.error_rate)),
        el("td", {}, pct(t.cache_hit_rate)),
        el("td", {}, ms(t.avg_duration_ms)),
        el("td", {}, ms(t.p95_duration_ms)),
        el("td", {}, t.pending_retries),
      ),
    ),
    "No tool statistics. A tool appears here once an application records its executions on " +
      "this store (`ToolStateManager.start_execution`, `cached_call`, `run_with_retries`): runs, " +
      "success and cache hit rates, durations and retries pending." + DEMO_HINT,
  );
}

async function loadSessions() {
  const data = await api("/api/sessions");
  fill(
    $("#sessions-table tbody"),
    data.sessions.map((s) =>
      pickRow(
        s.session_id,
        { "data-session": s.session_id },
        el("td", { class: "key" }, s.session_id),
        el("td", {}, s.user_id),
        el("td", {}, s.name || ""),
        el("td", {}, s.message_count),
        el("td", {}, when(s.updated_at)),
      ),
    ),
    "No sessions. A session appears here once an application creates one on this store " +
      "(`SessionManager.create_session`): its user, name and messages." + DEMO_HINT,
  );
  if (route.item !== null) await showMessages(route.item);
  else $("#messages-panel").replaceChildren(el("p", { class: "muted" }, "Select a session to see its messages."));
}

async function showMessages(sessionId) {
  const panel = $("#messages-panel");
  try {
    const data = await api("/api/sessions/" + encodeURIComponent(sessionId) + "/messages");
    panel.replaceChildren(
      el("h3", { class: "key" }, sessionId),
      ...(data.messages.length
        ? data.messages.map((m) =>
            el("div", { class: "message" }, el("b", {}, "#" + m.seq + " " + m.role), " ", el("span", { class: "muted" }, time(m.created_at)), el("pre", {}, m.content)),
          )
        : [el("p", { class: "muted" }, ...rich("No messages yet (`SessionManager.add_message` adds them)."))]),
    );
  } catch (error) {
    panel.replaceChildren(el("p", { class: "error" }, error.message));
  }
}

async function loadSpeech() {
  const data = await api("/api/speech");
  fill(
    $("#speech-table tbody"),
    data.speech.map((s) =>
      pickRow(
        s.session_id,
        { "data-session": s.session_id },
        el("td", { class: "key" }, s.session_id),
        el("td", {}, s.type),
        el("td", {}, s.mode),
        el("td", {}, s.status),
        el("td", {}, s.stt ? s.stt.status + (s.stt.final_transcript || s.stt.interim_transcript ? ": " + (s.stt.final_transcript || s.stt.interim_transcript) : "") : "-"),
        el("td", {}, s.tts ? (s.tts.is_speaking ? "speaking" : "idle") + (s.tts.text_queue.length ? ", " + s.tts.text_queue.length + " queued" : "") : "-"),
        el("td", {}, s.turns === null ? "-" : s.turns),
        el("td", {}, when(s.created_at)),
      ),
    ),
    "No speech sessions. A voice session appears here once an application creates one on this " +
      "store (`SpeechStateManager.create_session`): its status, speech-to-text and text-to-speech " +
      "state, and its turns." + DEMO_HINT,
  );
}

// -- tabs -----------------------------------------------------------------------------------

const LOADERS = {
  teams: loadTeams,
  workflows: loadWorkflows,
  agents: loadAgents,
  knowledge: loadKnowledge,
  tools: loadTools,
  sessions: loadSessions,
  speech: loadSpeech,
};

async function refresh(scroll) {
  const tab = route.tab;
  const loader = LOADERS[tab];
  if (!loader) return;
  try {
    problems = [];
    await loader(scroll);
    document.body.dataset.loaded = tab;
    showError(problemsText());
  } catch (error) {
    showError(error.message);
  }
}

async function start() {
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    go({ tab: "keys", item: null, glob: $("#key-pattern").value || "*" });
  });
  $("#stream-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const pattern = $("#stream-pattern").value || "*";
    if (pattern === streamPattern && stream) watch(pattern); // Watch again: a fresh stream
    go({ tab: "stream", item: null, glob: pattern });
  });
  window.addEventListener("hashchange", follow);
  try {
    info = await api("/api/info");
    $("#backend").textContent = info.backend;
    $("#mode").textContent = info.allow_writes ? "writes allowed" : "read-only";
  } catch (error) {
    showError(error.message);
  }
  await follow();
  document.body.dataset.ready = "1";
}

start();
