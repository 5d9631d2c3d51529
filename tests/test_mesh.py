"""A device mesh from the API, the command line and the server (issue: beyond one device).

Oracle: the same generation on one device. The mesh runs in a subprocess with 4 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): ``load_target(mesh="data=2,model=2")``
lays the parameters out by their logical axes, ``generate`` and the server lay their decode
states out on it, and every answer is the one-device answer (float32, greedy; plain and DFlash).
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_cpu_devices

from dflash_jax.cli.main import main

_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys, tempfile, pathlib
    sys.path.insert(0, "tests")
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import openai
    import tiny_hf
    from serve_util import serve_in_thread
    import dflash_jax as dj
    from dflash_jax.runtime import sharding
    from dflash_jax.cli.main import main
    from dflash_jax.loading import Drafter
    from dflash_jax.drafter import model as drafter_model
    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel
    from dflash_jax.testing import tiny_drafter

    assert len(jax.devices()) == 4, jax.devices()
    folder = tiny_hf.make_tiny_hf(pathlib.Path(tempfile.mkdtemp()))
    one, meshed = dj.load_target(folder), dj.load_target(folder, mesh="data=2,model=2")
    wq = meshed.params["layers"][0]["wq"]
    assert wq.sharding.shard_shape(wq.shape) == (wq.shape[0], wq.shape[1] // 2), wq.sharding
    cfg, params = tiny_drafter(one.cfg, seed=3, layer_ids=(0, 1), block_size=4)
    drafters = (Drafter(cfg=cfg, params=params, source="tiny"),
                Drafter(cfg=cfg, params=sharding.shard_params(params, drafter_model.param_axes(cfg), meshed.mesh), source="tiny"))
    prompts = [[5, 9, 17, 3, 40, 2], [40, 2, 7], [1, 2, 3, 4], [9, 9]]
    for spec in (False, True):
        kw = dict(n_max=3) if spec else {}
        a = dj.generate(one, prompts, max_new_tokens=24, drafter=drafters[0] if spec else None, ignore_eos=True, **kw)
        b = dj.generate(meshed, prompts, max_new_tokens=24, drafter=drafters[1] if spec else None, ignore_eos=True, **kw)
        assert a.output_ids == b.output_ids, (spec, a.output_ids, b.output_ids)
        if spec:
            assert {k: a.stats[k] for k in ("drafted_tokens", "accepted_tokens")} == {k: b.stats[k] for k in ("drafted_tokens", "accepted_tokens")}

    def cli(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["generate", "hello", "--target", str(folder), "--no-spec", "--max-new-tokens", "12", "--json", *extra]) == 0
        return json.loads(out.getvalue())["output_ids"]

    assert cli("--mesh", "data=2,model=2") == cli()

    want = a.texts[2]  # one device, DFlash, prompt [1, 2, 3, 4]: the server's oracle (its own batch on the mesh)
    engine = Engine(ServedModel(meshed, drafters[1], name="tiny", n_max=3), max_batch=2, max_len=128)
    url, stop = serve_in_thread(build_app(engine))
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = c.completions.create(model="tiny", prompt=prompts[2], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want, (got.choices[0].text, want)
        assert engine._batch.state.cache.k.sharding.mesh.shape["model"] == 2
    finally:
        stop()
    print("OK")
    """
)


@pytest.mark.slow
def test_generate_the_cli_and_the_server_on_a_mesh_answer_as_on_one_device():
    run_on_cpu_devices(_SCRIPT, 4)


@pytest.mark.parametrize("spec,what", [("data=2", "2 devices asked for, 1 available"), ("rows=2", "'rows=2'"),
                                       ("data=0", "'data=0'"), ("data=2,data=1", "'data=1'"), ("", "got ''")])
def test_a_bad_mesh_is_refused_before_anything_loads(capsys, spec, what):
    assert main(["generate", "hi", "--mesh", spec]) == 2
    err = capsys.readouterr().err
    assert "--mesh" in err and what in err, err


_LAGUNA = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import dflash_jax as dj
    from dflash_jax.runtime import sharding
    from dflash_jax.loading import Drafter, Target
    from dflash_jax.drafter import model as drafter_model
    from dflash_jax.families.laguna import model as laguna
    from dflash_jax.drafter.model import drafter_config_from_hf
    from laguna_tiny import LAGUNA_DRAFTER, PER_HEAD, tiny_laguna

    cfg, params = tiny_laguna(PER_HEAD, seed=4, max_block=4)
    dcfg = drafter_config_from_hf(LAGUNA_DRAFTER)
    dparams = drafter_model.init_params(dcfg, jax.random.key(7), scale=0.3)
    mesh = sharding.parse_mesh("data=1,model=2,expert=2")
    one = Target(cfg=cfg, params=params, source="tiny-laguna", eos_ids=())
    meshed = Target(cfg=cfg, params=sharding.shard_params(params, laguna.MODEL.param_axes(cfg), mesh), source="tiny-laguna", eos_ids=(), mesh=mesh)
    experts = [x for x in jax.tree_util.tree_leaves(meshed.params) if x.ndim >= 3 and x.shape[-3:-2] == (cfg.num_experts,)]
    assert experts and all(x.sharding.shard_shape(x.shape)[-3] == cfg.num_experts // 2 for x in experts), [x.sharding for x in experts]
    drafters = (Drafter(cfg=dcfg, params=dparams, source="d"),
                Drafter(cfg=dcfg, params=sharding.shard_params(dparams, drafter_model.param_axes(dcfg), mesh), source="d"))
    prompts = [[5, 9, 17, 3, 40, 2, 7, 8], [40, 2, 7]]
    for spec in (False, True):
        kw = dict(n_max=3) if spec else {}
        a = dj.generate(one, prompts, max_new_tokens=20, drafter=drafters[0] if spec else None, ignore_eos=True, chunk_size=4, **kw)
        b = dj.generate(meshed, prompts, max_new_tokens=20, drafter=drafters[1] if spec else None, ignore_eos=True, chunk_size=4, **kw)
        assert a.output_ids == b.output_ids, (spec, a.output_ids, b.output_ids)
        if spec:
            assert a.stats["accepted_tokens"] == b.stats["accepted_tokens"]
    print("OK")
    """
)


@pytest.mark.slow
def test_laguna_with_experts_and_heads_over_a_mesh_answers_as_on_one_device():
    """Expert parallel (the MoE layers' experts over ``expert``) and tensor parallel (heads over
    ``model``) for a Laguna target with its drafter, plain and DFlash, with chunked prefill."""
    run_on_cpu_devices(_LAGUNA, 4)
