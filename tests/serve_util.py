"""Helpers of the server tests: a server on a free loopback port in a thread, and a scripted model.

The scripted model is a one-layer Llama whose attention and MLP write nothing (zero output
projections), whose embedding is one-hot and whose LM head maps each token to a chosen successor:
its greedy answer is a fixed script picked by the prompt's last token. Its tokenizer has one vocab
entry per script piece (bytes otherwise), so the answers hold exactly the tool calls and reasoning
the parser tests need, cut into pieces at awkward places (inside tags) to exercise streaming.
"""

from __future__ import annotations

import socket
import threading
import time

import jax.numpy as jnp
import numpy as np

IM_START, IM_END = 256, 257
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ layout | default('') }}{% endif %}"
)
# the answer after a prompt ending in "\n" (no layout) and after one ending in "P" (layout "P")
HERMES_SCRIPT = ["<think>", "Let me check", " the weather.", "</thi", "nk>\n\n", "Sure.", " <tool_",
                 'call>{"name": "get_weather", ', '"arguments": {"city": "Paris", "days": 3}}', "</tool_call>"]
POOLSIDE_SCRIPT = ["Checking.", "\n<tool_call>get_weather\n<arg_key>city</arg_key>", "<arg_value>  New York </arg_value>\n<arg_",
                   "key>days</arg_key><arg_value>3</arg_value>\n</tool", "_call>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


def run_in_thread(server) -> tuple[str, threading.Thread]:
    """Runs the ``uvicorn.Server`` ``server`` on a free loopback port in a thread, once it has
    started: ``(base url, thread)``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.time() + 300  # startup warms every batch size up: minutes on a loaded 2-core machine
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", thread


def serve_in_thread(app):
    """Runs ``app`` with uvicorn on a free loopback port; returns ``(base url, stop())``."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    url, thread = run_in_thread(server)

    def stop():
        server.should_exit = True
        thread.join(30)

    return url, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokenizer(pieces: list[str]):
    from dflash_jax.formats.tokenizer import Tokenizer as DJTokenizer
    from test_tokenizer import byte_alphabet
    from tiny_hf import byte_tokenizer

    alphabet = byte_alphabet()
    tok = byte_tokenizer({"".join(alphabet[b] for b in p.encode()): IM_END + 1 + i for i, p in enumerate(pieces)})
    return DJTokenizer(tok, bos_token_id=None, eos_token_ids=[IM_END], chat_template=TEMPLATE, source="scripted")


def scripted_target():
    """The scripted :class:`~dflash_jax.loading.Target` (module docstring)."""
    import jax

    from dflash_jax.loading import Target
    from dflash_jax.families.dense import model as dense
    from dflash_jax.testing import tiny_target_config

    pieces = HERMES_SCRIPT + POOLSIDE_SCRIPT
    vocab = IM_END + 1 + len(pieces)
    hidden = 16 * ((vocab + 15) // 16)
    cfg = tiny_target_config("llama", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, intermediate_size=32, tie_word_embeddings=False,
                             max_position_embeddings=512)
    params = dense.MODEL.init_params(cfg, jax.random.key(0), scale=0.1)
    succ = np.full(vocab, IM_END)
    for script, trigger in ((HERMES_SCRIPT, ord("\n")), (POOLSIDE_SCRIPT, ord("P"))):
        ids = [IM_END + 1 + pieces.index(p) for p in script]
        for a, b in zip([trigger] + ids, ids + [IM_END]):
            succ[a] = b
    head = np.zeros((hidden, vocab), np.float32)
    head[np.arange(vocab), succ] = 10.0
    layers = dict(params["layers"], wo=jnp.zeros_like(params["layers"]["wo"]), w_down=jnp.zeros_like(params["layers"]["w_down"]))
    params = dict(params, embed=jnp.eye(vocab, hidden, dtype=jnp.float32), layers=layers,
                  norm=jnp.ones((hidden,), jnp.float32), lm_head=jnp.asarray(head))
    return Target(cfg=cfg, params=params, tokenizer=_tokenizer(pieces), source="scripted", eos_ids=(IM_END,))


def free_rows_at_length_1(engine) -> bool:
    """Whether every free row of the engine's batch has length 1 (a finished answer's length would
    widen every later step's attention span); call it while the engine is idle."""
    length = np.asarray(engine._batch.state.length)
    return all(int(length[i]) == 1 for i, r in enumerate(engine._rows) if r is None)


def raw(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None, timeout: float = 60):
    """``(status, headers, body bytes)`` of one plain HTTP request (standard library; for what the
    ``openai`` client cannot send: malformed JSON, oversized bodies, raw metrics)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers=dict({"Content-Type": "application/json"}, **(headers or {})))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
