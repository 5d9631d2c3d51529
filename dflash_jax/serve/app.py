"""The FastAPI application: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Handlers check a request (:mod:`~dflash_jax.serve.requests`), queue it on the
:class:`~dflash_jax.serve.engine.Engine` and turn its events into OpenAI responses
(:mod:`~dflash_jax.serve.responses`). With an API key, the ``/v1`` endpoints and ``/metrics``
need ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` stays open for probes. A body
over ``max_body_bytes`` is refused with 413, a full queue with 429 and ``Retry-After``;
``/health`` answers 503 once the engine died.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.datastructures import Headers
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from dflash_jax.serve import responses
from dflash_jax.serve.engine import Engine, NoFreePages, NotAccepting, QueueFull
from dflash_jax.serve.errors import APIError, install_handlers
from dflash_jax.serve.jobs import Job
from dflash_jax.serve.metrics import Metrics
from dflash_jax.serve.openapi import document
from dflash_jax.serve.requests import chat_job, completion_job
from dflash_jax.serve.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList


class _ContentLength:
    """Refuses a declared body over the limit before reading it (413 as an OpenAI error object);
    bodies without a length are counted by Starlette's ``RequestBodyLimitMiddleware`` inside."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            declared = Headers(scope=scope).get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                err = APIError(413, f"request body of {declared} bytes is over this server's limit of {self.max_body_bytes} bytes",
                               None, "request_too_large")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _auth(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), api_key.encode())):
            raise APIError(401, "invalid or missing API key (expected the header Authorization: Bearer <key>)", None, "invalid_api_key")
    return check


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the ASGI server's ``http.disconnect``; the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _submit(engine: Engine, job: Job, metrics: Metrics) -> None:
    try:
        engine.submit(job)
    except NoFreePages as e:
        metrics.errors.labels("503").inc()
        raise APIError(503, f"the server is out of KV memory: {e}; retry later", None, "kv_cache_full", headers={"Retry-After": "1"}) from None
    except QueueFull as e:
        metrics.errors.labels("429").inc()
        raise APIError(429, f"the server is busy: {e}; retry later", None, "queue_full", headers={"Retry-After": "1"}) from None
    except NotAccepting as e:
        metrics.errors.labels("503").inc()
        raise APIError(503, f"the server is not accepting requests: {e}", None, "unavailable", headers={"Retry-After": "5"}) from None


def build_app(engine: Engine, metrics: Metrics | None = None, api_key: str | None = None, max_body_bytes: int = 4 << 20,
              shutdown_timeout: float = 30.0, start_engine: bool = True) -> FastAPI:
    """The server's app around ``engine`` (warmed up, :meth:`~dflash_jax.serve.engine.Engine.warm_up`,
    and started by the app's lifespan, before the server listens, unless ``start_engine`` is
    false; stopped, with ``shutdown_timeout`` seconds for running requests, at shutdown)."""
    metrics = metrics or engine.metrics or Metrics()
    engine.metrics = metrics  # the engine counts into the registry /metrics shows
    model, created = engine.model, int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if start_engine and not engine.started:
            await asyncio.to_thread(engine.warm_up)  # the server listens once every batch size is ready
            engine.start()
        yield
        await asyncio.to_thread(engine.stop, shutdown_timeout)

    app = FastAPI(title="dflash-jax", lifespan=lifespan)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=max_body_bytes)
    app.add_middleware(_ContentLength, max_body_bytes=max_body_bytes)
    install_handlers(app)
    auth = [Depends(_auth(api_key))]

    @app.get("/health")
    async def health():
        """``starting`` (the engine has not started), ``ready``, ``draining`` (after SIGTERM) or
        ``dead``; 200 only when ready."""
        if engine.error is not None:
            return JSONResponse({"status": "dead", "error": f"{type(engine.error).__name__}: {engine.error}"}, status_code=503)
        running, waiting = engine.counts()
        status = engine.status
        return JSONResponse({"status": status, "running": running, "waiting": waiting}, status_code=200 if status == "ready" else 503)

    @app.get("/metrics", dependencies=auth)
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=created, max_model_len=engine.max_len) for name in model.names])

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request):
        spec, options = chat_job(model, body, engine.max_len)
        job = Job(spec, asyncio.get_running_loop())
        _submit(engine, job, metrics)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return EventSourceResponse(responses.chat_stream(job, options, model.name, include_usage, engine))
        reasoning, content, calls, done, entries = await responses.collect(job, options, _disconnect(request), engine)
        logprobs = responses.chat_logprobs(engine.tokenizer, entries, spec.logprobs)
        return responses.chat_completion(model.name, reasoning, content, calls, done, bool(calls), logprobs)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        spec, echo = completion_job(model, body, engine.max_len)
        job = Job(spec, asyncio.get_running_loop())
        _submit(engine, job, metrics)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return EventSourceResponse(responses.completion_stream(job, model.name, include_usage, engine, echo))
        _, content, _, done, entries = await responses.collect(job, None, _disconnect(request), engine)
        return responses.text_completion(model.name, echo + content, done,
                                         responses.completion_logprobs(engine.tokenizer, entries, spec.logprobs, len(echo)))

    tok = model.target.tokenizer
    tools = tok is not None and tok.chat_template is not None and "tools" in tok.chat_template
    n_max = None if model.drafter is None else model.drafter.cfg.block_size - 1

    def openapi():
        if app.openapi_schema is None:
            app.openapi_schema = document(app, model.names, engine.max_len, model.target.cfg.vocab_size, n_max, tools, api_key is not None)
        return app.openapi_schema

    app.openapi = openapi
    return app
