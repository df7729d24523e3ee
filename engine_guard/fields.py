"""Which body fields may reach an engine: the allowlist's tables, one place for all routes.

A field of a proxied request is one of:

- **allowed**: declared (typed, bounded) by the route's schema in :mod:`engine_guard.schemas`, sent upstream;
- **dropped**: sent by OpenAI-compatible clients for OpenAI's own service, meaningless for an engine (e.g.
  ``store`` on chat, ``service_tier``): removed before the request goes upstream, never refused (:data:`DROPPED`);
- **an extension**: an SGLang field that carries raw token ids or engine control; refused (400 naming the
  field) unless the deployment enables it for the model (``gateway.extension_fields``), validated when on
  (:data:`EXTENSIONS`);
- anything else: **unknown**, refused with a 400 naming the field. SGLang itself silently ignores unknown
  fields, so a client misspelling ``max_tokens`` would otherwise get a default it did not ask for.

A test compares these tables with the request models of the installed SGLang: a field a new SGLang
version adds is refused until it is classified here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Extension:
    """An SGLang extension field, off unless enabled per model."""

    why: str  # what it does, and why it is off by default (the table of docs/security.md)
    routes: frozenset[str]  # the proxied paths whose engine route reads it


_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_GENERATE = frozenset({_CHAT, _COMPLETIONS})
_ALL_GENERATION = frozenset({_CHAT, _COMPLETIONS, "/v1/responses", "/v1/messages"})


def _on(*paths: str) -> frozenset[str]:
    return frozenset(paths)


# name -> Extension. Grouped by why they are off; every one of them is accepted by SGLang 0.5.23.
EXTENSIONS: dict[str, Extension] = {
    # Raw ids and engine-side identities: a client could crash the scheduler, or see other keys' requests.
    "input_ids": Extension("the prompt as raw token ids instead of messages (checked against the vocabulary when on)", _on(_CHAT)),
    "rid": Extension("the engine's own request id: ids are shared by every key, a duplicate reveals another key's request", _on(_CHAT, _COMPLETIONS, "/v1/embeddings", "/v1/classify")),
    "session_id": Extension("an engine session the request continues (sessions are not owned by keys)", _on(_CHAT, _COMPLETIONS, "/v1/responses")),
    "session_params": Extension("engine session control (sessions are not owned by keys)", _GENERATE),
    "extra_key": Extension("a prefix-cache namespace key", _on(_CHAT, _COMPLETIONS, "/v1/responses")),
    "cache_salt": Extension("a prefix-cache salt", _on(_CHAT, _COMPLETIONS, "/v1/responses")),
    # Code and adapters run by the engine.
    "custom_logit_processor": Extension("a pickled logit processor run inside the engine (needs the engine's --enable-custom-logit-processor): code execution by design", _GENERATE),
    "custom_params": Extension("parameters for a custom logit processor", _GENERATE),
    "lora_path": Extension("a LoRA adapter the engine loads for the request", _on(_CHAT, _COMPLETIONS, "/v1/embeddings")),
    # Disaggregation and data-parallel routing: where the engine sends the request.
    **{
        name: Extension("prefill/decode disaggregation and data-parallel routing (a router's job, not a client's)", _ALL_GENERATION)
        for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank", "routed_dp_rank")
    },
    "data_parallel_rank": Extension("the data-parallel rank that serves the request", _on(_CHAT, _COMPLETIONS, "/v1/responses")),
    # Expensive or internal outputs.
    "return_hidden_states": Extension("the model's hidden states in the answer (large, slow)", _GENERATE),
    "return_routed_experts": Extension("MoE routing of every token (large)", _GENERATE),
    "routed_experts_start_len": Extension("with return_routed_experts", _GENERATE),
    "return_meta_info": Extension("the engine's internal request metadata", _on(_CHAT)),
    "return_prompt_token_ids": Extension("the prompt's token ids in the answer", _on(_CHAT)),
    "return_input_ids_in_sglext": Extension("the prompt's token ids in the answer", _on(_CHAT)),
    "return_output_ids_in_sglext": Extension("the output's token ids in the answer", _on(_CHAT)),
    "return_token_ids": Extension("token ids in the answer", _GENERATE),
    "return_cached_tokens_details": Extension("prefix-cache details (reveals what other requests cached)", _GENERATE),
    "return_spec_tokens_details": Extension("speculative decoding details", _GENERATE),
    "return_flat_raw_output_top_logprobs": Extension("raw top logprobs arrays", _on(_CHAT)),
    "return_flat_raw_top_logprobs_b64": Extension("raw top logprobs arrays", _on(_CHAT)),
    "return_sampling_mask": Extension("the sampling mask of every step (large)", _on(_CHAT)),
    "sampling_logprobs_mode": Extension("which logprobs the sampler reports", _on(_CHAT)),
    "watermark": Extension("output watermarking parameters", _GENERATE),
    "task": Extension("an engine-internal task selector", _on(_CHAT)),
    "custom_labels": Extension("labels for the engine's metrics (unbounded cardinality)", _on(_COMPLETIONS)),
    # Multimodal processor knobs (the CPU tiny model has no processor; sizes drive memory).
    **{
        name: Extension("multimodal processor settings", _on(_CHAT, _COMPLETIONS) if name in ("mm_processor_kwargs", "images_config") else _on(_CHAT))
        for name in ("mm_processor_kwargs", "images_config", "video_config", "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video")
    },
    # Embedding overrides: raw vectors and token ids placed into the model's input.
    "embed_overrides": Extension("raw embedding vectors placed into the input", _on("/v1/embeddings")),
    "embed_override_token_id": Extension("the token id whose embedding is overridden", _on("/v1/embeddings", "/v1/score")),
    "query_embed_overrides": Extension("raw embedding vectors placed into the query", _on("/v1/score")),
    "item_embed_overrides": Extension("raw embedding vectors placed into the items", _on("/v1/score")),
    "return_pooled_hidden_states": Extension("pooled hidden states in the answer (large)", _on("/v1/score")),
    "score_extraction_token": Extension("which token position is scored", _on("/v1/score")),
}  # fmt: skip

# path -> fields never sent, whatever the deployment says, with the reason the client is told.
REFUSED: dict[str, dict[str, str]] = {
    "/v1/responses": {
        "request_id": "response ids are chosen by the engine (a client choosing one could overwrite another key's stored response)",
    },
}

# path -> fields removed before the request goes upstream: OpenAI's (or Anthropic's) service options that
# clients and SDK wrappers send, which an engine has no use for. Refusing them would break those clients.
_OPENAI_SERVICE = frozenset({"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"})
DROPPED: dict[str, frozenset[str]] = {
    _CHAT: _OPENAI_SERVICE | {"store", "metadata", "verbosity", "modalities", "web_search_options"},
    _COMPLETIONS: _OPENAI_SERVICE,
    "/v1/responses": _OPENAI_SERVICE | {"stream_options"},
    "/v1/messages": frozenset({"service_tier", "container", "mcp_servers", "context_management"}),
    "/v1/messages/count_tokens": frozenset({"context_management", "mcp_servers"}),
}


@functools.cache
def extensions_for(path: str) -> frozenset[str]:
    """The extension fields the engine route behind ``path`` reads (computed once per path: it runs per request)."""
    return frozenset(name for name, extension in EXTENSIONS.items() if path in extension.routes)


def extension_table() -> str:
    """The table of extension fields in docs/security.md (a test checks that page holds exactly this)."""
    lines = ["| field | routes | what it does, and why it is off |", "|---|---|---|"]
    for name, extension in EXTENSIONS.items():
        routes = ", ".join(f"`{path}`" for path in sorted(extension.routes))
        lines.append(f"| `{name}` | {routes} | {extension.why} |")
    return "\n".join(lines)
