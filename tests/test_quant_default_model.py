"""The default model (SmolLM2-135M-Instruct) re-encoded with Q4_K, Q6_K, Q8_0, Q5_0, Q5_1, Q4_0 and
Q4_1 tensors (tests/requant.py), loaded with ``weights="quantized"``: it takes at most 1.15x its
tensor bytes, raises the loading process's peak memory by at most 2.5x those bytes, writes no float
cache, and decodes (plain and DFlash with the shipped drafter) the same greedy ids as
transformers' own GGUF loading of the same file (``from_pretrained(dir, gguf_file=...)``, which
dequantizes every one of these types with gguf-py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.assets.default_model import DRAFTERS_DIR, default_target_path
from dflash_jax.families.dense.gguf_cache import cache_path
from requant import Q, reencode

pytestmark = pytest.mark.slow
LEGACY = (Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1)


def type_of(name: str, shape: tuple):
    """ffn_down (1536 inputs: whole 256-weight super-blocks) alternates Q4_K and Q6_K by layer; the
    other matrices (576 inputs) cycle through the legacy types; the embedding stays Q8_0."""
    if name == "token_embd.weight":
        return Q.Q8_0
    layer = int(name.split(".")[1])
    if name.endswith("ffn_down.weight"):
        return (Q.Q4_K, Q.Q6_K)[layer % 2]
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
    return LEGACY[(layer + kinds.index(name.split(".")[2])) % len(LEGACY)]


@pytest.fixture(scope="module")
def requantized(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("requant")
    path = folder / "smollm2-mixed.gguf"
    types = reencode(str(default_target_path()), str(path), type_of)
    assert set(types.values()) == {"F32", "Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1"}
    return path


_MEASURE = r"""
import json, sys
import jax, numpy as np
import dflash_jax as dj
from dflash_jax.families.dense import gguf_quantized  # imported before the baseline: code is not data
import gguf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(sys.argv[1]).tensors)
before = status("VmRSS")
t = dj.load_target(sys.argv[1], weights="quantized")
peak = status("VmHWM")
leaves = jax.tree_util.tree_leaves(t.params)
print(json.dumps(dict(tensor_bytes=tensor_bytes, loaded=sum(int(a.size) * a.dtype.itemsize for a in leaves),
                      raised=peak - before, weights=t.weights)))
"""


def test_loads_quantized_within_the_memory_bounds_and_writes_no_cache(requantized):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(requantized)], capture_output=True, text=True, timeout=900, env=env,
                         cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(got)
    assert got["weights"] == "quantized"
    assert got["loaded"] <= 1.15 * got["tensor_bytes"]
    assert got["raised"] <= 2.5 * got["tensor_bytes"]
    assert not cache_path(requantized).exists()


@pytest.fixture(scope="module")
def transformers_model(requantized):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(requantized.parent), gguf_file=requantized.name, torch_dtype=torch.float32)
    return model.eval()


def test_plain_and_dflash_decode_as_transformers_does(requantized, transformers_model):
    from hf_oracle import hf_greedy

    target = dj.load_target(requantized, weights="quantized")
    assert target.weights == "quantized"
    drafter = dj.load_drafter(DRAFTERS_DIR / "smollm2-135m-instruct", target)
    for text in ("What is 7 times 8?", "Write a Python function that reverses a string."):
        prompt = dj.encode_prompt(target, text)
        want = hf_greedy(transformers_model, prompt, 24)
        plain = dj.generate(target, [prompt], max_new_tokens=24, ignore_eos=True)
        spec = dj.generate(target, [prompt], max_new_tokens=24, ignore_eos=True, drafter=drafter, n_max=7)
        assert plain.output_ids[0] == want, text
        assert spec.output_ids[0] == want, text
        assert spec.stats["mode"] != "plain"
    assert np.isfinite(spec.stats["decode_time_s"])
