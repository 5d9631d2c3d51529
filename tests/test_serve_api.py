"""``dflash-jax serve`` answers, through the real ``openai`` client against a server on loopback.

Oracle: :func:`dflash_jax.generate` (float32, greedy, the same capacity) on the same prompt. The
shared server (tests/conftest.py) decodes the tiny model with a tiny DFlash drafter in a batch of
8 rows; the scripted server's model answers with fixed reasoning and tool calls.
"""

import asyncio
import json

import jax.numpy as jnp
import openai
import pytest
from conftest import SERVE_MAX_LEN
from serve_util import TOOLS, free_rows_at_length_1, raw

import dflash_jax as dj

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)


def oracle(model, ids, max_tokens, **kw):
    """``generate``'s answer alone: ``(text, ids, finish_reason)``."""
    _, target, drafter = model
    res = dj.generate(target, [ids], max_new_tokens=max_tokens, drafter=drafter, max_len=SERVE_MAX_LEN, **kw)
    return res.texts[0], res.output_ids[0], res.finish_reason[0]


def chat_ids(model, messages):
    return model[1].tokenizer.encode_chat(messages)


def stream_chat(c, **kw):
    """``(content, finish_reason, usage, speculative, chunks)`` of a streamed chat answer."""
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    spec = [ch.speculative for ch in chunks if getattr(ch, "speculative", None)]
    return content, finish, chunks[-1].usage, spec, chunks


@pytest.mark.smoke
def test_chat_streamed_and_whole_equal_generate(serve_tiny, serve_tiny_model):
    url, _ = serve_tiny
    c = client(url)
    text, ids, reason = oracle(serve_tiny_model, chat_ids(serve_tiny_model, MESSAGES), 24)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason
    u = r.usage
    assert u.prompt_tokens == len(chat_ids(serve_tiny_model, MESSAGES)) and u.completion_tokens == len(ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    spec = r.speculative
    assert spec["verify_steps"] >= 1 and len(spec["accepted_per_position"]) == 3 and spec["n_max"] == 3 and spec["tree"] is None
    assert u.completion_tokens_details.accepted_prediction_tokens == spec["accepted_tokens"]
    assert u.completion_tokens_details.rejected_prediction_tokens == spec["drafted_tokens"] - spec["accepted_tokens"]
    assert 0 < spec["drafted_tokens"] <= 3 * spec["verify_steps"]  # a block near the budget drafts fewer
    content, finish, usage, specs, chunks = stream_chat(c, model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    assert chunks[0].choices[0].delta.role == "assistant" and content == text and finish == [reason]
    assert usage.completion_tokens == len(ids) and chunks[-1].choices == [] and specs[0]["tau"] == spec["tau"]


def test_completions_streamed_and_whole_equal_generate(serve_tiny, serve_tiny_model):
    url, _ = serve_tiny
    c = client(url)
    prompt = "The sky is"
    text, ids, reason = oracle(serve_tiny_model, serve_tiny_model[1].tokenizer.encode(prompt), 12, ignore_eos=True)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == text and r.choices[0].finish_reason == "length" == reason
    assert r.usage.completion_tokens == 12 == len(ids)
    chunks = list(c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_ids, _, _ = oracle(serve_tiny_model, [5, 6, 7], 12, ignore_eos=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text_ids
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"


def test_stop_texts_cut_like_generate(serve_tiny, serve_tiny_model):
    url, _ = serve_tiny
    c = client(url)
    prompt = [9, 10, 11, 12]
    full, _, _ = oracle(serve_tiny_model, prompt, 30, ignore_eos=True)
    stop = full[6:9]  # a text the answer holds, after its start
    assert len(stop) == 3
    text, ids, reason = oracle(serve_tiny_model, prompt, 30, ignore_eos=True, stop=[stop, "never-there"])
    assert reason == "stop" and len(text) < len(full)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "never-there"],
                  extra_body={"ignore_eos": True})
        if stream:
            chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            got, finish, n = "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-2].choices[0].finish_reason, chunks[-1].usage
        else:
            r = c.completions.create(**kw)
            got, finish, n = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert (got, finish, n.completion_tokens) == (text, "stop", len(ids))


def test_sixteen_concurrent_requests_each_equal_their_answer_alone(serve_tiny, serve_tiny_model):
    """16 requests at once on 8 rows (half wait, rows are reused): each answer equals generate's alone."""
    url, engine = serve_tiny
    prompts = [[3 + i, 40 + 2 * i, 7, 100 + i][: 2 + i % 3] for i in range(16)]
    budgets = [6 + (5 * i) % 17 for i in range(16)]
    expected = [oracle(serve_tiny_model, p, n)[0] for p, n in zip(prompts, budgets)]

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(p, n, stream):
            if not stream:
                r = await c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
                return r.choices[0].text
            s = await c.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])

        return await asyncio.gather(*(one(p, n, i % 2 == 1) for i, (p, n) in enumerate(zip(prompts, budgets))))

    got = asyncio.run(main())
    assert got == expected
    assert engine.counts() == (0, 0) and free_rows_at_length_1(engine)


def test_models_health_and_metrics(serve_tiny):
    url, _ = serve_tiny
    c = client(url)
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].max_model_len == SERVE_MAX_LEN
    status, _, body = raw(url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ready"
    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    m = raw(url + "/metrics")[2].decode()
    for name in ("dflash_requests_total", "dflash_generation_tokens_total", "dflash_time_to_first_token_seconds_bucket",
                 "dflash_accepted_tokens_total", "dflash_running_requests", "dflash_engine_alive 1.0"):
        assert name in m, name
    compiled = [float(line.split()[1]) for line in m.splitlines() if line.startswith("dflash_xla_compilations ")]
    assert compiled and compiled[0] > 0  # this request's programs at least
    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert f"dflash_xla_compilations {compiled[0]}" in raw(url + "/metrics")[2].decode()  # the same shapes compile nothing


def _assemble(chunks):
    """Reasoning, content and tool calls of a streamed chat answer, as the client would rebuild them."""
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [(tc.function.name, json.loads(tc.function.arguments)) for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return reasoning, content, calls, finish


@pytest.mark.parametrize("layout,reasoning,content,args", [
    (None, "Let me check the weather.", "Sure.", {"city": "Paris", "days": 3}),  # Hermes / Qwen JSON layout
    ("P", None, "Checking.", {"city": "  New York ", "days": 3}),  # Laguna poolside_v1 layout
])
def test_tool_calls_and_reasoning(serve_scripted, layout, reasoning, content, args):
    url, _ = serve_scripted
    c = client(url)
    kw = dict(model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, temperature=0,
              max_tokens=40, extra_body={"chat_template_kwargs": {"layout": layout}} if layout else {})
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert getattr(msg, "reasoning_content", None) == reasoning and msg.content == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [("get_weather", args)]
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert _assemble(chunks) == (reasoning or "", content, [("get_weather", args)], ["tool_calls"])
    # without tools the same text is plain content (reasoning is still split)
    plain = c.chat.completions.create(**dict(kw, tools=openai.omit))
    assert plain.choices[0].finish_reason == "stop" and "<tool_call>" in plain.choices[0].message.content
    # a conversation that carries the call and its result renders and answers
    history = kw["messages"] + [{"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in msg.tool_calls]},
                                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    again = c.chat.completions.create(**dict(kw, messages=history))
    assert again.choices[0].finish_reason == "tool_calls"


def test_a_server_compiles_every_batch_size_before_it_listens(serve_tiny_model):
    """The warm-up runs each batch size's programs (greedy, the default depth) before the server
    listens: a burst of concurrent greedy requests with short prompts then compiles nothing, and
    each answer equals ``generate``'s answer alone."""
    from concurrent.futures import ThreadPoolExecutor

    from serve_util import serve_in_thread

    from dflash_jax.runtime.compiled import count_compilations
    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    _, target, drafter = serve_tiny_model
    ids = chat_ids(serve_tiny_model, MESSAGES)
    assert len(ids) <= 64  # the smallest prefill chunk, the one warmed up
    text = oracle(serve_tiny_model, ids, 12)[0]
    engine = Engine(ServedModel(target, drafter, name="tiny"), max_batch=4, max_len=SERVE_MAX_LEN, max_queue=16)
    url, stop = serve_in_thread(build_app(engine))
    try:
        def ask(_):
            return client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)

        with count_compilations() as compiled, ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(6)))
        assert compiled() == 0
        assert [a.choices[0].message.content for a in answers] == [text] * 6
    finally:
        stop()


def test_the_warm_up_covers_a_jump_between_any_two_batch_sizes(serve_tiny_model):
    """A burst can take the batch from one size straight to any other (1 -> 4 as four requests
    come at once, 4 -> 1 as three finish together); after the warm-up none of these jumps compiles."""
    from dflash_jax.runtime.compiled import count_compilations
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    _, target, drafter = serve_tiny_model
    engine = Engine(ServedModel(target, drafter, name="tiny"), max_batch=4, max_len=SERVE_MAX_LEN, max_queue=16)
    engine.warm_up()
    sizes = engine.batch_sizes()
    assert sizes == [1, 2, 4]

    def jump(rows):  # a shrink keeps some rows and needs one free row
        engine._batch.resize(rows, list(range(min(engine._batch.rows, rows) - 1)))

    with count_compilations() as compiled:
        for src in reversed(sizes):
            for dst in sizes:
                jump(src)
                jump(dst)
    assert compiled() == 0


def test_a_tree_server_answers_as_generate_and_reports_its_tree(serve_tiny_model):
    """A server whose default decoding verifies a tree (``ServedModel(tree=5)``, ``--tree 5``):
    greedy answers equal ``generate``'s, the answer's ``speculative`` stats name the tree, and a
    request's own ``n_max`` drafts a chain."""
    from serve_util import serve_in_thread

    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    _, target, drafter = serve_tiny_model
    engine = Engine(ServedModel(target, drafter, name="tiny", n_max=3, tree=5), max_batch=1, max_len=SERVE_MAX_LEN, max_queue=4)
    url, stop = serve_in_thread(build_app(engine))
    try:
        text, _, _ = oracle(serve_tiny_model, chat_ids(serve_tiny_model, MESSAGES), 16)
        r = client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == text and r.speculative["tree"] == 5 and r.speculative["verify_steps"] >= 1
        r = client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"n_max": 2})
        assert r.choices[0].message.content == text and r.speculative["tree"] is None and r.speculative["n_max"] == 2
    finally:
        stop()


def test_adaptive_depth_server_measures_before_it_listens(serve_tiny_model, tmp_path, monkeypatch):
    """A server under ``n_max="auto"`` gets the step costs of every batch size it can run before
    it listens (kept under the cache folder); no request, greedy or sampled, alone or together,
    runs a measurement; greedy answers equal ``generate``'s."""
    from concurrent.futures import ThreadPoolExecutor

    from serve_util import serve_in_thread

    from dflash_jax.decode.auto import costs
    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "STABLE", 100.0)  # the tiny pair's steps take a millisecond: timer noise
    measured = []
    real_measure = costs.measure
    monkeypatch.setattr(costs, "measure", lambda run, params, state, *a, **k: measured.append(state.tokens.shape[0]) or
                        real_measure(run, params, state, *a, **k))
    _, target, drafter = serve_tiny_model
    engine = Engine(ServedModel(target, drafter, name="tiny", n_max="auto"), max_batch=3, max_len=SERVE_MAX_LEN, max_queue=8)
    assert engine.batch_sizes() == [1, 2, 3]
    url, stop = serve_in_thread(build_app(engine))
    try:
        assert measured == [1, 2, 3] and len(list((tmp_path / "depth_costs").glob("*.json"))) == 3
        text, _, _ = oracle(serve_tiny_model, chat_ids(serve_tiny_model, MESSAGES), 16)

        def ask(temperature):
            return client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=temperature)

        first = ask(0)
        assert first.choices[0].message.content == text and first.speculative["n_max"] == "auto", first.speculative
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, [0, 0, 0, 0.7, 0.7, 0]))
        assert [a.choices[0].message.content for a, t in zip(answers, [0, 0, 0, 0.7, 0.7, 0]) if t == 0] == [text] * 4
        # a seeded request answers what generate samples with its seed, whatever the requests before it left of
        # auto's batch-wide plain-step schedule (set here as earlier requests could leave it, between requests):
        # the depth never changes a sampled token
        seeded = set()
        for plain_left, backoff in ((0, 1), (3, 8), (1, 2), (7, 16)):
            spec = engine._batch.state.speculative
            engine._batch.state = engine._batch.state.replace(speculative=spec.replace(
                plain_left=jnp.int32(plain_left), backoff=jnp.int32(backoff)))
            seeded.add(client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0,
                                                           seed=42).choices[0].message.content)
        sampled = oracle(serve_tiny_model, chat_ids(serve_tiny_model, MESSAGES), 16, sampling=dj.SamplingConfig(1.0), seed=42)
        assert seeded == {sampled[0]}
        assert measured == [1, 2, 3]  # nothing measured once the server listened
    finally:
        stop()


def test_greedy_and_sampled_requests_share_one_batch(serve_tiny, serve_tiny_model):
    """Greedy and sampled requests sent at once (seeds, top-p, top-k, ``ignore_eos`` mixed) are
    admitted together: each row carries its own settings, so none waits for another kind to drain
    (under per-kind batches at most one kind ran at a time). Each answers what ``generate`` gives
    its prompt alone with its settings and seed."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    url, engine = serve_tiny
    asks = [(dict(temperature=0), {}), (dict(temperature=1.0, seed=3), {}), (dict(temperature=0.8, top_p=0.9, seed=4), {"ignore_eos": True}),
            (dict(temperature=0.7, seed=5), {"top_k": 5, "ignore_eos": True}), (dict(temperature=0), {"ignore_eos": True})]
    prompts = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3], [9, 8], [7, 7]]
    want = []
    for (kw, extra), prompt in zip(asks, prompts):
        sampling = dj.SamplingConfig(kw["temperature"], extra.get("top_k", 0), kw.get("top_p", 1.0))
        want.append(oracle(serve_tiny_model, prompt, 40, sampling=sampling, seed=kw.get("seed", 0), ignore_eos=extra.get("ignore_eos", False))[0])
    most, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            most[0] = max(most[0], engine.counts()[0])

    def ask(i):
        kw, extra = asks[i]
        return client(url).completions.create(model="tiny", prompt=prompts[i], max_tokens=40, extra_body=extra, **kw).choices[0].text

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(ask, range(len(asks))))
    finally:
        done.set()
        watcher.join()
    assert got == want
    assert most[0] >= 4, most  # the kinds ran side by side (all five unless one finished before the last was admitted)


def test_a_seeded_request_gives_one_text_alone_or_in_a_batch(serve_tiny, serve_tiny_model):
    """A sampled request with a seed answers what ``generate`` samples with that seed, sent alone
    five times or at once with other seeds and prompts (whole and streamed, twice in one batch);
    another seed gives another text. Each row samples with its own seed's key at each position
    (dflash_jax.decode.sampling), so neither its row, its neighbours nor the drafter change its tokens."""
    url, engine = serve_tiny
    expected = oracle(serve_tiny_model, [1, 2, 3], 24, sampling=dj.SamplingConfig(temperature=1.0), seed=42, ignore_eos=True)[0]
    c = client(url)

    def text(seed):
        return c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=24, temperature=1.0, seed=seed,
                                    extra_body={"ignore_eos": True}).choices[0].text

    assert {text(42) for _ in range(5)} == {expected}
    assert text(7) != expected

    async def main():
        a = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(prompt, seed, stream):
            kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            if not stream:
                return (await a.completions.create(**kw)).choices[0].text
            return "".join([ch.choices[0].text async for ch in await a.completions.create(stream=True, **kw) if ch.choices])

        mixed = [([1, 2, 3], 42, False), ([9, 8], 5, True), ([1, 2, 3], 6, False), ([1, 2, 3], 42, True), ([4, 4, 4, 4], 0, False)]
        return await asyncio.gather(*(one(*m) for m in mixed))

    got = asyncio.run(main())
    assert got[0] == got[3] == expected and got[2] != expected
    assert engine.counts() == (0, 0) and free_rows_at_length_1(engine)
