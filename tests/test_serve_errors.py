"""Refusals and failures of ``dflash-jax serve``: OpenAI error objects with the exact codes, and a
server that stays healthy (bad input, unknown model, capacity, queue full, API key, body size, a
client that disconnects, a request that fails inside the engine, an engine that dies)."""

import json
import socket
import threading
import time

import openai
import pytest
from serve_util import free_rows_at_length_1, raw, serve_in_thread

from dflash_jax.serve.app import build_app
from dflash_jax.serve.engine import Engine
from dflash_jax.serve.jobs import ServedModel

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def post(url, body, path="/v1/chat/completions", headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, hdrs, out = raw(url + path, "POST", data, headers)
    return status, hdrs, json.loads(out)


def healthy(url):
    status, _, body = raw(url + "/health")
    return status == 200 and json.loads(body)["status"] == "ready"


def finished(url, reason):
    """The server's count of requests finished with ``reason`` (``/metrics``)."""
    for line in raw(url + "/metrics")[2].decode().splitlines():
        if line.startswith(f'dflash_requests_total{{finish_reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("body,param,code", [
    (b'{"model": "tiny", "messages": [', None, "invalid_json"),
    (dict(CHAT, max_tokens="5"), "max_tokens", "invalid_type"),
    (dict(CHAT, temperature=3), "temperature", "invalid_value"),
    (dict(CHAT, messages=[{"role": "robot", "content": "x"}]), "messages.0.role", "invalid_value"),
    ({"model": "tiny"}, "messages", "missing_required_parameter"),
    (dict(CHAT, n=2), "n", "invalid_value"),
    (dict(CHAT, stop=[""]), "stop", "invalid_value"),
    (dict(CHAT, stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),  # OpenAI's limit: 4
    (dict(CHAT, top_k=2**31), "top_k", "invalid_value"),  # beyond int32: once a dead engine
    (dict(CHAT, n_max=9), "n_max", "invalid_value"),
    (dict(CHAT, tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice", "invalid_value"),
    (dict(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "invalid_value"),  # the template takes none
    (dict(CHAT, max_tokens=1000), "max_tokens", "context_length_exceeded"),
    (dict(CHAT, top_logprobs=21), "top_logprobs", "invalid_value"),  # OpenAI's bound: 20
    (dict(CHAT, chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs", "invalid_value"),
    (dict(CHAT, max_tokens=4, max_completion_tokens=1000), "max_completion_tokens", "context_length_exceeded"),
    (None, None, "missing_body"),
    (b"[1, 2]", None, "invalid_body"),
    (dict(CHAT, frequency_penalty=0.5), "frequency_penalty", "unsupported_parameter"),
    (dict(CHAT, logit_bias={"5": 10}), "logit_bias", "unsupported_parameter"),
    (dict(CHAT, response_format={"type": "json_object"}), "response_format", "unsupported_parameter"),
    (dict(CHAT, temprature=0.5), "temprature", "unknown_parameter"),  # a typo is not silently dropped
    (dict(CHAT, messages=[{"role": "user", "content": "x" * 400}]), "messages", "context_length_exceeded"),
])
def test_bad_requests_are_400_naming_the_field(serve_tiny, body, param, code):
    url, _ = serve_tiny
    status, _, out = post(url, body if body is not None else b"")
    assert status == 400, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code), err
    assert param is None or param.split(".")[0] in err["message"]
    assert param is not None or code == "invalid_json" or err["message"].startswith("request body: ")
    assert healthy(url), raw(url + "/health")


def test_neutral_and_bookkeeping_parameters_are_taken_the_rest_refused_through_openai(serve_tiny):
    """OpenAI's fields at their neutral values, and its bookkeeping fields, change nothing; the
    client gets a BadRequestError naming a field this server cannot honour or does not know."""
    url, _ = serve_tiny
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    args = dict(model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0)
    plain = c.chat.completions.create(**args).choices[0].message.content
    same = c.chat.completions.create(**args, logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={}, user="u",
                                     store=False, metadata={"k": "v"}, response_format={"type": "text"}, parallel_tool_calls=True)
    assert same.choices[0].message.content == plain and same.choices[0].logprobs is None
    for extra, param in ((dict(frequency_penalty=1), "frequency_penalty"), (dict(extra_body={"best_fit": 1}), "best_fit")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**args, **extra)
        assert e.value.body["param"] == param, e.value.body
    for extra, param in ((dict(logprobs=0, echo=True), "echo"), (dict(best_of=2), "best_of")):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, **extra)
        assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_parameter", e.value.body
    assert healthy(url)


def test_completion_errors_and_unknown_model_and_size(serve_tiny):
    url, _ = serve_tiny
    status, _, out = post(url, {"model": "tiny", "prompt": [5, 99999]}, "/v1/completions")
    assert status == 400 and out["error"]["param"] == "prompt" and "99999" in out["error"]["message"]
    status, _, out = post(url, {"model": "tiny", "prompt": ["a", "b"]}, "/v1/completions")
    assert status == 400 and out["error"]["param"] == "prompt"
    status, _, out = post(url, dict(CHAT, model="../../etc/passwd"))
    assert status == 404 and out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model"
    status, _, out = post(url, dict(CHAT, messages=[{"role": "user", "content": "x" * (70 << 10)}]))
    assert status == 413 and out["error"]["code"] == "request_too_large"
    status, _, out = post(url, {}, "/v1/nowhere")
    assert status == 404 and "error" in out
    with pytest.raises(openai.NotFoundError) as e:
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert e.value.code == "model_not_found"
    assert healthy(url), raw(url + "/health")


def test_api_key_queue_full_and_engine_death(serve_tiny_model):
    """An engine that never runs holds requests in its queue: with --max-queue 1 the second is
    refused with 429 and Retry-After; the key is checked first. Then the engine dies: /health
    says so, the waiting request gets a 500 error object and on_death is called."""
    _, target, drafter = serve_tiny_model
    died = threading.Event()
    engine = Engine(ServedModel(target, drafter, name="tiny"), max_batch=2, max_len=64, max_queue=1, on_death=lambda e: died.set())
    url, stop = serve_in_thread(build_app(engine, api_key="sekrit", start_engine=False))
    try:
        key = {"Authorization": "Bearer sekrit"}
        assert post(url, CHAT)[0] == 401 and post(url, CHAT, headers={"Authorization": "Bearer wrong"})[0] == 401
        status, _, out = post(url, CHAT, headers={"Authorization": "Bearer wrong"})
        assert out["error"]["code"] == "invalid_api_key"
        assert raw(url + "/v1/models", headers=key)[0] == 200 and raw(url + "/v1/models")[0] == 401
        assert raw(url + "/metrics")[0] == 401 and raw(url + "/metrics", headers=key)[0] == 200  # the key guards /metrics
        status, _, body = raw(url + "/health")  # probes need no key; an engine not started is not ready yet
        assert status == 503 and json.loads(body)["status"] == "starting"
        first = {}
        waiting = threading.Thread(target=lambda: first.update(r=post(url, CHAT, headers=key)))
        waiting.start()
        while engine.counts()[1] < 1:
            time.sleep(0.01)
        status, headers, out = post(url, CHAT, headers=key)
        assert status == 429 and out["error"]["code"] == "queue_full" and headers["retry-after"] == "1"

        def broken_round():
            raise RuntimeError("device lost")

        engine._round = broken_round
        engine.start()
        waiting.join(30)
        assert died.wait(10)
        status, _, out = first["r"]
        assert status == 500 and "device lost" in out["error"]["message"]
        status, _, body = raw(url + "/health")
        assert status == 503 and "device lost" in json.loads(body)["error"]
        assert post(url, CHAT, headers=key)[0] == 503
    finally:
        stop()


def test_disconnect_mid_stream_frees_the_row(serve_tiny):
    url, engine = serve_tiny
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=140, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    got = [next(iter(stream)) for _ in range(2)]
    assert got and engine.counts()[0] == 1
    stream.close()
    deadline = time.time() + 30
    while engine.counts()[0] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.counts() == (0, 0) and free_rows_at_length_1(engine)
    assert 'dflash_requests_total{finish_reason="cancelled"}' in raw(url + "/metrics")[2].decode()
    assert healthy(url), raw(url + "/health")


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_row(serve_tiny, monkeypatch):
    """A non-streamed request whose client leaves is cancelled at once, while its text keeps
    arriving (each round's delivery slowed so that the answer would take seconds; compiled first,
    so that no pause between rounds gives a polling check its chance)."""
    url, engine = serve_tiny
    request = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 140, "temperature": 0, "ignore_eos": True}
    assert post(url, dict(request, max_tokens=8), "/v1/completions")[0] == 200
    real = engine._feed

    def slow_feed(r, new, *rest):
        time.sleep(0.05)
        return real(r, new, *rest)

    monkeypatch.setattr(engine, "_feed", slow_feed)
    cancelled, lengths = finished(url, "cancelled"), finished(url, "length")
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(request).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 30
        while engine.counts() != (1, 0) and time.time() < deadline:
            time.sleep(0.01)
        assert engine.counts() == (1, 0)
    deadline = time.time() + 30
    while engine.counts()[0] and time.time() < deadline:
        time.sleep(0.01)
    assert engine.counts() == (0, 0)
    assert finished(url, "cancelled") == cancelled + 1 and finished(url, "length") == lengths  # not run to its end
    assert healthy(url)


def test_a_failing_request_fails_alone(serve_tiny, monkeypatch):
    """A request whose text handling raises inside the engine gets a 500; the one beside it is answered."""
    url, engine = serve_tiny
    real = engine._feed

    def feed(r, new, *rest):
        if r.job.spec.prompt[0] == 77:
            raise ValueError("bad row")
        return real(r, new, *rest)

    monkeypatch.setattr(engine, "_feed", feed)
    out = {}

    def ask(key, prompt):
        out[key] = post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}, "/v1/completions")

    threads = [threading.Thread(target=ask, args=(k, p)) for k, p in (("bad", [77, 1]), ("good", [5, 1]))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert out["bad"][0] == 500 and "bad row" in out["bad"][2]["error"]["message"]
    assert out["good"][0] == 200 and out["good"][2]["usage"]["completion_tokens"] >= 1
    assert healthy(url) and engine.counts() == (0, 0)


def test_the_key_from_the_environment_or_a_file(serve_tiny_model, tmp_path):
    """``$DFLASH_JAX_API_KEY`` and ``--api-key-file`` give the server its key (a real client with
    it gets answers, without it 401); giving two, or an empty or unreadable one, is an error
    naming it."""
    from dflash_jax.cli.main import build_parser
    from dflash_jax.errors import DFlashError
    from dflash_jax.cli.serve import api_key

    def args(*extra):
        return build_parser().parse_args(["serve", "--target", str(serve_tiny_model[0]), *extra])

    (tmp_path / "key").write_text("from-file\n")
    assert api_key(args(), {"DFLASH_JAX_API_KEY": "from-env"}) == "from-env"
    assert api_key(args("--api-key-file", str(tmp_path / "key")), {"DFLASH_JAX_API_KEY": "from-env"}) == "from-file"
    assert api_key(args("--api-key", "given"), {"DFLASH_JAX_API_KEY": "from-env"}) == "given"
    assert api_key(args(), {}) is None
    for extra, env, needle in ((("--api-key", "a", "--api-key-file", str(tmp_path / "key")), {}, "--api-key, --api-key-file"),
                               (("--api-key-file", str(tmp_path / "nope")), {}, "--api-key-file"),
                               ((), {"DFLASH_JAX_API_KEY": " "}, "DFLASH_JAX_API_KEY")):
        with pytest.raises(DFlashError, match=needle):
            api_key(args(*extra), env)

    _, target, drafter = serve_tiny_model
    engine = Engine(ServedModel(target, drafter, name="tiny"), max_batch=1, max_len=64)
    url, stop = serve_in_thread(build_app(engine, api_key=api_key(args(), {"DFLASH_JAX_API_KEY": "from-env"})))
    try:
        ok = openai.OpenAI(base_url=url + "/v1", api_key="from-env", max_retries=0)
        assert ok.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, temperature=0).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        stop()
