"""The server's OpenAPI document, made true: what FastAPI derives from the pydantic models, then
the bounds the server enforces beyond their types (:func:`document`).

- Request bodies: every field with its type and bound; the ``model`` field an enum of the names
  served; the fields whose effect this server does not have (penalties, ``logit_bias``,
  ``best_of``, ``suffix``, a ``response_format`` other than text, ``n`` above 1) bounded to
  their neutral values; ``max_tokens`` to the context; token ids to the vocabulary; ``n_max`` to the
  drafter's block (absent without a drafter); ``tools`` absent when the chat template takes none.
  What no JSON schema can say is in the field descriptions: a prompt plus ``max_tokens`` must fit
  the context (else 400 ``context_length_exceeded``), ``echo`` goes without ``logprobs``.
- Responses: 200 as JSON or, with ``stream: true``, server-sent events; every error status the
  server answers (400, 401 with a key, 404, 413, 429, 503) as OpenAI's error object; ``/metrics``
  as Prometheus text; ``/health`` as its states.
"""

from __future__ import annotations

import copy

from fastapi.openapi.utils import get_openapi

from dflash_jax.serve.schemas import ChatCompletion, Completion, ModelList

ERROR = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"type": "string", "enum": ["starting", "ready", "draining", "dead"]},
    "running": {"type": "integer"}, "waiting": {"type": "integer"}, "error": {"type": "string"}}}

_WHY = {400: "a malformed request, a field out of its bounds, or a prompt plus max_tokens over the context",
        401: "no or a wrong API key (Authorization: Bearer KEY)", 404: "a model that is not served here",
        413: "a body over the server's limit", 429: "the queue is full (Retry-After)",
        503: "the server is starting, draining or out of KV memory (Retry-After)"}


SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk of the answer (or an error object), then [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
"""One server-sent event (before OpenAPI 3.2 a stream's ``schema`` describes each of its events)."""

_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def _json_bounds(node) -> None:
    """Pydantic writes the bounds of a union of number types (and of an annotated integer) as its
    own keys ``ge``/``gt``/``le``/``lt`` beside an ``anyOf``, which JSON Schema ignores: they are
    moved into the numeric branches as ``minimum``/``maximum``/... (in place, recursively)."""
    if isinstance(node, list):
        for x in node:
            _json_bounds(x)
        return
    if not isinstance(node, dict):
        return
    bounds = {_BOUNDS[k]: node.pop(k) for k in list(node) if k in _BOUNDS}
    if bounds:
        targets = [b for b in node.get("anyOf", []) if b.get("type") in ("integer", "number") or "anyOf" in b] or [node]
        for t in targets:
            for branch in (t["anyOf"] if "anyOf" in t and t is not node else [t]):
                branch.update(bounds)
    for v in node.values():
        _json_bounds(v)


def _errors(statuses) -> dict:
    return {str(s): {"description": _WHY[s], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


def _components(doc: dict, *models) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR
    for m in models:
        js = m.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(js.pop("$defs", {}))
        schemas[m.__name__] = js


def _tighten(props: dict, names: list[str], max_len: int, vocab: int, n_max: int | None, tools: bool) -> None:
    """The request bounds the server enforces beyond the pydantic types (module docstring)."""
    props["model"] = {"type": "string", "enum": names, "description": "the served model (GET /v1/models)"}
    budget = {"type": ["integer", "null"], "minimum": 1, "maximum": max_len - 1,
              "description": f"new tokens; the prompt plus these must fit the context of {max_len} tokens (else 400 context_length_exceeded)"}
    for key in ("max_tokens", "max_completion_tokens"):
        if key in props:
            props[key] = dict(budget)
    props["seed"] = {"type": ["integer", "null"], "minimum": 0, "maximum": 2**63 - 1, "description": "sampling seed"}
    props["n"] = {"type": "integer", "minimum": 1, "maximum": 1, "default": 1, "description": "one choice per request"}
    for key in ("frequency_penalty", "presence_penalty"):
        props[key] = {"type": ["number", "null"], "minimum": 0, "maximum": 0, "description": "no penalties here: 0 or absent"}
    props["logit_bias"] = {"type": ["object", "null"], "maxProperties": 0, "description": "no logit bias here: {} or absent"}
    text = {"type": "string", "minLength": 1}
    props["stop"] = {"anyOf": [text, {"type": "array", "items": text, "maxItems": 4}, {"type": "null"}],
                     "description": "up to 4 non-empty stop texts"}
    if n_max is None:
        props.pop("n_max", None)
    else:
        props["n_max"] = {"type": ["integer", "null"], "minimum": 1, "maximum": n_max, "description": "draft depth (a chain) for this request"}
    if "prompt" in props:  # completions
        ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
        props["prompt"] = {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                                     {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}],
                           "description": "one prompt: text or token ids (its tokens plus max_tokens fit the context)"}
        props["best_of"] = {"type": ["integer", "null"], "minimum": 1, "maximum": 1}
        props["suffix"] = {"type": ["string", "null"], "maxLength": 0}
        props["echo"]["description"] = "the answer starts with the prompt; not with logprobs (400)"
        props["logprobs"]["description"] = "alternatives per token reported with each token's log-probability (raw target logits)"
    else:  # chat
        props["response_format"] = {"anyOf": [{"type": "object", "required": ["type"], "additionalProperties": False,
                                               "properties": {"type": {"type": "string", "enum": ["text"]}}}, {"type": "null"}]}
        props["tool_choice"] = {"type": ["string", "null"], "enum": ["none", "auto", None]}
        props["chat_template_kwargs"] = {"type": ["object", "null"],
                                         "propertyNames": {"not": {"enum": ["messages", "add_generation_prompt", "tools"]}},
                                         "description": "variables of the chat template"}
        props["top_logprobs"]["description"] = "alternatives per token (asks for log-probabilities, as logprobs: true does)"
        if not tools:
            props.pop("tools", None)
            props.pop("tool_choice", None)


def document(app, names: list[str], max_len: int, vocab: int, n_max: int | None, tools: bool, api_key: bool) -> dict:
    """The OpenAPI document of ``app`` (module docstring): ``names`` the model names served,
    ``max_len`` the context, ``vocab`` the target's vocabulary size, ``n_max`` the deepest draft a
    request may ask (``None``: no drafter), ``tools`` whether the chat template takes tools,
    ``api_key`` whether ``/v1`` and ``/metrics`` need one."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    doc = copy.deepcopy(doc)
    _components(doc, ChatCompletion, Completion, ModelList)
    schemas = doc["components"]["schemas"]
    _json_bounds(schemas)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        _tighten(schemas[name]["properties"], names, max_len, vocab, n_max, tools)
    schemas["CompletionRequest"]["not"] = {"required": ["echo", "logprobs"], "properties": {  # echo goes without logprobs
        "echo": {"const": True}, "logprobs": {"type": "integer"}}}
    auth = [401] if api_key else []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
                responses.update(_errors(auth))
            elif path == "/health":
                ok = {"content": {"application/json": {"schema": HEALTH}}}
                responses["200"] = dict(ok, description="ready")
                responses["503"] = dict(ok, description="starting, draining or dead")
            elif path == "/v1/models":
                responses["200"] = {"description": "the served model", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ModelList"}}}}
                responses.update(_errors(auth))
            else:
                answer = "ChatCompletion" if "chat" in path else "Completion"
                responses["200"] = {"description": "the answer, or with stream: true its server-sent events", "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}},
                    "text/event-stream": {"schema": SSE_EVENT}}}
                responses.update(_errors([400, *auth, 404, 413, 429, 503]))
            if api_key and path != "/health":
                op["security"] = [{"bearer": []}]
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
