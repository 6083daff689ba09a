// An AG-UI client in a page, with no library: it posts AG-UI's RunAgentInput to
// /agui/agents/assistant and applies the run's events (Server-Sent Events, one JSON
// object per "data:" line) as they arrive. Every text goes in with textContent: what the
// model writes is shown, never run.
"use strict";

const AGENT = "/agui/agents/assistant";
const threadId = "page-" + Math.random().toString(36).slice(2);
let runs = 0;
let state = {};

const $ = (id) => document.getElementById(id);

function item(list, className, id) {
  const li = document.createElement("li");
  li.className = className;
  if (id) li.dataset.id = id;
  $(list).appendChild(li);
  return li;
}

function find(className, id) {
  return document.querySelector(`#messages li.${className}[data-id="${CSS.escape(id)}"]`);
}

function showState() {
  $("state").textContent = `${state.status || "idle"}${state.activity ? " (" + state.activity + ")" : ""}, steps: ${state.steps || 0}`;
}

function toolCall(id, name) {
  const li = find("tool-call", id) || item("messages", "tool-call", id);
  li.textContent = "";
  const head = document.createElement("span");
  head.className = "name";
  head.textContent = `${name}(`;
  const args = document.createElement("span");
  args.className = "args";
  const tail = document.createElement("span");
  tail.textContent = ")";
  li.append(head, args, tail);
  return li;
}

function toolResult(id, content) {
  const li = find("tool-call", id) || toolCall(id, "?");
  let result = li.querySelector(".result");
  if (!result) {
    result = document.createElement("span");
    result.className = "result";
    li.appendChild(result);
  }
  result.textContent = typeof content === "string" ? content : JSON.stringify(content);
}

function snapshot(messages) {
  $("messages").textContent = "";
  for (const m of messages) {
    if (m.role === "user") {
      item("messages", "user", m.id).textContent = m.content;
    } else if (m.role === "assistant") {
      if (m.content) item("messages", "assistant", m.id).textContent = m.content;
      for (const call of m.toolCalls || []) {
        toolCall(call.id, call.function.name).querySelector(".args").textContent = call.function.arguments;
      }
    } else if (m.role === "tool") {
      toolResult(m.toolCallId, m.content);
    }
  }
}

function interrupted(interrupts) {
  for (const interrupt of interrupts) {
    const li = item("interrupts", "interrupt", interrupt.id);
    const text = document.createElement("span");
    text.className = "message";
    text.textContent = interrupt.message + " ";
    const approve = document.createElement("button");
    approve.className = "approve";
    approve.textContent = "Approve";
    const deny = document.createElement("button");
    deny.className = "deny";
    deny.textContent = "Deny";
    approve.addEventListener("click", () => answer(interrupt.id, true));
    deny.addEventListener("click", () => answer(interrupt.id, false));
    li.append(text, approve, deny);
  }
}

function apply(event) {
  switch (event.type) {
    case "STATE_SNAPSHOT":
      state = event.snapshot;
      showState();
      break;
    case "STATE_DELTA":
      for (const op of event.delta) state[op.path.slice(1)] = op.value;
      showState();
      break;
    case "MESSAGES_SNAPSHOT":
      snapshot(event.messages);
      break;
    case "TEXT_MESSAGE_START":
      item("messages", "assistant", event.messageId).classList.add("streaming");
      break;
    case "TEXT_MESSAGE_CONTENT":
      find("assistant", event.messageId).textContent += event.delta;
      break;
    case "TEXT_MESSAGE_END":
      find("assistant", event.messageId).classList.remove("streaming");
      break;
    case "TOOL_CALL_START":
      toolCall(event.toolCallId, event.toolCallName);
      break;
    case "TOOL_CALL_ARGS":
      find("tool-call", event.toolCallId).querySelector(".args").textContent += event.delta;
      break;
    case "TOOL_CALL_RESULT":
      toolResult(event.toolCallId, event.content);
      break;
    case "RUN_FINISHED": {
      const outcome = event.outcome || { type: "success" };
      if (outcome.type === "interrupt") interrupted(outcome.interrupts);
      else if (outcome.type === "success") $("answer").textContent = (event.result || {}).answer || "";
      else $("answer").textContent = "(" + outcome.type + ")";
      break;
    }
    case "RUN_ERROR":
      $("error").textContent = event.message;
      break;
  }
}

async function run(body) {
  $("error").textContent = "";
  const response = await fetch(AGENT, {
    method: "POST",
    headers: {
      "Content-Type": "application/json",
      Accept: "text/event-stream",
      Authorization: "Bearer " + $("token").value,
    },
    body: JSON.stringify({ threadId, runId: "run-" + ++runs, state: {}, tools: [], context: [], forwardedProps: {}, ...body }),
  });
  if (!response.ok) {
    const problem = await response.json().catch(() => ({}));
    $("error").textContent = problem.title || `HTTP ${response.status}`;
    return;
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const message = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of message.split("\n")) {
        if (line.startsWith("data: ")) apply(JSON.parse(line.slice(6)));
      }
    }
  }
}

function answer(id, grant) {
  $("interrupts").textContent = "";
  $("answer").textContent = "";
  const entry = { interruptId: id, status: "resolved", payload: { grant, reason: grant ? "" : "denied on the page" } };
  run({ messages: [], resume: [entry] });
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("task").value.trim();
  if (!text) return;
  $("task").value = "";
  $("answer").textContent = "";
  $("interrupts").textContent = "";
  const id = "user-" + (runs + 1);
  item("messages", "user", id).textContent = text;
  run({ messages: [{ id, role: "user", content: text }] });
});
$("sign-in").addEventListener("submit", (e) => e.preventDefault());
