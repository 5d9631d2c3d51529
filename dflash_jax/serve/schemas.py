"""Pydantic models of the OpenAI requests and responses the server speaks.

Requests: :class:`ChatCompletionRequest` (``POST /v1/chat/completions``) and
:class:`CompletionRequest` (``POST /v1/completions``), with the extensions ``top_k``,
``ignore_eos``, ``chat_template_kwargs`` and ``n_max``. Numbers and flags are strict (``"5"`` is
not an integer). A request's own fields are closed: an unknown one is refused (400 naming it,
code ``unknown_parameter``), never dropped unseen; OpenAI's fields that change nothing here
(``user``, ``store``, ``metadata``, ``service_tier``, ``parallel_tool_calls``) are taken, and
those whose effect this server does not have (log-probabilities, penalties, ``logit_bias``, a
``response_format`` other than text, ...) are refused by
:mod:`~dflash_jax.serve.requests` unless at their neutral value. Nested objects (messages, tools)
ignore extra fields: clients send back earlier answers with fields such as ``refusal``.
Responses follow OpenAI's schema; ``usage.completion_tokens_details`` counts the drafted tokens the
target accepted and rejected, and ``speculative`` (an extension) holds the request's speculative
statistics.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from dflash_jax.decode.logprobs import MAX_TOP_LOGPROBS


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Request):
    name: StrictStr
    arguments: StrictStr = "{}"


class MessageToolCall(_Request):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class FunctionSpec(_Request):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: dict[str, Any]


class StreamOptions(_Request):
    include_usage: StrictBool = False


def _integral(x):
    """JSON has one number type: ``11.0`` is the integer 11 (as JSON Schema says); ``11.5``,
    ``"11"`` and ``true`` are not integers."""
    return int(x) if isinstance(x, float) and x.is_integer() and abs(x) < 2**63 else x


Int = Annotated[StrictInt, BeforeValidator(_integral)]
Number = Union[StrictInt, StrictFloat]


class _Sampling(BaseModel):
    """Fields both endpoints share (OpenAI's names and defaults; ``top_k``, ``ignore_eos`` and
    ``n_max`` are extensions). Closed to unknown fields (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=0, lt=2**31)
    seed: Int | None = Field(default=None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    ignore_eos: StrictBool = False
    n_max: Int | None = Field(default=None, ge=1)
    # OpenAI's, refused unless neutral (serve.requests.check_unsupported)
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    # OpenAI's bookkeeping: no effect here
    user: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[Int] | list[StrictStr] | list[list[Int]]
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool | None = None
    best_of: Int | None = None
    suffix: StrictStr | None = None


# ---------------------------------------------------------------- responses


class PredictionDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class PromptDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails = PromptDetails()
    completion_tokens_details: PredictionDetails = PredictionDetails()


class SpeculativeStats(BaseModel):
    """The request's own DFlash statistics (extension field ``speculative``)."""

    tau: float
    verify_steps: int
    accepted_per_position: list[float]
    drafted_tokens: int
    accepted_tokens: int
    n_max: int | Literal["auto"]
    tree: int | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class TopLogprob(BaseModel):
    """A token and the target's log-probability of it (``log_softmax`` of the raw logits, before
    temperature, top-k and top-p); ``bytes``: its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """A chat choice's log-probabilities: one entry per answer token."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's log-probabilities (OpenAI's legacy layout)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class _Answer(BaseModel):
    """What every completion object shares (OpenAI's schema, plus the ``speculative`` extension)."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    speculative: SpeculativeStats | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash_jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
