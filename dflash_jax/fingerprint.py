"""The content fingerprint of a target's weights, by which a shipped drafter finds its target.

Two files hold "the same model" when they give the same float32 weights: the fingerprint is the
sha256 of the target's parameters converted to float32, in one canonical order (top-level
leaves by name, then layer by layer, each leaf by name), each preceded by its name and shape. So
it does not depend on the file's name or folder, its metadata (a re-saved GGUF with another chat
template, general.name or key order; an HF folder holding the same weights), or the layer layout
(stacked or per layer); a tied embedding's output-head copy (:func:`dflash_jax.loading.with_output_head`)
is left out. A re-quantized file is another model: its weights, and the drafts a drafter should
make for it, differ.

Computing it reads every weight (about 0.35 s for the 135M-parameter default model), so a GGUF
target records it in its float32 cache (:mod:`dflash_jax.io.gguf_cache`) when that is written.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

PREFIX = "f32-sha256:"


def weights_fingerprint(cfg: Any, params: Any) -> str:
    """``"f32-sha256:<64 hex digits>"`` of a target's weights (see the module docstring).

    Args:
      cfg: the target config (``tie_word_embeddings`` says whether ``params["lm_head"]``, when
        present, is a derived copy to leave out).
      params: the target's parameter pytree, numpy or JAX leaves of any float dtype, with
        ``"layers"`` stacked (leaves ``[L, ...]``) or a tuple of per-layer pytrees.
    Returns:
      the fingerprint string.
    """
    h = hashlib.sha256()

    def feed(name: str, a) -> None:
        a = np.ascontiguousarray(np.asarray(a), dtype="<f4")
        h.update(f"{name} {list(a.shape)}\n".encode())
        h.update(memoryview(a).cast("B"))

    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    top = {k: v for k, v in params.items() if k != "layers" and not (tied and k == "lm_head")}
    for path, a in jax.tree_util.tree_flatten_with_path(top)[0]:
        feed(jax.tree_util.keystr(path), a)
    layers = params["layers"]
    if isinstance(layers, (tuple, list)):
        per_layer = list(layers)
    else:
        stacked = jax.tree_util.tree_map(np.asarray, layers)
        n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
        per_layer = [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(n)]
    for i, layer in enumerate(per_layer):
        for path, a in jax.tree_util.tree_flatten_with_path(layer)[0]:
            feed(f"layers[{i}]{jax.tree_util.keystr(path)}", a)
    return PREFIX + h.hexdigest()
