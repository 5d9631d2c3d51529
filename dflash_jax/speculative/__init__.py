"""DFlash speculative decoding, one module per stage of a step's data flow.

- :mod:`~dflash_jax.speculative.state`: the drafter context and statistics carried in
  ``DecodeState.speculative``.
- :mod:`~dflash_jax.speculative.capture`: target hidden states at the drafter's layers, projected
  into the drafter context (during prefill and every verify).
- :mod:`~dflash_jax.speculative.propose`: the drafter drafts a block in one pass.
- :mod:`~dflash_jax.speculative.verify`: one target pass over the block and the accept rules.
- :mod:`~dflash_jax.speculative.commit`: accepted drafts and bonus join the state.
- :mod:`~dflash_jax.speculative.step`: propose -> verify -> commit as one pure step.

Prefill, the on-device loop and continuous batching are shared with plain decoding in
:mod:`dflash_jax.decode`, driven by a :class:`~dflash_jax.decoding.Decoding` with a drafter.
"""

from dflash_jax.speculative.propose import propose_block  # noqa: E402
from dflash_jax.speculative.step import step_fn, verify_block  # noqa: E402

__all__ = ["propose_block", "step_fn", "verify_block"]
