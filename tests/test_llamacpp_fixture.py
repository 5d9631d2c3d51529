"""The outside oracle: llama.cpp's prompt tokens and greedy tokens for the default model (SmolLM2-135M Q4_1).

The fixture (``tests/fixtures/smollm2_llamacpp_greedy.json``, a copy of ``shared/fixtures/``) was made with
llama-cpp-python from the same GGUF: the GGUF's own chat template, special tokens parsed, then 48
greedy steps. We check that our rendered prompt ids are identical, and, teacher-forcing
``prompt_ids + greedy_ids`` through our float32 dense forward, that our argmax equals llama.cpp's
token wherever llama.cpp's own top-2 logit gap is at least 0.25 (below that, llama.cpp's
quantized dot products, which also round activations to 8 bits, may legitimately flip the order).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.families.dense import model as dense

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "smollm2_llamacpp_greedy.json"
MIN_GAP = 0.25

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def default_model():
    """(cfg, params, tokenizer) of the default target, loaded once."""
    from dflash_jax.assets.default_model import default_target_path
    from dflash_jax.families.dense.gguf import load_gguf_target
    from dflash_jax.formats.tokenizer import Tokenizer

    path = default_target_path()
    cfg, params = load_gguf_target(path, dtype="float32")
    return cfg, params, Tokenizer.from_gguf(path)


def test_prompt_ids_match_llamacpp(fixture, default_model):
    _, _, tok = default_model
    assert fixture["eos_token_id"] == tok.eos_token_ids[0]
    for case in fixture["cases"]:
        msgs = [{"role": "user", "content": case["user_message"]}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        assert text == case["chat_text"]
        assert tok.encode_chat(msgs) == case["prompt_ids"]
        assert tok.decode(case["greedy_ids"]) == case["text"]


def test_teacher_forced_argmax_matches_llamacpp(fixture, default_model):
    cfg, params, _ = default_model
    cases = fixture["cases"]
    seqs = [c["prompt_ids"] + c["greedy_ids"] for c in cases]
    T = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), T), np.int32)  # right padding: causal, so it never reaches real rows
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
    fwd = jax.jit(dense.MODEL.forward, static_argnums=1)
    logits, _, _ = fwd(params, cfg, jnp.asarray(tokens), jnp.asarray(positions), dense.MODEL.init_cache(cfg, len(seqs), T))
    pred = np.asarray(jnp.argmax(logits, axis=-1))
    checked, agree_low, n_low, mismatches = 0, 0, 0, []
    for b, c in enumerate(cases):
        p = len(c["prompt_ids"])
        for j, (want, gap) in enumerate(zip(c["greedy_ids"], c["top2_logit_gap"])):
            got = int(pred[b, p - 1 + j])
            if gap >= MIN_GAP:
                checked += 1
                if got != want:
                    mismatches.append((b, j, got, want, gap))
            else:
                n_low += 1
                agree_low += got == want
    print(f"llama.cpp oracle: {checked} confident positions checked, {agree_low}/{n_low} low-gap positions agree")
    assert checked > 100
    assert not mismatches, f"(case, step, ours, llama.cpp, gap): {mismatches}"
