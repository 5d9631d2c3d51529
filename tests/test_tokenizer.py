"""Tokenizer from GGUF metadata and HF folders; chat templates; the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import gguf
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.formats.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2's byte-level BPE uses for bytes 0..255, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o"]


def tiny_lists():
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def write_tokenizer_gguf(path, pre="smollm", add_bos=False, template=TEMPLATE):
    tokens, types = tiny_lists()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    return Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "tok.gguf"))


def test_specials_merges_and_round_trip(tiny):
    tokens, _ = tiny_lists()
    tid = {t: i for i, t in enumerate(tokens)}
    assert tiny.vocab_size == len(tokens)
    assert tiny.eos_token_ids == (2, 0)  # eos, then <|endoftext|> (llama.cpp's end-of-generation list)
    assert tiny.bos_token == "<|im_start|>" and tiny.eos_token == "<|im_end|>"
    ids = tiny.encode("<|im_start|>user\nhello the<|im_end|>")
    assert ids == [1, tid["u"], tid["s"], tid["e"], tid["r"], tid["Ċ"], tid["hello"], tid["Ġthe"], 2]
    assert tiny.decode(ids) == "<|im_start|>user\nhello the<|im_end|>"
    assert tiny.decode(ids, skip_special_tokens=True) == "user\nhello the"
    for text in ["héllo wörld ✓ 日本語 🙂", "  leading spaces\tand\ttabs\n\n", "a1234b"]:
        assert tiny.decode(tiny.encode(text)) == text


def test_smollm_pretokenizer_splits_digits(tiny):
    tokens, _ = tiny_lists()
    tid = {t: i for i, t in enumerate(tokens)}
    # digits are isolated one by one before the GPT-2 regex (llama.cpp's "smollm" pre-type)
    assert tiny.encode("x 12") == [tid["x"], tid["Ġ"], tid["1"], tid["2"]]


def test_unsupported_pre_and_model(tmp_path):
    with pytest.raises(DFlashError, match="tokenizer.ggml.pre"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "p.gguf", pre="mystery"))
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("rwkv")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DFlashError, match=r"spm\.gguf: metadata tokenizer\.ggml\.model: unsupported tokenizer 'rwkv'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(tmp_path / "spm.gguf")


def test_add_bos(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "b.gguf", add_bos=True))
    assert tok.encode("the")[0] == 1
    assert tok.encode("the", add_bos=False)[0] != 1
    # the template already starts with <|im_start|> (= BOS here): no second BOS
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[:2] != [1, 1] and ids[0] == 1


def test_chat_template(tiny):
    msgs = [{"role": "user", "content": "hello"}]
    assert tiny.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False).endswith("hello<|im_end|>\n")
    sys_msgs = [{"role": "system", "content": "S"}, *msgs]
    assert tiny.apply_chat_template(sys_msgs).startswith("<|im_start|>system\nS<|im_end|>")
    assert tiny.encode_chat(msgs) == tiny.encode(tiny.apply_chat_template(msgs))


def test_template_features_and_sandbox(tmp_path):
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}\n"
        "  {% for m in messages %}\n"
        "    [{{ m.content|tojson }}|{{ flag }}|{{ bos_token }}]\n"
        "  {% endfor %}"
    )
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", template=template))
    # trim_blocks + lstrip_blocks: block tags leave no whitespace behind
    assert tok.apply_chat_template([{"role": "user", "content": "é"}], flag=7) == '    ["é"|7|<|im_start|>]\n'
    with pytest.raises(DFlashError, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "e.gguf", template=evil))
    with pytest.raises(Exception):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "n.gguf", template=None))
    with pytest.raises(DFlashError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_tokenizer_cache(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "c.gguf")
    a = Tokenizer.from_gguf(path)
    assert (tmp_path / "c.gguf.tokenizer.json").is_file()
    b = Tokenizer.from_gguf(path)
    text = "<|im_start|>hello the 42<|im_end|>"
    assert a.encode(text) == b.encode(text)
    assert (a.eos_token_ids, a.bos_token_id, a.chat_template, a.vocab_size) == (b.eos_token_ids, b.bos_token_id, b.chat_template, b.vocab_size)


def test_from_hf_folder(tmp_path, tiny):
    folder = tmp_path / "hf"
    folder.mkdir()
    tiny._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": TEMPLATE,
    }))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(folder)
    text = "<|im_start|>user\nhello the 12<|im_end|>"
    assert tok.encode(text) == tiny.encode(text)
    assert tok.eos_token_ids == (2, 0)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == tiny.apply_chat_template(msgs)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_hf_folder(folder).apply_chat_template(msgs) == "x!"
    with pytest.raises(DFlashError, match="tokenizer.json: file not found"):
        Tokenizer.from_hf_folder(tmp_path)


# ------------------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def smollm2():
    from dflash_jax.assets.default_model import default_target_path

    return Tokenizer.from_gguf(default_target_path())


@pytest.mark.slow
def test_default_model_tokenizer(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.eos_token_ids[0] == 2 and smollm2.eos_token == "<|im_end|>"
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    text = "def f(x):\n    return x ** 2  # 123 héllo"
    assert smollm2.decode(smollm2.encode(text)) == text
    assert [smollm2.decode([i]) for i in smollm2.encode("12345")] == ["1", "2", "3", "4", "5"]
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_gpt4o_pretokenizer_splits_as_o200k():
    """llama.cpp's ``gpt-4o`` pre-type (gpt-oss GGUFs): o200k's splits, camel case apart, contractions
    kept on their word, digits in threes; the same pieces Python's ``regex`` finds with the pattern."""
    import regex
    from tokenizers import decoders

    from dflash_jax.formats.pretokenize import _GPT4O_REGEX, pre_tokenizer

    text = "HelloWorld's ÉCOLE 1234567 x\n\n  y//z\r\n don'T 日本語 café!?\n/"
    pieces = [decoders.ByteLevel().decode([p]) for p, _ in pre_tokenizer("gpt-4o", "t").pre_tokenize_str(text)]
    assert pieces == ["Hello", "World's", " ÉCOLE", " ", "123", "456", "7", " x", "\n\n", " ", " y", "//", "z", "\r\n", " don'T",
                      " 日本語", " café", "!?\n/"]
    assert pieces == regex.findall(_GPT4O_REGEX, text)


HARMONY = ["<|endoftext|>", "<|return|>", "<|call|>", "<|end|>", "<|start|>", "<|message|>"]  # ids 0..5


def test_harmony_turns_end_at_return_or_call(tmp_path):
    """gpt-oss (OpenAI's harmony format): a turn ends at ``<|return|>`` or ``<|call|>``; ``<|end|>``
    ends one message (analysis) and the turn goes on, so it is no stop (the stops of gpt-oss's
    ``generation_config.json``: return, endoftext, call). Elsewhere ``<|end|>`` still stops (Phi-3)."""
    tokens, types = HARMONY + byte_alphabet(), [3] * len(HARMONY) + [1] * 256
    gguf_tok = Tokenizer.from_vocab(tokens, [], types, pre="gpt-4o", eos_token_id=1)  # a gpt-oss GGUF's EOS: <|return|>
    assert gguf_tok.eos_token_ids == (1, 0, 2) and gguf_tok.eos_token == "<|return|>"
    assert Tokenizer.from_vocab(tokens, [], types, pre="gpt-4o", eos_token_id=3).eos_token_ids == (0, 1, 2)
    phi = Tokenizer.from_vocab(["<|endoftext|>", "<|end|>"] + byte_alphabet(), [], [3, 3] + [1] * 256, eos_token_id=0)
    assert phi.eos_token_ids == (0, 1)
    folder = tmp_path / "hf"
    folder.mkdir()
    gguf_tok._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "pad_token": "<|endoftext|>"}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Tokenizer.from_hf_folder(folder).eos_token_ids == (1, 2)  # no generation_config.json: config.json's, and call
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0, 2]}))
    assert Tokenizer.from_hf_folder(folder).eos_token_ids == (1, 0, 2)


def test_eos_from_config_json_without_generation_config(tmp_path, tiny):
    """Without ``generation_config.json`` (or without its ``eos_token_id``) the EOS list of
    ``config.json`` stops too, as transformers' ``GenerationConfig.from_model_config`` takes it."""
    folder = tmp_path / "hf"
    folder.mkdir()
    tiny._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert Tokenizer.from_hf_folder(folder).eos_token_ids == (2, 0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert Tokenizer.from_hf_folder(folder).eos_token_ids == (2,)
