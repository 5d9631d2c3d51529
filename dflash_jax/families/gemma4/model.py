"""The Gemma 4 text decoder (``Gemma4ForCausalLM``, ``model_type`` ``gemma4_text``) as pure functions.

The family contract (:class:`dflash_jax.families.contract.FamilyModel`, :data:`MODEL`: it declares
``param_specs``, ``forward_hidden``, its own cache, ``embed`` and ``lm_head``; the rest is derived). Per layer (transformers
``modeling_gemma4.py`` ``Gemma4TextDecoderLayer`` / ``Gemma4TextAttention``; every RMSNorm is
``w * x / sqrt(mean(x^2) + eps)``, the plain weight, not ``1 + w``)::

    h = rms(x; attn_norm); q = rms(h Wq; q_norm), k = rms(h Wk; k_norm), v = rms(h Wv) (no weight)
    per head (``attention_k_eq_v``: v = rms(h Wk) on full layers, which have no Wv); RoPE of the
    layer type on q, k; GQA causal attention, scale 1 (not D^-1/2); sliding layers see keys less
    than sliding_window positions back; x += rms(a Wo; post_attn_norm)
    h = rms(x; mlp_norm); m = down(gelu_tanh(h Wg) * h Wu)
    with the MoE block: m = rms(m; post_mlp_norm_1) + rms(moe(x); post_moe_norm) (:func:`moe`)
    x += rms(m; post_mlp_norm)
    with per-layer inputs: x += rms((gelu_tanh(x Wpg) * pli[layer]) Wpo; post_pl_norm)
    x *= scalar (the layer's ``layer_scalar``)

Sliding and full layers have their own head size, key/value head count and RoPE
(:class:`~dflash_jax.families.gemma4.config.Gemma4Config`); ``proportional`` RoPE rotates the first
``partial_rotary_factor`` of the frequency pairs over the whole head (the others have frequency 0).
The embedding is scaled by ``sqrt(H)`` (in the parameter dtype) in :func:`embed`; the logits are
soft-capped ``c * tanh(l / c)`` (``final_logit_softcapping``) in :func:`lm_head`; the drafters
reach both through the family. Per-layer inputs (``hidden_size_per_layer_input`` = P > 0,
``Gemma4TextModel.get_per_layer_inputs`` / ``project_per_layer_inputs``)::

    pli = (rms((e Wpl) / sqrt(H); pl_norm) + embed_pl[token] * sqrt(P)) / sqrt(2), per layer [P]

with ``e`` the scaled embedding.

Covered: the above (sliding/full mix, per-type head sizes and RoPE, q/k/v norms, sandwich norms,
layer scalars, per-layer inputs, KV sharing (``num_kv_shared_layers``: the last layers attend the
keys and values of the last earlier layer of their type, and have no ``wk``/``wv``/``k_norm``),
double-wide MLPs on those layers, ``attention_k_eq_v``, the MoE block (``enable_moe_block``: Gemma
4 26B-A4B), final-logit soft-cap, tied or untied head). Refused by the config parser
(:func:`~dflash_jax.families.gemma4.config.gemma4_config_from_hf`): bidirectional attention, attention
biases, attention-logit soft-capping.

Layers are held one per key (``"layer{i}"``, no layer axis: sliding and full layers differ in
shape) and run as an unrolled Python loop. Parameter pytree (``[in, out]`` weights)::

    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "embed_pl": [Vp, L*P], "pl_proj": [H, L*P], "pl_norm": [P] (with per-layer inputs),
     "layer{i}": {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "w_gate",
                  "w_up", "w_down" (:func:`dflash_jax.nn.params.decoder_layer`), "post_attn_norm",
                  "post_mlp_norm": [H], "scalar": [1]; "pl_gate": [H, P], "pl_out": [P, H],
                  "post_pl_norm": [H] with per-layer inputs; with the MoE block "router": [H, E],
                  "router_scale": [H], "expert_scale": [E], "e_gate"/"e_up": [E, H, Im],
                  "e_down": [E, Im, H] (experts over the "experts" logical axis), "post_mlp_norm_1",
                  "pre_moe_norm", "post_moe_norm": [H]}}

The cache (:class:`Gemma4Cache`) holds one dense KV stack per layer type, a row per layer that
computes keys and values (every position kept; a sliding layer masks the keys outside its window).
"""

from __future__ import annotations

from typing import Any
import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import KV_AXES, axes_field
from dflash_jax.runtime.carry import Capture, move_slots, write_layer_rows
from dflash_jax.families.gemma4.config import Gemma4Config
from dflash_jax.errors import DFlashError
from dflash_jax.runtime import carry as captures
from dflash_jax.families.contract import FamilyModel
from dflash_jax.nn.params import ParamSpec, decoder_layer
from dflash_jax.nn import layer as embedding
from dflash_jax.nn.attention import TreeBlock, block_visible, rope_positions, windowed
from dflash_jax.nn.layer import split_heads
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn import quant
from dflash_jax.nn.moe import routed_experts, softmax_top_k
from dflash_jax.nn.layer import apply_rope


Params = dict[str, Any]


@pytree.dataclass
class Gemma4Cache:
    """Target cache of a Gemma 4 model: ``k[j], v[j]`` ``[Lj, B, S, Hkv_j, D_j]`` for layer type
    ``j`` (0 sliding, 1 full; slot = absolute position)."""

    k_sliding: jnp.ndarray = axes_field(*KV_AXES)
    v_sliding: jnp.ndarray = axes_field(*KV_AXES)
    k_full: jnp.ndarray = axes_field(*KV_AXES)
    v_full: jnp.ndarray = axes_field(*KV_AXES)

    @property
    def capacity(self) -> int:
        return self.k_full.shape[2]


def _layer_specs(cfg: Gemma4Config, i: int) -> dict:
    H, kind = cfg.hidden_size, cfg.kind(i)
    s = decoder_layer(H, cfg.num_attention_heads, cfg.kv_heads[kind], cfg.head_dims[kind], cfg.mlp_size(i), qk_norm=True)
    if cfg.shares_kv(i):  # keys and values of an earlier layer: no projections of its own
        del s["wk"], s["wv"], s["k_norm"]
    elif cfg.k_eq_v(i):  # values from the key projection
        del s["wv"]
    s.update(post_attn_norm=ParamSpec((H,), ("embed",), "norm"), post_mlp_norm=ParamSpec((H,), ("embed",), "norm"),
             scalar=ParamSpec((1,), (None,), "norm"))
    if cfg.per_layer_input:
        Pl = cfg.per_layer_input
        s.update(pl_gate=ParamSpec((H, Pl), ("embed", None)), pl_out=ParamSpec((Pl, H), (None, "embed")),
                 post_pl_norm=ParamSpec((H,), ("embed",), "norm"))
    if cfg.num_experts:
        E, Im, norm = cfg.num_experts, cfg.moe_intermediate_size, ParamSpec((H,), ("embed",), "norm")
        s.update(router=ParamSpec((H, E), ("embed", "experts")), router_scale=norm, expert_scale=ParamSpec((E,), (None,), "norm"),
                 e_gate=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")),
                 e_up=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")),
                 e_down=ParamSpec((E, Im, H), ("experts", "expert_mlp", "embed")),
                 post_mlp_norm_1=norm, pre_moe_norm=norm, post_moe_norm=norm)
    return s


def param_specs(cfg: Gemma4Config) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` of every parameter leaf (module docstring)."""
    H, n = cfg.hidden_size, cfg.num_hidden_layers
    specs: dict = {"embed": ParamSpec((cfg.vocab_size, H), ("vocab", "embed")), "norm": ParamSpec((H,), ("embed",), "norm")}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((H, cfg.vocab_size), ("embed", "vocab"))
    if cfg.per_layer_input:
        Pl = cfg.per_layer_input
        specs.update(embed_pl=ParamSpec((cfg.per_layer_vocab, n * Pl), ("vocab", None)),
                     pl_proj=ParamSpec((H, n * Pl), ("embed", None)), pl_norm=ParamSpec((Pl,), (None,), "norm"))
    for i in range(n):
        specs[f"layer{i}"] = _layer_specs(cfg, i)
    return specs


def init_cache(cfg: Gemma4Config, batch: int, capacity: int) -> Gemma4Cache:
    """An empty :class:`Gemma4Cache` of ``capacity`` slots per row and layer."""
    shapes = [(cfg.count(j), batch, capacity, cfg.kv_heads[j], cfg.head_dims[j]) for j in (0, 1)]
    z = [jnp.zeros(s, cfg.dtype) for s in shapes]
    return Gemma4Cache(k_sliding=z[0], v_sliding=jnp.zeros_like(z[0]), k_full=z[1], v_full=jnp.zeros_like(z[1]))


def move_rows(cfg: Gemma4Config, cache: Gemma4Cache, src: jnp.ndarray, dst: jnp.ndarray) -> Gemma4Cache:
    """The cache with the K/V of slot ``src[b, w]`` copied to ``dst[b, w]`` in every layer
    (``[B, W]`` int32; :func:`~dflash_jax.runtime.carry.move_slots`)."""
    return Gemma4Cache(*(move_slots(a, src, dst) for a in (cache.k_sliding, cache.v_sliding, cache.k_full, cache.v_full)))


def embed(params: Params, cfg: Gemma4Config, tokens: jnp.ndarray) -> jnp.ndarray:
    """``[B, T]`` int32 -> ``[B, T, H]``: embedding rows times ``sqrt(H)`` rounded to the
    parameter dtype (transformers ``Gemma4TextScaledWordEmbedding``)."""
    e = params["embed"]
    return quant.take_rows(e, tokens) * jnp.asarray(cfg.hidden_size ** 0.5, e.dtype)


def lm_head(params: Params, cfg: Gemma4Config, hidden: jnp.ndarray) -> jnp.ndarray:
    """Final-normed hidden ``[..., H]`` -> float32 logits ``[..., V]`` (tied or untied head),
    soft-capped ``c * tanh(l / c)`` when ``final_logit_softcapping`` = c > 0 (transformers
    ``Gemma4ForCausalLM.forward``)."""
    logits = embedding.lm_head(params, cfg, hidden)
    c = cfg.final_logit_softcapping
    return jnp.tanh(logits / c) * c if c > 0 else logits


def inv_freq(cfg: Gemma4Config, kind: int) -> np.ndarray:
    """``[D/2]`` inverse frequencies of layer type ``kind`` (``default``: ``theta^(-2i/D)``;
    ``proportional``: the first ``int(partial * D / 2)`` of those, then zeros; both divided by
    ``factor``). Source: transformers ``_compute_proportional_rope_parameters``."""
    _, theta, partial, factor = cfg.ropes[kind]
    d = cfg.head_dims[kind]
    n_rot = int(partial * d // 2)
    inv = np.zeros(d // 2, np.float64)
    inv[:n_rot] = 1.0 / theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float64) / d)
    return (inv / factor).astype(np.float32)


def per_layer_inputs(params: Params, cfg: Gemma4Config, tokens: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
    """``[B, T, L, P]`` per-layer inputs of ``tokens [B, T]`` and their scaled embedding ``x``
    (module docstring). Source: transformers ``Gemma4TextModel.get_per_layer_inputs`` and
    ``project_per_layer_inputs``."""
    b, t = tokens.shape
    Pl, n = cfg.per_layer_input, cfg.num_hidden_layers
    e = params["embed_pl"]
    tok = (quant.take_rows(e, tokens) * jnp.asarray(Pl ** 0.5, e.dtype)).reshape(b, t, n, Pl)
    proj = _scaled(quant.dot(x, params["pl_proj"]), cfg.hidden_size ** -0.5)
    proj = rms(proj.reshape(b, t, n, Pl), params["pl_norm"], cfg.rms_norm_eps)
    return _scaled(proj + tok.astype(x.dtype), 2.0 ** -0.5)


def rms(x: jnp.ndarray, weight: jnp.ndarray | None, eps: float) -> jnp.ndarray:
    """Gemma 4's RMSNorm of the last axis of ``x [..., D]``: ``x * (mean(x^2) + eps)^-1/2`` times
    ``weight [D]`` (none: ``v_norm``), all in float32, cast to ``x.dtype`` at the end (transformers
    ``Gemma4RMSNorm``: the weight multiplies before the cast, unlike Llama's)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(jnp.float32)).astype(x.dtype)


def _scaled(x: jnp.ndarray, factor: float) -> jnp.ndarray:
    """``x * factor`` computed in float32 (a Python scalar times a tensor in torch), cast back."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def _gelu_glu(g: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    return jax.nn.gelu(g, approximate=True) * u


def moe(cfg: Gemma4Config, lp: dict, x: jnp.ndarray) -> jnp.ndarray:
    """The routed experts of a layer on its post-attention residual ``x [B, T, H]`` -> ``[B, T, H]``
    in ``x.dtype`` (before ``post_moe_norm``)::

        r = rms(x) * router_scale / sqrt(H); p = softmax(r Wr) (float32); top k of p renormalised
        to sum 1, times expert_scale[chosen]; experts on rms(x; pre_moe_norm):
        down(gelu_tanh(h Wg) * h Wu) (:func:`dflash_jax.nn.moe.routed_experts`)

    Source: transformers ``Gemma4TextRouter`` / ``Gemma4TextExperts`` / ``Gemma4TextDecoderLayer``.
    """
    shape, eps = x.shape, cfg.rms_norm_eps
    x = x.reshape(-1, shape[-1])
    r = _scaled(rms(x, None, eps) * lp["router_scale"].astype(x.dtype), cfg.hidden_size ** -0.5)
    w, idx = softmax_top_k(quant.dot(r, lp["router"]), cfg.top_k_experts, True)
    w = w * jnp.take(lp["expert_scale"], idx).astype(jnp.float32)
    h = rms(x, lp["pre_moe_norm"], eps)
    return routed_experts(h, idx, w.astype(x.dtype), lp["e_gate"], lp["e_up"], lp["e_down"], act=_gelu_glu).reshape(shape)


def _layer(cfg: Gemma4Config, i: int, lp: dict, x, kv: list, pli, positions, rope_pos, visible, n_keys):
    """Decoder layer ``i`` on ``x [B, T, H]`` (module docstring); writes its K/V rows into
    ``kv[kind]`` (``[k, v]`` stacks of its type) and attends them. Returns ``x``."""
    eps, kind, row = cfg.rms_norm_eps, cfg.kind(i), cfg.kv_row(i)
    d, hq, hkv = cfg.head_dims[kind], cfg.num_attention_heads, cfg.kv_heads[kind]
    freqs = inv_freq(cfg, kind)
    h = rms(x, lp["attn_norm"], eps)
    q = apply_rope(rms(split_heads(quant.dot(h, lp["wq"]), hq, d), lp["q_norm"], eps), rope_pos, freqs)
    if not cfg.shares_kv(i):  # a KV-sharing layer attends the rows its type's last computing layer wrote
        k = split_heads(quant.dot(h, lp["wk"]), hkv, d)
        v = rms(k if cfg.k_eq_v(i) else split_heads(quant.dot(h, lp["wv"]), hkv, d), None, eps)  # k_eq_v: the raw keys
        k = apply_rope(rms(k, lp["k_norm"], eps), rope_pos, freqs)
        kv[kind] = [write_layer_rows(kv[kind][0], row, k, positions), write_layer_rows(kv[kind][1], row, v, positions)]
    k_all, v_all = kv[kind]
    q = _scaled(q, d ** 0.5)  # cache_attention scales by D^-1/2; Gemma 4's scale is 1
    a = cache_attention(q, k_all, v_all, row, n_keys, visible[kind])
    b, t = x.shape[:2]
    x = x + rms(quant.dot(a.reshape(b, t, hq * d), lp["wo"]), lp["post_attn_norm"], eps)
    h = rms(x, lp["mlp_norm"], eps)
    m = quant.dot(jax.nn.gelu(quant.dot(h, lp["w_gate"]), approximate=True) * quant.dot(h, lp["w_up"]), lp["w_down"])
    if cfg.num_experts:  # the dense MLP and the routed experts side by side, each with its own norms
        m = rms(m, lp["post_mlp_norm_1"], eps) + rms(moe(cfg, lp, x), lp["post_moe_norm"], eps)
    x = x + rms(m, lp["post_mlp_norm"], eps)
    if cfg.per_layer_input:
        g = jax.nn.gelu(quant.dot(x, lp["pl_gate"]), approximate=True) * pli[:, :, i]
        x = x + rms(quant.dot(g, lp["pl_out"]), lp["post_pl_norm"], eps)
    return x * lp["scalar"].astype(x.dtype)


def forward_hidden(
    params: Params,
    cfg: Gemma4Config,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: Gemma4Cache,
    capture: Capture | None = None,
    tree: TreeBlock | None = None,
) -> tuple[jnp.ndarray, Gemma4Cache, Capture | None]:
    """Runs the decoder stack; returns ``(final-normed hidden [B, T, H] in cfg.dtype, cache, capture)``.

    Same contract as :attr:`dflash_jax.families.contract.FamilyModel.forward_hidden` (``tokens``/``positions``
    ``[B, T]`` int32, K/V of token ``t`` written to slot ``positions[b, t]``, capture of listed
    layers' output residuals, ``tree`` verification).
    Raises :class:`~dflash_jax.errors.DFlashError` for a capture layer id outside the target, or
    a tree of more tokens than the sliding window. Source: transformers ``Gemma4TextModel.forward``.
    """
    n_layers = cfg.num_hidden_layers
    positions = positions.astype(jnp.int32)
    n_keys = live_keys(positions, cache.capacity)
    rope_pos, full = rope_positions(positions, tree), block_visible(positions, tree)
    if tree is not None and tree.mask.shape[-1] > cfg.sliding_window:
        raise DFlashError("tree", f"{tree.mask.shape[-1]} tokens in one verify pass", f"at most sliding_window={cfg.sliding_window}")
    visible = (windowed(full, positions, rope_pos, cfg.sliding_window, tree), full)
    x = embed(params, cfg, tokens).astype(cfg.dtype)
    pli = per_layer_inputs(params, cfg, tokens, x) if cfg.per_layer_input else None
    slot_of = captures.slots(capture, n_layers)
    cap = captures.stack(capture, x)
    kv = [[cache.k_sliding, cache.v_sliding], [cache.k_full, cache.v_full]]
    for i in range(n_layers):
        x = _layer(cfg, i, params[f"layer{i}"], x, kv, pli, positions, rope_pos, visible, n_keys)
        cap = captures.keep(capture, cap, x, int(slot_of[i]))
    final_norm = lambda y: rms(y, params["norm"], cfg.rms_norm_eps)  # noqa: E731
    capture = captures.write(capture, cap, positions, n_layers, final_norm)
    return final_norm(x), Gemma4Cache(kv[0][0], kv[0][1], kv[1][0], kv[1][1]), capture


MODEL = FamilyModel(name="gemma4", module=__name__, param_specs=param_specs, forward_hidden=forward_hidden, embed=embed,
                    lm_head=lm_head, init_cache=init_cache, move_rows=move_rows, trees=True)
