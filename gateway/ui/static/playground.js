// The playground: one chat message, streamed through the gateway's own /v1/chat/completions with the
// client key typed above (no route a client key could not use), with its time to first token and tokens/s.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let running = null;  // the AbortController of the answer being streamed

  function offerModels(names) {
    const select = $("pg-model");
    const current = select.value;
    const have = Array.from(select.options, (option) => option.value);
    if (have.length === names.length && have.every((name, i) => name === names[i])) return;
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(current)) select.value = current;
  }

  function requestBody() {
    const body = {
      model: $("pg-model").value,
      messages: [{ role: "user", content: $("pg-prompt").value }],
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = $("pg-temperature").value, maxTokens = $("pg-max-tokens").value;
    if (temperature !== "") body.temperature = Number(temperature);
    if (maxTokens !== "") body.max_tokens = Number(maxTokens);
    const schema = $("pg-schema").value.trim();
    if (schema) {
      let parsed;
      try { parsed = JSON.parse(schema); } catch (error) { throw new Error("the JSON schema is not valid JSON: " + error.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed } };
    }
    return body;
  }

  function errorText(body, status) {
    const error = body && body.error;
    return error ? `${status ? status + ": " : ""}${error.message || JSON.stringify(error)}` : `the gateway answered ${status}`;
  }

  // SSE events ("data: {...}" separated by blank lines) as they arrive, whole events only.
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart()).join("\n");
        if (data) yield data;
      }
    }
  }

  function showStats(started, first, last, tokens, finished) {
    const parts = [];
    if (first !== null) parts.push(`TTFT ${(first - started).toFixed(0)} ms`);
    if (tokens) parts.push(`${tokens} tokens`);
    if (first !== null && last > first && tokens > 1) parts.push(`${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tokens/s`);
    if (finished) parts.push(finished);
    $("pg-stats").textContent = parts.join(" · ");
  }

  async function send(event) {
    event.preventDefault();
    if (running) return;
    const answer = $("pg-answer"), error = $("pg-error");
    answer.textContent = error.textContent = "";
    delete answer.dataset.done;
    let body;
    try { body = requestBody(); } catch (problem) { error.textContent = problem.message; return; }
    running = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop").disabled = false;
    const key = window.GatewayKeys ? window.GatewayKeys.client : "";
    const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
    if (key) headers.Authorization = "Bearer " + key;
    const started = performance.now();
    let first = null, last = null, pieces = 0, usage = null, finish = null;
    try {
      const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body), signal: running.signal });
      if (!response.ok) {
        const problem = await response.json().catch(() => null);
        error.textContent = errorText(problem, response.status);
        return;
      }
      for await (const data of events(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) { error.textContent = errorText(chunk); break; }
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.finish_reason) finish = choice.finish_reason;
        const text = choice.delta && choice.delta.content;
        if (text) {
          last = performance.now();
          if (first === null) first = last;
          pieces += 1;
          answer.textContent += text;
          showStats(started, first, last, pieces, null);
        }
      }
      const tokens = usage ? usage.completion_tokens : pieces;
      showStats(started, first, last ?? performance.now(), tokens, finish ? `finish: ${finish}` : null);
    } catch (problem) {
      error.textContent = problem.name === "AbortError" ? "stopped" : "the stream broke: " + problem.message;
    } finally {
      running = null;
      $("pg-send").disabled = false;
      $("pg-stop").disabled = true;
      answer.dataset.done = "true";
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("chat").addEventListener("submit", send);
    $("pg-stop").addEventListener("click", () => running && running.abort());
    $("pg-prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("chat").requestSubmit();
    });
  });

  window.GatewayPlayground = { offerModels };
})();
