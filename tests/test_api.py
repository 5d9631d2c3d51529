"""The public Python API: load_target, encode_prompt, generate, TextStream, compile cache."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import arguments, loading
from dflash_jax.text import split_stop
from dflash_jax.errors import DFlashError
from dflash_jax.nn.params import PerLayer
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.testing import reference_greedy, tiny_target

PROMPTS = [[5, 9, 17, 3, 22, 8, 1], [40, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_target("llama", seed=1)
    return dj.Target(cfg=cfg, params=params, tokenizer=None, source="tiny", eos_ids=())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import tiny_hf

    return tiny_hf.make_tiny_hf(tmp_path_factory.mktemp("tiny_hf_api"))


def test_public_names():
    for name in ("load_target", "encode_prompt", "generate", "Target", "GenerationResult", "SamplingConfig", "DFlashError",
                 "enable_compile_cache", "compile_cache_dir"):
        assert hasattr(dj, name)


def test_generate_batch_matches_oracle(tiny):
    res = dj.generate(tiny, PROMPTS, max_new_tokens=6, chunk_size=4)
    assert res.output_ids == [reference_greedy(tiny.params, tiny.cfg, p, 6) for p in PROMPTS]
    assert res.finish_reason == ["length"] * 3
    assert res.texts is None
    assert [len(g) for g in res.top2_logit_gaps] == [6, 6, 6]
    st = res.stats
    assert st["new_tokens"] == 18 and st["batch"] == 3 and st["prompt_tokens"] == sum(map(len, PROMPTS))
    assert st["max_len"] == 1024 and st["chunk_size"] == 4 and st["steps"] == 5  # the smallest capacity bucket
    assert st["decode_tokens_per_s"] == pytest.approx((18 - 3) / st["decode_time_s"], rel=1e-2)


def test_chunk_size_does_not_change_the_result(tiny):
    a = dj.generate(tiny, PROMPTS, max_new_tokens=5, chunk_size=1)
    b = dj.generate(tiny, PROMPTS, max_new_tokens=5, chunk_size=256)
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(np.array(a.top2_logit_gaps), np.array(b.top2_logit_gaps), rtol=1e-5, atol=1e-5)
    assert b.stats["chunk_size"] == 64  # the smallest chunk bucket that holds the longest prompt


def test_streaming_reports_every_token_once(tiny):
    calls = []
    res = dj.generate(tiny, PROMPTS, max_new_tokens=5, on_tokens=calls.append)
    got = [sum((c[b] for c in calls), []) for b in range(len(PROMPTS))]
    assert got == res.output_ids == [reference_greedy(tiny.params, tiny.cfg, p, 5) for p in PROMPTS]
    assert calls[0] == [[ids[0]] for ids in res.output_ids]  # the first call carries prefill's token


def test_stop_ids_eos_and_capacity(tiny):
    free = reference_greedy(tiny.params, tiny.cfg, PROMPTS[0], 10)
    stop = free[3]
    res = dj.generate(tiny, [PROMPTS[0]], max_new_tokens=10, stop_ids=[stop])
    assert res.output_ids[0] == free[: free.index(stop) + 1] and res.finish_reason == ["stop"]
    with_eos = loading.Target(tiny.cfg, tiny.params, None, "tiny", eos_ids=(stop,))
    assert dj.generate(with_eos, [PROMPTS[0]], max_new_tokens=10).output_ids[0] == free[: free.index(stop) + 1]
    assert dj.generate(with_eos, [PROMPTS[0]], max_new_tokens=10, ignore_eos=True).output_ids[0] == free
    res = dj.generate(tiny, [PROMPTS[0]], max_new_tokens=10, max_len=10)
    assert res.output_ids[0] == free[:3] and res.finish_reason == ["capacity"]


def test_sampling_seeded(tiny):
    s = SamplingConfig(temperature=1.2, top_k=30, top_p=0.9)
    a = dj.generate(tiny, PROMPTS, max_new_tokens=8, sampling=s, seed=5).output_ids
    assert a == dj.generate(tiny, PROMPTS, max_new_tokens=8, sampling=s, seed=5, on_tokens=lambda n: None).output_ids
    assert a != dj.generate(tiny, PROMPTS, max_new_tokens=8, sampling=s, seed=6).output_ids


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(prompts=[[1, 2, 500]]), "500"),
        (dict(prompts=[[]]), "empty"),
        (dict(prompts="hello"), "prompts"),
        (dict(prompts=[[1, 2]], max_new_tokens=0), "--max-new-tokens"),
        (dict(prompts=[[1, 2]], chunk_size=0), "--chunk-size"),
        (dict(prompts=[list(range(1, 20))], max_len=19), "--max-len"),
        (dict(prompts=[[1, 2]], stop=["x"]), "--stop"),
    ],
)
def test_bad_input(tiny, kwargs, needle):
    with pytest.raises(DFlashError, match=needle.replace("-", r"\-")):
        dj.generate(tiny, **kwargs)


def test_default_capacity_and_chunk_come_from_fixed_buckets():
    assert arguments.default_max_len([[1] * 10], 54) == 1024
    assert arguments.default_max_len([[1] * 10, [1] * 11], 1013) == 1024  # 1024 exactly
    assert arguments.default_max_len([[1] * 10, [1] * 11], 1014) == 2048
    assert arguments.default_max_len([[1] * 3000], 2000) == 8192
    assert [arguments.effective_chunk_size(256, n) for n in (1, 64, 65, 128, 129, 5000)] == [64, 64, 128, 128, 256, 256]
    assert arguments.effective_chunk_size(100, 5000) == 100 and arguments.effective_chunk_size(16, 3) == 16


def test_load_target_errors(tmp_path):
    with pytest.raises(DFlashError, match="no such file"):
        dj.load_target(tmp_path / "missing")
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(DFlashError, match="model.bin"):
        dj.load_target(tmp_path / "model.bin")
    with pytest.raises(DFlashError, match="config.json"):
        dj.load_target(tmp_path)
    with pytest.raises(DFlashError, match="--dtype"):
        dj.load_target(tmp_path, dtype="float64")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\0\0")
    with pytest.raises(DFlashError, match="bad.gguf"):
        dj.load_target(tmp_path / "bad.gguf")


def test_load_hf_target_with_tokenizer(hf_dir):
    import tiny_hf

    t = dj.load_target(hf_dir)
    assert t.cfg.vocab_size == tiny_hf.VOCAB and t.eos_ids == (tiny_hf.IM_END,) and t.tokenizer is not None
    assert t.source == str(hf_dir)
    ids = dj.encode_prompt(t, "Hi")
    assert ids == [tiny_hf.IM_START, *b"user\nHi", tiny_hf.IM_END, 10, tiny_hf.IM_START, *b"assistant\n"]
    assert dj.encode_prompt(t, "Hi", raw=True) == list(b"Hi")
    assert dj.encode_prompt(t, "Hi", system="S")[:10] == [tiny_hf.IM_START, *b"system\nS", tiny_hf.IM_END]
    with pytest.raises(DFlashError, match="--system"):
        dj.encode_prompt(t, "Hi", system="S", raw=True)
    res = dj.generate(t, [ids], max_new_tokens=12, ignore_eos=True)
    assert res.texts[0] == t.tokenizer.decode(res.output_ids[0], skip_special_tokens=True)
    half = dj.load_target(hf_dir, dtype="bfloat16")
    assert half.cfg.dtype == "bfloat16" and jax.tree_util.tree_leaves(half.params)[0].dtype == "bfloat16"
    # on CPU the layers are separate buffers by default; the stacked layout gives the same text
    assert isinstance(t.params["layers"], PerLayer) and len(t.params["layers"]) == t.cfg.num_hidden_layers
    stacked = dj.load_target(hf_dir, layers="stacked")
    assert isinstance(stacked.params["layers"], dict)
    assert dj.generate(stacked, [ids], max_new_tokens=12, ignore_eos=True).output_ids == res.output_ids
    with pytest.raises(DFlashError, match="layers"):
        dj.load_target(hf_dir, layers="unrolled")


def test_load_hf_target_eos_without_tokenizer(hf_dir, tmp_path):
    import tiny_hf

    bare = tiny_hf.without_tokenizer(hf_dir, tmp_path / "bare")
    t = dj.load_target(bare)
    assert t.tokenizer is None and t.eos_ids == (tiny_hf.IM_END,)  # from generation_config.json
    with pytest.raises(DFlashError, match="tokenizer"):
        dj.encode_prompt(t, "Hi")


def test_text_stream_partial_utf8_and_stop(hf_dir):
    tok = dj.load_target(hf_dir).tokenizer
    s = dj.TextStream(tok)
    e_acute = list("é".encode())
    assert s.feed([ord("a")]) == "a"
    assert s.feed(e_acute[:1]) == ""  # an incomplete UTF-8 sequence is held back
    assert s.feed(e_acute[1:]) == "é"
    assert s.feed([257]) == ""  # special tokens are skipped
    assert s.finish() == ""
    s = dj.TextStream(tok, stop=["STOP"])
    out = s.feed(list(b"abc ST"))
    assert out == "abc " and not s.stopped  # "ST" could start the stop text
    out += s.feed(list(b"O"))
    out += s.feed(list(b"Pxyz"))
    assert out == "abc " and s.stopped and s.text() == "abc "
    assert s.feed(list(b"more")) == "" and s.finish() == ""
    s = dj.TextStream(tok, stop=["STOP"])
    assert s.feed(list(b"abc ST")) + s.feed(list(b"AR")) + s.finish() == "abc STAR"


@pytest.mark.parametrize("skip_special", [True, False])
def test_text_stream_releases_what_decoding_everything_at_each_step_releases(hf_dir, skip_special):
    """The incremental decoder (each id decoded once) against the oracle of decoding every id so far
    at each step (a tokenizer without ``decode_stream``): the same text at every step, the same
    stop, the same rest at the end, over random ids (bytes that never complete, special tokens, stop
    texts split across steps), with special tokens skipped or kept (the server keeps harmony's)."""
    import random

    tok = dj.load_target(hf_dir).tokenizer

    class WholeDecode:  # the tokenizer without its incremental decoder
        decode = staticmethod(tok.decode)

    rng = random.Random(0)
    pieces = [list(b"STOP"), list("é".encode()), list("日本".encode()), [0xE6, 0x97], [0xFF], [257], list(b"\n\n"), list(b"ab")]
    for trial in range(300):
        stop = rng.sample(["STOP", "\n\n", "é", "b a"], rng.randint(0, 2))
        ids = [i for _ in range(rng.randint(1, 12)) for i in (rng.choice(pieces) if rng.random() < 0.5 else [rng.randint(0, 258)])]
        fast, whole = dj.TextStream(tok, stop, skip_special), dj.TextStream(WholeDecode(), stop, skip_special)
        k = 0
        while k < len(ids):
            n = rng.randint(1, 4)
            assert fast.feed(ids[k : k + n]) == whole.feed(ids[k : k + n]), (trial, ids, stop, k)
            assert fast.stopped == whole.stopped
            k += n
        assert fast.finish() == whole.finish() and fast.text() == whole.text(), (trial, ids, stop)
        if not fast.stopped:
            assert ("<|im_end|>" in fast.text()) == (not skip_special and 257 in ids)


def test_split_stop(hf_dir):
    tok = dj.load_target(hf_dir).tokenizer
    ids, texts = split_stop(tok, ["x", "xy", "<|im_end|>"])
    assert ids == [ord("x"), 257] and texts == ["xy"]
    with pytest.raises(DFlashError, match="--stop"):
        split_stop(tok, [""])


def test_compile_cache_is_turned_on_by_load_target_not_by_import(tmp_path, hf_dir):
    """Importing the package leaves JAX's configuration alone; load_target (which the command line
    also reaches) and enable_compile_cache turn the persistent cache on in <cache folder>/jax_cache;
    DFLASH_JAX_NO_COMPILE_CACHE=1 keeps it off."""
    # A fresh interpreter without the test session's own cache folder (conftest.py).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "DFLASH_JAX_NO_COMPILE"))}
    env["DFLASH_JAX_CACHE"] = str(tmp_path)
    code = ("import sys, jax, dflash_jax as dj; state = lambda: print(jax.config.jax_compilation_cache_dir or 'off'); state(); "
            "dj.load_target(sys.argv[1]); state(); print(dj.enable_compile_cache() or 'off'); print(dj.compile_cache_dir())")
    out = subprocess.run([sys.executable, "-c", code, str(hf_dir)], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["off"] + [str(tmp_path / "jax_cache")] * 3
    env["DFLASH_JAX_NO_COMPILE_CACHE"] = "1"
    out = subprocess.run([sys.executable, "-c", code, str(hf_dir)], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["off", "off", "off", str(tmp_path / "jax_cache")]


@pytest.mark.parametrize(
    "kwargs, where, expected",
    [
        (dict(sampling={"temperature": 1}), "sampling", "SamplingConfig"),
        (dict(stop=[2]), "stop", "list of strings"),
        (dict(stop="\n"), "stop", "list of strings"),
        (dict(stop_ids=[1.5]), "stop_ids", "integer"),
        (dict(drafter="path/to/drafter"), "drafter", "Drafter"),
        (dict(seed="x"), "seed (--seed)", "[0, 2**63)"),
        (dict(seed=2**63), "seed (--seed)", "[0, 2**63)"),
        (dict(seed=-1), "seed (--seed)", "[0, 2**63)"),
        (dict(seed=1.0), "seed (--seed)", "[0, 2**63)"),
        (dict(max_new_tokens=2.0), "max_new_tokens (--max-new-tokens)", "integer"),
        (dict(n_max=3), "n_max (--n-max)", "a drafter"),  # no drafter: nothing to draft
        (dict(on_tokens=5), "on_tokens", "callable"),
        (dict(prompts=[[1, 2.5]]), "prompt", "integer token ids"),
        (dict(prompts=[[1, True]]), "prompt", "integer token ids"),
        (dict(prompts=[np.array([1.0, 2.0])]), "prompts", "integer array"),
        (dict(prompts=np.zeros((2, 2, 2), np.int32)), "prompts", "[batch, length]"),
    ],
)
def test_wrong_argument_types_are_dflash_errors(tiny, kwargs, where, expected):
    kwargs = dict(dict(prompts=[[1, 2]], max_new_tokens=2), **kwargs)
    with pytest.raises(DFlashError) as e:
        dj.generate(tiny, **kwargs)
    assert e.value.where == where and expected in (e.value.expected or ""), str(e.value)


def test_generate_refuses_a_non_target():
    with pytest.raises(DFlashError, match="target"):
        dj.generate("model.gguf", [[1, 2]])


def test_prompts_as_numpy_and_jax_arrays(tiny):
    import jax.numpy as jnp

    want = dj.generate(tiny, [[5, 9, 17], [40, 2, 7]], max_new_tokens=3).output_ids
    assert dj.generate(tiny, [jnp.asarray([5, 9, 17]), np.asarray([40, 2, 7], np.int64)], max_new_tokens=3).output_ids == want
    assert dj.generate(tiny, jnp.asarray([[5, 9, 17], [40, 2, 7]], jnp.int32), max_new_tokens=3).output_ids == want
    assert dj.generate(tiny, [[np.int32(5), 9, 17], (40, 2, 7)], max_new_tokens=3).output_ids == want


def test_capacity_is_bounded_by_max_position_embeddings(tiny):
    import dataclasses

    small = dj.Target(cfg=dataclasses.replace(tiny.cfg, max_position_embeddings=40), params=tiny.params, source="tiny")
    prompt = [[5, 9, 17, 3, 22, 8, 1]]  # 7 tokens
    # 7 + 33 = 40 fits exactly: the default capacity (1024) is capped at the limit
    res = dj.generate(small, prompt, max_new_tokens=33)
    assert res.stats["max_len"] == 40 and len(res.output_ids[0]) == 33
    with pytest.raises(DFlashError) as e:
        dj.generate(small, prompt, max_new_tokens=34)
    assert e.value.where == "max_new_tokens (--max-new-tokens)" and "40" in e.value.what and e.value.expected == "at most 33"
    with pytest.raises(DFlashError) as e:
        dj.generate(small, prompt, max_new_tokens=4, max_len=41)
    assert e.value.where == "max_len (--max-len)" and e.value.expected == "an integer in [2, 40]"
    # a budget far beyond a given capacity is harmless (the capacity ends the row)
    res = dj.generate(small, prompt, max_new_tokens=10**12, max_len=12)
    assert res.finish_reason == ["capacity"] and len(res.output_ids[0]) == 5


@pytest.mark.parametrize("text", [5, None, ["Hi"], b"Hi"])
def test_encode_prompt_wants_a_str(hf_dir, text):
    t = dj.load_target(hf_dir)
    with pytest.raises(DFlashError) as e:
        dj.encode_prompt(t, text)
    assert e.value.where == "text" and "str" in e.value.expected


def test_encode_prompt_option_types(hf_dir):
    t = dj.load_target(hf_dir)
    with pytest.raises(DFlashError, match="^system: "):
        dj.encode_prompt(t, "Hi", system=3)
    with pytest.raises(DFlashError, match="^chat_template_kwargs: "):
        dj.encode_prompt(t, "Hi", chat_template_kwargs=["enable_thinking"])


def test_one_token_stop_text_is_cut_from_the_text_like_a_longer_one(hf_dir):
    t = dj.load_target(hf_dir)
    ids = [1, 2, 3]
    base = dj.generate(t, [ids], max_new_tokens=40, ignore_eos=True)
    text = base.texts[0]
    ch = next(c for c in text[2:] if c.isascii() and c.isalnum())
    assert split_stop(t.tokenizer, [ch])[0] == [ord(ch)]  # a one-token stop text: a stop id
    for on_tokens in (None, lambda new: None):
        res = dj.generate(t, [ids], max_new_tokens=40, ignore_eos=True, stop=[ch], on_tokens=on_tokens)
        assert res.texts[0] == text[: text.index(ch)]
        assert res.output_ids[0][-1] == ord(ch) and res.finish_reason == ["stop"]
        assert res.output_ids[0] == base.output_ids[0][: len(res.output_ids[0])]


def test_load_drafter_names_an_existing_file_that_is_not_a_checkpoint(tiny, tmp_path):
    f = tmp_path / "notafolder.txt"
    f.write_text("x")
    with pytest.raises(DFlashError) as e:
        dj.load_drafter(f, tiny)
    assert e.value.where == str(f) and "exists" in e.value.what and "neither a folder nor a .gguf" in e.value.what
    with pytest.raises(DFlashError, match="no such folder"):
        dj.load_drafter(tmp_path / "missing", tiny)


def test_damaged_cached_default_model_says_to_delete_it(tmp_path, monkeypatch):
    from dflash_jax.assets.default_model import GGUF_NAME

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path))
    bad = tmp_path / GGUF_NAME
    bad.write_bytes(b"GGUF\0\0")  # truncated
    with pytest.raises(DFlashError) as e:
        dj.load_target()
    msg = str(e.value)
    assert msg.startswith(str(bad)) and f"delete {bad}" in msg and "fetched again" in msg


def test_positional_arguments_after_prompts_are_refused_by_name():
    """Every argument of dj.generate after ``prompts`` is keyword-only; a positional one (the old
    ``generate(target, prompts, 64)``) gets a DFlashError that says what to write instead."""
    from dflash_jax.testing import tiny_target

    cfg, params = tiny_target()
    with pytest.raises(DFlashError, match=r"generate: 1 positional argument\(s\) after prompts .*max_new_tokens=64"):
        dj.generate(dj.Target(cfg=cfg, params=params), [[1, 2, 3]], 64)
