"""A pytest plugin (loaded by ``tests/conftest.py``): with ``DFLASH_JAX_REQUIRE_ORACLES=1`` a test
that would be skipped because an oracle is missing fails instead (CI runs with it: ``.ci/run``).

An oracle skip is one from ``pytest.importorskip`` of an oracle package (:data:`ORACLES`:
transformers and torch, the z-lab ``dflash`` package, the notebook runner, ``gguf``, the openai
client) or one whose reason begins ``"<oracle> without"`` (an oracle too old for a test, e.g.
``"transformers without Qwen3_5ForCausalLM"``). A skip at collection (a module-level
``importorskip``) becomes a collection error, one in a test or its fixtures a failed test or an
error; every other skip stays a skip. Without the variable (or with ``0``) nothing changes.
"""

from __future__ import annotations

import os
import re

import pytest

ENV = "DFLASH_JAX_REQUIRE_ORACLES"
ORACLES = ("torch", "transformers", "dflash", "nbclient", "nbformat", "gguf", "openai")
_NAMES = "|".join(ORACLES)
_ORACLE_SKIP = re.compile(rf"could not import '({_NAMES})(\.[\w.]+)?'|\b({_NAMES}) without ")


def required() -> bool:
    """Whether oracle skips fail (``DFLASH_JAX_REQUIRE_ORACLES`` set and not ``0``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def oracle_skip(report) -> str | None:
    """The reason of ``report``'s skip when it is an oracle skip (module docstring), else ``None``."""
    if not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2])
    return reason if _ORACLE_SKIP.search(reason) else None


def _fail_if_required(report) -> None:
    reason = oracle_skip(report) if required() else None
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (f"{ENV}=1: an oracle is missing, so this was not tested ({reason}); install the test "
                           "oracles (README's test command: torch, '.[test]' and dflash==0.1.0; docs/testing.md) or unset "
                           f"{ENV} to skip")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_required(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_required(outcome.get_result())
