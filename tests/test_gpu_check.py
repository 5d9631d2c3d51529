"""tools/gpu_check.py, the prepared check for a lent GPU: its dry run (the same code on tiny shapes)
runs end to end on the CPU, so the script cannot rot before a GPU is lent; its plans fit; and the
bytes it counts per decode step (:mod:`dflash_jax.shapes`) are the ones a step must read. The
script runs as a program (tools/ is never put on ``sys.path``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from dflash_jax import shapes as gpu_shapes
from dflash_jax.families.dense import model as dense
from dflash_jax.families.laguna import model as laguna

REPO = Path(__file__).resolve().parents[1]


def gpu_check(*argv) -> subprocess.CompletedProcess:
    """``python tools/gpu_check.py ARGV`` from the repository root."""
    return subprocess.run([sys.executable, "tools/gpu_check.py", *map(str, argv)], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    r = gpu_check("--dry-run", "--out", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return out, json.loads((out / "gpu_check.json").read_text(encoding="utf-8")), r.stdout


@pytest.mark.slow  # the dry run: ten runs of tiny shapes, each compiling its programs (3-5 min)
def test_dry_run_measures_every_section(dry_run):
    out, res, stdout = dry_run
    runs = {(e["shape"], e["dtype"]): e for e in res["runs"]}
    assert set(runs) == {("qwen3-8b", "bfloat16"), ("qwen3-8b-fp8", "bfloat16"), ("laguna-xs-2.1", "bfloat16"), ("smollm2-135m", "float32"),
                         ("qwen3-coder-30b-a3b", "bfloat16"), ("gpt-oss-20b", "bfloat16"), ("qwen3.8-27b", "bfloat16"), ("laguna-xs-2.1 q4_k_m", "bfloat16"),
                         ("gpt-oss-20b mxfp4", "bfloat16")}
    for quantized, float_entry in (("laguna-xs-2.1 q4_k_m", "laguna-xs-2.1"), ("gpt-oss-20b mxfp4", "gpt-oss-20b")):
        assert runs[(quantized, "bfloat16")]["weights_bytes"] < runs[(float_entry, "bfloat16")]["weights_bytes"]
    assert all(not e.get("skipped") for e in runs.values()), [e.get("skipped") for e in runs.values()]
    qwen = runs[("qwen3-8b", "bfloat16")]
    assert [d["live"] for d in qwen["decode"]] == [64, 200]
    assert sorted(v["width"] for v in qwen["verify"]) == [1, 4]  # the fill-in run joined the entry
    for e in runs.values():
        assert e["decode"] and e["verify"] and e["dflash"] and e["compile_s"]["plain loop"] > 0
        for d in e["decode"]:
            assert d["steps"] == 8 and d["step_ms"] > 0 and d["weight_bytes"] > 0 and d["kv_bytes"] > 0 and d["hbm_fraction"] > 0
        for d in e["dflash"]:  # the scripted acceptance is exact: accepted drafts plus the bonus token per step
            assert d["steps"] == 8 and d["tau"] == d["accept"] + 1 and d["tokens_per_s"] > 0
    assert [d["tree"] for d in qwen["dflash"] if d["tree"]] == [5] and qwen["compile_s"]["tree 5 loop"] > 0
    fp8 = runs[("qwen3-8b-fp8", "bfloat16")]  # one byte a linear weight: fewer weight bytes than bf16's
    assert fp8["weights_bytes"] < qwen["weights_bytes"] and fp8["decode"][0]["weight_bytes"] < qwen["decode"][0]["weight_bytes"]
    o = res["oracle_tests"]
    assert o["passed"] >= 1 and o["failed"] == 0 and not o["timed_out"], o
    assert (out / "oracle_tests.log").read_text().count(" PASSED") == o["passed"]
    m = res["mesh"]
    assert m["runs"] and m["same_tokens"] and m["error"] is None and m["devices"] == 1, m
    md = (out / "gpu_check.md").read_text(encoding="utf-8")
    for heading in ("Oracle tests on the device", "Mesh", "Weights in device memory", "Decode step and HBM bandwidth", "Decode step against live length", "Verify cost",
                    "DFlash tokens/s against acceptance", "Compile times"):
        assert f"### {heading}" in md and f"### {heading}" in stdout
    assert "Skipped" not in md


@pytest.mark.slow
def test_merge_puts_the_section_into_benchmarks_once(dry_run, tmp_path):
    """``--merge`` twice: the section replaces the placeholder once."""
    out, _, _ = dry_run
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\n<!-- gpu_check device -->\nno device lent yet\n<!-- /gpu_check device -->\n", encoding="utf-8")
    for _ in range(2):
        r = gpu_check("--merge", out / "gpu_check.md", "--benchmarks", bench)
        assert r.returncode == 0, r.stderr
    text = bench.read_text(encoding="utf-8")
    assert "no device lent yet" not in text and text.count("<!-- gpu_check device -->") == 1
    assert (out / "gpu_check.md").read_text(encoding="utf-8").strip() in text


def test_bytes_per_decode_step():
    """Every weight once, but one embedding row when the LM head is separate and only the top-k
    experts of a MoE; the live K/V rows, a sliding layer's at most its window."""
    for name, tied in (("smollm2-135m", True), ("qwen3-8b", False)):
        cfg, dcfg = gpu_shapes.configs(name, "bfloat16", tiny=True)
        params, _ = jax.eval_shape(lambda: gpu_shapes.random_models(cfg, dcfg))
        total = gpu_shapes.tree_bytes(params)
        embed = params["embed"].size * 2
        assert gpu_shapes.weight_bytes_per_token(params, cfg) == (total if tied else total - embed + cfg.hidden_size * 2)
        cache = jax.eval_shape(lambda: dense.MODEL.init_cache(cfg, 1, 64))
        per_row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # k and v, bf16
        assert gpu_shapes.kv_bytes_live(cache, 64, 10) == 10 * per_row
    cfg, dcfg = gpu_shapes.configs("laguna-xs-2.1", "bfloat16", tiny=True)
    params, _ = jax.eval_shape(lambda: gpu_shapes.random_models(cfg, dcfg))
    experts = sum(x.size * 2 for k, x in jax.tree_util.tree_leaves_with_path(params) if jax.tree_util.keystr(k[-1:]) in ("['e_gate']", "['e_up']", "['e_down']"))
    rest = gpu_shapes.tree_bytes(params) - experts - params["embed"].size * 2 + cfg.hidden_size * 2
    assert gpu_shapes.weight_bytes_per_token(params, cfg) == rest + experts * cfg.num_experts_per_tok // cfg.num_experts
    cache = jax.eval_shape(lambda: laguna.MODEL.init_cache(cfg, 1, 256))
    full = sum(cfg.layer_types[i] == "full_attention" for i in range(cfg.num_hidden_layers))
    per_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    live = cfg.sliding_window + 40
    want = per_row * (full * live + (cfg.num_hidden_layers - full) * cfg.sliding_window)
    assert gpu_shapes.kv_bytes_live(cache, 256, live, cfg.sliding_window) == want


def test_the_gpu_plans_fit_their_capacity_and_the_h200():
    """The full and quick plans never run here: their lengths, blocks and widths fit the capacity
    (and a Laguna target's rings),
    DFlash runs at a context the same model decodes at, and the weights fit an H200 (139 GiB; the
    check lets JAX take 90%) with room for temporaries."""
    r = gpu_check("--plans")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)
    assert set(plans) == {"full", "quick", "dry-run"}
    for name, plan in plans.items():
        plan = SimpleNamespace(**plan)
        decoded = set()
        for run in map(lambda r: SimpleNamespace(**r), plan.runs):
            cfg, dcfg = gpu_shapes.configs(run.shape, run.dtype, plan.tiny)
            decoded |= {(run.shape, run.dtype, n) for n in run.lengths}
            assert all(n + plan.steps + 1 <= plan.capacity for n in run.lengths), (name, run)
            assert run.context + max(run.widths) <= plan.capacity, (name, run)
            assert max(run.widths) <= getattr(cfg, "max_block", 16), (name, run)  # Laguna: what its rings hold past the length
            if run.accepts:
                assert (run.shape, run.dtype, run.context) in decoded, (name, run)
                assert max(run.accepts) < dcfg.block_size and run.context + 1 + plan.steps * (max(run.accepts) + 1) <= plan.capacity
            if not plan.tiny:
                target, drafter = jax.eval_shape(lambda: gpu_shapes.random_models(cfg, dcfg))
                assert gpu_shapes.tree_bytes(target) + gpu_shapes.tree_bytes(drafter) < 0.6 * 139 * 2**30, (name, run)


def test_qwen3_coder_30b_a3b_real_shapes():
    """The Qwen3-Coder-30B-A3B shapes hold its published parameter count (30.5B) and 3.3B active
    (top-8 of 128 experts), all 48 layers sparse in one segment, experts on the ``experts`` axis."""
    cfg, dcfg = gpu_shapes.configs("qwen3-coder-30b-a3b", "bfloat16")
    assert all(cfg.sparse_layers) and cfg.num_hidden_layers == 48 and cfg.norm_topk_prob and dcfg.hidden_size == cfg.hidden_size
    target, _ = jax.eval_shape(lambda: gpu_shapes.random_models(cfg, dcfg))
    assert sorted(target) == ["embed", "lm_head", "norm", "seg0_0"] and target["seg0_0"]["e_gate"].shape == (48, 128, 2048, 768)
    assert 30.4e9 < gpu_shapes.tree_bytes(target) / 2 < 30.6e9
    active = gpu_shapes.weight_bytes_per_token(target, cfg) / 2 + cfg.vocab_size * cfg.hidden_size  # plus the embedding table
    assert 3.2e9 < active < 3.4e9
    from dflash_jax.families.registry import module_for
    assert module_for(cfg).param_axes(cfg)["seg0_0"]["e_up"] == ("layers", "experts", "embed", "expert_mlp")


def test_gpt_oss_20b_real_shapes():
    """The gpt-oss-20b shapes hold its published parameter count (20.9B) and 3.6B active per token
    (top-4 of 32 experts, the unembedding counted, the embedding table not), alternating
    sliding / full layers as one segment of period 2, YaRN 32 over 4096."""
    cfg, dcfg = gpu_shapes.configs("gpt-oss-20b", "bfloat16")
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 12 and cfg.sliding_window == 128
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 32 and cfg.rope.original_max_position_embeddings == 4096
    assert dcfg.hidden_size == cfg.hidden_size == 2880
    target, _ = jax.eval_shape(lambda: gpu_shapes.random_models(cfg, dcfg))
    assert sorted(target) == ["embed", "lm_head", "norm", "seg0_0", "seg0_1"] and target["seg0_1"]["e_down"].shape == (12, 32, 2880, 2880)
    assert 20.85e9 < gpu_shapes.tree_bytes(target) / 2 < 20.95e9
    assert 3.55e9 < gpu_shapes.weight_bytes_per_token(target, cfg) / 2 < 3.65e9


def test_qwen3_8_27b_dflash2_real_shapes():
    """The Qwen3.8-27B shapes (assumed: Qwen3.5-27B's, :mod:`dflash_jax.shapes`) hold about 27B
    target parameters in 64 hybrid layers, and its DFlash2 drafter the specs' layout: 5 sliding
    layers, block 8, convolutions of 2 taps over groups of 16, a rank-256 selector over the top 16."""
    cfg, dcfg = gpu_shapes.configs("qwen3.8-27b", "bfloat16")
    assert cfg.num_hidden_layers == 64 and dcfg.architecture == "DFlash2DraftModel" and dcfg.target_layer_ids == (5, 19, 33, 47, 61)
    assert (dcfg.block_size, dcfg.conv_kernel_size, dcfg.conv_group_size, dcfg.selector_rank, dcfg.selector_top_k) == (8, 2, 16, 256, 16)
    assert dcfg.layer_window == (2048,) * 5 and all(dcfg.layer_causal)
    target, drafter = jax.eval_shape(lambda: gpu_shapes.random_models(cfg, dcfg))
    assert 25e9 < gpu_shapes.tree_bytes(target) / 2 < 29e9
    assert drafter["layers"]["attn_conv_proj"].shape == (5, 5120, 2 * 2 * 320) and drafter["selector"]["pred"].shape == (248320, 256)
    assert 1.7e9 < gpu_shapes.tree_bytes(drafter) / 2 < 2.0e9
