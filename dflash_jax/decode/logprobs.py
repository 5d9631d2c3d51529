"""The target's log-probabilities of committed tokens, recorded on device by the steps that commit them.

Off by default (``Decoding.logprobs`` is ``None``: no buffer in the state, the steps' programs are
the ones without it). With ``Decoding(..., logprobs=k)`` every step that commits tokens (the
prefill's first token, a plain step, a chain's or a tree's verify, the adaptive step's verify)
also writes, at each committed token's position, the log-probability the target gave that token
and the target's ``k`` most probable tokens with theirs, from the logits the step already has (the
verify has the target's logits at every slot of the block): no extra target pass. Every committed
token is the target's own choice from those logits (:mod:`dflash_jax.decode.step`), so the values
are the ones plain decoding records, whatever the drafter proposed.

Definition: ``log_softmax`` of the raw target logits in float32, before temperature, top-k and
top-p (vLLM's default ``logprobs_mode="raw_logprobs"``): a function of the prefix only, the same for
greedy and sampled rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import axes_field

MAX_TOP_LOGPROBS = 20
"""The most alternatives per token (OpenAI's bound on ``top_logprobs``)."""


@pytree.dataclass
class TokenLogprobs:
    """Log-probabilities per token position (``DecodeState.logprobs``), or per block slot when a
    step hands them to :func:`dflash_jax.decode.state.commit`.

    Attributes:
      chosen: ``[B, S]`` float32 the target's log-probability of the token at each position
        (0 where nothing was recorded: prompt positions).
      top_ids: ``[B, S, k]`` int32 the target's ``k`` most probable tokens there, most probable first.
      top: ``[B, S, k]`` float32 their log-probabilities.
    """

    chosen: jnp.ndarray = axes_field("batch", "seq")
    top_ids: jnp.ndarray = axes_field("batch", "seq", None)
    top: jnp.ndarray = axes_field("batch", "seq", None)

    @property
    def k(self) -> int:
        return self.top_ids.shape[-1]


def empty(batch: int, length: int, k: int) -> TokenLogprobs:
    """A zeroed buffer of ``length`` positions per row and ``k`` alternatives."""
    return TokenLogprobs(chosen=jnp.zeros((batch, length), jnp.float32), top_ids=jnp.zeros((batch, length, k), jnp.int32),
                         top=jnp.zeros((batch, length, k), jnp.float32))


def of_logits(logits: jnp.ndarray, tokens: jnp.ndarray, k: int) -> TokenLogprobs:
    """The log-probabilities of ``tokens [B, K]`` under ``logits [B, K, V]`` (the target's logits
    at the slot that chose each token) and the ``k`` best alternatives at each slot (module
    docstring: raw logits, float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if k == 0:
        shape = tokens.shape + (0,)
        return TokenLogprobs(chosen=chosen, top_ids=jnp.zeros(shape, jnp.int32), top=jnp.zeros(shape, jnp.float32))
    top, ids = jax.lax.top_k(logp, k)
    return TokenLogprobs(chosen=chosen, top_ids=ids.astype(jnp.int32), top=top)


def along(logits: jnp.ndarray, path: jnp.ndarray) -> jnp.ndarray:
    """``logits [B, N, V]`` at the slots ``path [B, K]`` (a tree's accepted path): ``[B, K, V]``."""
    return jnp.take_along_axis(logits, path[:, :, None], axis=1)


def write(buffer: TokenLogprobs, rows, pos, new: TokenLogprobs) -> TokenLogprobs:
    """``buffer`` with ``new``'s slots ``[B, K]`` written at positions ``pos [B, K]`` of ``rows``
    (``pos == capacity`` drops the slot, as :func:`~dflash_jax.decode.state.commit` does)."""
    return TokenLogprobs(chosen=buffer.chosen.at[rows, pos].set(new.chosen, mode="drop"),
                         top_ids=buffer.top_ids.at[rows, pos].set(new.top_ids, mode="drop"),
                         top=buffer.top.at[rows, pos].set(new.top, mode="drop"))
