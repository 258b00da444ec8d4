"""Bad input to the ``xinserve`` command: a path, a file or a field in one that cannot be used.

Every command raises ``BadInput`` with a message that names the file or field; ``cli.main`` catches it
once, prints it as one line on stderr and exits 2 (1 stays "ran, and the answer is no": a plan that
does not fit, a benchmark with failed requests). ``read_text`` is how a command reads a file the user
named, so a missing, unreadable or non-UTF-8 file is reported the same way everywhere.
"""

from pathlib import Path


class BadInput(ValueError):
    """Input the user gave that cannot be used; the message names it."""


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of the user's ``what`` at ``path``; BadInput naming it otherwise."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"cannot read {what} {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                       f"at offset {exc.start})") from None
