"""The one error type the package raises for bad input.

Every message follows the CLI contract ``<file or option>: <what> (expected <what>)`` so the
command line can print it as ``error: <message>`` on one line.
"""

from __future__ import annotations


class DFlashError(ValueError):
    """Bad input: a file, field, option or shape that is not what was expected.

    Args:
      where: the file, tensor, config field or option at fault (for example
        ``"model.gguf: tensor blk.0.attn_q.weight"``).
      what: what is wrong with it.
      expected: what was expected instead (optional).
    """

    def __init__(self, where: str, what: str, expected: str | None = None):
        self.where, self.what, self.expected = str(where), str(what), expected
        msg = f"{self.where}: {self.what}"
        if expected is not None:
            msg += f" (expected {expected})"
        super().__init__(msg)
