"""SentencePiece-style GGUF tokenizers (``tokenizer.ggml.model`` ``gemma4`` and ``llama``) against
transformers: the HF tokenizer a ``gemma4`` GGUF is converted from (written the way llama.cpp's
``convert_hf_to_gguf.py`` writes Gemma 4's vocabulary, with gguf-py's ``LlamaHfVocab`` and
``SpecialVocab``) and transformers' own GGUF tokenizer loader; the ``qwen35`` pre-tokenizer."""

from __future__ import annotations

import json

import gguf
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.formats.tokenizer import Tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "naïve café déjà vu",
          "def main():\n    return 42\n", "tokens and merges and  spaces   here"] * 4
TEXTS = ["the quick brown fox", "hello there", "  hello   world \n\n\tdef main():  ", " leading space", "trailing  ",
         "naïve café 日本語 🙂 \x00\x7f", "", " ", "\n", "<|turn>user\nhi<turn|>\n<|channel>x<bos>y<eos>", "a<unk>b<0x41>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|turn>model\n{% endif %}")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _trained_bpe():
    """A SentencePiece-style BPE (``▁`` for spaces, no pre-splitting) trained on ``CORPUS`` by the
    ``tokenizers`` trainer: ``(vocab {token: rank}, merges [(left, right)], best first)``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, trainers

    raw = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.normalizer = normalizers.Replace(" ", "\u2581")
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    model = json.loads(raw.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


@pytest.fixture(scope="module")
def gemma4_files(tmp_path_factory):
    """``(folder, gguf path)``: a Gemma-style HF tokenizer (transformers' ``GemmaTokenizer``: BPE with
    byte fallback, ``▁`` spaces; control tokens ``<|turn>`` ``<turn|>``, non-special ``<|channel>``, ``<|tool_response>``)
    saved by transformers, and its ``gemma4`` GGUF as llama.cpp's converter writes it."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    trained, merges = _trained_bpe()
    vocab = {t: i for i, t in enumerate(SPECIALS + BYTES)}
    for t in sorted(trained, key=trained.get):
        vocab.setdefault(t, len(vocab))
    hf = GemmaTokenizer(vocab=vocab, merges=merges)
    hf.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>"]})
    hf.add_tokens(["<|channel>", "<|tool_response>"])
    hf.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("gemma4_tok")
    hf.save_pretrained(folder)
    # convert_hf_to_gguf.py, Gemma4Model.set_vocab
    tokens, scores, types = zip(*gguf.LlamaHfVocab(folder).all_tokens())
    w = gguf.GGUFWriter(str(folder / "g.gguf"), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(list(tokens))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return folder, folder / "g.gguf"


def _write_spm_gguf(path, tokens, types, scores=None, merges=None, model="llama", **kv):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges:
        w.add_token_merges(merges)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in kv.items():
        w.add_bool(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama_spm_gguf(tmp_path_factory):
    """A ``llama`` GGUF without merges, as the converter writes a SentencePiece ``tokenizer.model``:
    pieces with scores (minus the merge rank; single characters last), ids in another order
    (alphabetical) so only the scores give the merge order."""
    trained, merges = _trained_bpe()
    rank = {a + b: r for r, (a, b) in enumerate(merges)}
    pieces = sorted(trained)
    tokens = ["<unk>", "<s>", "</s>"] + BYTES + pieces + ["<|user|>"]
    scores = [0.0] * (3 + 256) + [-float(rank.get(p, 1000 + i)) for i, p in enumerate(pieces)] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    return _write_spm_gguf(tmp_path_factory.mktemp("llama_tok") / "l.gguf", tokens, types, scores)


def _hf_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_gemma4_gguf_matches_its_hf_tokenizer(gemma4_files):
    from transformers import AutoTokenizer

    folder, path = gemma4_files
    ours = Tokenizer.from_gguf(path, use_cache=False)
    original = AutoTokenizer.from_pretrained(folder)
    from_gguf = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    for text in TEXTS + CORPUS[:5]:
        ids = ours.encode(text, add_bos=False)
        assert ids == _hf_ids(original, text) == _hf_ids(from_gguf, text), text
        assert ours.decode(ids) == original.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True), text
    # bytes not in the vocabulary go through <0xXX> tokens and back
    ids = ours.encode("🙂", add_bos=False)
    assert [ours._tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    stream = ours.decode_stream()
    assert "".join(stream.step(i) for i in ours.encode("naïve 🙂 日本", add_bos=False)) == "naïve 🙂 日本"


def test_gemma4_gguf_specials_eos_and_chat(gemma4_files):
    _, path = gemma4_files
    tok = Tokenizer.from_gguf(path, use_cache=False)
    tid = tok.token_to_id
    assert (tok.bos_token, tok.eos_token, tok.add_bos) == ("<bos>", "<eos>", True)
    # llama.cpp's end-of-generation texts; <|tool_response> whatever its type (the converter makes it USER_DEFINED)
    assert tok.eos_token_ids == (tid("<eos>"), tid("<turn|>"), tid("<|tool_response>"))
    msgs = [{"role": "user", "content": "hello there"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<bos><|turn>user\nhello there<turn|>\n<|turn>model\n"
    ids = tok.encode_chat(msgs)
    assert ids[:2] == [tid("<bos>"), tid("<|turn>")] and ids.count(tid("<bos>")) == 1  # one BOS, from the template
    assert tid("<turn|>") in ids and ids.count(tid("<|turn>")) == 2
    assert tok.encode("<|channel>", add_bos=False) == [tid("<|channel>")]  # user-defined: whole, and shown
    assert tok.decode([tid("<|channel>"), tid("<turn|>")], skip_special_tokens=True) == "<|channel>"


def test_gemma4_gguf_tokenizer_cache(gemma4_files, tmp_path):
    import shutil

    path = shutil.copy(gemma4_files[1], tmp_path / "c.gguf")
    first = Tokenizer.from_gguf(path)
    assert (tmp_path / "c.gguf.tokenizer.json").is_file()
    again = Tokenizer.from_gguf(path)
    for text in TEXTS:
        assert again.encode(text) == first.encode(text) and again.decode(first.encode(text)) == first.decode(first.encode(text))


def test_llama_gguf_merges_from_scores(llama_spm_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(llama_spm_gguf, use_cache=False)
    ref = AutoTokenizer.from_pretrained(llama_spm_gguf.parent, gguf_file=llama_spm_gguf.name)
    assert ours.add_bos and ours.bos_token == "<s>" and ours.eos_token_ids == (2,)
    for text in TEXTS + CORPUS[:5] + ["<s>x</s><|user|>y"]:
        ids = ours.encode(text, add_bos=False)
        assert ids == _hf_ids(ref, text), text
        assert ours.decode(ids) == ref.decode(ids), text
    assert len(ours.encode("the quick brown fox", add_bos=False)) < 8  # merged, not spelled out
    assert ours.encode("hi")[0] == 1  # a SentencePiece vocabulary adds BOS unless the file says otherwise


def test_llama_gguf_with_merges_and_no_space_prefix(tmp_path):
    from transformers import AutoTokenizer

    tokens = ["<unk>", "<s>", "</s>"] + BYTES + ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    merges = ["\u2581 a", "a b", "\u2581a b"]
    path = _write_spm_gguf(tmp_path / "m.gguf", tokens, types, merges=merges)
    ours, ref = Tokenizer.from_gguf(path, use_cache=False), AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    tid = {t: i for i, t in enumerate(tokens)}
    assert ours.encode("ab ab", add_bos=False) == [tid["\u2581ab"], tid["\u2581ab"]] == _hf_ids(ref, "ab ab")
    path = _write_spm_gguf(tmp_path / "n.gguf", tokens, types, merges=merges, model="gemma4", **{"tokenizer.ggml.add_space_prefix": False})
    assert Tokenizer.from_gguf(path, use_cache=False).encode("ab ab", add_bos=False) == [tid["ab"], tid["\u2581ab"]]


def test_unsupported_spm_metadata(tmp_path):
    tokens, types = ["<unk>", "<s>", "</s>", "a"], [2, 3, 3, 1]
    with pytest.raises(DFlashError, match=r"x\.gguf: metadata tokenizer\.ggml\.scores: missing"):
        Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "x.gguf", tokens, types), use_cache=False)
    with pytest.raises(DFlashError, match=r"y\.gguf: metadata tokenizer\.ggml\.scores: 2 entries for 4 tokens"):
        Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "y.gguf", tokens, types, scores=[0.0, 0.0]), use_cache=False)
    with pytest.raises(DFlashError, match=r"z\.gguf: metadata tokenizer\.ggml\.merges: malformed merge 'ab'"):
        Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "z.gguf", tokens, types, merges=["ab"]), use_cache=False)
    with pytest.raises(DFlashError, match=r"v\.gguf: metadata tokenizer\.ggml\.merges: merge 'a b' names 'b', not a token"):
        Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "v.gguf", tokens, types, merges=["a b"]), use_cache=False)
    with pytest.raises(DFlashError, match=r"w\.gguf: metadata tokenizer\.ggml\.model: unsupported tokenizer 'bert'.*'gemma4'"):
        Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "w.gguf", tokens, types, model="bert"), use_cache=False)


def test_qwen35_pretokenizer_is_transformers_qwen3_5():
    """Qwen3.5's split keeps combining marks (\\p{M}) in a word; Qwen2's cuts them off."""
    from tokenizers import pre_tokenizers

    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    from dflash_jax.formats.pretokenize import pre_tokenizer

    ref = Qwen3_5Tokenizer(vocab={"a": 0}, merges=[]).backend_tokenizer.pre_tokenizer
    assert isinstance(ref, pre_tokenizers.Sequence)
    for text in ["cafe\u0301 nai\u0308ve \u0915\u093f\u0924\u093e\u092c 12 x\u0301y!\u0301 it's", "plain words, 123 and\n\n  spaces"]:
        assert pre_tokenizer("qwen35", "q").pre_tokenize_str(text) == ref.pre_tokenize_str(text), text
    text = "cafe\u0301"
    assert pre_tokenizer("qwen2", "q").pre_tokenize_str(text) != ref.pre_tokenize_str(text)
