"""From a validated request to a :class:`~dflash_jax.serve.jobs.JobSpec`: the prompt (chat
template with tools, or a completion prompt), the budget checked against the capacity, sampling,
stop texts and the draft depth. Every refusal is an :class:`~dflash_jax.serve.errors.APIError`
naming the request field, with OpenAI's codes (``context_length_exceeded``, ``model_not_found``).
"""

from __future__ import annotations

import dataclasses
import json
import secrets

from dflash_jax.errors import DFlashError
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.serve.errors import APIError, from_dflash
from dflash_jax.serve.harmony import is_harmony
from dflash_jax.serve.jobs import MAX_STOPS, JobSpec, ServedModel
from dflash_jax.serve.reasoning import prompt_opens_reasoning
from dflash_jax.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from dflash_jax.text import split_stop


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How a chat answer is parsed: ``tools`` (``None``: tool calls are not parsed), whether the
    prompt opened a reasoning block, and whether the answer is harmony's (gpt-oss: parsed by
    :mod:`~dflash_jax.serve.harmony` from text with its special tokens)."""

    tools: list | None
    in_reasoning: bool
    harmony: bool = False


def check_model(model: ServedModel, name: str) -> None:
    """404 ``model_not_found`` unless ``name`` is one of the served model's names (never used as a path)."""
    if name not in model.names:
        raise APIError(404, f"model: {name!r} is not served here (expected {' or '.join(map(repr, model.names))})", "model", "model_not_found")


def _message(m: ChatMessage) -> dict:
    """A request message as the chat template sees it (text parts joined, tool-call arguments as
    objects, as Hugging Face templates expect; arguments that are not JSON stay the text sent)."""
    content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
    out = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except ValueError:  # not JSON (a model's own malformed call sent back): the template gets the text as it was
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def _chat_prompt(model: ServedModel, req: ChatCompletionRequest) -> tuple[list[int], ChatOptions]:
    tok = model.target.tokenizer
    if tok is None or tok.chat_template is None:
        raise APIError(400, "messages: this model has no chat template (expected /v1/completions with a prompt)", "messages", "invalid_value")
    reserved = sorted(set(req.chat_template_kwargs or {}) & {"messages", "add_generation_prompt", "tools"})
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the server (expected other template variables)",
                       "chat_template_kwargs", "invalid_value")
    kwargs = dict(model.chat_template_kwargs or {}, **(req.chat_template_kwargs or {}))
    tools = None
    if req.tools and req.tool_choice != "none":
        if req.tool_choice not in (None, "auto"):
            raise APIError(400, "tool_choice: forcing a call is not supported (expected \"auto\" or \"none\")", "tool_choice", "invalid_value")
        if "tools" not in tok.chat_template:
            raise APIError(400, "tools: this model's chat template does not take tools (expected no tools)", "tools", "invalid_value")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        kwargs["tools"] = tools
    messages = [_message(m) for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except DFlashError as e:
        raise from_dflash(e, "messages") from e
    ids = tok.encode(text, add_bos=False)
    if tok.add_bos and not (ids and ids[0] == tok.bos_token_id):
        ids = [tok.bos_token_id, *ids]
    return ids, ChatOptions(tools=tools, in_reasoning=prompt_opens_reasoning(text), harmony=is_harmony(tok))


def _completion_prompt(model: ServedModel, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"prompt: {len(p)} prompts in one request (expected one; send one request per prompt)", "prompt", "invalid_value")
        p = p[0]
    if isinstance(p, str):
        if model.target.tokenizer is None:
            raise APIError(400, "prompt: text needs a tokenizer (expected token ids)", "prompt", "invalid_value")
        return model.target.tokenizer.encode(p)
    vocab = model.target.cfg.vocab_size
    bad = [i for i in p if not 0 <= i < vocab]
    if bad:
        raise APIError(400, f"prompt: token id {bad[0]} outside the vocabulary (expected ids in [0, {vocab}))", "prompt", "invalid_value")
    return list(p)


# OpenAI's fields whose effect this server does not have, each with the values that ask for none
_NEUTRAL = {"frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
            "response_format": (None, {"type": "text"}), "best_of": (None, 1), "suffix": (None, "")}


def check_unsupported(req) -> None:
    """400 ``unsupported_parameter`` naming the first field of :data:`_NEUTRAL` the request sets to
    something other than its neutral values (no penalties, no logit bias...)."""
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name, None)
        if not any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral):
            allowed = " or ".join("absent" if n is None else json.dumps(n) for n in neutral)
            raise APIError(400, f"{name}: {json.dumps(value)} is not supported by this server (expected {allowed})",
                           name, "unsupported_parameter")


def logprobs_asked(req) -> int | None:
    """The alternatives per token a request's answer reports with its log-probabilities, or
    ``None`` when it asks for none: chat's ``logprobs: true`` with ``top_logprobs`` (a
    ``top_logprobs`` alone asks for them too), completions' ``logprobs: N``."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and req.echo:
            raise APIError(400, "echo: true with logprobs is not supported by this server (expected echo false, or no logprobs: "
                           "the prompt's log-probabilities are not computed)", "echo", "unsupported_parameter")
        return req.logprobs
    return (req.top_logprobs or 0) if (req.logprobs or req.top_logprobs) else None


def _spec(model: ServedModel, req, prompt: list[int], max_tokens: int | None, max_len: int, prompt_field: str) -> JobSpec:
    """The checks both endpoints share, then the job."""
    check_unsupported(req)
    logprobs = logprobs_asked(req)
    if req.n != 1:
        raise APIError(400, f"n: got {req.n} (expected 1: one choice per request)", "n", "invalid_value")
    if not prompt:
        raise APIError(400, f"{prompt_field}: empty prompt (expected at least one token)", prompt_field, "invalid_value")
    if len(prompt) >= max_len:
        raise APIError(400, f"{prompt_field}: the prompt has {len(prompt)} tokens; this server's context is {max_len} tokens "
                       "(--max-len), leaving no room for an answer", prompt_field, "context_length_exceeded")
    room = max_len - len(prompt)
    for name in ("max_tokens", "max_completion_tokens"):  # both bounded, whichever is used
        value = getattr(req, name, None)
        if value is not None and value > room:
            raise APIError(400, f"{name}: {value} after a prompt of {len(prompt)} tokens exceeds this server's context of "
                           f"{max_len} tokens (expected at most {room})", name, "context_length_exceeded")
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    sampling = SamplingConfig(temperature=temperature, top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else float(req.top_p))
    if req.n_max is not None and model.drafter is None:
        raise APIError(400, "n_max: this server decodes without a drafter (expected no n_max)", "n_max", "invalid_value")
    try:
        static = model.decoding(req.n_max, logprobs=logprobs is not None)
    except DFlashError as e:
        raise from_dflash(e, "n_max") from e
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop: empty stop text (expected non-empty strings)", "stop", "invalid_value")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop: got {len(stops)} stop texts (expected at most {MAX_STOPS})", "stop", "invalid_value")
    stop_ids, _ = split_stop(model.target.tokenizer, stops) if stops else ([], [])
    return JobSpec(prompt=tuple(prompt), max_new=room if max_tokens is None else max_tokens, static=static,
                   sampling=sampling, ignore_eos=req.ignore_eos, stop_texts=tuple(stops), stop_ids=tuple(stop_ids),
                   seed=secrets.randbelow(2**63) if req.seed is None else req.seed,  # no seed: an answer of its own
                   logprobs=logprobs)


def chat_job(model: ServedModel, req: ChatCompletionRequest, max_len: int) -> tuple[JobSpec, ChatOptions]:
    """The job of a chat request and how its answer is parsed."""
    check_model(model, req.model)
    ids, options = _chat_prompt(model, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    spec = _spec(model, req, ids, max_tokens, max_len, "messages")
    return dataclasses.replace(spec, special_tokens=options.harmony), options


def completion_job(model: ServedModel, req: CompletionRequest, max_len: int) -> tuple[JobSpec, str]:
    """The job of a completion request, and the text its answer starts with (the prompt under
    ``echo``, else ``""``)."""
    check_model(model, req.model)
    prompt = _completion_prompt(model, req)
    spec = _spec(model, req, prompt, req.max_tokens, max_len, "prompt")
    if not req.echo:
        return spec, ""
    p = req.prompt if not isinstance(req.prompt, list) or not req.prompt or not isinstance(req.prompt[0], str) else req.prompt[0]
    tok = model.target.tokenizer
    return spec, p if isinstance(p, str) else (tok.decode(prompt) if tok is not None else "")
