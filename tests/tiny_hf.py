"""A tiny Hugging Face Llama checkpoint with a byte-level tokenizer and a chat template, for CLI/API tests.

The tokenizer has one token per byte (ids 0..255, GPT-2 byte-to-unicode alphabet, no merges) plus
``<|im_start|>`` (256) and ``<|im_end|>`` (257, EOS); the model's vocabulary is 260 rows, so
random generations exercise partial UTF-8 and ids the tokenizer does not know.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

VOCAB = 260
IM_START, IM_END = 256, 257
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(extra: dict | None = None):
    """The byte-level BPE of this module (``tokenizers.Tokenizer``): one token per byte, the two
    special tokens, and ``extra`` (``{piece in the byte alphabet: id}``) as whole tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from test_tokenizer import byte_alphabet

    alphabet = dict(enumerate(byte_alphabet()))
    vocab = {alphabet[b]: b for b in range(256)}
    vocab.update({"<|im_start|>": IM_START, "<|im_end|>": IM_END})
    vocab.update(extra or {})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                            AddedToken("<|im_end|>", special=True, normalized=False)])
    assert tok.token_to_id("<|im_end|>") == IM_END
    return tok


def write_tokenizer(folder: Path) -> None:
    tok = byte_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False, "chat_template": TEMPLATE}))


def make_tiny_hf(folder: Path, tokenizer: bool = True, seed: int = 0) -> Path:
    """Writes a random tiny Llama (2 layers, GQA 4/2, tied embeddings) with ``save_pretrained``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.3, max_position_embeddings=512,
        eos_token_id=IM_END, bos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        write_tokenizer(folder)
    return folder


def without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of ``src`` holding only the model files."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)
    return dst
