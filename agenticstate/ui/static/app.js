// agenticstate inspector: plain JS, no build step. Every value is put in the page with
// textContent (never innerHTML), so a stored value cannot run script in the inspector.
"use strict";

const $ = (selector) => document.querySelector(selector);
let info = { allow_writes: false, refresh_ms: 2000 };
let activeTab = "keys";
let refreshTimer = null;
let stream = null;

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

async function api(path, options) {
  const response = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  const body = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

const time = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "");
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "");
const pct = (x) => (x === null || x === undefined ? "" : (100 * x).toFixed(0) + "%");
const ms = (x) => (x === null || x === undefined ? "" : x.toFixed(1));

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

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// -- keys and values ------------------------------------------------------------------------

async function listKeys() {
  const pattern = $("#key-pattern").value || "*";
  try {
    const data = await api("/api/keys?pattern=" + encodeURIComponent(pattern));
    fill(
      $("#key-table tbody"),
      data.keys.map((row) =>
        el(
          "tr",
          { class: "pick", "data-key": row.key, onclick: () => showValue(row.key) },
          el("td", { class: "key" }, row.key),
          el("td", {}, row.version),
          el("td", {}, ttl(row.ttl)),
          el("td", {}, bytes(row.size)),
          el("td", {}, when(row.updated_at)),
        ),
      ),
    );
    $("#key-count").textContent =
      data.keys.length + " key" + (data.keys.length === 1 ? "" : "s") +
      (data.more ? " (first " + data.limit + "; narrow the glob)" : "");
    $("#key-table").dataset.pattern = data.pattern;
    showError("");
  } catch (error) {
    showError(error.message);
  }
}

async function showValue(key) {
  for (const row of document.querySelectorAll("#key-table tbody tr")) {
    row.classList.toggle("selected", row.dataset.key === key);
  }
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
    children.push(
      el("h4", {}, "History"),
      el(
        "p",
        { id: "value-history", class: "muted" },
        data.history === null
          ? "This store keeps no history: only the current version (" + data.version + ") is shown."
          : "",
      ),
    );
    if (data.writable && !data.truncated) children.push(editor(data));
    panel.replaceChildren(...children);
    panel.dataset.key = data.key;
    panel.dataset.version = data.version;
  } catch (error) {
    panel.replaceChildren(el("p", { class: "error" }, error.message));
  }
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

function watch() {
  if (stream) stream.close();
  const pattern = $("#stream-pattern").value || "*";
  const status = $("#stream-status");
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
  });
  stream.onerror = () => {
    status.textContent = "reconnecting…";
  };
  stream.onmessage = (event) => {
    const change = JSON.parse(event.data);
    const body = $("#stream-table tbody");
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

const SERIES = [
  ["pending", "#1565c0"],
  ["in_progress", "#ef6c00"],
  ["dead_letter", "#c62828"],
  ["expired_leases", "#6a1b9a"],
];

function chart(samples) {
  const ns = "http://www.w3.org/2000/svg";
  const width = 560, height = 140, pad = 24;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 " + width + " " + height);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("class", "queue-chart");
  const top = Math.max(1, ...samples.flatMap((s) => SERIES.map(([name]) => s[name])));
  const axis = document.createElementNS(ns, "path");
  axis.setAttribute("d", "M" + pad + " 4 V" + (height - pad) + " H" + (width - 4));
  axis.setAttribute("stroke", "#999");
  axis.setAttribute("fill", "none");
  svg.append(axis);
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", 2);
  label.setAttribute("y", 12);
  label.setAttribute("font-size", 10);
  label.textContent = String(top);
  svg.append(label);
  const n = samples.length;
  for (const [name, color] of SERIES) {
    const points = samples.map((s, i) => {
      const x = pad + (n === 1 ? 0 : (i * (width - pad - 6)) / (n - 1));
      const y = height - pad - (s[name] * (height - pad - 8)) / top;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("stroke", color);
    line.setAttribute("stroke-width", 2);
    line.setAttribute("fill", "none");
    line.setAttribute("data-series", name);
    svg.append(line);
  }
  return svg;
}

async function loadTeams() {
  const data = await api("/api/teams");
  const cards = data.teams.map((team) => {
    const legend = el(
      "div",
      { class: "legend" },
      ...SERIES.map(([name, color]) =>
        el("span", {}, el("i", { class: "sw", style: "background:" + color }), name.replace("_", " ")),
      ),
    );
    return el(
      "div",
      { class: "card team", "data-team": team.team_id },
      el("h3", {}, "Team " + team.team_id),
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
      chart(team.samples),
      legend,
      el(
        "p",
        { class: "muted" },
        "Agents: " + (team.agents.map((a) => a.agent_id + " (" + a.status + ")").join(", ") || "none"),
      ),
      team.dead_letters.length
        ? el("p", {}, "Dead letters: " + team.dead_letters.map((t) => t.task_id + (t.error ? " – " + t.error : "")).join("; "))
        : null,
    );
  });
  $("#teams").replaceChildren(...(cards.length ? cards : [el("p", { class: "muted" }, "No teams.")]));
}

// -- workflows, tools, sessions, speech -----------------------------------------------------

async function loadWorkflows() {
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
      { class: "card workflow", "data-workflow": w.workflow_id },
      el("h3", {}, (w.name || w.workflow_id) + " · " + w.status + " · step " + w.current_step + "/" + w.total_steps),
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
  $("#workflows").replaceChildren(...(cards.length ? cards : [el("p", { class: "muted" }, "No workflows.")]));
}

async function loadTools() {
  const data = await api("/api/tools");
  fill(
    $("#tools-table tbody"),
    data.tools.map((t) =>
      el(
        "tr",
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
  );
}

async function loadSessions() {
  const data = await api("/api/sessions");
  fill(
    $("#sessions-table tbody"),
    data.sessions.map((s) =>
      el(
        "tr",
        { class: "pick", "data-session": s.session_id, onclick: () => showMessages(s.session_id) },
        el("td", { class: "key" }, s.session_id),
        el("td", {}, s.user_id),
        el("td", {}, s.name || ""),
        el("td", {}, s.message_count),
        el("td", {}, when(s.updated_at)),
      ),
    ),
  );
}

async function showMessages(sessionId) {
  const panel = $("#messages-panel");
  try {
    const data = await api("/api/sessions/" + encodeURIComponent(sessionId) + "/messages");
    panel.replaceChildren(
      el("h3", { class: "key" }, sessionId),
      ...data.messages.map((m) =>
        el("div", { class: "message" }, el("b", {}, "#" + m.seq + " " + m.role), " ", el("span", { class: "muted" }, time(m.created_at)), el("pre", {}, m.content)),
      ),
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
      el(
        "tr",
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
  );
}

// -- tabs -----------------------------------------------------------------------------------

const LOADERS = {
  teams: loadTeams,
  workflows: loadWorkflows,
  tools: loadTools,
  sessions: loadSessions,
  speech: loadSpeech,
};

async function refresh() {
  const loader = LOADERS[activeTab];
  if (!loader) return;
  try {
    await loader();
    document.body.dataset.loaded = activeTab;
    showError("");
  } catch (error) {
    showError(error.message);
  }
}

function showTab(name) {
  activeTab = name;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.tab === name);
  }
  for (const section of document.querySelectorAll(".tab")) {
    section.classList.toggle("active", section.id === "tab-" + name);
  }
  clearInterval(refreshTimer);
  if (name === "stream" && !stream) watch();
  if (LOADERS[name]) {
    refresh();
    refreshTimer = setInterval(refresh, info.refresh_ms);
  }
}

async function start() {
  for (const button of document.querySelectorAll("#tabs button")) {
    button.addEventListener("click", () => showTab(button.dataset.tab));
  }
  $("#key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    listKeys();
  });
  $("#stream-form").addEventListener("submit", (event) => {
    event.preventDefault();
    watch();
  });
  try {
    info = await api("/api/info");
    $("#backend").textContent = info.backend;
    $("#mode").textContent = info.allow_writes ? "writes allowed" : "read-only";
  } catch (error) {
    showError(error.message);
  }
  await listKeys();
  document.body.dataset.ready = "1";
}

start();
