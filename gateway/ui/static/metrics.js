// Per-model traffic from the gateway's own /metrics (Prometheus text): rates between two scrapes.
"use strict";

(function () {
  const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

  // [{name, labels: {...}, value}] of every sample line.
  function parse(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const match = SAMPLE.exec(line);
      if (!match) continue;
      const labels = {};
      for (const pair of (match[2] || "").matchAll(LABEL)) labels[pair[1]] = pair[2].replace(/\\(.)/g, "$1");
      samples.push({ name: match[1], labels, value: Number(match[3]) });
    }
    return samples;
  }

  // What one scrape says per model: counters summed, the TTFT histogram's buckets.
  function totals(samples) {
    const models = {};
    const of = (name) => (models[name] ??= { requests: 0, errors: 0, tokensOut: 0, inFlight: 0, ttft: {} });
    for (const { name, labels, value } of samples) {
      if (!labels.model) continue;
      const model = of(labels.model);
      if (name === "gateway_requests_total") {
        model.requests += value;
        if (Number(labels.status) >= 500) model.errors += value;
      } else if (name === "gateway_stream_errors_total") model.errors += value;
      else if (name === "gateway_tokens_total" && labels.kind === "completion") model.tokensOut += value;
      else if (name === "gateway_in_flight_requests") model.inFlight += value;
      else if (name === "gateway_time_to_first_token_seconds_bucket") model.ttft[labels.le] = (model.ttft[labels.le] || 0) + value;
    }
    return models;
  }

  // The median of a cumulative histogram ({le: count}), interpolated in its bucket as Prometheus does.
  function median(buckets) {
    const bounds = Object.keys(buckets).map((le) => [le === "+Inf" ? Infinity : Number(le), buckets[le]]).sort((a, b) => a[0] - b[0]);
    const count = bounds.length ? bounds[bounds.length - 1][1] : 0;
    if (!count) return null;
    let lower = 0, below = 0;
    for (const [bound, cumulative] of bounds) {
      if (cumulative >= count / 2) {
        if (bound === Infinity) return lower;
        return lower + (bound - lower) * ((count / 2 - below) / Math.max(cumulative - below, 1e-9));
      }
      lower = bound; below = cumulative;
    }
    return null;
  }

  function difference(now, before) {
    const out = {};
    for (const le of Object.keys(now)) out[le] = now[le] - (before[le] || 0);
    return out;
  }

  // Rates over the time between the last two scrapes (the first scrape has none yet).
  class Rates {
    constructor() { this.last = null; }

    update(text, at) {
      const now = { at, models: totals(parse(text)) };
      const before = this.last;
      this.last = now;
      const view = {};
      for (const [name, model] of Object.entries(now.models)) {
        const old = before && before.models[name];
        const seconds = before ? (at - before.at) / 1000 : 0;
        const recent = old ? difference(model.ttft, old.ttft) : {};
        const recentMedian = old ? median(recent) : null;
        view[name] = {
          inFlight: model.inFlight,
          requestsPerS: old && seconds > 0 ? (model.requests - old.requests) / seconds : null,
          tokensPerS: old && seconds > 0 ? (model.tokensOut - old.tokensOut) / seconds : null,
          errors: model.errors,
          newErrors: old ? model.errors - old.errors : 0,
          ttftP50: recentMedian ?? median(model.ttft),
          ttftWindow: recentMedian !== null,
        };
      }
      return view;
    }
  }

  window.GatewayMetrics = { parse, median, Rates };
})();
