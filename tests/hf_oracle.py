"""Oracles shared by the family tests: a tiny random transformers checkpoint saved to a folder,
transformers' greedy decode, ours (plain and DFlash, one or several prefill chunks) and z-lab's
``dflash_generate`` with a drafter steered to get blocks accepted."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dflash_jax.decode import loop as decode
from dflash_jax.runtime import compiled
from dflash_jax.decode.state import Decoding, Params


def save_tiny(conf_cls: str, model_cls: str, folder, seed: int = 0, **conf):
    """Builds ``transformers.<model_cls>(<conf_cls>(**conf))`` in float32 with eager attention,
    its norms moved off 1, biases off 0, MoE routers (``mlp.gate`` / ``mlp.router``) and attention
    sinks drawn wide (so they matter and experts are chosen without ties), saves it to
    ``folder``; returns the eval model."""
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, conf_cls)(**conf, attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 logits ``[B, T, V]`` of ``tokens [B, T]`` (no cache)."""
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long(), use_cache=False).logits.float().numpy()


def rel_err(ours, ref) -> float:
    """``max |ours - ref| / max |ref|`` in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def check_logits_and_capture(model, cfg, params, module, layer_ids=(0, 2), tol: float = 1e-4, chunk: int = 5) -> np.ndarray:
    """Our float32 logits of 2 x 14 random tokens equal transformers' (one pass, and prefill
    chunks of ``chunk`` through the cache), and the hidden states captured after ``layer_ids``
    equal transformers' ``hidden_states[i + 1]`` (relative error below ``tol``). ``module``: the
    family's :class:`~dflash_jax.families.contract.FamilyModel`. Returns transformers' logits."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.runtime.carry import init_capture

    forward = jax.jit(module.forward, static_argnums=1)
    b, t = 2, 14
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    want = hf_logits(model, tokens)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    got, _, _ = forward(params, cfg, jnp.asarray(tokens), pos, module.init_cache(cfg, b, t + 2))
    assert rel_err(got, want) < tol
    with torch.no_grad():
        hidden = model(torch.from_numpy(tokens).long(), output_hidden_states=True, use_cache=False).hidden_states
    cache, out = module.init_cache(cfg, b, t + 2), []
    capture = init_capture(layer_ids, b, t, cfg.hidden_size, jnp.float32)
    for s in range(0, t, chunk):
        logits, cache, capture = forward(params, cfg, jnp.asarray(tokens[:, s : s + chunk]), pos[:, s : s + chunk], cache, capture)
        out.append(logits)
    assert rel_err(jnp.concatenate(out, axis=1), want) < tol
    feats = np.asarray(capture.hidden).reshape(b, t, len(layer_ids), cfg.hidden_size)
    for j, i in enumerate(layer_ids):
        assert rel_err(feats[:, :, j], hidden[i + 1].numpy()) < tol, i
    return want


def hf_greedy(model, prompt, n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``n`` tokens, no stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def ours_greedy(t_cfg, t_params, prompt, n: int, chunk: int, drafter=None, max_len: int = 64, tree: int | None = None,
                compiler_options: dict | None = None):
    """Our greedy continuation ``(tokens, verify steps or None)``: plain decoding, or DFlash with
    ``drafter = (cfg, params)`` (chains, or best-first trees of ``tree`` nodes); the prompt
    prefilled in chunks of ``chunk`` tokens. ``compiler_options``: XLA options of the decode loop's
    program (the same :func:`~dflash_jax.decode.loop.generate_until` that ``decode_loop`` runs, compiled
    as the driver does, through :func:`dflash_jax.runtime.compiled.compile`)."""
    d_cfg, d_params = drafter if drafter is not None else (None, None)
    static, params = Decoding(t_cfg, d_cfg, tree=tree), Params(t_params, d_params)
    st = decode.prefill(params, decode.init_state(static, [prompt], max_len, n), static, chunk)
    if compiler_options is None:
        st = decode.decode_loop(params, st, static)
    else:
        rows = jnp.int32(1)  # every row: decode_loop's min_done
        st = compiled.compile(decode.generate_until, params, st, static, rows, options=compiler_options)(params, st, rows)
    toks = [int(t) for t in np.asarray(st.tokens[0, len(prompt): int(st.length[0])])]
    return toks, (None if drafter is None else int(st.speculative.verify_steps[0]))


def steer_to(draft_model, t_model, token: int, mask_id: int, damp: float = 1.0) -> None:
    """Scales a z-lab drafter's final norm so its mask slots favour ``token`` (keeps its attention
    path, its layers' output projections scaled by ``damp`` so the embedding still dominates the
    residual), so that blocks get accepted on a target whose greedy output repeats ``token``."""
    with torch.no_grad():
        for layer in draft_model.layers:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
        e = t_model.lm_head.weight[token]
        m = t_model.get_input_embeddings().weight[mask_id]
        m = m / m.pow(2).mean().sqrt()
        draft_model.norm.weight.copy_(3.0 * e / m)


def zlab_generate(zlab, draft_model, t_model, prompt, n: int, block_size: int):
    """z-lab's ``dflash_generate``: ``(new tokens, acceptance lengths)``."""
    saved, zlab._cuda_time = zlab._cuda_time, time.perf_counter  # CPU: no CUDA events
    try:
        with torch.no_grad():
            out = zlab.dflash_generate(draft_model, t_model, torch.tensor([prompt]), n, None, block_size=block_size, return_stats=True)
    finally:
        zlab._cuda_time = saved
    return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)


def zlab_matches_ours(zlab, t_model, t_cfg, t_params, folder, prompt, n: int, vocab: int, hidden: int) -> list[int]:
    """z-lab's ``dflash_generate`` on the transformers target with a 2-layer z-lab drafter
    (layers 0 and 2 captured, block 4) steered to the commonest token of the target's greedy
    answer, saved to ``folder`` and loaded by us: asserts blocks get accepted and that ours gives
    the same ids and the same number of verify steps; returns the acceptance lengths."""
    from dflash_jax.drafter.model import load_hf_drafter

    free = hf_greedy(t_model, prompt, n)
    dc = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    dc.architectures, dc.num_target_layers = ["DFlashDraftModel"], t_cfg.num_hidden_layers
    dc.dflash_config = {"mask_token_id": vocab - 1, "target_layer_ids": [0, 2], "block_size": 4}
    torch.manual_seed(2)
    draft = zlab.DFlashDraftModel(dc).eval()
    steer_to(draft, t_model, max(set(free), key=free.count), vocab - 1, damp=0.3)
    draft.save_pretrained(folder, safe_serialization=True)
    want, accepted = zlab_generate(zlab, draft, t_model, prompt, n, block_size=4)
    assert max(accepted) > 1, "the steered drafter should get some blocks accepted"
    got, steps = ours_greedy(t_cfg, t_params, prompt, n, 4, load_hf_drafter(folder, t_cfg))
    assert got == want == free and steps == len(accepted)
    return accepted
