"""Memory and FLOPs per generated token for Laguna XS-2.1 and S-2.1 with their DFlash drafters.

Usage: ``python tools/laguna_plan.py [--context 32768] [--accept 4.0] [--block 16] [--batch 1]``

Counts come from the published configs (``dflash_jax.families.laguna.presets``) and the parameter
shapes of ``dflash_jax.families.laguna.model`` / ``laguna_drafter``; nothing is loaded. Assumptions:
bf16 weights and KV; full-attention layers cache every position, sliding layers a ring of
``window + block`` rows (this package's cache); the drafter keeps context K/V for every position
(``dflash_jax.decode.state``) but attends only the last ``window`` of them; FLOPs count 2 per
multiply-add of the matmuls and attention score/value products (no softmax, norms, rope); a
verify step runs ``block`` target tokens and is amortised over ``accept`` committed tokens
(mean accepted length incl. the bonus token). Devices: H200 with 141 GB, 90 % usable.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dflash_jax.drafter.model import drafter_config_from_hf  # noqa: E402
from dflash_jax.families.laguna.config import laguna_config_from_hf  # noqa: E402
from dflash_jax.families.laguna.safetensors import parameter_count  # noqa: E402
from dflash_jax.families.laguna.presets import DRAFTERS, PUBLISHED  # noqa: E402

GB = 1e9
H200 = 141 * GB


def target_flops_per_token(cfg, ctx: int) -> float:
    """Forward FLOPs of one target token at context ``ctx`` (active experts only)."""
    H, D, kv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
    f = 2 * H * cfg.vocab_size  # lm_head
    for i in range(cfg.num_hidden_layers):
        nh = cfg.heads_per_layer[i]
        f += 2 * H * (2 * nh * D + 2 * kv * D + cfg.gate_width(i))  # q, o, k, v, g
        seen = min(ctx, cfg.sliding_window) if cfg.layer_types[i] == "sliding_attention" else ctx
        f += 4 * nh * D * seen
        if cfg.mlp_layer_types[i] == "dense":
            f += 6 * H * cfg.intermediate_size
        else:
            f += 2 * H * cfg.num_experts + 6 * H * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
    return f


def drafter_params(d) -> int:
    H, D = d.hidden_size, d.head_dim
    qd, kd = d.num_attention_heads * D, d.num_key_value_heads * D
    per = 2 * H + H * (qd + 2 * kd) + qd * H + H * d.num_attention_heads + 2 * D + 3 * H * d.intermediate_size
    K = len(d.target_layer_ids)
    return d.num_hidden_layers * per + K * H * H + K * H + 2 * H


def drafter_flops_per_block(d, vocab: int, block: int) -> float:
    """One draft pass over ``block`` slots (window-limited context) plus the LM head on block-1 slots."""
    H, D = d.hidden_size, d.head_dim
    qd, kd = d.num_attention_heads * D, d.num_key_value_heads * D
    per_tok = d.num_hidden_layers * (2 * H * (2 * qd + 2 * kd + d.num_attention_heads) + 6 * H * d.intermediate_size
                                     + 4 * qd * (d.layer_window[0] or 4096))
    return block * per_tok + (block - 1) * 2 * H * vocab


def drafter_context_flops_per_token(d) -> float:
    H, kd, K = d.hidden_size, d.num_key_value_heads * d.head_dim, len(d.target_layer_ids)
    return 2 * K * H * H + d.num_hidden_layers * 2 * H * 2 * kd


def plan(name: str, ctx: int, accept: float, block: int, batch: int) -> None:
    cfg = laguna_config_from_hf(PUBLISHED[name])
    d = drafter_config_from_hf(DRAFTERS[name])
    n_t, n_d = parameter_count(cfg), drafter_params(d)
    w_t, w_d = 2 * n_t, 2 * n_d
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    n_full = cfg.layer_types.count("full_attention")
    n_swa = cfg.num_hidden_layers - n_full
    kv_t = batch * kv_row * (n_full * ctx + n_swa * (cfg.sliding_window + block))
    kv_d = batch * d.num_hidden_layers * 2 * d.num_key_value_heads * d.head_dim * 2 * ctx
    total = w_t + w_d + kv_t + kv_d
    f_tok = target_flops_per_token(cfg, ctx)
    f_verify = block * f_tok
    f_draft = drafter_flops_per_block(d, cfg.vocab_size, block) + accept * drafter_context_flops_per_token(d)
    active = (f_tok - 2 * cfg.hidden_size * cfg.vocab_size) / 2  # rough
    print(f"== Laguna {name} (+ DFlash drafter, {d.num_hidden_layers} layers) at context {ctx}, batch {batch}")
    print(f"  target params        {n_t:,}  -> bf16 weights {w_t / GB:8.2f} GB")
    print(f"  drafter params       {n_d:,}  -> bf16 weights {w_d / GB:8.2f} GB")
    print(f"  target KV            {kv_t / GB:8.3f} GB  ({n_full} full layers x {ctx} rows, {n_swa} sliding x {cfg.sliding_window + block} rows)")
    print(f"  drafter context KV   {kv_d / GB:8.3f} GB  (every position kept; attention windowed at {d.layer_window[0]})")
    print(f"  total                {total / GB:8.2f} GB  -> H200 (141 GB, 90% usable): {math.ceil(total / (0.9 * H200))} device(s)")
    print(f"  plain decode         {f_tok / 1e9:8.2f} GFLOP/token  (~{active / 1e9:.2f} B active params incl. attention at ctx)")
    n_sparse = cfg.mlp_layer_types.count("sparse")
    inactive = n_sparse * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    print(f"  weights read/token   {2 * (n_t - inactive) / GB:8.2f} GB at batch 1 (embedding row aside: all non-expert + top-k experts)")
    print(f"  speculative step     verify {f_verify / 1e9:8.2f} GFLOP + draft {f_draft / 1e9:6.2f} GFLOP (block {block})")
    print(f"  per generated token  {(f_verify + f_draft) / accept / 1e9:8.2f} GFLOP at mean accepted length {accept}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--accept", type=float, default=4.0, help="mean tokens committed per verify step")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)
    for name in ("XS-2.1", "S-2.1"):
        plan(name, a.context, a.accept, a.block, a.batch)


if __name__ == "__main__":
    main()
