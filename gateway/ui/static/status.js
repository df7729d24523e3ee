// The status page: models (from /ready, /v1/models and /metrics) and, with the admin key, engines,
// workers, batches and the last swaps, reloads and restarts (from /admin/models, /admin/workers, /admin/batches).
// Everything from the server goes into the page as text (textContent), never as HTML.
"use strict";

(function () {
  const REFRESH_MS = 3000;
  const keys = {
    get client() { return sessionStorage.getItem("gw.clientKey") || ""; },
    get admin() { return sessionStorage.getItem("gw.adminKey") || ""; },
    set(client, admin) {
      for (const [name, value] of [["gw.clientKey", client], ["gw.adminKey", admin]]) {
        if (value) sessionStorage.setItem(name, value); else sessionStorage.removeItem(name);
      }
    },
  };
  const rates = new window.GatewayMetrics.Rates();
  const $ = (id) => document.getElementById(id);

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) tr.append(cell instanceof Node ? cell : el("td", cell));
    return tr;
  }

  function stateCell(state) {
    return el("td", state, "state state-" + String(state).replace(/[^a-z]+/g, "-"));
  }

  const fixed = (value, digits, unit = "") => (value === null || value === undefined ? "…" : value.toFixed(digits) + unit);

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "";
    if (seconds < 90) return `${Math.round(seconds)} s`;
    if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
    return `${(seconds / 3600).toFixed(1)} h`;
  }

  async function get(path, key) {
    const headers = key ? { Authorization: "Bearer " + key } : {};
    const response = await fetch(path, { headers, cache: "no-store" });
    const body = response.headers.get("content-type")?.includes("json") ? await response.json() : await response.text();
    return { status: response.status, body };
  }

  // One refresh: what everybody may see, then the admin view when an admin key is set and accepted.
  let needsClientKey = false;  // a keyless try was refused: wait for a key instead of asking again every refresh

  async function refresh() {
    const asClient = !needsClientKey || keys.client;
    const [ready, models, metrics, admin, workers, batches] = await Promise.all([
      get("/ready").catch(() => null),
      asClient ? get("/v1/models", keys.client).catch(() => null) : null,
      asClient ? get("/metrics", keys.client).catch(() => null) : null,
      keys.admin ? get("/admin/models", keys.admin).catch(() => null) : null,
      keys.admin ? get("/admin/workers", keys.admin).catch(() => null) : null,
      keys.admin ? get("/admin/batches", keys.admin).catch(() => null) : null,
    ]);
    const notes = [];
    const traffic = metrics && metrics.status === 200 ? rates.update(metrics.body, Date.now()) : {};
    if (asClient && !keys.client) needsClientKey = metrics !== null && metrics.status === 401;
    if (needsClientKey && !keys.client) notes.push("enter a client key to see traffic and aliases");
    else if (metrics && metrics.status === 401) notes.push("client key refused");
    const adminView = admin && admin.status === 200 ? admin.body : null;
    if (keys.admin && !adminView) notes.push(admin ? `admin key refused (${admin.status})` : "admin API unreachable");
    const cards = models && models.status === 200 ? models.body : null;
    renderModels(ready && ready.body, cards, traffic, adminView);
    renderAdmin(adminView, workers && workers.status === 200 ? workers.body : null);
    renderBatches(adminView && batches && batches.status === 200 ? batches.body.data : null);
    window.GatewayPlayground?.offerModels(modelNames(ready && ready.body, cards));
    $("models-note").textContent = notes.join("; ");
    $("refreshed").textContent = ready ? `refreshed ${new Date().toLocaleTimeString()}` : "the gateway does not answer";
  }

  function modelNames(ready, models) {
    if (models && Array.isArray(models.data)) return models.data.map((card) => card.id);
    return ready && ready.models ? Object.keys(ready.models) : [];
  }

  function renderModels(ready, models, traffic, admin) {
    const names = new Map();  // model -> aliases
    for (const name of Object.keys((ready && ready.models) || {})) names.set(name, []);
    for (const card of (models && models.data) || []) {
      if (!names.has(card.root)) names.set(card.root, []);
      if (card.id !== card.root) names.get(card.root).push(card.id);
    }
    const detail = new Map(((admin && admin.models) || []).map((model) => [model.name, model]));
    const body = $("models-body");
    body.replaceChildren();
    for (const [name, aliases] of names) {
      const item = detail.get(name);
      const readiness = ready && ready.models && ready.models[name];
      let state = item ? item.state : readiness ? (readiness.starting ? "starting" : readiness.asleep ? "sleeping" : readiness.ready ? "ready" : "not ready") : "unknown";
      const reason = item ? item.reason : readiness && readiness.reason;
      const stateTd = stateCell(state);
      if (reason && state !== "ready") stateTd.title = reason;
      const seen = traffic[name] || {};
      const errors = seen.errors === undefined ? "" : String(seen.errors) + (seen.newErrors ? ` (+${seen.newErrors})` : "");
      const ttft = seen.ttftP50 === null || seen.ttftP50 === undefined ? "" : `${(seen.ttftP50 * 1000).toFixed(0)} ms${seen.ttftWindow ? "" : " (all)"}`;
      const tr = row([
        name, (item ? item.aliases : aliases).join(", "), stateTd,
        el("td", seen.inFlight ?? (item ? item.in_flight : ""), "num"),
        el("td", seen.requestsPerS === undefined ? "" : fixed(seen.requestsPerS, 1), "num"),
        el("td", seen.tokensPerS === undefined ? "" : fixed(seen.tokensPerS, 0), "num"),
        el("td", ttft, "num"),
        el("td", errors, seen.newErrors ? "num bad" : "num"),
      ]);
      tr.dataset.model = name;
      body.append(tr);
      if (reason && state !== "ready") body.append(row([el("td"), el("td", reason, "muted small")]));
    }
  }

  function renderAdmin(admin, workers) {
    for (const section of document.querySelectorAll("section.admin")) section.hidden = !admin;
    if (!admin) return;
    const engines = $("engines-body"), logs = $("engine-logs");
    engines.replaceChildren();
    logs.replaceChildren();
    for (const model of admin.models) {
      for (const replica of model.replicas) {
        const engine = replica.engine || {};
        const tr = row([
          model.name, replica.replica, stateCell(replica.state), engine.pid ?? "", duration(engine.uptime_s),
          replica.restarts, replica.url || "", replica.last_error || replica.reason || "",
        ]);
        tr.dataset.model = model.name;
        engines.append(tr);
        if (replica.log_tail && replica.log_tail.length) {
          logs.append(el("h3", `${model.name} replica ${replica.replica}: last lines of its log`, "small"));
          logs.append(el("pre", replica.log_tail.join("\n"), "log"));
        }
      }
      if (model.router) {
        const router = model.router;
        engines.append(row([model.name, "router", stateCell(router.running ? "ready" : "failed"), router.pid ?? "", "", "", router.url, router.policy]));
      }
    }
    const list = (workers && workers.workers) || [];
    $("workers").hidden = list.length === 0;
    $("workers-body").replaceChildren(...list.map((w) => row([w.index, w.pid, w.running ? "yes" : "no", w.connected ? "yes" : "no", w.restarts, w.in_flight ?? ""])));
    $("config-file").textContent = admin.config_file ? `deployment file: ${admin.config_file}` : "";
    const events = $("events-list");
    events.replaceChildren();
    for (const event of admin.events || []) {
      const li = el("li");
      li.append(el("span", new Date(event.at * 1000).toLocaleTimeString() + " "), el("strong", event.kind + " "));
      if (event.model) li.append(el("span", event.model + " "));
      li.append(el("span", event.ok ? "ok" : "failed", event.ok ? "ok" : "bad"), el("span", ": " + event.detail, "muted"));
      events.append(li);
    }
    if (!events.children.length) events.append(el("li", "nothing yet since the gateway started", "muted"));
  }

  // The batch API's jobs (absent when it is off: /admin/batches answers 404 batches_off).
  function renderBatches(list) {
    $("batches").hidden = !list || list.length === 0;
    $("batches-body").replaceChildren(...(list || []).map((batch) => {
      const counts = batch.request_counts || { total: 0, completed: 0, failed: 0 };
      const bar = document.createElement("progress");
      bar.max = Math.max(counts.total, 1);
      bar.value = counts.completed + counts.failed;
      const progress = el("td");
      progress.append(bar);
      const tr = row([
        batch.id, batch.key ?? "", stateCell(batch.status), batch.endpoint, progress,
        el("td", `${counts.completed} / ${counts.failed} / ${counts.total}`, "num"),
        new Date(batch.created_at * 1000).toLocaleTimeString(),
      ]);
      tr.dataset.batch = batch.id;
      return tr;
    }));
  }

  function start() {
    const form = $("keys");
    $("client-key").value = keys.client;
    $("admin-key").value = keys.admin;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      keys.set($("client-key").value.trim(), $("admin-key").value.trim());
      refresh();
    });
    $("forget-keys").addEventListener("click", () => {
      keys.set("", "");
      $("client-key").value = $("admin-key").value = "";
      refresh();
    });
    window.GatewayKeys = keys;
    const failed = (error) => {
      console.error("status page refresh failed:", error);
      $("refreshed").textContent = `refresh failed: ${error && error.message}`;
    };
    const loop = () => refresh().catch(failed).finally(() => setTimeout(loop, REFRESH_MS));  // never two at once
    loop();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
