"""Reading a file a flag names, with a bound: /dev/zero, a FIFO fed without end or a huge file
given by mistake is refused after `cap` + 1 bytes instead of read until memory runs out. Every
file flag of the commands reads through here (key and token files, calibration, inventory and
routing profile JSON, prompt id files); each caller picks its cap. In protocol/ because the token
file is read here (auth.load_secret), below every other user."""
from __future__ import annotations

import os

KIB, MIB = 1 << 10, 1 << 20
# a key, token or CURVE key file is a few lines: past this it is not one (/dev/zero, a log)
KEY_FILE_MAX = 64 * KIB


class FileTooLarge(ValueError):
    """A file past its cap; the message names the flag, the path and the cap."""


def read_capped(path: str | os.PathLike[str], cap: int, flag: str) -> bytes:
    """The bytes of `path`, at most `cap` of them. A file with more raises FileTooLarge:
    "<flag> <path>: larger than <cap> bytes". OSError (missing, unreadable) passes through, for
    the caller's own message."""
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise FileTooLarge(f"{flag} {os.fspath(path)}: larger than {cap} bytes")
    return data


__all__ = ["FileTooLarge", "KEY_FILE_MAX", "KIB", "MIB", "read_capped"]
