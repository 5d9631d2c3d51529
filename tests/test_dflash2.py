"""The DFlash2 drafter (grouped dynamic convolutions, candidate selector) against z-lab's PyTorch
reference (PyPI ``dflash==0.1.0``: ``DFlash2DraftModel``, ``dflash_generate``) on random weights."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
zlab = pytest.importorskip("dflash.model")
safetensors_torch = pytest.importorskip("safetensors.torch")

from dflash_jax.decode.state import Decoding, Params  # noqa: E402
from dflash_jax.drafter import model as drafter  # noqa: E402
from dflash_jax.drafter.model import load_hf_drafter  # noqa: E402
from dflash_jax.errors import DFlashError  # noqa: E402
from dflash_jax.families.dense.safetensors import load_hf_target  # noqa: E402
from dflash_jax.families.registry import module_for  # noqa: E402
from hf_oracle import hf_greedy, rel_err, zlab_generate  # noqa: E402

H, V, TARGET_LAYERS, TOL = 64, 96, 4, 1e-4
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


def dflash2_config(**dflash):
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg.architectures, cfg.num_target_layers = ["DFlash2DraftModel"], TARGET_LAYERS
    cfg.dflash_config = {"mask_token_id": V - 1, "target_layer_ids": [0, 2], "block_size": 4, **DFLASH2, **dflash}
    return cfg


def save_published(model, folder):
    """Saves a z-lab DFlash2 drafter as published: the codebooks without ``.weight``."""
    model.save_pretrained(folder, safe_serialization=True)
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    renamed = {k[: -len(".weight")] if "codebook" in k else k: v.contiguous() for k, v in tensors.items()}
    safetensors_torch.save_file(renamed, path, metadata={"format": "pt"})


def make_dflash2(folder, seed, scale=0.3, **dflash):
    """A z-lab ``DFlash2DraftModel`` with every parameter random (base kernels included: z-lab
    leaves them uninitialised), saved to ``folder``."""
    torch.manual_seed(seed)
    model = zlab.DFlash2DraftModel(dflash2_config(**dflash)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "codebook" in name:  # wide enough that the pairwise term overrules the logits somewhere
                p.copy_(2.0 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.ndim > 1 and "codebook" not in name else 1.0))
    save_published(model, folder)
    return model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    hc = transformers.Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(hc).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder, safe_serialization=True)
    return (model, *load_hf_target(folder))


@pytest.fixture(scope="module")
def pair(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash2")
    ref = make_dflash2(folder, 1)
    return ref, load_hf_drafter(folder, target[1])


def _block_pass(ref, target, d_cfg, d_params, ctx_len=9, w=4):
    """z-lab's hidden after each layer (then its final norm) and ours with the first ``i`` layers."""
    t_model, t_cfg, t_params = target
    feats = np.random.RandomState(0).randn(1, ctx_len, 2 * H).astype(np.float32)
    block = np.array([[7] + [V - 1] * (w - 1)])
    outs = []
    hook = [layer.register_forward_hook(lambda m, i, o: outs.append(o)) for layer in ref.layers]
    with torch.no_grad():
        emb = t_model.get_input_embeddings().weight[torch.tensor(block)]
        hid = ref(position_ids=torch.arange(ctx_len + w)[None], noise_embedding=emb, target_hidden=torch.tensor(feats))
    for h in hook:
        h.remove()
    k, v = drafter.context_kv(d_params, d_cfg, jnp.asarray(feats), jnp.arange(ctx_len, dtype=jnp.int32)[None])
    pos = ctx_len + jnp.arange(w, dtype=jnp.int32)[None]
    for i, out in enumerate(outs):
        n = i + 1
        cfg_i = d_cfg.__class__(**{**d_cfg.__dict__, "num_hidden_layers": n, "layer_causal": d_cfg.layer_causal[:n], "layer_window": d_cfg.layer_window[:n]})
        p_i = dict(d_params, layers={name: a[:n] for name, a in d_params["layers"].items()})
        got = drafter.forward(p_i, cfg_i, module_for(t_cfg), t_params, t_cfg, jnp.asarray(block), pos, k[:n], v[:n], jnp.array([ctx_len]))
        with torch.no_grad():
            want = ref.norm(out).numpy()
        assert rel_err(got, want) < TOL, f"layer {i}"
    return hid, got


def test_config_and_tensors(target, pair):
    _, (cfg, params) = pair
    assert cfg.architecture == "DFlash2DraftModel" and (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (3, 16, 8, 6)
    assert params["layers"]["attn_conv_proj"].shape == (2, H, 2 * 3 * 4) and params["selector"]["pred"].shape == (V, 8)


def test_layers_logits_path_and_q_match_zlab(target, pair, monkeypatch):
    """Layer by layer, the draft logits, the greedy path (which differs from the argmax) and, at
    temperature 0.7, each slot's q over the candidates along a path equal z-lab's."""
    t_model, t_cfg, t_params = target
    ref, (cfg, params) = pair
    hid, got = _block_pass(ref, target, cfg, params)
    with torch.no_grad():
        want_logits = ref.compute_logits(hid[:, 1:], t_model.lm_head)
    family = module_for(t_cfg)
    logits = drafter.logits(params, cfg, family, t_params, t_cfg, got[:, 1:])
    assert rel_err(logits, want_logits.numpy()) < TOL
    x = drafter.selector_inputs(params, cfg, got[:, 1:], logits)
    anchor = jnp.array([7], jnp.int32)
    path, q = drafter.select(params, cfg, x, anchor)
    assert np.allclose(np.asarray(q).sum(-1), 1.0) and np.asarray(q).max(-1).min() == 1.0  # greedy: one-hot q
    with torch.no_grad():
        want_path, want_cand, _ = ref.propose(hid[:, 1:], torch.tensor([7]), t_model.lm_head, 0.0)
    assert np.asarray(path).tolist() == want_path.tolist()
    assert sorted(np.asarray(x.candidates)[0, 0].tolist()) == sorted(want_cand[0, 0].tolist())
    assert np.asarray(path).tolist() != np.argmax(np.asarray(logits), -1).tolist(), "the selector should overrule the argmax here"
    # sampled: z-lab's draw is steered to our path, so its q rows are conditioned on the same predecessors
    t = 0.7
    u = jnp.asarray([[0.9, 0.15, 0.6]], jnp.float32)
    s_path, s_q = drafter.select(params, cfg, x, anchor, jnp.array([t]), u)
    s_path = np.asarray(s_path)[0]
    cands = torch.topk(want_logits, cfg.selector_top_k, dim=-1, sorted=False)[1]
    calls = iter(range(3))

    def steered(probs):
        i = next(calls)
        return (cands[:, i] == int(s_path[i])).int().argmax(-1)

    monkeypatch.setattr(zlab, "_sample_probs", steered)
    with torch.no_grad():
        z_path, z_cand, z_q = ref.propose(hid[:, 1:], torch.tensor([7]), t_model.lm_head, t)
    assert z_path[0].tolist() == s_path.tolist()
    for i in range(3):
        ours = dict(zip(np.asarray(x.candidates)[0, i].tolist(), np.asarray(s_q)[0, i].tolist()))
        theirs = dict(zip(z_cand[0, i].tolist(), z_q[0, i].tolist()))
        assert ours.keys() == theirs.keys() and max(abs(ours[c] - theirs[c]) for c in ours) < 1e-5


def test_sampled_selector_draw_is_inverse_transform_in_vocab_order():
    from dflash_jax.drafter.selector import draw_in_vocab_order

    q = jnp.array([[0.5, 0.2, 0.3]] * 4)
    cand = jnp.array([[9, 2, 5]] * 4)  # vocab order: 2 (0.2), 5 (0.3), 9 (0.5)
    u = jnp.array([0.1, 0.3, 0.6, 0.99])
    assert np.asarray(draw_in_vocab_order(q, cand, u)).tolist() == [1, 2, 0, 0]


def test_bad_config_and_tensors_are_named(target, tmp_path):
    from dflash_jax.drafter.model import drafter_config_from_hf

    base = dflash2_config().to_dict()
    for field, value, match in [("conv_group_size", 24, "conv_group_size"), ("selector_top_k", 0, "selector_top_k"),
                                ("selector_rank", None, "selector_rank"), ("selector_top_k", V + 1, "selector_top_k")]:
        cfg = json.loads(json.dumps(base))
        cfg["dflash_config"][field] = value
        with pytest.raises(DFlashError, match=f"x.json: field dflash_config.{match}"):
            drafter_config_from_hf(cfg, "x.json")
    folder = tmp_path / "d"
    make_dflash2(folder, 3)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["selector_rank"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="tensor candidate_selector.hidden_projection.weight"):
        load_hf_drafter(folder, target[1])


def steer_selector(ref, t_model, nxt, mask_id):
    """Makes the selector decide: the mask slots' final hidden about a fixed vector (the final norm
    steered onto the mask embedding, layers damped), a flat unary (``output_multiplier`` small) and
    codebooks that score ``c`` after ``p`` high when ``c == nxt[p]`` (the target's greedy bigrams)."""
    with torch.no_grad():
        for layer in ref.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[1].mul_(0.1)
        m = t_model.get_input_embeddings().weight[mask_id]
        m = m / m.pow(2).mean().sqrt()
        e = torch.randn(H)
        ref.norm.weight.copy_(3.0 * e / m)
        r = ref.candidate_selector.hidden_projection.weight.shape[0]
        ref.candidate_selector.hidden_projection.weight.copy_((e / e.dot(e))[None].expand(r, H) * 3.0)
        pred, succ = ref.candidate_selector.predecessor_codebook.weight, ref.candidate_selector.successor_codebook.weight
        pred.zero_()
        succ.zero_()
        for p, c in nxt.items():
            pred[p, p % r] = 1.0
            succ[c, p % r] += 2.0


def test_same_tokens_and_verify_steps_as_zlab_dflash_generate(target, tmp_path):
    """Greedy decoding with a DFlash2 drafter whose selector decides what is accepted gives z-lab's
    ``dflash_generate`` ids and acceptance lengths; with ``selector_top_k = 1`` (the argmax) fewer
    drafts are accepted."""
    t_model, t_cfg, t_params = target
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 24
    free = hf_greedy(t_model, prompt, n)
    seq = prompt + free
    nxt = {}
    for a, b in zip(seq, seq[1:]):
        nxt.setdefault(a, b)
    ref = make_dflash2(tmp_path / "tmp", 5, selector_top_k=V, selector_rank=V, output_multiplier=0.02)
    steer_selector(ref, t_model, nxt, V - 1)
    save_published(ref, tmp_path)
    want, accepted = zlab_generate(zlab, ref, t_model, prompt, n, block_size=4)
    assert max(accepted) > 1, "the steered selector should get some blocks accepted"
    d = load_hf_drafter(tmp_path, t_cfg)
    got, lengths = _ours_steps(t_cfg, t_params, prompt, n, d)
    assert got == want == free and lengths == accepted
    argmax_only = (d[0].__class__(**{**d[0].__dict__, "selector_top_k": 1}), d[1])
    got1, lengths1 = _ours_steps(t_cfg, t_params, prompt, n, argmax_only)
    assert got1 == free and len(lengths1) > len(lengths), "the selector should decide which drafts are accepted"


def _ours_steps(t_cfg, t_params, prompt, n, d):
    """Our greedy DFlash decode, one step at a time: ``(tokens, tokens committed per verify step)``."""
    from dflash_jax.decode import loop as decode

    static, params = Decoding(t_cfg, d[0]), Params(t_params, d[1])
    st = decode.prefill(params, decode.init_state(static, [prompt], 64, n), static, 4)
    lengths = []
    while not bool(st.done[0]):
        before = int(st.length[0])
        st = decode.decode_step(params, st, static)
        lengths.append(int(st.length[0]) - before)
    return [int(t) for t in np.asarray(st.tokens[0, len(prompt): int(st.length[0])])], lengths


TINY2 = dict(architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)


@pytest.fixture(scope="module")
def tiny():
    from dflash_jax.testing import tiny_drafter, tiny_target

    cfg, params = tiny_target("llama", seed=3, scale=0.5, vocab_size=12)
    return (cfg, params), tiny_drafter(cfg, seed=2, block_size=5, layer_ids=(0, 2), scale=0.5, **TINY2)


def _run(target, d, prompts, n, sampling=None, mode="argmax", tree=None, n_max=None, seed=7):
    from dflash_jax.decode import loop as decode
    from test_spec import auto_policy
    from dflash_jax.decode.sampling import SamplingConfig

    (cfg, params), (dcfg, dparams) = target, d if d is not None else (None, None)
    static, weights = Decoding(cfg, dcfg, mode, n_max, tree=tree), Params(params, dparams)
    if n_max == "auto":
        weights = weights._replace(depth=auto_policy(static.depth))
    st = decode.init_state(static, prompts, 48, n, seed=seed, sampling=sampling or SamplingConfig())
    st = decode.decode_loop(weights, decode.prefill(weights, st, static, 4), static)
    return [np.asarray(st.tokens[b, len(p): int(st.length[b])]).tolist() for b, p in enumerate(prompts)], st


PROMPTS = [[3, 7, 4, 8, 1], [5, 9, 2]]


def test_seeded_sampled_answer_is_independent_of_the_drafter(tiny):
    """A seeded sampled answer is the target's sample with the row's key: the same with a DFlash2
    drafter drafting from its selector's q (coupled by the positions' uniforms), with its greedy
    path, and without a drafter; some drafts are accepted."""
    from dflash_jax.decode.sampling import SamplingConfig

    target, d = tiny
    s = SamplingConfig(0.9, top_k=6)
    prompts = PROMPTS + [PROMPTS[0]] * 4  # each row its own key
    plain, _ = _run(target, None, prompts, 16, s)
    sampled, st = _run(target, d, prompts, 16, s, mode="sample")
    greedy_path, _ = _run(target, d, prompts, 16, s)
    assert sampled == plain == greedy_path
    assert int(np.asarray(st.speculative.accepted).sum()) > 0


def test_trees_and_auto_width_with_dflash2_equal_plain_greedy(tiny):
    """Greedy chains (layers stacked or held per layer), best-first trees ranked by the selector's
    pairwise scores and the adaptive width all give plain greedy decoding's tokens with a DFlash2 drafter."""
    target, d = tiny
    plain, _ = _run(target, None, PROMPTS, 20)
    chain, _ = _run(target, d, PROMPTS, 20)
    tree, _ = _run(target, d, PROMPTS, 20, tree=7)
    auto, _ = _run(target, d, PROMPTS, 20, n_max="auto")
    from dflash_jax.nn.params import unstack_layers

    per_layer, _ = _run(target, (d[0], unstack_layers(d[1])), PROMPTS, 20)  # the CPU inference layout
    assert chain == tree == auto == per_layer == plain
    from dflash_jax.decode.auto.costs import CostModel
    from test_tree import run_auto_tree

    chooses = CostModel(step_cost=((1.3, 1.6),), plain_cost=(1.0,), widths=(3, 7))
    st = run_auto_tree(target, d, PROMPTS, 20, chooses)
    assert [np.asarray(st.tokens[b, len(p): int(st.length[b])]).tolist() for b, p in enumerate(PROMPTS)] == plain


def test_tree_ranks_children_by_the_selector(tiny):
    """The tree's root children are the first slot's candidates in the selector's order after the
    anchor, and its deepest first-child chain is the selector's greedy path."""
    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.step import draft_pass
    from dflash_jax.decode.tree import build_tree, tree_inputs, tree_of

    (cfg, params), (dcfg, dparams) = tiny
    static, weights = Decoding(cfg, dcfg, tree=12), Params(params, dparams)
    st = decode.prefill(weights, decode.init_state(static, PROMPTS, 48, 8), static, 4)
    lg, _, hidden, anchor = draft_pass(weights, st, static)
    x = drafter.selector_inputs(dparams, dcfg, hidden, lg)
    path, _ = drafter.select(dparams, dcfg, x, anchor)
    tree, _ = tree_of(weights, static, *tree_inputs(weights, st, static))
    tokens, parent, rank = (np.asarray(a) for a in (tree.tokens, tree.parent, tree.rank))
    for b in range(len(PROMPTS)):
        first = [i for i in range(12) if rank[b, i] == 0]
        node, walk = -1, []
        while True:  # follow each node's first child from the anchor
            nxt = [i for i in first if parent[b, i] == node + 1]
            if not nxt:
                break
            node = nxt[0]
            walk.append(int(tokens[b, node]))
        assert walk and walk == np.asarray(path)[b, : len(walk)].tolist()
        root = [int(tokens[b, i]) for i in range(12) if parent[b, i] == 0]
        scores = np.asarray(drafter.selector_scores(dparams, x, 0, anchor))[b]
        want = np.asarray(x.candidates)[b, 0][np.argsort(-scores)].tolist()
        assert root == want[: len(root)]
    assert np.asarray(build_tree(lg, 12)[1].rank).shape == (2, 12)


# The drafter reaches a target only through the family contract (embed, lm_head, captured features,
# the shared draft pass of drafter/generic.py), which tests/test_family_*.py check with the generic
# drafter against z-lab for every family. DFlash2 decoding on llama (the dense family) is the tests
# above; here the families whose drafter-facing path differs in kind: gemma4 (scaled embedding,
# per-layer inputs, soft-capped logits) and qwen3_5 (recurrent state: no trees, verify keeps
# per-position states). laguna, qwen3_moe and gpt_oss take the dense path (plain embedding and head,
# a KV cache, trees), so their cases were merged into these.
DRAFTER_PATHS = ("gemma4", "qwen3_5")


def _families():
    from dflash_jax.families import registry

    return [f for f in registry.TARGET_FAMILIES if f.name in DRAFTER_PATHS]


def test_the_drafter_path_families_are_registered():
    assert len(_families()) == len(DRAFTER_PATHS)


@pytest.mark.parametrize("fam", _families(), ids=lambda f: f.name)
def test_families_of_a_distinct_drafter_path_draft_with_dflash2(fam):
    """gemma4 and qwen3_5 take a DFlash2 drafter through the drafter API they give a generic one
    (embed, lm_head, captured features): greedy DFlash2 decoding equals plain greedy decoding."""
    import jax

    from dflash_jax.testing import tiny_drafter
    from test_families import TINY_HF

    cfg = fam.parse_hf(TINY_HF[fam.name], f"{fam.name}/config.json")
    params = fam.model.init_params(cfg, jax.random.key(0), 0.3)
    d = tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 1), **dict(TINY2, selector_top_k=3))
    prompts = [[1, 5, 9, 3, 7], [2, 4]]
    plain, _ = _run((cfg, params), None, prompts, 10)
    spec, st = _run((cfg, params), d, prompts, 10)
    assert spec == plain and int(np.asarray(st.speculative.verify_steps).max()) > 0
