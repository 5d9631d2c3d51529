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

The same pytree may hold ``"layers"`` as a ``PerLayer`` of ``L`` per-layer dicts (:func:`unstack_layers`,
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
import jax
import jax.numpy as jnp
from jax import lax
from dflash_jax.runtime.carry import Capture, KVCache, init_kv_cache
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.runtime import carry as captures
from dflash_jax.nn import params as P
from dflash_jax.nn.params import ParamSpec, decoder_layer, stacked
from dflash_jax.nn.attention import TreeBlock, block_visible, rope_positions, windowed
from dflash_jax.nn.layer import embed, lm_head  # noqa: F401 (the model API: shared by every family)
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn.layer import attention_output, mlp_residual, project_qkv
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import inv_frequencies


PAGED_KV = True
"""The forward also runs on a :class:`~dflash_jax.runtime.carry.PagedKVCache` (:attr:`dflash_jax.families.contract.FamilyModel.paged_kv`)."""

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


def param_shapes(cfg: TargetConfig) -> dict:
    """The expected shape of every parameter leaf, as a pytree shaped like the params."""
    return P.shapes(param_specs(cfg))


def param_axes(cfg: TargetConfig, per_layer: bool = False) -> dict:
    """Logical axis names of every parameter leaf (same tree as :func:`param_shapes`; with
    ``per_layer`` the tree of :func:`unstack_layers`: ``L`` dicts without the ``"layers"`` axis)."""
    return P.axes(param_specs(cfg), per_layer)


def unstack_layers(params: Params) -> Params:
    """``params`` with ``"layers"`` as a :class:`~dflash_jax.nn.params.PerLayer` of ``L`` dicts: each stacked leaf
    ``[L, ...]`` becomes ``L`` leaves ``[...]`` of the same dtype (one buffer per layer and
    weight; a no-op when already unstacked). The arrays are copies: the stacked ones can be freed.
    Source: the per-step weight copies of ``lax.scan`` on XLA:CPU (BENCHMARKS.md, plain-decoding
    notes)."""
    if P.is_per_layer(params["layers"]):
        return params
    leaves = jax.tree_util.tree_leaves(params["layers"])
    if all(isinstance(a, jax.Array) for a in leaves):  # one program, not one eager slice per leaf and layer
        return dict(params, layers=_split_layers(params["layers"], leaves[0].shape[0]))
    return dict(params, layers=_split_layers.__wrapped__(params["layers"], leaves[0].shape[0]))  # numpy: views


@functools.partial(jax.jit, static_argnums=1)
def _split_layers(layers, n: int) -> P.PerLayer:
    return P.PerLayer(jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(n))


def stack_layers(params: Params) -> Params:
    """The inverse of :func:`unstack_layers`: ``L`` per-layer leaves ``[...]`` become one ``[L, ...]``
    leaf each (a no-op on stacked parameters). Raises ``ValueError`` from ``jnp.stack`` when the
    layers' shapes differ."""
    if not P.is_per_layer(params["layers"]):
        return params
    return dict(params, layers=jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params["layers"]))


def run_layers(body, carry, layers, xs):
    """Runs ``carry = body(carry, layer_params, layer_xs, i)`` over a run of identical layers.

    ``layers`` is either stacked (leaves ``[L, ...]``: one ``lax.scan``, ``i`` a traced int32
    scalar) or the :class:`~dflash_jax.nn.params.PerLayer` of :func:`unstack_layers` (a Python
    loop over one jitted ``body``, so the layers are traced once, not ``L`` times; ``i`` a traced
    int32 scalar there too). ``xs`` is a pytree of per-layer inputs with leading axis ``L``;
    ``layer_xs`` is its slice at ``i``.
    Returns the final carry. Source: the per-step weight copies of ``lax.scan`` on XLA:CPU
    (BENCHMARKS.md, plain-decoding notes) are why the per-layer form exists."""
    if P.is_per_layer(layers):
        layer = jax.jit(body)  # traced once for all layers of one shape (the program still holds L copies)
        for i, lp in enumerate(layers):
            carry = layer(carry, lp, jax.tree_util.tree_map(lambda a, i=i: a[i], xs), jnp.int32(i))
        return carry
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]

    def step(c, inp):
        lp, layer_xs, i = inp
        return body(c, lp, layer_xs, i), None

    return lax.scan(step, carry, (layers, xs, jnp.arange(n, dtype=jnp.int32)))[0]


def init_params(cfg: TargetConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random normal parameters (norm weights near 1) for tests and experiments."""
    return P.init(param_specs(cfg), key, scale, cfg.dtype)


def init_cache(cfg: TargetConfig, batch: int, capacity: int) -> KVCache:
    """An empty KV cache for ``cfg`` of ``capacity`` slots per row."""
    return init_kv_cache(cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype)


def move_rows(cfg: TargetConfig, cache: KVCache, src: jnp.ndarray, dst: jnp.ndarray) -> KVCache:
    """The cache with the K/V of slot ``src[b, w]`` copied to ``dst[b, w]`` in every layer
    (``[B, W]`` int32; :func:`~dflash_jax.runtime.carry.move_slots`): a verified tree's accepted path
    moved to the slots a chain would have written."""
    return cache.moved(src, dst)


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

    Same contract as :func:`forward` without the LM head, so callers that need only some rows'
    logits (prefill's last row) pay for the head once; ``tree``: the block is a tree of
    candidates (:class:`~dflash_jax.nn.attention.TreeBlock`: RoPE by depth, ancestors visible).
    Raises :class:`~dflash_jax.errors.DFlashError` for a capture layer id outside the target, or
    a tree of more tokens than a sliding window (Mistral's ``sliding_window``).
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


def forward(
    params: Params,
    cfg: TargetConfig,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: KVCache,
    capture: Capture | None = None,
) -> tuple[jnp.ndarray, KVCache, Capture | None]:
    """One target forward for a prefill chunk, a verify block or a single decode token.

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
      ``(logits [B, T, V] float32, cache, capture)``.
    """
    hidden, cache, capture = forward_hidden(params, cfg, tokens, positions, cache, capture)
    return lm_head(params, cfg, hidden), cache, capture
