"""Tiny random models and reference loops for tests, notebooks and examples."""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.families.dense import model as dense


def tiny_target_config(family: str = "llama", **overrides) -> TargetConfig:
    """A tiny dense target (vocab 128, hidden 64, 3 layers, GQA 4/2, head_dim 16)."""
    base = dict(
        family=family, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0), tie_word_embeddings=family == "llama",
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
    )
    base.update(overrides)
    return TargetConfig(**base)


def tiny_target(family: str = "llama", seed: int = 0, scale: float = 0.2, **overrides):
    """``(cfg, params)`` of a tiny random target whose greedy output is not degenerate."""
    cfg = tiny_target_config(family, **overrides)
    return cfg, dense.MODEL.init_params(cfg, jax.random.key(seed), scale=scale)


def reference_greedy(params, cfg, prompt, n_new: int, stop_ids=()) -> list[int]:
    """Greedy decoding by recomputing the full forward for every token (no cache reuse).

    An independent oracle for the cached paths: ``n_new`` tokens (or up to the first stop id).
    Every step runs one forward over a fixed ``len(prompt) + n_new`` slots, the tokens so far
    followed by padding (causal attention keeps the padding out of the logits read), so the
    forward compiles once per length rather than once per step.
    """
    total = len(prompt) + n_new
    toks = np.zeros((1, total), np.int32)
    toks[0, : len(prompt)] = prompt
    out = []
    for t in range(len(prompt), total):
        nxt = int(np.argmax(np.asarray(_full_logits(params, cfg, jnp.asarray(toks))[0, t - 1])))
        toks[0, t] = nxt
        out.append(nxt)
        if nxt in stop_ids:
            break
    return out


@functools.partial(jax.jit, static_argnums=1)
def _full_logits(params, cfg, tokens):
    """``[1, T, V]`` logits of one forward over ``tokens [1, T]`` from an empty cache of ``T`` slots."""
    t = tokens.shape[1]
    logits, _, _ = dense.MODEL.forward(params, cfg, tokens, jnp.arange(t, dtype=jnp.int32)[None], dense.MODEL.init_cache(cfg, 1, t))
    return logits


def tiny_drafter_config(target_cfg: TargetConfig, layer_ids=(0, 2), block_size: int = 4, **overrides):
    """A tiny generic DFlash drafter for ``target_cfg`` (2 layers, mask id = last vocab row)."""
    from dflash_jax.drafter.config import DrafterConfig

    n = overrides.pop("num_hidden_layers", 2)
    base = dict(
        hidden_size=target_cfg.hidden_size, intermediate_size=96, num_hidden_layers=n, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=target_cfg.vocab_size, block_size=block_size,
        mask_token_id=target_cfg.vocab_size - 1, target_layer_ids=tuple(layer_ids),
        num_target_layers=target_cfg.num_hidden_layers, layer_causal=(False,) * n, layer_window=(0,) * n,
        rope=RopeConfig(theta=10000.0),
    )
    base.update(overrides)
    return DrafterConfig(**base)


def tiny_drafter(target_cfg: TargetConfig, seed: int = 0, scale: float = 0.2, **overrides):
    """``(cfg, params)`` of a tiny random drafter for ``target_cfg``."""
    from dflash_jax.drafter import model as drafter

    cfg = tiny_drafter_config(target_cfg, **overrides)
    return cfg, drafter.init_params(cfg, jax.random.key(seed), scale=scale)


def verify_scripted(state, continuation, n: int, verify, corrupt_at: int | None = None, vocab_size: int = 0):
    """Steps ``state = verify(state, drafts)`` until row 0 is done, with scripted drafts: each
    step's ``n`` drafts (a list of ints) are the next tokens of ``continuation`` after row 0's
    committed length (``continuation``: the prompt and the target's greedy answer; 0 past its end),
    draft ``corrupt_at`` (if given) replaced by the next id modulo ``vocab_size``. Acceptance is
    then known in advance: ``min(corrupt_at, width)`` per full step.

    Returns:
      ``(state, accepts)``: the last state and the drafts row 0 accepted at each step.
    """
    accepts = []
    while not bool(state.done[0]):
        length = int(state.length[0])
        drafts = [continuation[length + i] if length + i < len(continuation) else 0 for i in range(n)]
        if corrupt_at is not None:
            drafts[corrupt_at] = (drafts[corrupt_at] + 1) % vocab_size
        before = int(state.speculative.accepted[0])
        state = verify(state, drafts)
        accepts.append(int(state.speculative.accepted[0]) - before)
    return state, accepts
