"""An independent NumPy oracle for the Laguna DFlash drafter (``DFlashLagunaForCausalLM``).

The oracle below is written directly from ``docs/specs/laguna.md`` section 6.4 (vLLM
``laguna_dflash.py`` semantics) and works on checkpoint-layout weights (``[out, in]``, packed
``qkv_proj`` rows ``q | k | v``, ``aux_hidden_norms.j``), in float64, without calling any
``dflash_jax`` function. It checks :func:`dflash_jax.drafter.model.context_kv`, ``forward`` and
``logits`` on tiny configs with a per-head (and a per-element) gate, a causal block, a sliding
window shorter than the context, three captured layers and a batch whose rows have different
context lengths (garbage in the unused context slots must not leak).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter.model import drafter_config_from_hf
from dflash_jax.drafter import model as drafter
from dflash_jax.families.registry import module_for
from laguna_tiny import LAGUNA_DRAFTER, PER_HEAD, tiny_laguna

TOL = 1e-4  # max|delta| / max|ref|


# ------------------------------------------------------------------------------------ the oracle


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """NeoX rotate-half over the full head dim. x: [T, heads, d]; pos: [T]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
    half = d // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def softplus(x):
    return np.logaddexp(0.0, x)


def silu(x):
    return x / (1.0 + np.exp(-x))


def oracle(sd, hp, features, ctx_pos, block_tokens, p, embed, lm_head_w):
    """One draft block of one sequence, spec 6.4 (b)-(e).

    Args:
      sd: checkpoint-layout weights (names as the published drafter safetensors, float64).
      hp: dict of hyperparameters (H, nh, nkv, d, eps, theta, window, gate, n_aux, layers).
      features: ``[T, n_aux*H]`` captured target residuals, slices in target_layer_ids order.
      ctx_pos: ``[T]`` absolute positions of those context tokens.
      block_tokens: ``[B]`` ``[anchor, MASK, ...]``; ``p`` the anchor's position.
      embed: target ``[V, H]``; lm_head_w: target ``lm_head.weight`` ``[V, H]``.
    Returns:
      (K_c per layer [T, nkv, d], V_c per layer, logits [B, V]).
    """
    H, nh, nkv, d, eps = hp["H"], hp["nh"], hp["nkv"], hp["d"], hp["eps"]
    T, B = features.shape[0], len(block_tokens)
    # (b) fuse: per-capture RMSNorm, concat, fc, hidden_norm
    f = [rms(features[:, j * H:(j + 1) * H], sd[f"aux_hidden_norms.{j}.weight"], eps) for j in range(hp["n_aux"])]
    c = rms(np.concatenate(f, -1) @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = embed[block_tokens]  # (d) no scaling
    bpos = p + np.arange(B)
    kcs, vcs = [], []
    for i in range(hp["layers"]):
        pre = f"layers.{i}."
        wqkv = sd[pre + "self_attn.qkv_proj.weight"]
        wq, wk, wv = wqkv[: nh * d], wqkv[nh * d: nh * d + nkv * d], wqkv[nh * d + nkv * d:]
        qn, kn = sd[pre + "self_attn.q_norm.weight"], sd[pre + "self_attn.k_norm.weight"]
        in_norm = sd[pre + "input_layernorm.weight"]
        # (c) context K/V through this layer's input_layernorm
        u = rms(c, in_norm, eps)
        kc = rope(rms((u @ wk.T).reshape(T, nkv, d), kn, eps), ctx_pos, hp["theta"])
        vc = (u @ wv.T).reshape(T, nkv, d)
        kcs.append(kc)
        vcs.append(vc)
        # (e) block layer
        h = rms(x, in_norm, eps)
        q = rope(rms((h @ wq.T).reshape(B, nh, d), qn, eps), bpos, hp["theta"])
        k = rope(rms((h @ wk.T).reshape(B, nkv, d), kn, eps), bpos, hp["theta"])
        v = (h @ wv.T).reshape(B, nkv, d)
        K = np.concatenate([kc, k], 0)
        V = np.concatenate([vc, v], 0)
        kpos = np.concatenate([ctx_pos, bpos])
        is_blk = np.concatenate([np.zeros(T, bool), np.ones(B, bool)])
        a = np.zeros((B, nh, d))
        for s in range(B):
            qp = bpos[s]
            visible = (kpos <= qp) & (qp - kpos < hp["window"])  # causal block, per-query window
            visible &= ~is_blk | (np.arange(T + B) - T <= s)
            for hh in range(nh):
                g = hh // (nh // nkv)  # GQA: consecutive query heads share a kv head
                sc = K[visible, g] @ q[s, hh] / np.sqrt(d)
                w = np.exp(sc - sc.max())
                a[s, hh] = (w / w.sum()) @ V[visible, g]
        gate = softplus(h @ sd[pre + "self_attn.g_proj.weight"].T)
        a = (a * gate[:, :, None]).reshape(B, nh * d) if hp["gate"] == "head" else a.reshape(B, nh * d) * gate
        x = x + a @ sd[pre + "self_attn.o_proj.weight"].T
        h2 = rms(x, sd[pre + "post_attention_layernorm.weight"], eps)
        mlp = (silu(h2 @ sd[pre + "mlp.gate_proj.weight"].T) * (h2 @ sd[pre + "mlp.up_proj.weight"].T)) @ sd[pre + "mlp.down_proj.weight"].T
        x = x + mlp
    out = rms(x, sd["norm.weight"], eps)
    return kcs, vcs, out @ lm_head_w.T


# ------------------------------------------------------------------------------------ the check


def checkpoint_layout(cfg, p):
    """The JAX params tree as the published drafter safetensors (spec 6.3), float64."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    L = p["layers"]
    sd = {"fc.weight": p["fc"].T, "hidden_norm.weight": p["hidden_norm"], "norm.weight": p["norm"]}
    for j in range(len(cfg.target_layer_ids)):
        sd[f"aux_hidden_norms.{j}.weight"] = p["aux_norm"][j]
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        sd[pre + "self_attn.qkv_proj.weight"] = np.concatenate([L["wq"][i].T, L["wk"][i].T, L["wv"][i].T])
        for name, leaf, tr in (("input_layernorm", "attn_norm", 0), ("post_attention_layernorm", "mlp_norm", 0),
                               ("self_attn.o_proj", "wo", 1), ("self_attn.g_proj", "wg", 1), ("self_attn.q_norm", "q_norm", 0),
                               ("self_attn.k_norm", "k_norm", 0), ("mlp.gate_proj", "w_gate", 1), ("mlp.up_proj", "w_up", 1),
                               ("mlp.down_proj", "w_down", 1)):
            sd[pre + name + ".weight"] = L[leaf][i].T if tr else L[leaf][i]
    return sd


def rel(got, ref):
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("gating,theta", [("per-head", 500000.0), ("per-element", 10000.0)])
def test_drafter_matches_numpy_oracle(gating, theta):
    hf = dict(LAGUNA_DRAFTER, gating=gating, rope_theta=theta, sliding_window=6,
              dflash_config=dict(LAGUNA_DRAFTER["dflash_config"], target_layer_ids=[0, 1, 3], block_size=4))
    cfg = drafter_config_from_hf(hf)
    assert cfg.layer_causal == (True, True) and cfg.layer_window == (6, 6) and cfg.gate == gating.split("-")[1]
    tcfg, tparams = tiny_laguna(PER_HEAD, seed=3)
    params = drafter.init_params(cfg, jax.random.key(11), scale=0.3)
    H, K, W, S = cfg.hidden_size, len(cfg.target_layer_ids), cfg.block_size, 14
    rng = np.random.default_rng(0)
    # captured residuals of very different magnitudes per slice (the aux norms matter)
    feats = rng.normal(size=(2, S, K * H)) * np.repeat([1.0, 8.0, 40.0], H)
    ctx_len = np.array([12, 9])  # both longer than the window (6); slots past ctx_len hold garbage
    pos = np.tile(np.arange(S), (2, 1))
    blocks = np.array([[7] + [cfg.mask_token_id] * (W - 1), [40] + [cfg.mask_token_id] * (W - 1)])
    bpos = ctx_len[:, None] + np.arange(W)[None]

    ck, cv = drafter.context_kv(params, cfg, jnp.asarray(feats, jnp.float32), jnp.asarray(pos, jnp.int32))
    hid = drafter.forward(params, cfg, module_for(tcfg), tparams, tcfg, jnp.asarray(blocks, jnp.int32), jnp.asarray(bpos, jnp.int32),
                          ck, cv, jnp.asarray(ctx_len, jnp.int32))
    lg = np.asarray(drafter.logits(params, cfg, module_for(tcfg), tparams, tcfg, hid))

    sd = checkpoint_layout(cfg, params)
    hp = dict(H=H, nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, d=cfg.head_dim, eps=cfg.rms_norm_eps,
              theta=theta, window=6, gate=cfg.gate, n_aux=K, layers=cfg.num_hidden_layers)
    embed = np.asarray(tparams["embed"], np.float64)
    lm_head_w = np.asarray(tparams["lm_head"], np.float64).T  # [V, H] as lm_head.weight
    for b in range(2):
        n = int(ctx_len[b])
        kcs, vcs, ref = oracle(sd, hp, feats[b, :n], np.arange(n), blocks[b], n, embed, lm_head_w)
        for i in range(cfg.num_hidden_layers):
            assert rel(ck[i, b, :n], kcs[i]) < TOL, ("context K", b, i)
            assert rel(cv[i, b, :n], vcs[i]) < TOL, ("context V", b, i)
        assert rel(lg[b], ref) < TOL, ("logits", b, rel(lg[b], ref))
        assert np.argmax(lg[b, 1:], -1).tolist() == np.argmax(ref[1:], -1).tolist()
