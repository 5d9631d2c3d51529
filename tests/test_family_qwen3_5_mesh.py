"""The Qwen3.5 hybrid target on a device mesh and behind the server (continuous batching).

Oracle: the same generation on one device. In a subprocess with 4 CPU devices, a tiny random
``Qwen3_5ForCausalLM`` (with the byte tokenizer of ``tiny_hf``) is loaded with
``mesh="data=2,model=2"``: the linear layers' heads, the recurrent states' heads and the rows are
split; plain and DFlash answers equal the one-device ones, and the OpenAI server (its batch swaps
rows through the states' declared batch axes; the prefix cache is off for this family) answers
as ``generate`` does.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_cpu_devices

pytest.importorskip("transformers")

_SCRIPT = textwrap.dedent(
    """
    import sys, tempfile, pathlib
    sys.path.insert(0, "tests")
    import jax, torch, transformers
    jax.config.update("jax_default_matmul_precision", "highest")
    import openai
    import tiny_hf
    from serve_util import serve_in_thread
    import dflash_jax as dj
    from dflash_jax.runtime import sharding
    from dflash_jax.loading import Drafter
    from dflash_jax.drafter import model as drafter_model
    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel
    from dflash_jax.testing import tiny_drafter

    assert len(jax.devices()) == 4, jax.devices()
    conf = transformers.Qwen3_5TextConfig(
        vocab_size=tiny_hf.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"] * 2, eos_token_id=tiny_hf.IM_END,
        max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(conf).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.log(torch.rand_like(p) * 2 + 0.5) if name.endswith("A_log") else 0.3 * torch.randn_like(p))
    folder = pathlib.Path(tempfile.mkdtemp())
    model.save_pretrained(folder)
    tiny_hf.write_tokenizer(folder)
    one, meshed = dj.load_target(folder), dj.load_target(folder, mesh="data=2,model=2")
    wv = meshed.params["linear"]["wv"]
    assert wv.sharding.shard_shape(wv.shape) == (2, 32, 16), wv.sharding
    cfg, params = tiny_drafter(one.cfg, seed=3, layer_ids=(0, 3), block_size=4)
    drafters = (Drafter(cfg=cfg, params=params, source="tiny"),
                Drafter(cfg=cfg, params=sharding.shard_params(params, drafter_model.param_axes(cfg), meshed.mesh), source="tiny"))
    prompts = [[5, 9, 17, 3, 40, 2], [40, 2, 7], [1, 2, 3, 4], [9, 9]]
    for spec in (False, True):
        kw = dict(n_max=3, drafter=drafters[0]) if spec else {}
        a = dj.generate(one, prompts, max_new_tokens=16, ignore_eos=True, max_len=64, **kw)
        kw = dict(n_max=3, drafter=drafters[1]) if spec else {}
        b = dj.generate(meshed, prompts, max_new_tokens=16, ignore_eos=True, max_len=64, **kw)
        assert a.output_ids == b.output_ids, (spec, a.output_ids, b.output_ids)

    want = a.texts  # one device, DFlash: the server's oracle (its own batch of 2 rows on the mesh)
    engine = Engine(ServedModel(meshed, drafters[1], name="tiny", n_max=3), max_batch=2, max_len=64)
    url, stop = serve_in_thread(build_app(engine))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for i in (2, 1):
            got = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
            text = want[i]
            assert got.choices[0].text == text, (got.choices[0].text, text)
        assert engine._batch.prefix is None  # no K/V per position in the linear layers: the prefix cache stays off
        assert engine._batch.state.cache.rec.sharding.mesh.shape["model"] == 2
    finally:
        stop()
    print("OK")
    """
)


@pytest.mark.slow
def test_qwen3_5_on_a_mesh_and_behind_the_server_answers_as_on_one_device():
    run_on_cpu_devices(_SCRIPT, 4)
