"""The Qwen3.5 hybrid target family against transformers' ``Qwen3_5ForCausalLM`` (and
``Qwen3_5ForConditionalGeneration``'s text part, and ``Qwen3NextForCausalLM``): fp32, tiny random
checkpoints saved by ``save_pretrained``. Oracles: transformers' logits and greedy ``generate``;
for the rollback after partial acceptance, the states of a plain prefill of the committed tokens
(and a run without rollback, which must differ). Mesh and server: test_family_qwen3_5_mesh.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decode import loop as decode
from dflash_jax.decode import step as speculative
from dflash_jax.runtime.carry import flat_axes
from dflash_jax.families.qwen3_5.config import qwen3_5_config_from_hf
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.families.qwen3_5 import model as qwen3_5
from dflash_jax.families.registry import load_hf_target
from dflash_jax.testing import tiny_drafter, verify_scripted

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers without Qwen3_5ForCausalLM", allow_module_level=True)

HF = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
          linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2,  # period 2: a scan of 2
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
SEQ = [5, 17, 3, 42, 8, 9, 60, 33, 21, 7, 11, 2, 19, 44, 58, 13, 25, 31, 23, 70]
PROMPT = SEQ[:11]
N_NEW = 14


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(hf model, folder)``: random weights everywhere (norm offsets, decays, gates)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    conf = Qwen3_5TextConfig(**HF)
    conf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 2 + 0.5))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    folder = str(tmp_path_factory.mktemp("qwen3_5"))
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def pair(saved):
    """``(hf model, cfg, params)`` of :func:`saved`, loaded by the registry."""
    cfg, params = load_hf_target(saved[1])
    return saved[0], cfg, params


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def run(cfg, params, prompt, n_new, chunk, drafter=None, max_len=48):
    static = Decoding(cfg, drafter[0] if drafter else None)
    p = Params(params, drafter[1] if drafter else None)
    st = decode.prefill(p, decode.init_state(static, [prompt], max_len, n_new), static, chunk)
    st = decode.decode_loop(p, st, static)
    return st, [int(t) for t in np.asarray(st.tokens[0, len(prompt) : int(st.length[0])])]


def test_config_and_loader(pair):
    _, cfg, params = pair
    assert cfg.linear_layers == (0, 2) and cfg.full_layers == (1, 3) and cfg.rope.partial == 0.5 and qwen3_5.period(cfg) == 2
    assert params["linear"]["wq"].shape == (2, 32, 16) and params["full"]["wg"].shape == (2, 32, 64)
    axes = qwen3_5.MODEL.param_axes(cfg)
    jax.tree_util.tree_map(lambda s, a: None if len(s) == len(a) else pytest.fail(f"{s} vs {a}"), qwen3_5.MODEL.param_shapes(cfg), axes,
                           is_leaf=lambda x: isinstance(x, tuple))
    with pytest.raises(DFlashError, match="layer_types"):
        qwen3_5_config_from_hf(dict(HF, layer_types=["linear_attention"] * 3), "c.json")
    with pytest.raises(DFlashError, match="hidden_act"):
        qwen3_5_config_from_hf(dict(HF, hidden_act="gelu"), "c.json")
    with pytest.raises(DFlashError, match="rollback"):
        cfg.replace(rollback="none")
    st = decode.init_state(Decoding(cfg), [PROMPT], 16, 2)
    axes = flat_axes(st.cache)  # every cache array declares its axes, each with a batch axis (replace_rows)
    assert len(axes) == 4 and all("batch" in a for a in axes)
    from dflash_jax.serve import prefix_cache

    assert not prefix_cache.supports(st)  # the server's prefix cache stays off: no K/V per position in linear layers


def test_public_api_generate_plain_and_dflash(saved):
    """``dflash_jax.load_target`` + ``generate`` (plain and with a drafter, several prefill chunks)
    give transformers' greedy tokens; a GGUF-only path is refused by the registry elsewhere."""
    import dflash_jax as dj

    model, folder = saved
    target = dj.load_target(folder)
    want = hf_greedy(model, PROMPT, N_NEW)
    res = dj.generate(target, [PROMPT], max_new_tokens=N_NEW, max_len=48, chunk_size=4, ignore_eos=True)
    assert res.output_ids[0] == want
    dcfg, dparams = tiny_drafter(target.cfg, layer_ids=(0, 3), block_size=4)
    res = dj.generate(target, [PROMPT], max_new_tokens=N_NEW, max_len=48, chunk_size=4, ignore_eos=True,
                      drafter=dj.Drafter(cfg=dcfg, params=dparams, source="tiny-drafter"))
    assert res.output_ids[0] == want and res.stats["mode"] == "dflash"


def test_forward_matches_transformers_one_and_several_chunks(pair):
    model, cfg, params = pair
    with torch.no_grad():
        ref = model(torch.tensor([SEQ])).logits[0].numpy()
    step = jax.jit(lambda p, t, pos, c: qwen3_5.MODEL.forward(p, cfg, t, pos, c))
    logits, _, _ = step(params, jnp.asarray([SEQ]), jnp.arange(len(SEQ))[None], qwen3_5.MODEL.init_cache(cfg, 1, 32))
    assert rel(logits[0], ref) < 1e-4
    cache, out = qwen3_5.MODEL.init_cache(cfg, 1, 32), []
    for s in range(0, len(SEQ), 6):  # chunks of 6, the last one padded past the capacity
        toks = (SEQ[s : s + 6] + [0] * 6)[:6]
        pos = [p if p < len(SEQ) else 32 for p in range(s, s + 6)]
        lg, cache, _ = step(params, jnp.asarray([toks]), jnp.asarray([pos]), cache)
        out.append(lg[0, : min(6, len(SEQ) - s)])
    assert rel(jnp.concatenate(out), ref) < 1e-4


@pytest.mark.parametrize("chunk", [len(PROMPT), 3])
def test_plain_greedy_matches_transformers_generate(pair, chunk):
    model, cfg, params = pair
    assert run(cfg, params, PROMPT, N_NEW, chunk)[1] == hf_greedy(model, PROMPT, N_NEW)


def scripted(pair, corrupt_at, chunk=4):
    """Verify steps with drafts from the target's own greedy continuation, wrong at ``corrupt_at``."""
    model, cfg, params = pair
    d = tiny_drafter(cfg, layer_ids=(0, 2), block_size=5)
    static, p = Decoding(cfg, d[0]), Params(params, d[1])
    ref = hf_greedy(model, PROMPT, N_NEW + 5)
    st = decode.prefill(p, decode.init_state(static, [PROMPT], 48, N_NEW), static, chunk)
    verify = jax.jit(lambda s, drafts: speculative.verify_block(p, s, static, jnp.asarray([drafts], jnp.int32)))
    st, accepts = verify_scripted(st, PROMPT + ref, 4, verify, corrupt_at, cfg.vocab_size)
    return st, accepts, ref


def test_without_rollback_the_output_differs(pair, monkeypatch):
    """The same kind of run with the commit keeping the state after the *whole* block (no
    rollback) departs from transformers: :func:`test_rows_roll_back_to_their_own_acceptance` can fail."""
    import dataclasses

    from dflash_jax.families import registry

    real = qwen3_5.commit_block_states

    def whole_block(fam):  # the registry holds the family's functions (family.FamilyModel): swap the hook there
        if fam.name != "qwen3_5":
            return fam
        return dataclasses.replace(fam, model=dataclasses.replace(
            fam.model, commit_block_states=lambda cfg, cache, kept: real(cfg, cache, jnp.full_like(kept, 5))))

    monkeypatch.setattr(registry, "TARGET_FAMILIES", tuple(map(whole_block, registry.TARGET_FAMILIES)))
    jax.clear_caches()
    try:
        st, _, ref = scripted(pair, 1)
        assert np.asarray(st.tokens[0, len(PROMPT) : int(st.length[0])]).tolist() != ref[:N_NEW]
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_dflash_greedy_equals_plain(pair):
    """One prefill chunk here; several in the public API test and the rollback tests."""
    _, cfg, params = pair
    chunk = len(PROMPT)
    d = tiny_drafter(cfg, layer_ids=(0, 3), block_size=4)
    st, got = run(cfg, params, PROMPT, N_NEW, chunk, drafter=d)
    assert got == run(cfg, params, PROMPT, N_NEW, len(PROMPT))[1]
    assert int(st.speculative.verify_steps[0]) > 0


def test_tree_refused(pair):
    _, cfg, _ = pair
    d = tiny_drafter(cfg, layer_ids=(0, 3), block_size=4)
    with pytest.raises(DFlashError, match="tree"):
        Decoding(cfg, d[0], tree=3)


def test_continuous_batching_replaces_linear_state_rows(pair):
    """``decode.replace_rows`` swaps the conv and recurrent states with the rows: a refilled row
    answers its new prompt as transformers does while the other goes on."""
    model, cfg, params = pair
    a, b, c = PROMPT, SEQ[3:9], SEQ[1:12]
    static, p = Decoding(cfg), Params(params)
    st = decode.prefill(p, decode.init_state(static, [a, b], 40, [4, 12]), static, 4)
    st = decode.generate_until(p, st, static, jnp.int32(1))
    fresh = decode.prefill(p, decode.init_state(static, [c], 40, 8), static, 4)
    st = decode.generate_until(p, decode.replace_rows(st, fresh, jnp.asarray([0], jnp.int32)), static, jnp.int32(2))
    toks, length = np.asarray(st.tokens), np.asarray(st.length)
    assert toks[0, len(c) : length[0]].tolist() == hf_greedy(model, c, 8)
    assert toks[1, len(b) : length[1]].tolist() == hf_greedy(model, b, 12)


@pytest.mark.parametrize("width", [1, 3, 0])
def test_auto_depth_greedy_equals_plain(pair, width):
    """``n_max="auto"`` (each width one compiled branch of verify + commit, or a plain step:
    ``width`` 0) keeps the rollback exact."""
    from dflash_jax.decode.auto.costs import CostModel, depth_policy
    from dflash_jax.decode.auto.policy import Calibration

    _, cfg, params = pair
    dcfg, dparams = tiny_drafter(cfg, layer_ids=(0, 3), block_size=4)
    model = CostModel.never_pays(3) if width == 0 else CostModel.forcing(3, width)
    static = Decoding(cfg, dcfg, n_max="auto")
    weights = Params(params, dparams, depth_policy(Calibration.identity(3), model))
    st = decode.prefill(weights, decode.init_state(static, [PROMPT], 48, N_NEW), static, 4)
    st = decode.decode_loop(weights, st, static)
    assert np.asarray(st.tokens[0, len(PROMPT) : int(st.length[0])]).tolist() == run(cfg, params, PROMPT, N_NEW, 4)[1]


def test_conditional_generation_checkpoint_text_part(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` checkpoint (nested ``text_config``, tensors under
    ``model.language_model.``, vision tensors skipped, multimodal RoPE sections) loads as its text
    decoder: text-only logits equal transformers'."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(HF, rope_parameters=dict(HF["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True),
                layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])  # no period: one pass unrolled
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4, num_position_embeddings=16)
    torch.manual_seed(1)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.log(torch.rand_like(p) * 2 + 0.5) if name.endswith("A_log") else 0.3 * torch.randn_like(p))
        ref = model(input_ids=torch.tensor([SEQ[:12]])).logits[0].numpy()
    model.save_pretrained(str(tmp_path))
    cfg, params = load_hf_target(str(tmp_path))
    assert qwen3_5.period(cfg) == 4
    logits, _, _ = qwen3_5.MODEL.forward(params, cfg, jnp.asarray([SEQ[:12]]), jnp.arange(12)[None], qwen3_5.MODEL.init_cache(cfg, 1, 16))
    assert rel(logits[0], ref) < 1e-4


@pytest.mark.parametrize("rollback", ["states", "replay"])
def test_rows_roll_back_to_their_own_acceptance(pair, rollback):
    """Partial acceptance, two rows of one batch: every block of row 0 is rejected at draft 1 and
    of row 1 at draft 3 (0 < accepted < drafted), so each row keeps the states after its own
    committed prefix: the tokens are transformers' greedy ones and the committed conv / recurrent
    states equal those of a plain prefill of the committed tokens (rounding apart), with either
    rollback (``Qwen3_5Config.rollback``)."""
    model, cfg, params = pair
    cfg = cfg.replace(rollback=rollback)
    d = tiny_drafter(cfg, layer_ids=(0, 2), block_size=5)
    static, p = Decoding(cfg, d[0]), Params(params, d[1])
    prompts, n_new = [PROMPT, SEQ[4:13]], 10
    full = [list(q) + hf_greedy(model, q, n_new + 5) for q in prompts]
    st = decode.prefill(p, decode.init_state(static, prompts, 40, n_new), static, 4)
    verify = jax.jit(lambda s, drafts: speculative.verify_block(p, s, static, drafts))
    accepted = []
    while not bool(np.all(np.asarray(st.done))):
        length = np.asarray(st.length)
        drafts = np.array([[full[b][min(length[b] + i, len(full[b]) - 1)] for i in range(4)] for b in range(2)], np.int32)
        drafts[0, 1], drafts[1, 3] = (drafts[0, 1] + 1) % cfg.vocab_size, (drafts[1, 3] + 1) % cfg.vocab_size
        before = np.asarray(st.speculative.accepted)
        st = verify(st, jnp.asarray(drafts))
        accepted.append((np.asarray(st.speculative.accepted) - before).tolist())
    assert [1, 3] in accepted
    for b, q in enumerate(prompts):
        n = int(st.length[b])
        assert np.asarray(st.tokens[b, len(q) : n]).tolist() == full[b][len(q) : len(q) + n_new]
        _, cache, _ = qwen3_5.MODEL.forward(params, cfg, st.tokens[b : b + 1, : n - 1], jnp.arange(n - 1)[None], qwen3_5.MODEL.init_cache(cfg, 1, 40))
        np.testing.assert_allclose(np.asarray(st.cache.rec[:, b]), np.asarray(cache.rec[:, 0]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(st.cache.conv[:, b]), np.asarray(cache.conv[:, 0]), rtol=1e-4, atol=1e-5)
    assert st.cache.block_rec is None and st.cache.block_inputs is None and not st.cache.keep_block  # one verify only


@pytest.fixture(scope="module")
def next_pair(tmp_path_factory):
    """``(hf model, cfg, params)`` of a tiny random ``Qwen3NextForCausalLM`` (every MLP a MoE of 4
    experts, top 2, and a gated shared expert), saved and loaded by the registry."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    conf = Qwen3NextConfig(**{k: v for k, v in HF.items() if k != "rope_parameters"}, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, shared_expert_intermediate_size=24)
    conf._attn_implementation = "eager"
    torch.manual_seed(2)
    model = Qwen3NextForCausalLM(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.log(torch.rand_like(p) * 2 + 0.5) if name.endswith("A_log") else 0.3 * torch.randn_like(p))
    folder = str(tmp_path_factory.mktemp("qwen3_next"))
    model.save_pretrained(folder)
    cfg, params = load_hf_target(folder)
    return model, cfg, params


def test_qwen3_next_logits_and_greedy_match_transformers(next_pair):
    """Qwen3-Next (grouped ``in_proj_qkvz`` / ``in_proj_ba``, MoE MLP): logits of one pass, and
    plain greedy decoding with several prefill chunks, equal transformers'."""
    model, cfg, params = next_pair
    assert cfg.family == "qwen3_next" and params["linear"]["e_gate"].shape == (2, 4, 32, 16) and cfg.rope.partial == 0.25
    with torch.no_grad():
        ref = model(torch.tensor([SEQ])).logits[0].numpy()
    logits, _, _ = qwen3_5.MODEL.forward(params, cfg, jnp.asarray([SEQ]), jnp.arange(len(SEQ))[None], qwen3_5.MODEL.init_cache(cfg, 1, 32))
    assert rel(logits[0], ref) < 1e-4
    assert run(cfg, params, PROMPT, N_NEW, 3)[1] == hf_greedy(model, PROMPT, N_NEW)


def test_qwen3_next_partial_acceptance_rolls_back(next_pair):
    """DFlash verify on Qwen3-Next with every block rejected at draft 2: transformers' tokens."""
    model, cfg, params = next_pair
    d = tiny_drafter(cfg, layer_ids=(0, 2), block_size=5)
    static, p = Decoding(cfg, d[0]), Params(params, d[1])
    ref = hf_greedy(model, PROMPT, N_NEW + 5)
    st = decode.prefill(p, decode.init_state(static, [PROMPT], 48, N_NEW), static, 4)
    verify = jax.jit(lambda s, drafts: speculative.verify_block(p, s, static, jnp.asarray([drafts], jnp.int32)))
    st, accepts = verify_scripted(st, PROMPT + ref, 4, verify, 2, cfg.vocab_size)
    assert all(a == 2 for a in accepts[:-1])
    assert np.asarray(st.tokens[0, len(PROMPT) : int(st.length[0])]).tolist() == ref[:N_NEW]


def test_chunked_delta_rule_equals_the_recurrence():
    """Prefill's chunked gated delta rule (chunks of 5, a last partial one, a row whose tail is
    padding) gives the token-by-token recurrence's outputs and final state."""
    from dflash_jax.nn import gated_deltanet as gdn

    keys = jax.random.split(jax.random.key(0), 6)
    b, t, h, dk, dv = 2, 13, 3, 8, 6
    q = gdn.l2_normalize(jax.random.normal(keys[0], (b, t, h, dk))) * dk ** -0.5
    k = gdn.l2_normalize(jax.random.normal(keys[1], (b, t, h, dk)))
    v = jax.random.normal(keys[2], (b, t, h, dv))
    g = -2 * jax.nn.softplus(jax.random.normal(keys[3], (b, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
    s0 = jax.random.normal(keys[5], (b, h, dk, dv))
    valid = jnp.arange(t)[None] < jnp.asarray([[t], [8]])
    out, final, _ = gdn.gated_delta_scan(q, k, v, g, beta, s0, valid)
    out_c, final_c, _ = gdn.gated_delta_chunked(q, k, v, g, beta, s0, valid, chunk=5)
    np.testing.assert_allclose(np.asarray(final_c), np.asarray(final), atol=1e-5)
    np.testing.assert_allclose(np.where(np.asarray(valid)[..., None, None], np.asarray(out_c), 0),
                               np.where(np.asarray(valid)[..., None, None], np.asarray(out), 0), atol=1e-5)
