"""The drafter and the DFlash loop against z-lab's PyTorch reference (PyPI ``dflash==0.1.0``)."""

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
zlab = pytest.importorskip("dflash.model")

from dflash_jax.decode import loop as decode  # noqa: E402
from dflash_jax.decode.state import Decoding, Params  # noqa: E402
from dflash_jax.drafter.model import load_hf_drafter as load_drafter  # noqa: E402
from dflash_jax.families.dense.safetensors import load_hf_target  # noqa: E402
from dflash_jax.drafter import model as drafter  # noqa: E402
from dflash_jax.families.registry import module_for

H, V, TARGET_LAYERS = 64, 96, 4


def drafter_hf_config(**dflash):
    cfg = transformers.Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = TARGET_LAYERS
    cfg.dflash_config = {"mask_token_id": V - 1, "target_layer_ids": [0, 2], "block_size": 4, **dflash}
    return cfg


def make_drafter(tmp_path, name, seed, layer_types=None, sliding_window=None, is_causal=None, **dflash):
    torch.manual_seed(seed)
    cfg = drafter_hf_config(**dflash)
    if is_causal is not None:
        cfg.is_causal = is_causal
    if layer_types:
        cfg.layer_types, cfg.sliding_window = layer_types, sliding_window
    model = zlab.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(hc).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder, safe_serialization=True)
    cfg, params = load_hf_target(folder)
    return model, cfg, params


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
        dict(is_causal=True),
        dict(input_embedding_scale=1.7, output_multiplier=0.6, final_logit_softcapping=2.5),
    ],
)
def test_drafter_logits_match_reference(tmp_path, target, variant):
    t_model, t_cfg, t_params = target
    ref, folder = make_drafter(tmp_path, "d", 1, **variant)
    cfg, params = load_drafter(folder, t_cfg)
    ctx_len, w = 9, 4
    rs = np.random.RandomState(0)
    feats = rs.randn(1, ctx_len, 2 * H).astype(np.float32)
    block = np.array([[7] + [V - 1] * (w - 1)])
    with torch.no_grad():
        # z-lab's dflash_generate scales the raw embedding rows by input_embedding_scale
        emb = t_model.get_input_embeddings().weight[torch.tensor(block)] * variant.get("input_embedding_scale", 1.0)
        hid = ref(position_ids=torch.arange(ctx_len + w)[None], noise_embedding=emb, target_hidden=torch.tensor(feats))
        want = ref.compute_logits(hid, t_model.lm_head).numpy()
    s = 16  # context capacity larger than used: unused slots must stay masked
    k, v = drafter.context_kv(params, cfg, jnp.asarray(feats), jnp.arange(ctx_len, dtype=jnp.int32)[None])
    ck = jnp.zeros((cfg.num_hidden_layers, 1, s) + k.shape[3:]).at[:, :, :ctx_len].set(k)
    cv = jnp.zeros_like(ck).at[:, :, :ctx_len].set(v)
    pos = ctx_len + jnp.arange(w, dtype=jnp.int32)[None]
    out = drafter.forward(params, cfg, module_for(t_cfg), t_params, t_cfg, jnp.asarray(block), pos, ck, cv, jnp.array([ctx_len]))
    got = np.asarray(drafter.logits(params, cfg, module_for(t_cfg), t_params, t_cfg, out))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def steer_to(model, t_model, token):
    """Scales the drafter's final norm so mask slots favour ``token`` (keeps its attention path)."""
    with torch.no_grad():
        e = t_model.lm_head.weight[token]
        m = t_model.get_input_embeddings().weight[V - 1]
        m = m / m.pow(2).mean().sqrt()
        model.norm.weight.copy_(3.0 * e / m)


def test_same_tokens_and_verify_steps_as_dflash_generate(tmp_path, target, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)
    t_model, t_cfg, t_params = target
    prompt = [3, 17, 42, 8, 11, 5, 29]
    with torch.no_grad():
        free = t_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    common = max(set(free), key=free.count)
    ref, folder = make_drafter(tmp_path, "steered", 2)
    steer_to(ref, t_model, common)
    ref.save_pretrained(folder, safe_serialization=True)
    with torch.no_grad():
        out = zlab.dflash_generate(ref, t_model, torch.tensor([prompt]), 40, None, block_size=4, return_stats=True)
    want_tokens = out.output_ids[0, len(prompt):].tolist()
    want_steps = len(out.acceptance_lengths)
    assert max(out.acceptance_lengths) > 1, "the steered drafter should get some blocks accepted"

    cfg, params = load_drafter(folder, t_cfg)
    st = decode.init_state(Decoding(t_cfg, cfg), [prompt], 64, 40)
    st = decode.prefill(Params(t_params, params), st, Decoding(t_cfg, cfg), 4)
    st = decode.decode_loop(Params(t_params, params), st, Decoding(t_cfg, cfg))
    got = list(np.asarray(st.tokens[0, len(prompt) : int(st.length[0])]))
    assert got == want_tokens == free
    assert int(st.speculative.verify_steps[0]) == want_steps
    assert int(st.committed[0]) == sum(out.acceptance_lengths)


def test_config_field_locations(tmp_path):
    """block_size / mask_token_id / target_layer_ids at top level or in dflash_config."""
    from dflash_jax.drafter.model import drafter_config_from_hf

    base = drafter_hf_config().to_dict()
    nested = drafter_config_from_hf(base)
    flat = dict(base)
    dc = flat.pop("dflash_config")
    flat.update(dc)
    assert drafter_config_from_hf(flat) == nested
    assert (nested.block_size, nested.mask_token_id, nested.target_layer_ids) == (4, V - 1, (0, 2))
    json.dumps(base)  # the reference config is plain JSON


def test_fc_width_must_fit_captured_layers(tmp_path, target):
    """An ``fc`` whose input width is not ``len(target_layer_ids) * hidden_size`` is refused by name."""
    from dflash_jax.errors import DFlashError

    _, folder = make_drafter(tmp_path, "d", 4)
    cfg_path = folder / "config.json"
    data = json.loads(cfg_path.read_text())
    data["dflash_config"]["target_layer_ids"] = [0, 1, 2]
    cfg_path.write_text(json.dumps(data))
    with pytest.raises(DFlashError, match=r"fc\.weight.*3 captured layers"):
        load_drafter(folder, target[1])
