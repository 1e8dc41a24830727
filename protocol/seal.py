"""Sealed data links: every message on a TCP data link proves it comes from an admitted peer.

The control socket admits a process that proves the shared secret (auth.py); the data links
(rows between stages, tokens to the head, expert requests to helper tiers) used to take any frame
from anyone who could connect. On TCP they are sealed now: each message gets one more frame,

    sender (8 bytes) | sequence (8 bytes, little-endian) | HMAC-SHA256 (first 16 bytes)

where the MAC covers the sender, the sequence and every frame (length-prefixed), under a key that
every admitted process derives from the shared secret and the launch's nonce (sent in Assign;
the key itself never travels). A receiver drops — and counts — a message whose MAC is wrong or
whose sequence is not above the last one it took from that sender (a replay). Each sending
channel has its own random sender id and counter, so a receiver sees each sender's messages in
order. Local links (ipc://, in a 0700 directory) are not sealed: they cost nothing extra.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from typing import Sequence

TRAILER_BYTES = 32
_MAC_BYTES = 16
_HEAD = struct.Struct("<8sQ")


def link_key(secret: bytes, nonce: str) -> bytes:
    """The data-link key of a launch: the shared secret and the launch's nonce, never sent."""
    return hmac.new(secret, b"strata-dist data links\0" + nonce.encode(), hashlib.sha256).digest()


def new_nonce() -> str:
    return os.urandom(16).hex()


class LinkSeal:
    """A launch's data-link key, and (for the receiving side) the last sequence taken from each
    sender. One per process; each sending channel takes a `Sealer` of its own."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("a link key needs at least 16 bytes")
        self._key = key
        self._last: dict[bytes, int] = {}
        self._lock = threading.Lock()     # channels of several threads may share one seal
        self.rejected = 0                 # messages dropped: forged, damaged or replayed

    def _mac(self, head: bytes, frames: Sequence) -> bytes:
        m = hmac.new(self._key, head, hashlib.sha256)
        for f in frames:
            view = memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B")
            m.update(struct.pack("<Q", view.nbytes))
            m.update(view)
        return m.digest()[:_MAC_BYTES]

    def sealer(self) -> "Sealer":
        return Sealer(self)

    def open(self, frames: list) -> list | None:
        """The message's frames without the trailer, or None (counted) when it does not prove
        itself: no trailer, a wrong MAC, or a sequence already seen from that sender."""
        if not frames:
            return self._reject()
        last = frames[-1]
        trailer = bytes(last.buffer if hasattr(last, "buffer") else last)
        if len(trailer) != TRAILER_BYTES:
            return self._reject()
        head, mac = trailer[:_HEAD.size], trailer[_HEAD.size:]
        body = frames[:-1]
        if not hmac.compare_digest(mac, self._mac(head, body)):
            return self._reject()
        sender, seq = _HEAD.unpack(head)
        with self._lock:
            if seq <= self._last.get(sender, 0):
                self.rejected += 1
                return None
            self._last[sender] = seq
        return body

    def _reject(self) -> None:
        with self._lock:
            self.rejected += 1
        return None


class Sealer:
    """The sending half for one channel: its own sender id and counter."""

    def __init__(self, seal: LinkSeal):
        self._seal = seal
        self._sender = os.urandom(8)
        self._seq = 0

    def seal(self, frames: list) -> list:
        self._seq += 1
        head = _HEAD.pack(self._sender, self._seq)
        return list(frames) + [head + self._seal._mac(head, frames)]
