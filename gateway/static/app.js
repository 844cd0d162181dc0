// loopmesh web view: one session's events, live, from the gateway's /v1 API.
//
// Rules this file keeps:
// - Event data reaches the screen only as text (textContent, never innerHTML): model
//   output cannot inject markup or script. The page's CSP forbids inline script too.
// - The event stream is read with fetch() so that the API key travels in the
//   Authorization header, never in a URL. A dropped stream reconnects by itself with
//   Last-Event-ID = the last id shown; an event whose id was already applied is ignored,
//   so a replay never duplicates anything on screen.

const KEY_STORE = "loopmesh.key";
const INPUTS_STORE = "loopmesh.inputs";
const $ = (id) => document.getElementById(id);

const app = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  session: null, // the View of the open session
  agents: new Map(), // name -> the agent's definition (GET /v1/agents)
  sessionAgents: new Map(), // session -> the agent it belongs to (GET /v1/sessions)
};

// -- small DOM helpers ------------------------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function ms(value) {
  if (!value && value !== 0) return "";
  return value >= 1000 ? `${(value / 1000).toFixed(2)} s` : `${Math.round(value)} ms`;
}

function ago(ts) {
  if (!ts) return "";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return new Date(ts * 1000).toLocaleDateString();
}

function pretty(value) {
  try {
    return JSON.stringify(value, null, 2);
  } catch {
    return String(value);
  }
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

function notice(text, kind = "") {
  const box = $("notice");
  box.dataset.kind = kind;
  box.textContent = text || "";
  box.hidden = !text;
}

function setLink(state, text) {
  const link = $("link");
  link.dataset.state = state;
  link.textContent = text;
}

// -- the API ----------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

function headers(extra) {
  const h = { Accept: "application/json", ...extra };
  if (app.key) h.Authorization = `Bearer ${app.key}`;
  return h;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) askForKey(message);
  const retry = Number(response.headers.get("Retry-After") || "1");
  return new ApiError(response.status, message, retry);
}

async function api(method, path, body) {
  const init = { method, headers: headers(), cache: "no-store" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response.json();
}

const sessionPath = (session) => `/v1/sessions/${encodeURIComponent(session)}`;

// -- the API key --------------------------------------------------------------------------

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-show").hidden = true;
  notice(message ? `${message} — paste an API key above.` : "Paste an API key above.");
  $("key").focus();
}

function showKeyState() {
  $("key-show").textContent = app.key ? "API key ✓" : "API key";
}

function useKey(key) {
  app.key = key.trim();
  if (app.key) sessionStorage.setItem(KEY_STORE, app.key);
  else sessionStorage.removeItem(KEY_STORE);
  $("key").value = "";
  $("key-form").hidden = true;
  $("key-show").hidden = false;
  showKeyState();
  notice("");
  refreshAgents();
  refreshSessions();
  refreshSchedules();
  if (app.session) open(app.session.session);
}

// -- SSE over fetch -------------------------------------------------------------------------

// Yields {event, id, data} for each message of a text/event-stream body.
async function* sse(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let message = { event: "message", id: null, data: [] };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let newline;
      while ((newline = buffer.search(/\r\n|\r|\n/)) >= 0) {
        const line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + (buffer.startsWith("\r\n", newline) ? 2 : 1));
        if (line === "") {
          if (message.data.length) {
            yield { event: message.event, id: message.id, data: message.data.join("\n") };
          }
          message = { event: "message", id: null, data: [] };
        } else if (!line.startsWith(":")) {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "event") message.event = value;
          else if (field === "id") message.id = value;
          else if (field === "data") message.data.push(value);
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// -- one session's view ---------------------------------------------------------------------

const HIDDEN_BUILTINS = new Set(["task_completion", "ask_question", "converse", "update_plan"]);

const END_TITLES = {
  task_completion: "Final answer",
  converse: "Reply",
  ask_question: "Question",
  max_iterations: "Stopped: iteration limit reached",
  cancelled: "Cancelled",
  circuit_open: "Stopped: a tool kept failing",
  forced_summary: "Summary (iteration limit reached)",
  llm_failed: "Stopped: the model could not be reached",
  budget_exceeded: "Stopped: budget exceeded",
  error: "Stopped by an error",
};

// A session's events on the page. A nested view (``root`` given) shows a called agent's
// turn inside its caller's call card: it touches nothing of the page around it.
class View {
  constructor(session, root = null) {
    this.session = session;
    this.nested = root !== null;
    this.root = root || $("timeline");
    this.children = new Map(); // session -> the nested view of a called agent's turn
    this.lastId = null; // the last event id applied (ids are stream sequences: they only grow)
    this.turns = new Map(); // turn_id -> {node, body, head, parts: Map}
    this.calls = new Map(); // call_id -> card parts
    this.running = null; // turn id of the running turn
    this.paused = false; // the running turn said it is paused (and not yet resumed)
    this.pausing = false; // a pause was sent; the turn pauses at its next iteration
    this.scrollPending = false;
    this.pendingQuestion = null;
    this.abort = new AbortController();
    this.inputs = JSON.parse(sessionStorage.getItem(INPUTS_STORE) || "{}");
  }

  close() {
    this.abort.abort();
    for (const child of this.children.values()) child.close();
  }

  // Page-wide facts (the sidebar, the link state) belong to the top view only.
  fact(id, text) {
    if (!this.nested) $(id).textContent = text;
  }

  link(state, text) {
    if (!this.nested) setLink(state, text);
  }

  // Reads the stream until the view closes; reconnects with Last-Event-ID.
  async follow() {
    const signal = this.abort.signal;
    let delay = 250;
    while (!signal.aborted) {
      const h = headers({ Accept: "text/event-stream" });
      let url = `${sessionPath(this.session)}/events`;
      if (this.lastId === null) url += "?since=0";
      else h["Last-Event-ID"] = String(this.lastId);
      try {
        const response = await fetch(url, { headers: h, signal, cache: "no-store" });
        if (!response.ok) throw await failure(response);
        this.link("live", "live");
        delay = 250;
        for await (const message of sse(response.body)) {
          this.receive(message);
        }
      } catch (error) {
        if (signal.aborted) return;
        if (error instanceof ApiError) {
          // a called agent's session appears once its turn starts: a nested view waits
          if (error.status === 401 || (error.status === 404 && !this.nested)) {
            this.link("down", error.status === 404 ? "no such session" : "needs a key");
            if (error.status === 404) notice(error.message);
            return;
          }
          delay = Math.max(delay, error.retryAfter * 1000);
        }
      }
      if (signal.aborted) return;
      this.link("retry", "reconnecting…");
      await sleep(delay, signal);
      delay = Math.min(delay * 2, 5000);
    }
  }

  receive(message) {
    if (message.event === "cut") return; // the stream ends; follow() resumes it
    let data;
    try {
      data = JSON.parse(message.data);
    } catch {
      return;
    }
    if (message.event === "trimmed") {
      this.timelineNote("note", `Older history is no longer kept: ${data.message}`);
      return;
    }
    if (message.id === null) return;
    const seq = Number(message.id);
    if (!Number.isFinite(seq) || (this.lastId !== null && seq <= this.lastId)) {
      return; // already on screen
    }
    this.lastId = seq;
    this.root.dataset.lastId = String(seq);
    if (!this.nested) this.followSoon();
    this.apply(data, seq);
  }

  // Keeps the newest events in sight while the reader is at the bottom: one check and
  // one scroll per frame, however many events arrive in it.
  followSoon() {
    if (this.scrollPending) return;
    if (window.innerHeight + window.scrollY < document.body.scrollHeight - 80) return;
    this.scrollPending = true;
    requestAnimationFrame(() => {
      this.scrollPending = false;
      window.scrollTo(0, document.body.scrollHeight);
    });
  }

  // -- structure: a turn, its parts -----------------------------------------------------

  turn(turnId) {
    let turn = this.turns.get(turnId);
    if (turn) return turn;
    const node = el("article", "turn");
    node.dataset.turn = turnId;
    const head = el("header", "turn-head");
    const title = el("span", "turn-title", `Turn ${turnId.slice(0, 8)}`);
    const meta = el("span", "turn-meta");
    const iter = el("span", "turn-iter");
    head.append(title, meta, iter);
    const input = el("div", "user");
    input.hidden = true;
    const body = el("div", "turn-body");
    node.append(head, input, body);
    this.root.append(node);
    turn = { id: turnId, node, meta, iter, input, body, parts: new Map(), max: 0, iteration: 0 };
    this.turns.set(turnId, turn);
    if (this.inputs[turnId]) this.showInput(turn, this.inputs[turnId]);
    return turn;
  }

  showInput(turn, text) {
    turn.input.textContent = text;
    turn.input.hidden = false;
  }

  // A block of streamed text (or thinking) for one iteration of a turn.
  stream(turn, iteration, kind) {
    const key = `${kind}:${iteration}`;
    let node = turn.parts.get(key);
    if (!node) {
      if (kind === "thinking") {
        node = el("details", "thinking");
        node.open = true;
        node.append(el("summary", null, "Thinking"), el("div", "thinking-text"));
      } else {
        node = el("div", "assistant");
      }
      node.dataset.iteration = String(iteration);
      turn.body.append(node);
      turn.parts.set(key, node);
    }
    return kind === "thinking" ? node.querySelector(".thinking-text") : node;
  }

  line(turn, className, text) {
    const node = el("div", `line ${className}`, text);
    turn.body.append(node);
    return node;
  }

  timelineNote(className, text) {
    this.root.append(el("div", `line ${className}`, text));
  }

  card(event) {
    let card = this.calls.get(event.call_id);
    if (card) return card;
    const turn = this.turn(event.turn_id);
    const node = el("div", "call");
    node.dataset.call = event.call_id;
    const head = el("div", "call-head");
    const name = el("span", "call-name", event.server ? `${event.server}.${event.tool}` : event.tool);
    const status = el("span", "badge", "running");
    const facts = el("span", "call-facts");
    head.append(name, status, facts);
    const args = el("pre", "call-args");
    const approval = el("div", "approval");
    approval.hidden = true;
    const result = el("pre", "call-result");
    result.hidden = true;
    node.append(head, args, approval, result);
    turn.body.append(node);
    card = { node, status, facts, args, approval, result, decided: false };
    this.calls.set(event.call_id, card);
    return card;
  }

  // A called agent's turn (its session is the call's id), shown inside the call's card.
  nest(card, session) {
    if (this.children.has(session)) return;
    const box = el("div", "child");
    box.dataset.session = session;
    card.node.insertBefore(box, card.result);
    const child = new View(session, box);
    this.children.set(session, child);
    child.follow();
  }

  setStatus(card, status, label) {
    card.status.textContent = label || status;
    card.status.dataset.status = status;
    card.node.dataset.status = status;
  }

  askApproval(card, event) {
    if (card.decided) return;
    this.setStatus(card, "approval", "needs approval");
    card.approval.replaceChildren();
    const text = el("span", "approval-text",
      `This call waits for a person${event.timeout_s ? ` (up to ${Math.round(event.timeout_s)} s)` : ""}.`);
    const approve = el("button", "approve", "Approve");
    const deny = el("button", "deny danger", "Deny");
    approve.type = deny.type = "button";
    const decide = async (approved) => {
      approve.disabled = deny.disabled = true;
      try {
        // a called agent's call is decided in its own session (``call_session``)
        const where = sessionPath(event.call_session || this.session);
        await api("POST", `${where}/approvals/${encodeURIComponent(event.call_id)}`,
          { approve: approved });
      } catch (error) {
        notice(`Could not send the decision: ${error.message}`);
        approve.disabled = deny.disabled = false;
      }
    };
    approve.addEventListener("click", () => decide(true));
    deny.addEventListener("click", () => decide(false));
    card.approval.append(text, approve, deny);
    card.approval.hidden = false;
  }

  // -- events -------------------------------------------------------------------------

  apply(e, seq) {
    // made by the gateway under a turn id of their own: they belong to no turn
    if (e.type === "forked") return this.forked(e);
    if (e.type === "rewound") return this.rewound(e);
    const turn = this.turn(e.turn_id);
    switch (e.type) {
      case "turn_accepted":
        if (e.input) this.showInput(turn, e.input);
        break;
      case "loop_start":
        this.running = e.turn_id;
        this.paused = false;
        turn.max = e.max_iterations;
        turn.node.dataset.state = "running";
        turn.node.dataset.agent = e.agent || "default";
        turn.meta.textContent = [e.model, e.worker && `on ${e.worker}`, e.resumed && "resumed"]
          .filter(Boolean).join(" · ");
        this.fact("agent-fact", agentLabel(e.agent, e.agent_revision));
        if (!this.nested) this.showAgent(e.agent || "default");
        this.fact("model", e.model || "–");
        this.fact("worker", e.worker || "–");
        this.pendingQuestion = null;
        this.showIteration(turn, 0);
        break;
      case "loop_iteration":
        turn.max = e.max_iterations || turn.max;
        this.showIteration(turn, e.iteration);
        break;
      case "llm_request":
        if (e.attempt > 1) this.line(turn, "retry", `Model call, attempt ${e.attempt}`);
        break;
      case "llm_response":
        if (e.usage) {
          this.fact("tokens",
            `${e.usage.prompt_tokens} in · ${e.usage.completion_tokens} out · ${ms(e.latency_ms)}`);
        }
        break;
      case "thinking_start":
        this.stream(turn, e.iteration, "thinking");
        break;
      case "thinking_delta":
        this.stream(turn, e.iteration, "thinking").append(e.text); // a text node: never markup
        break;
      case "thinking_end": {
        const node = this.stream(turn, e.iteration, "thinking");
        if (e.text) node.textContent = e.text; // the whole thought, as the worker kept it
        break;
      }
      case "content_delta":
        this.stream(turn, e.iteration, "text").append(e.text);
        break;
      case "retract": {
        // The reply streamed so far in this iteration was discarded: drop its text.
        let dropped = false;
        for (const kind of ["text", "thinking"]) {
          const key = `${kind}:${e.iteration}`;
          const node = turn.parts.get(key);
          if (node) {
            node.remove();
            turn.parts.delete(key);
            dropped = true;
          }
        }
        if (dropped) {
          const why = e.reason === "retry" ? "the model call is made again" : "it was not the answer";
          this.line(turn, "retracted", `A reply was taken back: ${why}.`);
        }
        break;
      }
      case "tool_call": {
        if (e.server === "loop" && HIDDEN_BUILTINS.has(e.tool)) break;
        const card = this.card(e);
        card.args.textContent = pretty(e.arguments);
        if (!card.status.dataset.status) this.setStatus(card, "running");
        if (e.server === "agents") this.nest(card, e.call_id); // its turn, inside the card
        break;
      }
      case "approval_required": {
        if (e.call_session && this.children.has(e.call_session)) break; // shown nested
        const card = this.card(e);
        if (!card.args.textContent) card.args.textContent = pretty(e.arguments);
        this.askApproval(card, e);
        break;
      }
      case "approval_decision": {
        const card = this.card(e);
        card.decided = true;
        card.approval.replaceChildren(el("span", e.approved ? "approved" : "denied",
          `${e.approved ? "Approved" : "Denied"}${e.reason ? `: ${e.reason}` : ""}`));
        card.approval.hidden = false;
        this.setStatus(card, e.approved ? "running" : "denied", e.approved ? "running" : "denied");
        break;
      }
      case "tool_result": {
        if (e.server === "loop" && HIDDEN_BUILTINS.has(e.tool)) break;
        const card = this.card(e);
        this.setStatus(card, "ok", "done");
        card.facts.textContent = [ms(e.duration_ms), e.worker && `on ${e.worker}`]
          .filter(Boolean).join(" · ");
        card.result.textContent = e.content + (e.truncated ? "\n… (truncated)" : "");
        card.result.hidden = false;
        break;
      }
      case "tool_error": {
        const card = this.card(e);
        this.setStatus(card, "error", "error");
        card.facts.textContent = e.worker ? `on ${e.worker}` : "";
        card.result.textContent = `${e.code}: ${e.message}`;
        card.result.hidden = false;
        break;
      }
      case "tool_timeout": {
        const card = this.card(e);
        this.setStatus(card, "error", "timed out");
        card.result.textContent = `no answer within ${e.timeout_s} s`;
        card.result.hidden = false;
        break;
      }
      case "plan_update":
        if (!this.nested) this.showPlan(e.plan);
        break;
      case "orchestrator_fallback":
        this.line(turn, "note", `The plan was given up (${e.reason}): ${e.message}. The single-model loop goes on.`);
        break;
      case "context_budget":
        this.fact("context", `${e.tokens} of ${e.budget} tokens`);
        break;
      case "memory_pruned":
        this.line(turn, "note", `Memory pruned: ${e.removed} messages (${e.tokens_before} → ${e.tokens_after} tokens)`);
        break;
      case "retry":
        this.line(turn, "retry",
          `Retrying ${e.what} (attempt ${e.attempt})${e.reason ? `: ${e.reason}` : ""}` +
          (e.delay_s ? ` in ${e.delay_s.toFixed(1)} s` : ""));
        break;
      case "no_tool_call":
        this.line(turn, "note", "The model answered without calling a tool.");
        break;
      case "rolled_back": {
        const ran = (e.calls || []).map((c) => (c.server ? `${c.server}.${c.tool}` : c.tool));
        this.line(turn, "note",
          `Rolled back for turn ${e.by_turn}: the session is as it was before this turn` +
          (ran.length ? ` (these calls ran, and stay done: ${ran.join(", ")})` : "") + ".");
        break;
      }
      case "paused":
        this.paused = true;
        this.pausing = false;
        turn.node.dataset.state = "paused";
        this.line(turn, "note", "Paused");
        break;
      case "resumed":
        this.paused = false;
        turn.node.dataset.state = "running";
        this.line(turn, "note", "Resumed");
        break;
      case "error":
        this.line(turn, "error", `${e.fatal ? "Fatal error" : "Error"} ${e.code}: ${e.message}`);
        break;
      case "loop_end":
        this.end(turn, e);
        break;
      default:
        break; // message, question: shown by loop_end; unknown types: ignored
    }
    if (!this.nested && (e.type === "loop_start" || e.type === "loop_end")) {
      this.showRunning();
      refreshSessions(); // the list shows each session's status
    } else if (!this.nested && (e.type === "paused" || e.type === "resumed")) {
      this.showRunning();
    }
  }

  showIteration(turn, k) {
    turn.iteration = k;
    const text = k ? `iteration ${k} of ${turn.max}` : "starting";
    turn.node.dataset.iteration = String(k);
    this.fact("iteration", k ? `${k} of ${turn.max}` : "–");
    turn.iter.textContent = text;
  }

  showPlan(plan) {
    const list = $("plan");
    list.replaceChildren();
    if (!plan || !plan.length) {
      list.append(el("li", "empty", "no plan yet"));
      return;
    }
    for (const step of plan) {
      const item = el("li", `step ${step.status}`);
      item.append(el("span", "step-mark", { done: "✓", in_progress: "▸", skipped: "–" }[step.status] || "○"),
        el("span", "step-title", step.title));
      if (step.result) item.title = step.result;  // what the orchestrator's executor found
      item.dataset.status = step.status;
      list.append(item);
    }
  }

  end(turn, e) {
    if (this.running === e.turn_id) {
      this.running = null;
      this.paused = this.pausing = false;
    }
    turn.node.dataset.state = "ended";
    const box = el("div", `final ${e.reason}`);
    box.append(el("div", "final-title", END_TITLES[e.reason] || e.reason));
    if (e.content) box.append(el("div", "final-text", e.content));
    if (e.error) box.append(el("div", "final-error", e.error));
    box.append(el("div", "final-meta", `${e.iterations} iteration${e.iterations === 1 ? "" : "s"}`));
    turn.body.append(box);
    this.pendingQuestion = e.reason === "ask_question" ? e.content : null;
    this.fact("iteration", `${e.iterations} of ${turn.max || e.iterations} (finished)`);
    turn.iter.textContent = `${e.iterations} of ${turn.max || e.iterations} iterations`;
    if (!this.nested) this.turnActions(turn);
  }

  // -- fork and rewind ------------------------------------------------------------------

  // An ended turn's actions: a new session from the session as it was after this turn,
  // or this session itself taken back to it (the turns after it are undone).
  turnActions(turn) {
    if (turn.actions) return;
    const box = el("span", "turn-actions");
    const branch = el("button", "quiet branch", "Branch from here");
    const rewind = el("button", "quiet rewind", "Rewind to here");
    branch.type = rewind.type = "button";
    branch.title = "A new session holding this one as it was after this turn";
    rewind.title = "Take this session back to the end of this turn: the turns after it are undone";
    branch.addEventListener("click", () => branchFrom(this.session, turn.id));
    rewind.addEventListener("click", () => rewindTo(this, turn.id));
    box.append(branch, rewind);
    turn.node.querySelector(".turn-head").append(box);
    turn.actions = box;
  }

  forked(e) {
    const n = (e.turns || []).length;
    const note = el("div", "line note forked",
      `Branched from session ${e.source}` +
      (e.at_turn ? ` as it was after turn ${e.at_turn.slice(0, 8)}` : " before its first turn") +
      ` (${n} turn${n === 1 ? "" : "s"}; their tool calls are not run again). `);
    const source = el("button", "quiet", `Open ${e.source}`);
    source.type = "button";
    source.addEventListener("click", () => open(e.source));
    note.append(source);
    this.root.append(note);
  }

  rewound(e) {
    for (const id of e.turns || []) {
      const turn = this.turns.get(id);
      if (!turn) continue;
      turn.node.dataset.undone = "true";
      if (!turn.undone) {
        turn.undone = el("span", "badge undone", "undone");
        turn.node.querySelector(".turn-title").after(turn.undone);
      }
      turn.actions?.remove();
      turn.actions = null;
    }
    const ran = (e.calls || []).map((c) => (c.server ? `${c.server}.${c.tool}` : c.tool));
    const n = (e.turns || []).length;
    this.timelineNote("note rewound",
      `Rewound to ${e.to_turn ? `the end of turn ${e.to_turn.slice(0, 8)}` : "the start"}: ` +
      `${n} turn${n === 1 ? "" : "s"} undone` +
      (ran.length ? ` (these calls ran, and stay done: ${ran.join(", ")})` : "") + ".");
  }

  showAgent(name) {
    const badge = $("session-agent");
    badge.textContent = `agent ${name}`;
    badge.title = app.agents.get(name)?.description || "";
    badge.hidden = false;
  }

  // The head's badge and buttons: idle, running, pausing (asked, not yet at the next
  // iteration) or paused, as the events say.
  showRunning() {
    const running = this.running !== null;
    const held = running && (this.paused || this.pausing);
    $("cancel").disabled = !running;
    $("pause").disabled = !running || held;
    $("resume").disabled = !held;
    const state = !running ? "idle" : this.paused ? "paused" : this.pausing ? "pausing" : "running";
    const status = $("session-status");
    status.hidden = false;
    status.textContent = state === "pausing" ? "pausing…" : state;
    status.dataset.status = state === "pausing" ? "paused" : state;
    const question = $("question");
    question.hidden = !this.pendingQuestion;
    question.textContent = this.pendingQuestion ? `The model asks: ${this.pendingQuestion}` : "";
    $("input").placeholder = this.pendingQuestion ? "Your answer…" : "Ask for something…";
  }

  rememberInput(turnId, text) {
    this.inputs[turnId] = text;
    const keys = Object.keys(this.inputs);
    for (const old of keys.slice(0, Math.max(0, keys.length - 200))) delete this.inputs[old];
    sessionStorage.setItem(INPUTS_STORE, JSON.stringify(this.inputs));
    this.showInput(this.turn(turnId), text);
  }
}

// -- the page -----------------------------------------------------------------------------

function open(session) {
  app.session?.close();
  const view = new View(session);
  app.session = view;
  $("timeline").replaceChildren();
  delete $("timeline").dataset.lastId;
  $("plan").replaceChildren(el("li", "empty", "no plan yet"));
  for (const id of ["agent-fact", "iteration", "model", "worker", "context", "tokens"]) {
    $(id).textContent = "–";
  }
  $("session-title").textContent = session;
  $("session-status").hidden = true;
  $("session-agent").hidden = true;
  const agent = app.sessionAgents.get(session);
  if (agent) view.showAgent(agent);
  $("input").disabled = $("send").disabled = false;
  $("cancel").disabled = $("pause").disabled = $("resume").disabled = true;
  armErase(false);
  $("question").hidden = true;
  history.replaceState(null, "", `#${encodeURIComponent(session)}`);
  for (const item of document.querySelectorAll("#session-list li")) {
    item.classList.toggle("selected", item.dataset.session === session);
  }
  setLink("retry", "connecting…");
  view.follow();
}

let listing = null;
async function refreshSessions() {
  if (listing) return listing;
  listing = (async () => {
    try {
      const { sessions } = await api("GET", "/v1/sessions");
      if ($("notice").dataset.kind === "list") notice("");
      const list = $("session-list");
      list.replaceChildren();
      if (!sessions.length) list.append(el("li", "empty", "no sessions yet"));
      for (const s of sessions) {
        app.sessionAgents.set(s.session, s.agent);
        const item = el("li", "session");
        item.dataset.session = s.session;
        item.dataset.agent = s.agent;
        item.classList.toggle("selected", app.session?.session === s.session);
        const name = el("span", "session-name", s.title || s.session);
        if (s.title) name.title = s.session;
        const badge = el("span", "badge", s.status);
        badge.dataset.status = s.status;
        const meta = el("span", "session-meta",
          `${s.agent} · ${s.turns} turn${s.turns === 1 ? "" : "s"} · ${ago(s.updated_at)}`);
        item.append(name, badge, meta);
        item.tabIndex = 0;
        item.addEventListener("click", () => open(s.session));
        item.addEventListener("keydown", (ev) => { if (ev.key === "Enter") open(s.session); });
        list.append(item);
      }
    } catch (error) {
      if (error.status !== 401) notice(`Could not list sessions: ${error.message}`, "list");
    } finally {
      listing = null;
    }
  })();
  return listing;
}

function until(ts) {
  if (!ts) return "";
  const s = ts - Date.now() / 1000;
  if (s < 60) return "in under a minute";
  if (s < 3600) return `in ${Math.floor(s / 60)} min`;
  if (s < 86400) return `in ${Math.floor(s / 3600)} h`;
  return new Date(ts * 1000).toLocaleString();
}

// The tenant's schedules (GET /v1/schedules): what each does, when it fires next, what
// its last tick did; pause or resume one. A schedule with a session opens it.
let scheduling = null;
async function refreshSchedules() {
  if (scheduling) return scheduling;
  scheduling = (async () => {
    try {
      const { schedules } = await api("GET", "/v1/schedules");
      const list = $("schedule-list");
      list.replaceChildren();
      if (!schedules.length) list.append(el("li", "empty", "no schedules"));
      for (const s of schedules) {
        const item = el("li", "schedule");
        item.dataset.schedule = s.id;
        const badge = el("span", "badge", s.paused ? "paused" : s.policy);
        badge.dataset.status = s.paused ? "paused" : "idle";
        const last = s.runs[0];
        const when = s.paused ? "paused" : `next ${until(s.next_tick)}`;
        const meta = el("span", "session-meta",
          `${s.explain || s.cron} (${s.timezone}) · ${s.agent} · ${when}` +
          (last ? ` · last ${last.outcome} ${ago(last.at)}` : ""));
        meta.title = s.input;
        const toggle = el("button", "quiet", s.paused ? "Resume" : "Pause");
        toggle.type = "button";
        toggle.addEventListener("click", async (ev) => {
          ev.stopPropagation();
          try {
            await api("POST", `/v1/schedules/${encodeURIComponent(s.id)}/${s.paused ? "resume" : "pause"}`);
          } catch (error) {
            notice(`Could not change schedule ${s.id}: ${error.message}`);
          }
          refreshSchedules();
        });
        item.append(el("span", "session-name", s.id), badge, meta, toggle);
        if (s.session) {
          item.classList.add("session-bound");
          item.title = `runs in session ${s.session}`;
          item.addEventListener("click", () => open(s.session));
        }
        list.append(item);
      }
    } catch (error) {
      if (error.status !== 401) notice(`Could not list schedules: ${error.message}`, "list");
    } finally {
      scheduling = null;
    }
  })();
  return scheduling;
}

function agentLabel(name, revision) {
  if (!name) return "–";
  return revision ? `${name} (revision ${revision})` : name;
}

// Fills the agent picker from GET /v1/agents, keeping the choice made.
async function refreshAgents() {
  try {
    const { agents } = await api("GET", "/v1/agents");
    const picker = $("agent");
    const chosen = picker.value || "default";
    app.agents = new Map(agents.map((a) => [a.name, a]));
    picker.replaceChildren();
    for (const agent of agents) {
      const option = el("option", null, agent.name);
      option.value = agent.name;
      option.title = agent.description || "";
      picker.append(option);
    }
    picker.value = app.agents.has(chosen) ? chosen : "default";
    describeAgent();
  } catch (error) {
    if (error.status !== 401) notice(`Could not list agents: ${error.message}`, "list");
  }
}

function describeAgent() {
  $("agent-about").textContent = app.agents.get($("agent").value)?.description || "";
}

async function newSession() {
  try {
    const agent = $("agent").value || "default";
    const created = await api("POST", "/v1/sessions", { agent });
    app.sessionAgents.set(created.session, created.agent);
    await refreshSessions();
    open(created.session);
    $("input").focus();
  } catch (error) {
    notice(`Could not create a session: ${error.message}`);
  }
}

async function send(event) {
  event.preventDefault();
  const view = app.session;
  const text = $("input").value;
  if (!view || !text.trim()) return;
  $("send").disabled = true;
  try {
    const posted = await api("POST", `${sessionPath(view.session)}/turns`, { input: text });
    view.rememberInput(posted.turn_id, text);
    $("input").value = "";
    view.pendingQuestion = null;
    view.showRunning();
    notice("");
  } catch (error) {
    notice(`Could not send: ${error.message}`);
  } finally {
    $("send").disabled = false;
  }
}

// A new session from ``session`` as it was after turn ``turnId``; the page opens it.
async function branchFrom(session, turnId) {
  try {
    const fork = await api("POST", `${sessionPath(session)}/fork`, { at_turn: turnId });
    app.sessionAgents.set(fork.session, fork.agent);
    await refreshSessions();
    open(fork.session);
    notice("");
  } catch (error) {
    notice(`Could not branch: ${error.message}`);
  }
}

// Take the view's session back to the end of turn ``turnId``; its `rewound` event marks
// the turns undone.
async function rewindTo(view, turnId) {
  try {
    await api("POST", `${sessionPath(view.session)}/rewind`, { at_turn: turnId });
    notice("");
    refreshSessions(); // its count of turns
  } catch (error) {
    notice(`Could not rewind: ${error.message}`);
  }
}

async function cancel() {
  const view = app.session;
  if (!view) return;
  $("cancel").disabled = true;
  try {
    await api("POST", `${sessionPath(view.session)}/cancel`, { reason: "cancelled from the web view" });
  } catch (error) {
    notice(`Could not cancel: ${error.message}`);
    $("cancel").disabled = false;
  }
}

// Erase the open session (DELETE): a first click asks, a second erases. The gateway
// cancels a running turn first; the session then leaves the list and the page.
function armErase(asking) {
  const button = $("erase");
  button.disabled = !app.session;
  button.dataset.asking = asking ? "true" : "";
  button.textContent = asking ? "Erase for good?" : "Erase";
}

async function erase() {
  const view = app.session;
  if (!view) return;
  if ($("erase").dataset.asking !== "true") {
    armErase(true);
    return;
  }
  $("erase").disabled = true;
  try {
    const erased = await api("DELETE", sessionPath(view.session));
    if (app.session !== view) return;
    view.close();
    app.session = null;
    $("timeline").replaceChildren(el("div", "erased",
      `Session ${erased.session} was erased` +
      (erased.children.length ? `, with ${erased.children.length} session(s) of agents it called` : "") +
      "."));
    $("session-title").textContent = "No session selected";
    $("session-status").hidden = $("session-agent").hidden = true;
    $("input").disabled = $("send").disabled = true;
    $("cancel").disabled = $("pause").disabled = $("resume").disabled = true;
    history.replaceState(null, "", "#");
    armErase(false);
    refreshSessions();
  } catch (error) {
    notice(`Could not erase: ${error.message}`);
    armErase(false);
  }
}

// Pause or resume the session's running turn. A pause takes hold at the turn's next
// iteration, which says so with a `paused` event; `resumed` says it runs again.
async function pauseOrResume(kind) {
  const view = app.session;
  if (!view) return;
  $("pause").disabled = $("resume").disabled = true;
  try {
    await api("POST", `${sessionPath(view.session)}/${kind}`, {});
    if (app.session !== view) return;
    view.pausing = kind === "pause" && !view.paused;
  } catch (error) {
    notice(`Could not ${kind}: ${error.message}`);
  }
  if (app.session === view) view.showRunning();
}

function start() {
  $("key-form").addEventListener("submit", (ev) => { ev.preventDefault(); useKey($("key").value); });
  $("key-forget").addEventListener("click", () => useKey(""));
  $("key-show").addEventListener("click", () => askForKey(""));
  $("new-session").addEventListener("click", newSession);
  $("agent").addEventListener("change", describeAgent);
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) send(ev);
  });
  $("cancel").addEventListener("click", cancel);
  $("erase").addEventListener("click", erase);
  $("pause").addEventListener("click", () => pauseOrResume("pause"));
  $("resume").addEventListener("click", () => pauseOrResume("resume"));
  showKeyState();
  refreshAgents();
  refreshSessions();
  refreshSchedules();
  setInterval(refreshSessions, 10000);
  setInterval(refreshSchedules, 10000);
  const wanted = decodeURIComponent(location.hash.slice(1));
  if (wanted) open(wanted);
  document.body.dataset.ready = "true";
}

start();
