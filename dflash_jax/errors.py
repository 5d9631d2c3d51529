"""The one error type the package raises for bad input.

Every message follows the CLI contract ``<file or option>: <what> (expected <what>)`` so the
command line can print it as ``error: <message>`` on one line. A Python argument that a
command-line option sets is named ``"arg (--flag)"``; :func:`option_error` gives the command
line's form of such an error.
"""

from __future__ import annotations

import re


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


def option_error(e: DFlashError) -> DFlashError:
    """``e`` as a command line reports it: ``"max_len (--max-len)"`` becomes ``"--max-len"``;
    errors about anything else come back unchanged (the same object)."""
    m = re.fullmatch(r"\w+ \((--[\w-]+)\)", e.where)
    return DFlashError(m.group(1), e.what, e.expected) if m else e
