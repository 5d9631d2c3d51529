"""DFLASH_JAX_REQUIRE_ORACLES=1 (tests/oracle_switch.py, set by .ci/run) turns the skips of missing
oracles into failures and leaves every other skip alone; without it they stay skips."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

TESTS = Path(__file__).resolve().parent

MISSING_AT_COLLECTION = """
import pytest
pytest.importorskip("dflash.no_such_module")

def test_never_runs():
    pass
"""

MISSING_IN_TESTS = """
import pytest

@pytest.fixture
def oracle():
    return pytest.importorskip("transformers.no_such_module")

def test_fixture_oracle(oracle):
    pass

def test_oracle_too_old():
    pytest.skip("transformers without NoSuchForCausalLM")

def test_unrelated_skip():
    pytest.skip("one case is enough")

def test_runs():
    pass
"""


def _pytest(folder: Path, required: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_JAX_REQUIRE_ORACLES"}
    if required is not None:
        env["DFLASH_JAX_REQUIRE_ORACLES"] = required
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-p", "oracle_switch", "-p", "no:cacheprovider", "-q", "-rA", "--continue-on-collection-errors",
           "-o", "addopts=", str(folder)]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("required", [None, "0", "1"])
def test_oracle_skips_fail_only_when_required(tmp_path, required):
    (tmp_path / "test_collection.py").write_text(textwrap.dedent(MISSING_AT_COLLECTION))
    (tmp_path / "test_inside.py").write_text(textwrap.dedent(MISSING_IN_TESTS))
    r = _pytest(tmp_path, required)
    out = r.stdout
    if required == "1":
        assert r.returncode == 1, out
        assert "1 failed, 1 passed, 1 skipped, 2 errors" in out, out  # the fixture's skip is an error in setup
        assert "ERROR test_collection.py" in out and "ERROR test_inside.py::test_fixture_oracle" in out, out
        assert "FAILED test_inside.py::test_oracle_too_old" in out, out
        assert "SKIPPED [1] test_inside.py" in out and "one case is enough" in out, out
        assert "DFLASH_JAX_REQUIRE_ORACLES=1: an oracle is missing, so this was not tested" in out, out
        assert "could not import 'dflash.no_such_module'" in out, out
    else:
        assert r.returncode == 0, out
        assert "1 passed, 4 skipped" in out, out
