// The web console's one script: live updates through EventSource and fetch. Every text
// from the server is put in the page with textContent (never parsed as HTML), so what a
// model, a tool or a client wrote is shown as text.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) if (child) node.appendChild(child);
  return node;
}

function csrf() {
  return document.querySelector('meta[name="csrf-token"]').content;
}

function debounce(fn, ms) {
  let timer = null;
  return () => {
    if (timer) return;
    timer = setTimeout(() => { timer = null; fn(); }, ms);
  };
}

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(url + ": " + response.status);
  return response.json();
}

function replaceChildren(node, children) {
  while (node.firstChild) node.removeChild(node.firstChild);
  for (const child of children) node.appendChild(child);
}

// -- approvals (overview, agent and task pages) -------------------------------------------

function approvalItem(a) {
  const here = window.location.pathname;
  const form = el("form", { method: "post", action: "/ui/approvals/" + encodeURIComponent(a.request_id) + "/decide", class: "decide" },
    el("input", { type: "hidden", name: "csrf", value: csrf() }),
    el("input", { type: "hidden", name: "agent", value: a.agent_id }),
    el("input", { type: "hidden", name: "next", value: here }),
    el("label", { text: "Reason " }, el("input", { type: "text", name: "reason", maxlength: "2000", autocomplete: "off" })),
    el("button", { type: "submit", name: "grant", value: "true", class: "approve", text: "Approve" }),
    el("button", { type: "submit", name: "grant", value: "false", class: "deny", text: "Deny" }));
  const line = el("p");
  line.append(el("strong", { text: a.agent_id }), " wants to call ", el("strong", { text: a.target }),
    " (rule " + a.rule + ", approver " + a.approver + ", " + a.seconds_left + " s left)");
  const hint = a.mine ? null : el("p", { class: "hint", text: "Only " + a.approver + " may decide this one." });
  return el("li", { class: "approval", "data-request": a.request_id }, line, hint, el("pre", { class: "payload", text: a.payload }), form);
}

function renderApprovals(items) {
  const list = document.getElementById("approvals");
  if (!list) return;
  const shown = [...list.querySelectorAll("li.approval")].map((li) => li.dataset.request).join(" ");
  const wanted = items.map((a) => a.request_id).join(" ");
  if (shown === wanted && (items.length > 0 || list.querySelector("li.none"))) return; // keep a half-typed reason
  replaceChildren(list, items.length ? items.map(approvalItem) : [el("li", { class: "none", text: "No approval is waiting." })]);
}

function replyItem(r) {
  return el("div", { class: "reply" },
    el("p", { class: "reply-from", text: "from " + r.from }),
    el("pre", { class: "reply-text", text: r.text }),
    el("details", {}, el("summary", { text: "Envelope" }), el("pre", { class: "reply-xml", text: r.xml })));
}

// -- overview ------------------------------------------------------------------------------

function renderAgents(agents) {
  const body = document.querySelector("#agents tbody");
  if (!body) return;
  replaceChildren(body, agents.map((a) => {
    const link = el("a", { href: "/ui/agents/" + encodeURIComponent(a.name), text: a.name });
    const active = a.active_turn ? "step " + a.active_turn.steps + ", " + a.active_turn.waiting_tools + " tool(s) waiting" : "–";
    const error = a.last_error ? a.last_error.status + ": " + a.last_error.text : "–";
    return el("tr", { "data-agent": a.name }, el("th", { scope: "row" }, link),
      el("td", { class: "state", text: a.state }), el("td", { class: "queue", text: String(a.queue) }),
      el("td", { class: "active", text: active }), el("td", { class: "error", text: error }));
  }));
}

function renderReady(ready) {
  const node = document.getElementById("ready");
  if (!node) return;
  const checks = Object.entries(ready.checks).map(([k, v]) => k + " " + (v === null ? "–" : v ? "ok" : "failing"));
  node.className = ready.ready ? "ok" : "bad";
  node.textContent = (ready.ready ? "Ready" : "Not ready") + ": " + checks.join(", ");
}

function renderBackends(backends) {
  const body = document.querySelector("#backends tbody");
  if (!body || !Object.keys(backends).length) return;
  replaceChildren(body, Object.entries(backends).map(([name, b]) => {
    return el("tr", {}, el("th", { scope: "row", text: name }), el("td", { text: b.provider || "" }),
      el("td", { text: b.breaker || "" }), el("td", { text: b.cooling_for ? b.cooling_for.toFixed(1) + " s" : "–" }),
      el("td", { text: b.skipped || "yes" }), el("td", { class: "calls", text: b.calls || "–" }));
  }));
}

function overviewPage() {
  const refresh = debounce(async () => {
    try {
      const doc = await getJSON("/ui/api/overview");
      renderReady(doc.ready);
      renderBackends(doc.backends);
      renderAgents(doc.agents);
      renderApprovals(doc.approvals);
    } catch (e) { /* the next event or tick retries */ }
  }, 250);
  const source = new EventSource("/ui/events");
  for (const kind of ["step", "state", "task"]) source.addEventListener(kind, refresh);
  setInterval(refresh, 5000);
}

function taskRow(agent, t) {
  const summary = t.thread
    ? el("a", { href: "/ui/agents/" + encodeURIComponent(agent) + "/tasks/" + encodeURIComponent(t.thread), title: "thread " + t.thread, text: t.summary })
    : document.createTextNode(t.summary);
  const state = el("td", { class: "state-cell" }, el("span", { class: "badge " + t.state.replace(/ /g, "-"), text: t.state }));
  if (t.detail) state.append(" ", el("span", { class: "detail", text: t.detail }));
  const came = el("time", { "data-epoch": String(t.created_at) });
  return el("tr", { "data-thread": t.thread || "" }, el("th", { scope: "row", class: "task-summary" }, summary),
    state, el("td", {}, came), el("td", { text: t.took }));
}

function renderTasks(agent, tasks) {
  const body = document.querySelector("#tasks tbody");
  if (!body) return;
  replaceChildren(body, tasks.length ? tasks.map((t) => taskRow(agent, t))
    : [el("tr", {}, el("td", { colspan: "4", text: "No task yet." }))]);
  localTimes();
}

function agentPage(agent) {
  const refresh = debounce(async () => {
    try {
      const doc = await getJSON("/ui/api/agents/" + encodeURIComponent(agent));
      renderApprovals(doc.approvals);
      renderTasks(agent, doc.tasks);
    } catch (e) { /* retried */ }
  }, 250);
  const source = new EventSource("/ui/events?agent=" + encodeURIComponent(agent));
  for (const kind of ["step", "state", "task"]) source.addEventListener(kind, refresh);
  setInterval(refresh, 5000);
}

// -- a task --------------------------------------------------------------------------------

function setText(id, text) {
  const node = document.getElementById(id);
  if (node) node.textContent = text;
}

// A finished task is over: no live badge, no Stop or Cancel (the server renders its page
// without them; this removes them from a page that watched it finish).
function showFinished() {
  for (const id of ["live", "controls"]) {
    const node = document.getElementById(id);
    if (node) node.remove();
  }
  document.body.dataset.finished = "true";
}

function renderTask(doc) {
  const task = doc.task;
  const reading = doc.reading;
  const status = document.getElementById("task-status");
  status.textContent = reading.state;
  status.className = "badge " + reading.state.replace(/ /g, "-");
  setText("task-detail", reading.detail);
  setText("task-text", reading.text);
  setText("task-took", reading.took);
  setText("task-steps", reading.steps);
  setText("task-tokens", reading.tokens);
  setText("task-cost", reading.cost);
  const cards = doc.log.cards.map((c) => {
    const li = el("li", { class: "card " + c.type.replace(/\./g, "-") }, el("span", { class: "kind", text: c.type }));
    if (c.metadata && c.metadata.to) li.appendChild(document.createTextNode(" → " + c.metadata.to));
    li.appendChild(el("pre", { text: c.text }));
    return li;
  });
  replaceChildren(document.getElementById("conversation"), cards);
  const steps = (task ? task.steps : []).map((s) => el("tr", {},
    el("th", { scope: "row", text: String(s.step) }), el("td", { text: s.status }), el("td", { text: s.model || "" }),
    el("td", { text: s.backend || "" }), el("td", { text: s.total_tokens == null ? "–" : s.total_tokens.toLocaleString("en-US") }),
    el("td", { text: s.cost_text }), el("td", { text: s.took }), el("td", { text: String(s.tool_calls) })));
  replaceChildren(document.querySelector("#steps tbody"), steps);
  replaceChildren(document.getElementById("decisions"), doc.log.decisions.map((d) =>
    el("li", { text: d.decision + " " + d.target + " (" + d.rule + ")" + (d.reason ? ": " + d.reason : "") })));
  renderApprovals(doc.approvals);
  if (doc.replies && doc.replies.length) {
    replaceChildren(document.getElementById("replies"), doc.replies.map(replyItem));
    document.getElementById("replies-box").hidden = false;
  }
  const answer = document.getElementById("answer");
  if (reading.answer !== null) {
    answer.textContent = reading.answer;
    answer.className = "answer" + (reading.answered ? "" : " failed");
    answer.hidden = false;
    document.getElementById("answer-cut").hidden = !reading.answer_cut;
    // The answer is there whole: the streamed copy of it is hidden.
    document.getElementById("streaming").classList.add("done");
  }
  if (reading.finished) {
    document.getElementById("no-answer").hidden = true;
    showFinished();
    return "done";
  }
  return "running";
}

function logEvent(kind, data) {
  const list = document.getElementById("events");
  let text = kind;
  if (kind === "step") text += " " + data.phase + (data.kind ? " (" + data.kind + ", attempt " + data.attempt + ")" : "");
  if (kind === "state") text += " " + data.status + (data.activity ? " " + data.activity : "") + (data.current_tool ? " " + data.current_tool : "");
  if (kind === "task") text += " " + data.status;
  list.appendChild(el("li", { text: text }));
  while (list.children.length > 200) list.removeChild(list.firstChild);
}

function taskPage(agent, thread) {
  // A finished task's page is whole as served: nothing to listen to.
  if (document.body.dataset.finished === "true") return;
  const url = "/ui/api/agents/" + encodeURIComponent(agent) + "/tasks/" + encodeURIComponent(thread);
  const live = document.getElementById("live");
  let finished = false;
  let timer = null;
  const source = new EventSource("/ui/events?agent=" + encodeURIComponent(agent) + "&thread=" + encodeURIComponent(thread));
  const refresh = debounce(async () => {
    if (finished) return;
    try {
      finished = renderTask(await getJSON(url)) === "done";
    } catch (e) { /* retried */ }
    if (finished) {
      // Over: stop listening, so no later event or reconnection brings a badge back.
      source.close();
      clearInterval(timer);
    }
  }, 150);
  source.addEventListener("open", () => { if (!finished) { live.textContent = "live"; refresh(); } });
  source.addEventListener("error", () => { if (!finished) live.textContent = "reconnecting"; });
  source.addEventListener("chunk", (e) => {
    const data = JSON.parse(e.data);
    document.getElementById("streaming").textContent += data.text;
  });
  for (const kind of ["step", "state", "task"]) {
    source.addEventListener(kind, (e) => {
      const data = JSON.parse(e.data);
      logEvent(kind, data);
      if (kind === "step" && data.phase === "retrying") document.getElementById("streaming").textContent = "";
      refresh();
    });
  }
  // Poll as a fallback for a dropped stream, until the task is over.
  timer = setInterval(refresh, 1000);
}

function threadPage(thread) {
  const url = "/ui/api/threads/" + encodeURIComponent(thread);
  const timer = setInterval(async () => {
    try {
      const doc = await getJSON(url);
      if (doc.replies.length) {
        replaceChildren(document.getElementById("replies"), doc.replies.map(replyItem));
      }
    } catch (e) { clearInterval(timer); }
  }, 1000);
}

function localTimes() {
  for (const t of document.querySelectorAll("time[data-epoch]")) {
    const when = new Date(Number(t.dataset.epoch) * 1000);
    t.textContent = when.toLocaleString();
    t.setAttribute("datetime", when.toISOString());
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const body = document.body;
  localTimes();
  if (body.dataset.page === "overview") overviewPage();
  else if (body.dataset.page === "agent") agentPage(body.dataset.agent);
  else if (body.dataset.page === "task") taskPage(body.dataset.agent, body.dataset.thread);
  else if (body.dataset.page === "thread") threadPage(body.dataset.thread);
});
