"""Dense decoder targets (Llama incl. SmolLM2 and Llama-3, Mistral, Qwen2, Qwen3) as pure functions.

Mistral's ``sliding_window`` (``TargetConfig.sliding_window``) narrows every layer's attention to
keys less than the window behind the query (:func:`dflash_jax.nn.attention.windowed`); the cache
still keeps every position.

Parameter pytree (weights in ``[in, out]`` layout; layers stacked on a leading ``L`` axis and run
with ``lax.scan``)::

    {"embed": [V, H],
     "layers": {"attn_norm": [L, H], "wq": [L, H, Hq*D], "wk": [L, H, Hkv*D], "wv": [L, H, Hkv*D],
                "wo": [L, Hq*D, H], "mlp_norm": [L, H],
                "w_gate": [L, H, I], "w_up": [L, H, I], "w_down": [L, I, H],
                # optional: "bq","bk","bv" [L, Hq*D|Hkv*D] (qkv_bias), "bo" [L, H] (o_bias),
                #           "q_norm","k_norm" [L, D] (qk_norm), "b_gate","b_up" [L, I], "b_down" [L, H]
               },
     "norm": [H],
     "lm_head": [H, V]}          # optional when tie_word_embeddings (embed.T is used; api adds a copy)

The same pytree may hold ``"layers"`` as a ``PerLayer`` of ``L`` per-layer dicts (:func:`dflash_jax.nn.params.unstack_layers`,
leaves without the ``L`` axis): :func:`forward_hidden` then runs a Python loop over separate
buffers instead of ``lax.scan``. XLA:CPU copies each layer's weights out of the stacked arrays in
every scan step (a ``dynamic-slice`` per weight); without those copies plain decoding of
SmolLM2-135M ran 1.15x faster (BENCHMARKS.md), so :func:`dflash_jax.loading.load_target` unstacks
on CPU. Both layouts give the same logits.

Source: transformers ``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``,
``modeling_qwen3.py``.
"""

from __future__ import annotations

import functools
from typing import Any
import jax.numpy as jnp
from dflash_jax.runtime.carry import Capture, KVCache
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.runtime import carry as captures
from dflash_jax.families.contract import FamilyModel
from dflash_jax.nn.params import ParamSpec, decoder_layer, stacked
from dflash_jax.nn.attention import TreeBlock, block_visible, rope_positions, windowed
from dflash_jax.nn.layer import embed, run_layers
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn.layer import attention_output, mlp_residual, project_qkv
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import inv_frequencies


Params = dict[str, Any]


def param_specs(cfg: TargetConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` (shape, logical axes, initialiser) of every
    parameter leaf, as a pytree shaped like the params (module docstring)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    layer = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                          qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias, qk_norm=cfg.qk_norm)
    specs = {"embed": ParamSpec((V, H), ("vocab", "embed")), "layers": stacked(cfg.num_hidden_layers, layer),
             "norm": ParamSpec((H,), ("embed",), "norm")}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((H, V), ("embed", "vocab"))
    return specs


def _layer(cfg: TargetConfig, inv_freq, x, lp, cache, positions, rope_pos, visible, n_keys, layer):
    """One decoder layer over ``x [B,T,H]``; writes this layer's K/V rows into the stacked cache
    (:class:`KVCache` or :class:`~dflash_jax.runtime.carry.PagedKVCache`) in place at index ``layer``
    (carried through the scan, never copied) and
    attends the cache's first ``n_keys`` slots (:func:`~dflash_jax.nn.attention.live_keys`)
    under ``visible`` (:func:`~dflash_jax.nn.attention.block_visible`); RoPE at ``rope_pos``."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(lp, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope_pos, inv_freq,
                          cfg.rms_norm_eps, bias=cfg.qkv_bias, qk_norm=cfg.qk_norm)
    cache = cache.written(layer, k, v, positions)
    a = cache_attention(q, cache.k, cache.v, layer, n_keys, visible, pages=cache.pages)
    x = x + attention_output(lp, a, h, bias=cfg.o_bias)
    return mlp_residual(lp, x, cfg.rms_norm_eps), cache


def forward_hidden(
    params: Params,
    cfg: TargetConfig,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: KVCache,
    capture: Capture | None = None,
    tree: TreeBlock | None = None,
) -> tuple[jnp.ndarray, KVCache, Capture | None]:
    """Runs the decoder stack; returns the final-normed hidden states ``[B, T, H]``.

    The family contract's ``forward`` without the LM head, so callers that need only some rows'
    logits (prefill's last row) pay for the head once; ``tree``: the block is a tree of
    candidates (:class:`~dflash_jax.nn.attention.TreeBlock`: RoPE by depth, ancestors visible).
    Raises :class:`~dflash_jax.errors.DFlashError` for a capture layer id outside the target, or
    a tree of more tokens than a sliding window (Mistral's ``sliding_window``).

    Args:
      params: parameter pytree (module docstring).
      cfg: static :class:`TargetConfig`.
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 absolute positions, contiguous per row and starting at or
        before the row's committed length; K/V of token ``t`` is written to slot
        ``positions[b, t]`` (slots past the capacity are dropped).
      cache: :class:`KVCache`; returned with the new rows written (the cache keeps no length:
        callers roll back rejected rows by lowering ``DecodeState.length``).
      capture: optional :class:`Capture`; receives the residual after each listed layer.
    Returns:
      ``(hidden [B, T, H] in cfg.dtype, cache, capture)``.
    """
    n_layers = cfg.num_hidden_layers
    inv_freq = inv_frequencies(cfg.rope, cfg.head_dim)
    positions = positions.astype(jnp.int32)
    n_keys = live_keys(positions, cache.capacity)
    rope_pos, visible = rope_positions(positions, tree), block_visible(positions, tree)
    if cfg.sliding_window:
        if tree is not None and tree.mask.shape[-1] > cfg.sliding_window:
            raise DFlashError("tree", f"{tree.mask.shape[-1]} tokens in one verify pass", f"at most sliding_window={cfg.sliding_window}")
        visible = windowed(visible, positions, rope_pos, cfg.sliding_window, tree)
    x = embed(params, cfg, tokens).astype(cfg.dtype)
    slot_of = jnp.asarray(captures.slots(capture, n_layers))
    cap = captures.stack(capture, x)

    def body(carry, lp, slot, i):
        x, cap, cache = carry
        x, cache = _layer(cfg, inv_freq, x, lp, cache, positions, rope_pos, visible, n_keys, i)
        return x, captures.keep(capture, cap, x, slot), cache

    x, cap, cache = run_layers(body, (x, cap, cache), params["layers"], slot_of)
    final_norm = functools.partial(rms_norm, weight=params["norm"], eps=cfg.rms_norm_eps)
    capture = captures.write(capture, cap, positions, n_layers, final_norm)
    return final_norm(x), cache, capture


MODEL = FamilyModel(name="dense", module=__name__, param_specs=param_specs, forward_hidden=forward_hidden, paged_kv=True,
                    trees=True, per_layer=True)
