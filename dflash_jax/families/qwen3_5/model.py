"""The Qwen3.5 hybrid decoder (``Qwen3_5ForCausalLM``, text only; ``Qwen3NextForCausalLM``: the same
with a MoE MLP, :mod:`dflash_jax.nn.moe`) as pure functions.

The family contract (:class:`dflash_jax.families.contract.FamilyModel`, :data:`MODEL`): it declares
``param_specs``, ``forward_hidden``, its own cache and the two verify hooks below (recurrent state,
no trees); the rest is derived. Source: transformers ``modeling_qwen3_5.py``.

Per layer: ``h = rms(x; attn_norm)``; a token mixer; ``x += mixer(h)``; ``x += MLP(rms(x; mlp_norm))``
(SwiGLU; Qwen3-Next: the MoE, leaves ``router``, ``e_gate``/``e_up``/``e_down``, ``s_gate``/``s_up``/
``s_down``, ``s_router`` in place of ``w_gate``/``w_up``/``w_down``).

* ``full_attention``: ``q, gate = h Wq, h Wg`` (transformers' ``q_proj`` holds, per head, ``D``
  query rows then ``D`` gate rows: the loader splits them), ``k, v``; per-head q/k RMSNorm; RoPE
  on the first ``rope.partial`` of each head (the multimodal RoPE reduces to this for text);
  GQA attention over the KV cache; ``a *= sigmoid(gate)`` per element; ``@ Wo``.
* ``linear_attention`` (Gated DeltaNet, :mod:`dflash_jax.nn.gated_deltanet`): ``[q|k|v] = h
  [Wq|Wk|Wv]`` through a causal depthwise conv (K taps) and SiLU; q, k L2-normalised per head and
  repeated to the value heads, q scaled by ``dk ** -0.5``; ``beta = sigmoid(h Wb)``,
  ``g = -exp(A_log) softplus(h Wa + dt_bias)``; the gated delta rule; ``gated_rms(out; z = h Wz)``; ``@ Wo``.

Every RMSNorm but the gated one is ``x * (1 + w)`` in transformers (zero-initialised ``w``): the
loader stores ``1 + w``, so the params hold plain weights and :func:`~dflash_jax.nn.layer.rms_norm`
serves (in float32 identical; in bfloat16 ``1 + w`` is rounded once at load).

Parameter pytree (``[in, out]`` weights; ``"linear"`` / ``"full"`` leaves stacked over the
layers of that type in order, ``Ll`` / ``Lf`` rows; the layers run as one ``lax.scan`` over the
repetitions of the layer-type pattern, :func:`period`)::

    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "linear": {"attn_norm", "mlp_norm": [Ll, H], "wq", "wk": [Ll, H, Hk*dk], "wv", "wz": [Ll, H, Hv*dv],
                "wb", "wa": [Ll, H, Hv], "conv_q", "conv_k": [Ll, K, Hk*dk], "conv_v": [Ll, K, Hv*dv],
                "a_log", "dt_bias": [Ll, Hv], "gnorm": [Ll, dv], "wo": [Ll, Hv*dv, H], "w_gate", "w_up", "w_down"},
     "full": {"attn_norm", "mlp_norm", "wq", "wg": [Lf, H, Hq*D], "wk", "wv": [Lf, H, Hkv*D], "wo",
              "q_norm", "k_norm": [Lf, D], "w_gate", "w_up", "w_down"}}

Cache (:class:`HybridCache`): full layers a KV cache (slot = position, rollback free as for
dense targets); linear layers the conv state (last ``K - 1`` inputs) and the recurrent state
``[Hv, dk, dv]`` float32 *after the committed tokens*, which a rejected draft would corrupt.

Rollback design (the hybrid part): **keep the per-position states of the verified block**
(``cfg.rollback = "states"``, the default). A verify pass runs the recurrence token by token over
``[anchor, drafts]`` anyway, so the state after every position is at hand: :func:`keep_block_states`
marks the cache so that :func:`forward_hidden` leaves the committed states alone and stashes the
conv window and the recurrent state before and after each block position (``block_rec [Ll, B,
T + 1, Hv, dk, dv]``); after the accept rule :func:`commit_block_states` (called by the generic
commit with the tokens each row committed) keeps, per row, the state after its last committed
fed position, and drops the stash (it lives inside one jitted step, never in the carried cache).
Why not replay the accepted prefix through the model: that is a second target pass on the
critical path of every step, while keeping the states costs no computation. Its price is memory
during the verify: ``Ll * (T + 1) * Hv * dk * dv * 4`` bytes per row (transformers' default
``Qwen3_5TextConfig``, its "Qwen3.5-9B style": 24 linear layers of 32 value heads of 128 x 128;
block 16: about 3.4 GB per row), so ``cfg.rollback = "replay"`` offers the lean variant: stash each position's recurrence inputs ``[k | v | g | beta]``
(``(dk + dv + 2) / (dk dv)`` of that memory, 13 MB per row there) and rerun the recurrence alone
(no projection, convolution, attention or MLP) over each row's committed prefix from the state
before the block. Both are tested to give the same states as a plain prefill of the committed
tokens. Outside a verify (prefill chunks, plain decoding) the pass itself commits the state
after each row's last valid position (padding positions leave it unchanged). Tree verification
(``tree=N``) is refused: a tree of candidates would need one recurrent state per branch.
"""

from __future__ import annotations

import functools
from typing import Any
import jax
import jax.numpy as jnp
from jax import lax
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import KV_AXES, axes_field
from dflash_jax.runtime.carry import Capture, write_layer_rows
from dflash_jax.families.qwen3_5.config import Qwen3_5Config
from dflash_jax.errors import DFlashError
from dflash_jax.runtime import carry as captures
from dflash_jax.families.contract import FamilyModel
from dflash_jax.nn.params import ParamSpec, decoder_layer, stacked
from dflash_jax.nn import gated_deltanet as gdn
from dflash_jax.nn import quant
from dflash_jax.nn.attention import block_visible
from dflash_jax.nn.layer import embed
from dflash_jax.nn.layer import mlp_residual, project_qkv, split_heads
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn.moe import softmax_moe
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import inv_frequencies


Params = dict[str, Any]

LINEAR_STATE_AXES = ("layers", "batch", "q_heads", None, None)
CONV_AXES = ("layers", "batch", None, None)


# --------------------------------------------------------------------------------------------
# Parameters


def _mlp_specs(cfg: Qwen3_5Config, s: dict) -> dict:
    """``s`` with the MLP leaves: the SwiGLU's (from :func:`~dflash_jax.nn.params.decoder_layer`)
    or, for Qwen3-Next, the MoE's (:func:`dflash_jax.nn.moe.softmax_moe`)."""
    if not cfg.sparse:
        return s
    for name in ("w_gate", "w_up", "w_down"):
        del s[name]
    H, E, Im, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    s.update(router=ParamSpec((H, E), ("embed", "experts")), e_gate=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")),
             e_up=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")), e_down=ParamSpec((E, Im, H), ("experts", "expert_mlp", "embed")),
             s_gate=ParamSpec((H, Is), ("embed", "mlp")), s_up=ParamSpec((H, Is), ("embed", "mlp")),
             s_down=ParamSpec((Is, H), ("mlp", "embed")), s_router=ParamSpec((H, 1), ("embed", None)))
    return s


def _linear_specs(cfg: Qwen3_5Config) -> dict:
    """Specs of one Gated DeltaNet layer's leaves (no layer axis)."""
    H, K = cfg.hidden_size, cfg.linear_conv_kernel_dim
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd, hv = cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads
    s = _mlp_specs(cfg, decoder_layer(H, 1, 1, 1, cfg.intermediate_size))
    for name in ("wq", "wk", "wv", "wo"):
        del s[name]
    s.update(
        wq=ParamSpec((H, kd), ("embed", "q_heads")), wk=ParamSpec((H, kd), ("embed", "q_heads")),
        wv=ParamSpec((H, vd), ("embed", "q_heads")), wz=ParamSpec((H, vd), ("embed", "q_heads")),
        wb=ParamSpec((H, hv), ("embed", "q_heads")), wa=ParamSpec((H, hv), ("embed", "q_heads")),
        conv_q=ParamSpec((K, kd), (None, "q_heads")), conv_k=ParamSpec((K, kd), (None, "q_heads")),
        conv_v=ParamSpec((K, vd), (None, "q_heads")), a_log=ParamSpec((hv,), ("q_heads",)),
        dt_bias=ParamSpec((hv,), ("q_heads",)), gnorm=ParamSpec((cfg.linear_value_head_dim,), ("head_dim",), "norm"),
        wo=ParamSpec((vd, H), ("q_heads", "embed")),
    )
    return s


def _full_specs(cfg: Qwen3_5Config) -> dict:
    """Specs of one full-attention layer's leaves (no layer axis): the shared decoder layer with
    q/k norms and a per-element output gate ``wg`` split over heads like ``wq``."""
    H, nh, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    s = _mlp_specs(cfg, decoder_layer(H, nh, cfg.num_key_value_heads, D, cfg.intermediate_size, qk_norm=True))
    s["wg"] = ParamSpec((H, nh * D), ("embed", "q_heads"))
    return s


def param_specs(cfg: Qwen3_5Config) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` (shape, logical axes, initialiser) of every
    parameter leaf, as a pytree shaped like the params (module docstring); heads over ``"q_heads"``
    / ``"kv_heads"`` (the ``"model"`` mesh axis by default)."""
    H = cfg.hidden_size
    specs: dict = {"embed": ParamSpec((cfg.vocab_size, H), ("vocab", "embed")), "norm": ParamSpec((H,), ("embed",), "norm"),
                   "linear": stacked(len(cfg.linear_layers), _linear_specs(cfg)),
                   "full": stacked(len(cfg.full_layers), _full_specs(cfg))}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((H, cfg.vocab_size), ("embed", "vocab"))
    return specs


# --------------------------------------------------------------------------------------------
# Cache


@pytree.dataclass
class HybridCache:
    """Target cache of a Qwen3.5 hybrid.

    Attributes:
      k, v: ``[Lf, B, S, Hkv, D]`` full-attention layers (slot = absolute position).
      conv: ``[Ll, B, K - 1, C]`` the last ``K - 1`` convolution inputs of the committed tokens
        (cfg dtype; ``C`` = :attr:`~dflash_jax.families.qwen3_5.config.Qwen3_5Config.conv_dim`).
      rec: ``[Ll, B, Hv, dk, dv]`` float32 recurrent state after the committed tokens.
      block_conv: during a verify only, ``[Ll, B, K - 1 + T, C]``: the conv window of the block.
      block_rec: during a verify under ``cfg.rollback == "states"``, ``[Ll, B, T + 1, Hv, dk, dv]``
        float32: the recurrent state before the block (index 0) and after each of its ``T`` positions.
      block_inputs: during a verify under ``cfg.rollback == "replay"``, ``[Ll, B, T, Hv, dk + dv + 2]``
        float32: each position's recurrence inputs ``[k | v | g | beta]`` (the state before the
        block is ``rec``, unchanged by the pass).
      keep_block: static; :func:`forward_hidden` fills ``block_conv`` and ``block_rec`` or ``block_inputs`` (set by
        :func:`keep_block_states`, cleared by :func:`commit_block_states`).
    """

    k: jnp.ndarray = axes_field(*KV_AXES)
    v: jnp.ndarray = axes_field(*KV_AXES)
    conv: jnp.ndarray = axes_field(*CONV_AXES)
    rec: jnp.ndarray = axes_field(*LINEAR_STATE_AXES)
    block_conv: Any = axes_field(*CONV_AXES, default=None)
    block_rec: Any = axes_field("layers", "batch", None, "q_heads", None, None, default=None)
    block_inputs: Any = axes_field("layers", "batch", None, "q_heads", None, default=None)
    keep_block: bool = pytree.field(pytree_node=False, default=False)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: Qwen3_5Config, batch: int, capacity: int) -> HybridCache:
    """An empty cache: ``capacity`` KV slots per full layer, zero conv and recurrent states
    (transformers starts from zeros too)."""
    lf, ll = len(cfg.full_layers), len(cfg.linear_layers)
    kv = (lf, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
    return HybridCache(
        k=jnp.zeros(kv, cfg.dtype), v=jnp.zeros(kv, cfg.dtype),
        conv=jnp.zeros((ll, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), cfg.dtype),
        rec=jnp.zeros((ll, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32),
    )


def keep_block_states(cfg: Qwen3_5Config, cache: HybridCache) -> HybridCache:
    """The cache marked so that the next :func:`forward_hidden` (a verify pass) keeps the states
    before and after each block position for :func:`commit_block_states` (module docstring)."""
    return cache.replace(keep_block=True)


def commit_block_states(cfg: Qwen3_5Config, cache: HybridCache, kept: jnp.ndarray) -> HybridCache:
    """After a verify pass made with :func:`keep_block_states`: the linear layers' states after
    the first ``kept[b]`` block positions of each row (``[B]`` int32 in ``[0, T]``: the anchor and
    the accepted drafts that were committed; 0 keeps the state before the block), the stash dropped.

    Returns:
      The :class:`HybridCache` as it is between steps (``keep_block`` false, no stash); a cache
      without a stash is returned unchanged.
    """
    if not cache.keep_block:
        return cache
    taps = cfg.linear_conv_kernel_dim
    conv = jax.vmap(lambda w: gdn.conv_state_after(w, kept, taps))(cache.block_conv)
    if cache.block_rec is not None:  # "states": pick
        rec = cache.block_rec[:, jnp.arange(kept.shape[0]), kept]
    else:  # "replay": the recurrence alone over each row's first kept positions, from the state before the block
        rec = jax.vmap(lambda r, x: _replay(cfg, r, x, kept))(cache.rec, cache.block_inputs)
    return cache.replace(conv=conv.astype(cache.conv.dtype), rec=rec, block_conv=None, block_rec=None, block_inputs=None,
                         keep_block=False)


def _replay(cfg: Qwen3_5Config, rec, inputs, kept):
    """One layer's recurrent state ``[B, Hv, dk, dv]`` after the first ``kept[b]`` positions of
    the stashed ``inputs [B, T, Hv, dk + dv + 2]`` (``[k | v | g | beta]``), from ``rec``."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    k, v, g, beta = jnp.split(inputs, [dk, dk + dv, dk + dv + 1], axis=-1)
    valid = jnp.arange(inputs.shape[1], dtype=jnp.int32)[None, :] < kept[:, None]
    return gdn.gated_delta_scan(k, k, v, g[..., 0], beta[..., 0], rec, valid)[1]


# --------------------------------------------------------------------------------------------
# Layers


def _linear_mixer(cfg: Qwen3_5Config, lp: dict, h, conv_state, rec_state, valid, keep: str):
    """One Gated DeltaNet token mixer on the normed input ``h [B, T, H]`` from the layer's
    ``conv_state [B, K-1, C]`` and ``rec_state [B, Hv, dk, dv]``.

    ``keep``: ``"states"`` also returns the state after each position, ``"replay"`` the recurrence
    inputs ``[k | v | g | beta]`` of each position, ``""`` neither (the 4th value is then None).
    Returns ``(out [B, T, H], conv window [B, K-1+T, C], final state, states [T, B, ...] / inputs [B, T, ...] / None)``.
    """
    b, t, _ = h.shape
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    mixed = jnp.concatenate([quant.dot(h, lp["wq"]), quant.dot(h, lp["wk"]), quant.dot(h, lp["wv"])], axis=-1)
    window = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)
    conv = gdn.causal_conv(window, jnp.concatenate([lp["conv_q"], lp["conv_k"], lp["conv_v"]], axis=-1)).astype(h.dtype)
    q, k, v = jnp.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
    rep = hv // hk
    q = jnp.repeat(gdn.l2_normalize(split_heads(q, hk, dk)), rep, axis=2) * (dk ** -0.5)
    k = jnp.repeat(gdn.l2_normalize(split_heads(k, hk, dk)), rep, axis=2)
    beta = jax.nn.sigmoid(quant.dot(h, lp["wb"]).astype(jnp.float32))
    g = -jnp.exp(lp["a_log"].astype(jnp.float32)) * jax.nn.softplus(quant.dot(h, lp["wa"]).astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
    v = split_heads(v, hv, dv).astype(jnp.float32)
    if keep or t == 1:  # decode and verify: token by token (a verify keeps what each position leaves)
        out, final, states = gdn.gated_delta_scan(q, k, v, g, beta, rec_state, valid, keep == "states")
    else:  # prefill chunks: the chunked form
        out, final, states = gdn.gated_delta_chunked(q, k, v, g, beta, rec_state, valid)
    if keep == "replay":
        states = jnp.concatenate([k, v, g[..., None], beta[..., None]], axis=-1)
    z = split_heads(quant.dot(h, lp["wz"]), hv, dv)
    out = gdn.gated_rms_norm(out, lp["gnorm"], z, cfg.rms_norm_eps).reshape(b, t, hv * dv)
    return quant.dot(out, lp["wo"]), window, final, states


def _attention_mixer(cfg: Qwen3_5Config, lp: dict, h, k_all, v_all, j: int, positions, inv_freq, n_keys, visible):
    """One gated full-attention mixer on ``h [B, T, H]``; writes its K/V rows into row ``j`` of
    the stacked cache. Returns ``(out [B, T, H], k_all, v_all)``."""
    b, t, _ = h.shape
    nh, D = cfg.num_attention_heads, cfg.head_dim
    q, k, v = project_qkv(lp, h, nh, cfg.num_key_value_heads, D, positions, inv_freq, cfg.rms_norm_eps, qk_norm=True)
    k_all, v_all = write_layer_rows(k_all, j, k, positions), write_layer_rows(v_all, j, v, positions)
    a = cache_attention(q, k_all, v_all, j, n_keys, visible).reshape(b, t, nh * D)
    gate = jax.nn.sigmoid(quant.dot(h, lp["wg"]).astype(jnp.float32)).astype(a.dtype)
    return quant.dot(a * gate, lp["wo"]), k_all, v_all


def _mlp_residual(cfg: Qwen3_5Config, lp: dict, x):
    """``x + MLP(rms(x; mlp_norm))``: the SwiGLU, or the MoE of Qwen3-Next."""
    if not cfg.sparse:
        return mlp_residual(lp, x, cfg.rms_norm_eps)
    return x + softmax_moe(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), cfg.num_experts_per_tok, cfg.norm_topk_prob)


def _layer_params(stack: dict, j: int) -> dict:
    return jax.tree_util.tree_map(lambda a: a[j], stack)


def forward_hidden(
    params: Params,
    cfg: Qwen3_5Config,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: HybridCache,
    capture: Capture | None = None,
    tree=None,
) -> tuple[jnp.ndarray, HybridCache, Capture | None]:
    """Runs the decoder stack; returns the final-normed hidden states ``[B, T, H]``.

    Args:
      params: parameter pytree (module docstring).
      cfg: static :class:`~dflash_jax.families.qwen3_5.config.Qwen3_5Config`.
      tokens: ``[B, T]`` int32.
      positions: ``[B, T]`` int32 absolute positions, contiguous per row from the row's committed
        length - 1 (the first token not yet fed); trailing entries ``>= capacity`` are padding:
        not written, not seen, and they leave the linear states unchanged.
      cache: :class:`HybridCache`. Without ``keep_block`` the linear states advance over every
        valid position; with it they stay and the per-position states are stashed (verify).
      capture: optional :class:`~dflash_jax.runtime.carry.Capture` of the listed layers' residuals.
      tree: must be ``None``.
    Returns:
      ``(hidden [B, T, H] in cfg.dtype, cache, capture)``.
    Raises:
      DFlashError: a ``tree`` block (tree verification is not supported for hybrid targets), or a
        capture layer id outside the target.
    Source: transformers ``Qwen3_5TextModel.forward`` / ``Qwen3_5DecoderLayer``.
    """
    if tree is not None:
        raise DFlashError("tree (--tree)", "tree verification with a Qwen3.5 hybrid target",
                          "a chain (tree=None): Gated DeltaNet states follow one sequence")
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    positions = positions.astype(jnp.int32)
    valid = positions < cache.capacity
    n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
    inv_freq = inv_frequencies(cfg.rope, cfg.head_dim)
    n_keys, visible = live_keys(positions, cache.capacity), block_visible(positions, None)
    x = embed(params, cfg, tokens).astype(cfg.dtype)
    cap = captures.stack(capture, x)
    p = period(cfg)
    reps, pattern, keep = n_layers // p, cfg.layer_types[:p], cfg.rollback if cache.keep_block else ""
    n_lin, n_full = pattern.count("linear_attention"), pattern.count("full_attention")

    def split(tree, m):  # [L_type, ...] -> [reps, m, ...]: the layers of each repetition of the pattern
        return jax.tree_util.tree_map(lambda t: t.reshape((reps, m) + t.shape[1:]), tree)

    def body(carry, xs):  # one repetition of the pattern, unrolled; K/V ride in the carry (rows scattered in place)
        x, cap, k_all, v_all = carry
        lin_p, full_p, conv, rec, slots, g = xs
        ys, ja, jf = [], 0, 0
        for k, kind in enumerate(pattern):
            if kind == "full_attention":
                lp = _layer_params(full_p, jf)
                out, k_all, v_all = _attention_mixer(cfg, lp, rms_norm(x, lp["attn_norm"], eps), k_all, v_all, g * n_full + jf,
                                                     positions, inv_freq, n_keys, visible)
                jf += 1
            else:
                lp = _layer_params(lin_p, ja)
                out, window, final, states = _linear_mixer(cfg, lp, rms_norm(x, lp["attn_norm"], eps), conv[ja], rec[ja], valid, keep)
                ys.append(_layer_states(cfg, keep, rec[ja], window, final, states, n_valid))
                ja += 1
            x = _mlp_residual(cfg, lp, x + out)
            cap = captures.keep(capture, cap, x, slots[k])
        return (x, cap, k_all, v_all), tuple(jnp.stack(z) for z in zip(*ys))

    xs = (split(params["linear"], n_lin), split(params["full"], n_full), split(cache.conv, n_lin), split(cache.rec, n_lin),
          jnp.asarray(captures.slots(capture, n_layers).reshape(reps, p)), jnp.arange(reps, dtype=jnp.int32))
    (x, cap, k_all, v_all), ys = lax.scan(body, (x, cap, cache.k, cache.v), xs)
    cache = _updated(cache.replace(k=k_all, v=v_all), tuple(y.reshape((-1,) + y.shape[2:]) for y in ys), keep)
    final_norm = functools.partial(rms_norm, weight=params["norm"], eps=eps)
    capture = captures.write(capture, cap, positions, n_layers, final_norm, valid=valid)
    return final_norm(x), cache, capture


def period(cfg: Qwen3_5Config) -> int:
    """The shortest ``p`` dividing the layer count with ``layer_types[i] == layer_types[i % p]``
    (Qwen3.5 and Qwen3-Next: 4, three linear layers then a full one; the layer count when the
    types do not repeat). :func:`forward_hidden` runs one ``lax.scan`` over the repetitions with
    the ``p`` layers unrolled in its body (one compiled body instead of one per layer: a third of
    the unrolled 32 layers' compile time on XLA:CPU, ``tools/bench_compile_qwen3_5.py`` at commit 9868b87, BENCHMARKS.md)."""
    n, t = cfg.num_hidden_layers, cfg.layer_types
    return next(p for p in range(1, n + 1) if n % p == 0 and all(t[i] == t[i % p] for i in range(n)))


def _layer_states(cfg: Qwen3_5Config, keep: str, rec, window, final, states, n_valid) -> tuple:
    """What a linear layer's pass leaves: without ``keep`` its new conv and recurrent states
    (after each row's last valid position); with it the conv window and the stash (``"states"``:
    the state before the block then after each position, ``[T + 1, B, ...]``; ``"replay"``: the
    recurrence inputs ``[B, T, ...]``)."""
    if not keep:
        return gdn.conv_state_after(window, n_valid, cfg.linear_conv_kernel_dim), final
    return window, jnp.concatenate([rec[None], states], axis=0) if keep == "states" else states


def _updated(cache: HybridCache, ys: tuple, keep: str) -> HybridCache:
    """The cache after a pass from the layers' :func:`_layer_states` (stacked over the linear
    layers): new conv and recurrent states, or (keeping block states) the committed ones
    unchanged and the stash (``block_rec`` moved to ``[Ll, B, T + 1, ...]``, or ``block_inputs``)."""
    if not ys:  # no linear layer: nothing to advance or roll back
        return cache.replace(keep_block=False)
    if not keep:
        return cache.replace(conv=ys[0].astype(cache.conv.dtype), rec=ys[1])
    cache = cache.replace(block_conv=ys[0].astype(cache.conv.dtype))
    if keep == "replay":  # [Ll, B, T, Hv, dk + dv + 2]
        return cache.replace(block_inputs=ys[1])
    return cache.replace(block_rec=jnp.moveaxis(ys[1], 1, 2))  # [Ll, T + 1, B, ...] -> [Ll, B, T + 1, ...]


MODEL = FamilyModel(name="qwen3_5", module=__name__, param_specs=param_specs, forward_hidden=forward_hidden, init_cache=init_cache,
                    keep_block_states=keep_block_states, commit_block_states=commit_block_states, trees=False,
                    recurrent_state=True)
