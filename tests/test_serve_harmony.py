"""OpenAI's harmony format (gpt-oss answers) parsed by the server: the pure streaming parser over
every cut of a few answers, and a chat request through the server's own pieces (request -> job ->
engine text stream -> whole and streamed responses) with a tiny harmony vocabulary."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from dflash_jax.serve.harmony import MARKERS, HarmonyParser, is_harmony, parse_harmony

ANALYSIS_FINAL = ("<|channel|>analysis<|message|>User asks for the capital. Easy.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>The capital is **Paris**.<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>')
# harmony's other layout (the recipient after the role), a commentary preamble first
CALL_AFTER_ROLE = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
                   '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>')
CUT_IN_ANALYSIS = "<|channel|>analysis<|message|>Let me think: is a <| b? We have <|en"
PLAIN = "Just text: 1 < 2, <|not a marker|> and <think>x</think>."

CASES = [
    # (text, tools, reasoning, content, calls)
    (ANALYSIS_FINAL, True, "User asks for the capital. Easy.", "The capital is **Paris**.", []),
    (CALL, True, "Need the weather tool.", "", [("get_weather", {"city": "Paris", "days": 3})]),
    (CALL_AFTER_ROLE, True, "", "Checking.", [("get_weather", {"city": "Oslo"})]),
    (CALL_AFTER_ROLE, False, "", 'Checking.{"city": "Oslo"}', []),  # no tools asked: the body is text
    (CALL[: CALL.index("3}")], True, "Need the weather tool.", '{"city": "Paris", "days": ', []),  # cut by the budget
    (CUT_IN_ANALYSIS, True, "Let me think: is a <| b? We have <|en", "", []),
    (PLAIN, True, "", PLAIN, []),
]


def run(pieces, tools):
    """``(reasoning, content, [(name, arguments dict)], the content and reasoning pieces)``."""
    p = HarmonyParser(tools)
    out = [p.feed(x) for x in pieces] + [p.finish()]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for _, _, cs in out for c in cs]
    assert [c["index"] for _, _, cs in out for c in cs] == list(range(len(calls)))
    return "".join(r for r, _, _ in out), "".join(c for _, c, _ in out), calls, [x for r, c, _ in out for x in (r, c)]


@pytest.mark.parametrize("text,tools,reasoning,content,calls", CASES)
def test_whole_and_streamed_agree_over_every_cut(text, tools, reasoning, content, calls):
    r, c, whole_calls = parse_harmony(text, tools)
    assert (r, c, [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in whole_calls]) == (reasoning, content, calls)
    one_by_one = run(list(text), tools)
    assert one_by_one[:3] == (reasoning, content, calls)
    if text is not PLAIN and text is not CUT_IN_ANALYSIS:  # no marker, whole or partial, ever leaks
        assert not any("<" in x for x in one_by_one[3])
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]], tools)[:3] == (reasoning, content, calls), i
    for i in range(0, len(text) + 1, 7):
        for j in range(i, len(text) + 1, 5):
            assert run([text[:i], text[i:j], text[j:]], tools)[:3] == (reasoning, content, calls), (i, j)


# ---------------------------------------------------------------- through the server's pieces

TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}]


def harmony_tokenizer():
    """A byte-level tokenizer whose vocabulary holds harmony's markers as special tokens."""
    from tokenizers import AddedToken

    from dflash_jax.formats.tokenizer import Tokenizer
    from tiny_hf import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=[tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")],
                     chat_template=TEMPLATE, source="harmony")


def answer_through_server(tok, answer: str, tools) -> tuple[dict, dict]:
    """The whole and the streamed chat response (as dicts of the fields that matter) of a request
    whose generated ids are ``answer``'s, fed to the engine's text stream one id at a time."""
    from dflash_jax.serve import responses
    from dflash_jax.serve.jobs import Done, Job, Text
    from dflash_jax.serve.requests import chat_job
    from dflash_jax.serve.running import RunningRequest
    from dflash_jax.serve.schemas import ChatCompletionRequest

    model = SimpleNamespace(target=SimpleNamespace(tokenizer=tok, cfg=None), name="m", names=["m"], chat_template_kwargs=None, drafter=None,
                            decoding=lambda n_max=None, logprobs=False: None)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    spec, options = chat_job(model, req, max_len=4096)
    ids = tok.encode(answer, add_bos=False)
    assert any(tok.decode([i]) in MARKERS for i in ids)  # the markers are single special tokens

    def job():
        j = Job(spec)
        stream = RunningRequest(j, 0, tok).stream
        for i in ids:
            j.post(Text(stream.feed([i]), 1))
        j.post(Text(stream.finish(), 0))
        j.post(Done("stop", len(spec.prompt), len(ids)))
        return j

    async def both():
        engine = SimpleNamespace(wake=lambda: None)
        reasoning, content, calls, done, _ = await responses.collect(job(), options, asyncio.get_running_loop().create_future(), engine)
        whole = dict(reasoning=reasoning, content=content, calls=[c["function"] for c in calls],
                     finish=responses.chat_completion("m", reasoning, content, calls, done, bool(calls)).choices[0].finish_reason)
        streamed = dict(reasoning="", content="", calls=[], finish=None)
        async for event in responses.chat_stream(job(), options, "m", False, engine):
            data = event.decode().split("data: ", 1)[1].strip()
            if data == "[DONE]":
                continue
            choice = json.loads(data)["choices"][0]
            delta = choice["delta"]
            streamed["reasoning"] += delta.get("reasoning_content") or ""
            streamed["content"] += delta.get("content") or ""
            streamed["calls"] += [c["function"] for c in delta.get("tool_calls") or []]
            streamed["finish"] = choice["finish_reason"] or streamed["finish"]
        return whole, streamed

    return asyncio.run(both())


@pytest.mark.parametrize("answer,tools,expected", [
    (ANALYSIS_FINAL, None, dict(reasoning="User asks for the capital. Easy.", content="The capital is **Paris**.", calls=[], finish="stop")),
    (CALL, TOOLS, dict(reasoning="Need the weather tool.", content="", finish="tool_calls",
                       calls=[{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}])),
])
def test_a_harmony_chat_answer_through_the_server(answer, tools, expected):
    tok = harmony_tokenizer()
    assert is_harmony(tok)
    whole, streamed = answer_through_server(tok, answer, tools)
    assert whole == expected
    assert streamed == expected
