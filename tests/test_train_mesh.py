"""Training beyond one device (issue 33): the step on a device mesh, and 2 processes on loopback.

Oracles: the same run on one device (float32, ``jax_default_matmul_precision=highest``: a mesh
changes only the order of float additions, so the losses and parameters agree to a tight
tolerance, stated below); and for the 2-process run, the uninterrupted 2-process run itself (a
run paused at a checkpoint and resumed by two new processes ends with the same parameters bit for
bit, and a run restarted without its checkpoint does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import run_on_cpu_devices, xla_flags
from serve_util import free_port

# float32 on CPU, 5 AdamW steps at lr 1e-2 (each moves a weight by up to 1e-2): observed, the logged losses (5 decimals)
# agree to a last-digit flip and the parameters to 2.3e-6 absolute; a wrong row or a lost gradient term moves them by ~1e-2
RTOL, ATOL = 2e-5, 5e-6

_COMMON = textwrap.dedent(
    """
    import json, sys, tempfile, pathlib
    import numpy as np
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from dflash_jax.testing import tiny_target, tiny_drafter
    from dflash_jax.train.data import Batcher, TokenDataset
    from dflash_jax.train.trainer import TrainConfig, train

    def dataset(n=10, seed=0):
        rs = np.random.RandomState(seed)
        seqs = [rs.randint(0, 120, rs.randint(10, 24)).tolist() for _ in range(n)]
        return TokenDataset.from_sequences(seqs, [[0] * 3 + [1] * (len(s) - 3) for s in seqs])

    t_cfg, t_params = tiny_target("llama", seed=0)
    d_cfg, _ = tiny_drafter(t_cfg, layer_ids=(0, 2), block_size=4)
    ds = dataset()
    """
)

_MESH = _COMMON + textwrap.dedent(
    """
    from dflash_jax.errors import DFlashError
    from dflash_jax.cli.train import main
    assert len(jax.devices()) == 4
    tc = TrainConfig(steps=5, batch_size=4, max_len=24, num_anchors=4, lr=1e-2, warmup_ratio=0.2, seed=3, draft_vocab=64)
    tmp = pathlib.Path(tempfile.mkdtemp())
    got = {}
    for mesh in (None, "data=2", "data=2,model=2"):
        losses = []
        st, s = train(tmp / str(mesh), target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=Batcher(ds, 4, 24, seed=3), tc=tc,
                      progress=False, mesh=mesh, on_step=lambda i, m: losses.append(m["loss"]))
        assert s["finished"] and s["step"] == 5
        got[str(mesh)] = dict(losses=losses, tokens=s["tokens_seen"], spec=str(st.params["layers"]["wq"].sharding.spec) if mesh else None,
                              params={jax.tree_util.keystr(p): np.asarray(x).tolist() for p, x in jax.tree_util.tree_leaves_with_path(st.params)})
    part = train(tmp / "cross", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=Batcher(ds, 4, 24, seed=3), tc=tc,
                 progress=False, mesh="data=2,model=2", stop_at=3)[1]
    st, s = train(tmp / "cross", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=Batcher(ds, 4, 24, seed=3), tc=tc,
                  progress=False)  # resumed on one device
    assert part["step"] == 3 and not part["finished"] and s["start"] == 3 and s["finished"]
    got["cross"] = dict(params={jax.tree_util.keystr(p): np.asarray(x).tolist() for p, x in jax.tree_util.tree_leaves_with_path(st.params)})
    try:
        train(tmp / "bad", target_params=t_params, target_cfg=t_cfg, cfg=d_cfg, batcher=Batcher(ds, 3, 24, seed=3), tc=TrainConfig(steps=2, batch_size=3, max_len=24),
              mesh="data=2")
        raise SystemExit("not refused")
    except DFlashError as e:
        got["bad_api"] = str(e)
    import contextlib, io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--data", str(tmp / "nowhere"), "--out", str(tmp / "cli"), "--mask-token-id", "127", "--batch-size", "6",
                     "--mesh", "data=4"])
    got["bad_cli"] = [code, err.getvalue()]
    print("RESULT", json.dumps(got))
    print("OK")
    """
)


def _result(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.slow
def test_a_data_and_model_mesh_trains_to_the_one_device_parameters():
    """data=2 and data=2,model=2 on 4 CPU devices: the same losses and parameters as one device
    after 5 AdamW steps (rtol 2e-5, atol 5e-6), the same tokens counted; the drafter's heads
    split over model; a run paused on the mesh resumes on one device to the same parameters; a
    batch size the data axis does not divide is refused naming ``--batch-size`` and ``--mesh``
    (the API, and the command line before it reads anything)."""
    got = _result(run_on_cpu_devices(_MESH, 4))
    one = got["None"]
    for mesh in ("data=2", "data=2,model=2"):
        g = got[mesh]
        assert g["tokens"] == one["tokens"]
        np.testing.assert_allclose(g["losses"], one["losses"], rtol=RTOL, atol=ATOL)
        assert g["params"].keys() == one["params"].keys()
        for k in one["params"]:
            np.testing.assert_allclose(np.asarray(g["params"][k]), np.asarray(one["params"][k]), rtol=RTOL, atol=ATOL, err_msg=f"{mesh} {k}")
    for k in one["params"]:  # paused on data=2,model=2, resumed on one device
        np.testing.assert_allclose(np.asarray(got["cross"]["params"][k]), np.asarray(one["params"][k]), rtol=RTOL, atol=ATOL, err_msg=k)
    assert "model" in got["data=2,model=2"]["spec"] and "model" not in got["data=2"]["spec"]
    assert got["bad_api"].startswith("--batch-size:") and "--mesh" in got["bad_api"] and "multiple of 2" in got["bad_api"]
    code, err = got["bad_cli"]  # refused before the (missing) data is read
    assert code == 2 and err.startswith("error: --batch-size: 6 rows") and "--mesh" in err and "multiple of 4" in err, err


def _two_processes(args: list, timeout: float = 300) -> list[str]:
    """Runs ``dflash-jax train ARGS`` as 2 processes of 2 CPU devices each on loopback
    (``--mesh data=2,model=2``); returns their stderr (asserting both exit 0)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_jax.train", *args, "--mesh", "data=2,model=2", "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-6000:]
    return [err for _, err in outs]


@pytest.mark.slow
def test_two_processes_resume_from_a_checkpoint_to_the_uninterrupted_parameters(tmp_path):
    """``dflash-jax train --mesh data=2,model=2`` as 2 processes x 2 CPU devices: 6 steps in one
    go, and 3 steps, a checkpoint, then 2 new processes that resume from it (they say so, at
    step 3) end with the same float32 parameters bit for bit; only process 0 prints and logs."""
    import jax
    import safetensors.numpy
    import tiny_gguf

    from dflash_jax.families.dense import model as dense
    from dflash_jax.train.data import TokenDataset

    cfg = tiny_gguf.tiny_cfg()
    params = dense.MODEL.init_params(cfg, jax.random.key(0), scale=0.2)
    target = tiny_gguf.write_model(tmp_path / "t.gguf", cfg, params)
    rs = np.random.RandomState(0)
    seqs = [rs.randint(0, 60, rs.randint(10, 24)).tolist() for _ in range(10)]
    TokenDataset.from_sequences(seqs, [[0] * 3 + [1] * (len(q) - 3) for q in seqs]).save(tmp_path / "data")
    (tmp_path / "eval.json").write_text(json.dumps({"ids": [seqs[0][:5]]}))
    common = ["--data", str(tmp_path / "data"), "--target", str(target), "--mask-token-id", "63", "--layers", "1",
              "--target-layer-ids", "0,1", "--block-size", "4", "--steps", "6", "--batch-size", "4", "--max-len", "24",
              "--num-anchors", "4", "--lr", "1e-2", "--no-progress", "--export-dtype", "float32",
              "--eval-prompts", str(tmp_path / "eval.json"), "--eval-max-new", "4"]
    full = _two_processes(common + ["--out", str(tmp_path / "full")])
    assert "step 6/6 (finished)" in full[0] and "exported" in full[0] and "resumed" not in full[0]
    assert "step 6/6" not in full[1] and "exported" not in full[1] and "data:" not in full[1]  # process 0 prints
    part = _two_processes(common + ["--out", str(tmp_path / "part"), "--stop-at", "3"])
    assert "step 3/6 (paused)" in part[0] and not (tmp_path / "part" / "drafter").exists()
    ck = tmp_path / "part" / "checkpoints" / "step_00000003"
    assert (ck / "state").is_dir() and json.loads((tmp_path / "part" / "checkpoints" / "latest.json").read_text())["step"] == 3
    resumed = _two_processes(common + ["--out", str(tmp_path / "part")])
    assert "step 6/6 (finished); resumed at step 3" in resumed[0]
    want = safetensors.numpy.load_file(str(tmp_path / "full" / "drafter" / "model.safetensors"))
    got = safetensors.numpy.load_file(str(tmp_path / "part" / "drafter" / "model.safetensors"))
    assert want.keys() == got.keys() and all(v.dtype == np.float32 for v in want.values())
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    logs = [[json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("full", "part")]
    assert [r["step"] for r in logs[1]] == list(range(1, 7))
    assert [(r["loss"], r["tokens_seen"]) for r in logs[1]] == [(r["loss"], r["tokens_seen"]) for r in logs[0]]
    tau = [json.loads((tmp_path / d / "tau_curve.json").read_text()) for d in ("full", "part")]
    assert [r["step"] for r in tau[0]] == [0, 6] and tau[1] == [dict(r, seconds=r2["seconds"]) for r, r2 in zip(tau[0], tau[1])]


@pytest.mark.parametrize("argv,what", [(["--mesh", "data=2"], "error: --mesh: "),  # this process has 1 device
                                       (["--mesh", "rows=2"], "error: --mesh: "),
                                       (["--coordinator", "nohost"], "error: --coordinator: "),
                                       (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "error: --process-id: ")])
def test_bad_mesh_and_process_options_of_train_are_refused_before_anything_loads(capsys, tmp_path, argv, what):
    from dflash_jax.cli.train import main

    assert main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"), "--mask-token-id", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(what) and err.count("\n") == 1, err
