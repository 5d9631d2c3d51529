"""Engine events to OpenAI responses: whole (``chat.completion``, ``text_completion``) or streamed
as server-sent events (role chunk, deltas, final chunk with ``finish_reason``, a usage chunk when
asked, ``[DONE]``). The same parsers (:class:`Answer`) run in both, so a streamed answer equals
the whole one.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Awaitable

from fastapi.sse import format_sse_event

from dflash_jax.serve import logprobs as lp
from dflash_jax.serve.errors import APIError
from dflash_jax.serve.harmony import HarmonyParser
from dflash_jax.serve.jobs import Done, Failed, Job, Text
from dflash_jax.serve.reasoning import ReasoningSplitter
from dflash_jax.serve.requests import ChatOptions
from dflash_jax.serve.tool_calls import ToolCallParser
from dflash_jax.serve.schemas import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChoiceLogprobs, ChunkChoice, Completion, Delta,
                                      DeltaToolCall, PredictionDetails, PromptDetails, ResponseMessage, ResponseToolCall,
                                      SpeculativeStats, TextChoice, Usage)


class Answer:
    """Reasoning split, then tool-call extraction, over the answer text as it arrives; a harmony
    answer (gpt-oss) goes through :class:`~dflash_jax.serve.harmony.HarmonyParser` instead.

    Args:
      options: a chat request's :class:`~dflash_jax.serve.requests.ChatOptions`, or ``None`` for a
        completion (raw text: nothing parsed).
    """

    def __init__(self, options: ChatOptions | None):
        harmony = options is not None and options.harmony
        self.harmony = HarmonyParser(options.tools is not None) if harmony else None
        self.reasoning = ReasoningSplitter(options.in_reasoning) if options is not None and not harmony else None
        self.tools = ToolCallParser(options.tools) if self.reasoning is not None and options.tools is not None else None

    def _content(self, text: str) -> tuple[str, list[dict]]:
        return (text, []) if self.tools is None else self.tools.feed(text)

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        """``(new reasoning, new content, new tool calls)``."""
        if self.harmony is not None:
            return self.harmony.feed(text)
        if self.reasoning is None:
            return "", text, []
        reasoning, content = self.reasoning.feed(text)
        return (reasoning, *self._content(content))

    def finish(self) -> tuple[str, str, list[dict]]:
        """Flushes what the parsers held back."""
        if self.harmony is not None:
            return self.harmony.finish()
        if self.reasoning is None:
            return "", "", []
        reasoning, content = self.reasoning.finish()
        content, calls = self._content(content)
        if self.tools is not None:
            content += self.tools.finish()
        return reasoning, content, calls

    @property
    def called(self) -> bool:
        calls = self.harmony.calls if self.harmony is not None else self.tools.calls if self.tools is not None else ()
        return bool(calls)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(done: Done) -> Usage:
    """OpenAI usage; the cached tokens are the prompt's leading tokens restored from the prefix
    cache, the accepted / rejected prediction tokens the drafts the target kept or refused."""
    sp = done.speculative or {}
    acc, drafted = sp.get("accepted_tokens", 0), sp.get("drafted_tokens", 0)
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens,
                 prompt_tokens_details=PromptDetails(cached_tokens=done.cached_tokens),
                 completion_tokens_details=PredictionDetails(accepted_prediction_tokens=acc, rejected_prediction_tokens=drafted - acc))


def speculative(done: Done) -> SpeculativeStats | None:
    return None if done.speculative is None else SpeculativeStats(**done.speculative)


async def events(job: Job) -> AsyncIterator:
    """The job's events up to and including :class:`Done` / :class:`Failed`."""
    while True:
        ev = await job.events.get()
        yield ev
        if isinstance(ev, (Done, Failed)):
            return


async def cancel_when(gone: Awaitable, job: Job, engine) -> None:
    """Waits for ``gone`` (the client's disconnect), then cancels ``job`` (the engine frees its row
    or drops it from the queue at its next round) and ends its event stream with a 499."""
    await gone
    job.cancelled = True
    engine.wake()
    job.events.put_nowait(Failed("client disconnected", 499))


def _failed(ev: Failed) -> APIError:
    code = {500: "engine_error", 499: "cancelled"}.get(ev.status, "server_shutting_down")
    return APIError(ev.status, ev.message, None, code)


async def collect(job: Job, options: ChatOptions | None, gone: Awaitable, engine) -> tuple[str, str, list[dict], Done, list]:
    """Waits for the whole answer: ``(reasoning, content, tool calls, Done, log-probability
    entries)`` (the entries of the answer's tokens, :class:`~dflash_jax.serve.logprobs.Entry`,
    when the request asked for them); cancels the job as soon as ``gone`` (the client's
    disconnect) returns. Raises :class:`APIError` when the engine failed the request or the client left."""
    answer, parts, entries = Answer(options), ([], [], []), []
    watch = asyncio.ensure_future(cancel_when(gone, job, engine))
    try:
        async for ev in events(job):
            if isinstance(ev, Failed):
                raise _failed(ev)
            r, c, calls = answer.feed(ev.text) if isinstance(ev, Text) else answer.finish()
            parts[0].append(r)
            parts[1].append(c)
            parts[2].extend(calls)
            if isinstance(ev, Text):
                entries.extend(ev.logprobs)
            if isinstance(ev, Done):  # a stop text cut the answer: the tokens it kept
                return "".join(parts[0]), "".join(parts[1]), parts[2], ev, entries[: ev.completion_tokens]
    finally:
        watch.cancel()


def finish_reason(done: Done, answer: Answer) -> str:
    return "tool_calls" if answer.called else done.finish_reason


def chat_logprobs(tokenizer, entries: list, k: int | None) -> ChoiceLogprobs | None:
    """A chat choice's ``logprobs`` (``None`` when the request did not ask: ``k`` is ``None``)."""
    return None if k is None else ChoiceLogprobs(content=lp.chat_content(tokenizer, entries, k))


def completion_logprobs(tokenizer, entries: list, k: int | None, offset: int = 0) -> dict | None:
    """A completion choice's ``logprobs`` (``None`` when the request did not ask)."""
    return None if k is None else lp.completion_logprobs(tokenizer, entries, k, offset)


def chat_completion(model_name: str, reasoning: str, content: str, calls: list[dict], done: Done, called: bool,
                    logprobs: ChoiceLogprobs | None = None) -> ChatCompletion:
    msg = ResponseMessage(content=content if (content or not calls) else None, reasoning_content=reasoning or None,
                          tool_calls=[ResponseToolCall(id=c["id"], function=c["function"]) for c in calls] or None)
    choice = ChatChoice(message=msg, finish_reason="tool_calls" if called else done.finish_reason, logprobs=logprobs)
    return ChatCompletion(id=new_id("chatcmpl"), created=int(time.time()), model=model_name, choices=[choice],
                          usage=usage(done), speculative=speculative(done))


def text_completion(model_name: str, text: str, done: Done, logprobs: dict | None = None) -> Completion:
    return Completion(id=new_id("cmpl"), created=int(time.time()), model=model_name,
                      choices=[TextChoice(text=text, finish_reason=done.finish_reason, logprobs=logprobs)], usage=usage(done),
                      speculative=speculative(done))


def sse(obj) -> bytes:
    """One server-sent event carrying a response model (or a dict) as JSON."""
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return format_sse_event(data_str=data)


DONE = format_sse_event(data_str="[DONE]")


async def chat_stream(job: Job, options: ChatOptions, model_name: str, include_usage: bool, engine) -> AsyncIterator[bytes]:
    """The streamed chat answer (module docstring); cancels the job if the client goes away. With
    log-probabilities asked, each chunk carries those of the tokens that arrived with it."""
    answer, cid, created = Answer(options), new_id("chatcmpl"), int(time.time())
    k = job.spec.logprobs
    tokenizer = None if k is None else engine.tokenizer

    def chunk(delta: Delta, finish=None, entries=(), **extra) -> bytes:
        choice = ChunkChoice(delta=delta, finish_reason=finish, logprobs=chat_logprobs(tokenizer, list(entries), k) if entries else None)
        return sse(ChatCompletionChunk(id=cid, created=created, model=model_name, choices=[choice], **extra))
    try:
        yield chunk(Delta(role="assistant", content=""))
        async for ev in events(job):
            if isinstance(ev, Failed):
                yield sse(_failed(ev).body())
                break
            r, c, calls = answer.feed(ev.text) if isinstance(ev, Text) else answer.finish()
            entries = ev.logprobs if isinstance(ev, Text) else []
            if r or c or calls or entries:
                tc = [DeltaToolCall(index=x["index"], id=x["id"], type="function", function=x["function"]) for x in calls] or None
                yield chunk(Delta(reasoning_content=r or None, content=c or None, tool_calls=tc), entries=entries)
            if isinstance(ev, Done):
                yield chunk(Delta(), finish_reason(ev, answer), speculative=speculative(ev))
                if include_usage:
                    yield sse(ChatCompletionChunk(id=cid, created=created, model=model_name, choices=[], usage=usage(ev)))
        yield DONE
    finally:
        job.cancelled = True  # no-op after Done; frees the row when the client left mid-stream
        engine.wake()


async def completion_stream(job: Job, model_name: str, include_usage: bool, engine, echo: str = "") -> AsyncIterator[bytes]:
    """The streamed completion: ``echo`` (the prompt, when asked), text deltas (with their tokens'
    log-probabilities when asked), the final chunk, usage when asked, ``[DONE]``."""
    cid, created = new_id("cmpl"), int(time.time())
    offset = len(echo)

    def chunk(text: str, finish=None, logprobs=None, **extra) -> bytes:
        choice = TextChoice(text=text, finish_reason=finish, logprobs=logprobs)
        return sse(Completion(id=cid, created=created, model=model_name, choices=[choice], **extra))
    try:
        if echo:
            yield chunk(echo)
        async for ev in events(job):
            if isinstance(ev, Failed):
                yield sse(_failed(ev).body())
                break
            if isinstance(ev, Text):
                if ev.text or ev.logprobs:
                    logprobs = completion_logprobs(engine.tokenizer, ev.logprobs, job.spec.logprobs, offset) if ev.logprobs else None
                    offset += sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
                    yield chunk(ev.text, logprobs=logprobs)
                continue
            yield chunk("", ev.finish_reason, speculative=speculative(ev))
            if include_usage:
                yield sse(Completion(id=cid, created=created, model=model_name, choices=[], usage=usage(ev)))
        yield DONE
    finally:
        job.cancelled = True
        engine.wake()
