"""Two processes, one program (dflash_jax/runtime/distributed.py): ``generate`` through the API and the
command line on a ``data=2,model=2`` mesh over 2 processes x 2 CPU devices on loopback (JAX's
multi-controller runtime, gloo collectives) answers as one device does (float32, greedy; plain and
DFlash). Oracle: the same generations in this process, on one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from conftest import xla_flags
from serve_util import free_port

import dflash_jax as dj
from dflash_jax.cli.main import main
from dflash_jax.loading import Drafter
from dflash_jax.testing import tiny_drafter

PROMPTS = [[5, 9, 17, 3, 40, 2], [40, 2, 7], [1, 2, 3, 4], [9, 9]]

_WORKER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    sys.path.insert(0, "tests")
    pid, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    from dflash_jax.runtime import distributed
    assert distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import dflash_jax as dj
    from dflash_jax.runtime import sharding
    from dflash_jax.cli.main import main
    from dflash_jax.loading import Drafter
    from dflash_jax.drafter import model as drafter_model
    from dflash_jax.testing import tiny_drafter

    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    meshed = dj.load_target(folder, mesh="data=2,model=2")
    cfg, params = tiny_drafter(meshed.cfg, seed=3, layer_ids=(0, 1), block_size=4)
    d = Drafter(cfg=cfg, params=sharding.shard_params(params, drafter_model.param_axes(cfg), meshed.mesh), source="tiny")
    out = {}
    for name, kw in (("plain", {}), ("dflash", dict(drafter=d, n_max=3))):
        out[name] = dj.generate(meshed, PROMPTS, max_new_tokens=24, ignore_eos=True, **kw).output_ids
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", "--prompt-ids", "5,9,17", "--target", folder, "--no-spec", "--max-new-tokens", "12", "--json",
                     "--mesh", "data=2,model=2"]) == 0
    out["cli"] = json.loads(buf.getvalue())["output_ids"] if buf.getvalue() else None  # process 0 prints
    print("RESULT", json.dumps(out), flush=True)
    """
)


@pytest.mark.slow
def test_two_processes_answer_as_one_device(tmp_path):
    import tiny_hf

    folder = str(tiny_hf.make_tiny_hf(tmp_path / "tiny"))
    with jax.default_matmul_precision("highest"):
        one = dj.load_target(folder)
        cfg, params = tiny_drafter(one.cfg, seed=3, layer_ids=(0, 1), block_size=4)
        d = Drafter(cfg=cfg, params=params, source="tiny")
        want = {name: dj.generate(one, PROMPTS, max_new_tokens=24, ignore_eos=True, **kw).output_ids
                for name, kw in (("plain", {}), ("dflash", dict(drafter=d, n_max=3)))}
        want["cli"] = dj.generate(one, [[5, 9, 17]], max_new_tokens=12).output_ids[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = f"PROMPTS = {PROMPTS!r}\n" + _WORKER
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i), port, folder], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-6000:]
        assert "[Gloo]" not in out and "joining process" in err  # the collectives' lines go to stderr: stdout stays parseable
    got = [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[7:]) for out, _ in outs]
    assert got[0] == want
    assert {k: v for k, v in got[1].items() if k != "cli"} == {k: v for k, v in want.items() if k != "cli"} and got[1]["cli"] is None


@pytest.mark.parametrize("argv,option", [(["--coordinator", "nohost"], "--coordinator"),
                                         (["--coordinator", "127.0.0.1:1", "--num-processes", "0"], "--num-processes"),
                                         (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "--process-id")])
def test_bad_process_options_are_refused_before_joining(capsys, argv, option):
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {option}:" in err, err


_DIES = textwrap.dedent(
    """
    import os, sys, time
    pid, port = int(sys.argv[1]), sys.argv[2]
    from dflash_jax.runtime import distributed
    distributed.HEARTBEAT_TIMEOUT_S = 8  # the test waits for it: 8 s, not the 30 s of a real group
    distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import numpy as np
    from jax.experimental import multihost_utils
    if pid == 1:
        os._exit(3)  # dies after joining
    time.sleep(2)
    multihost_utils.process_allgather(np.arange(3))  # a collective the dead process never joins
    print("NOT REACHED", flush=True)
    """
)


@pytest.mark.slow
def test_a_process_that_dies_ends_the_group_with_an_error_not_a_hang():
    """Process 1 dies after joining; process 0, blocked in a collective, ends with an error naming
    the heartbeats, after ``distributed.HEARTBEAT_TIMEOUT_S`` (set to 8 s in the processes): well
    before JAX's own default of 100 s, so the value is the one ``initialize`` passes on."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(free_port())
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _DIES, str(i), port], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    (out, err), _ = procs[0].communicate(timeout=240), procs[1].communicate(timeout=240)
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0 and "NOT REACHED" not in out
    assert "stopped sending heartbeats" in err, err[-3000:]
    assert time.perf_counter() - t0 < 90  # 8 s of heartbeats plus start-up; JAX's default (100 s) would not fit


_JOIN = textwrap.dedent(
    """
    import sys
    from dflash_jax.runtime import distributed
    from dflash_jax.errors import DFlashError
    pid, port, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    try:
        distributed.initialize(f"127.0.0.1:{port}", n, pid)
    except DFlashError as e:
        print("REFUSED", e, flush=True)
        sys.exit(2)
    print("JOINED", flush=True)
    """
)


@pytest.mark.slow
def test_a_process_told_another_process_count_is_refused():
    """Process 1 says 3 processes where process 0 (the coordinator) said 2: process 1 stops with an
    error naming --num-processes (it used to run on silently)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _JOIN, str(i), port, n], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i, n in ((0, "2"), (1, "3"))]
    outs = [p.communicate(timeout=240) for p in procs]
    assert procs[1].returncode == 2 and "REFUSED --num-processes: 3 here, but the group" in outs[1][0], outs[1]


_BROADCAST = textwrap.dedent(
    """
    import json, sys
    pid, port = int(sys.argv[1]), sys.argv[2]
    from dflash_jax.runtime import distributed
    distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    from jax._src import distributed as jax_distributed
    channel = distributed.Broadcast("t")
    channel.EPOCH = 4
    if pid == 0:
        for i in range(40):
            channel.send(("m", i, b"x" * i))
    else:
        got = [channel.receive() for _ in range(40)]
        assert got == [("m", i, b"x" * i) for i in range(40)], got
    assert distributed.everywhere(True)  # process 1 has read all 40
    if pid == 0:
        channel.send("last")
        channel.send("last")
        channel.send("last")
        channel.send("last")  # the 44th: epochs everyone has read are deleted
        keys = sorted(k for k, _ in jax_distributed.global_state.client.key_value_dir_get_bytes("t/"))
        print("KEYS", json.dumps(keys), flush=True)
    else:
        assert [channel.receive() for _ in range(4)] == ["last"] * 4
    assert distributed.everywhere(True)
    """
)


def test_broadcast_delivers_in_order_and_forgets_what_every_process_read():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _BROADCAST, str(i), port], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    keys = json.loads(next(line for line in outs[0][0].splitlines() if line.startswith("KEYS"))[5:])
    # epochs 0-9 (messages 0-39) are gone; epoch 10 too if process 1 had read it when the 44th went out; the follower's mark stays
    assert keys in (["t/10/40", "t/10/41", "t/10/42", "t/10/43", "t/read/1"], ["t/read/1"]), keys


@pytest.mark.slow
def test_processes_started_by_a_cluster_manager_join_without_options(tmp_path):
    """Under SLURM (``srun -n 2`` sets these variables) ``generate`` with no process options joins
    the group JAX detects, and answers as one process does."""
    import tiny_hf

    folder = str(tiny_hf.make_tiny_hf(tmp_path / "tiny"))
    want = dj.generate(dj.load_target(folder), [[5, 9, 17]], max_new_tokens=8, ignore_eos=True).output_ids[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    slurm = dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", JAX_COORDINATOR_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_jax", "generate", "--prompt-ids", "5,9,17", "--target", folder, "--no-spec",
                               "--max-new-tokens", "8", "--ignore-eos", "--json", "--mesh", "data=2"], cwd=root,
                              env=dict(os.environ, JAX_PLATFORMS="cpu", SLURM_PROCID=str(i), SLURM_LOCALID=str(i), **slurm),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("SlurmCluster found: joining its processes" in err for _, err in outs), outs
    assert json.loads(outs[0][0])["output_ids"] == want and outs[1][0] == ""
