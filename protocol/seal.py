"""Sealed data links: every message on a TCP data link proves it comes from an admitted peer, for
that link, for the process now at its receiving end.

The control socket admits a process that proves the shared secret (auth.py); the data links
(rows between stages, tokens to the head, expert requests to helper tiers) used to take any frame
from anyone who could connect. On TCP they are sealed now: each message gets one more frame,

    sender (8 bytes) | sequence (8 bytes, little-endian) | HMAC-SHA256 (first 16 bytes)

The MAC is keyed per link: every admitted process derives the launch key from the shared secret
and the launch's nonce (sent in Assign; no key ever travels), and from it one key per link and
epoch,

    link key = HMAC-SHA256(launch key, "strata-dist link\\0" | label | "\\0" | epoch (u64 LE))

where the label is the endpoint of the link's bound end as Register/Assign name it (the receiving
stage's data endpoint, a helper tier's endpoint, the head's inbox) and the epoch counts how often
the process at that endpoint was replaced (Assign.link_epochs; 0 at launch). The MAC covers the
direction (0: toward the bound end, 1: back from it), the connecting end's routing identity on the
way back (a ROUTER's reply names the DEALER it is for; empty toward the bound end), the sender, the
sequence and every frame (length-prefixed). So a frame sealed for one link proves nothing on
another, and a frame sealed before a rank was replaced proves nothing to its replacement.

A receiver drops — and counts — a message whose MAC is wrong for its own link or whose sequence is
not above the last one it took from that sender (a replay): `rejected`. A message that proves
itself under the link's previous epoch was sealed for the process this one replaced (delayed
across the replacement, or captured and replayed): dropped too, counted apart as `stale`. Each
sending channel has its own random sender id and counter, so a receiver sees each sender's
messages in order. Local links (ipc://, in a 0700 directory) are not sealed: they cost nothing
extra.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from typing import Mapping, Sequence

TRAILER_BYTES = 32
_MAC_BYTES = 16
_HEAD = struct.Struct("<8sQ")
_LEN = struct.Struct("<Q")
TOWARD, BACK = 0, 1     # toward the link's bound end (PUSH→PULL, DEALER→ROUTER), and back from it


def link_key(secret: bytes, nonce: str) -> bytes:
    """The data-link key of a launch: the shared secret and the launch's nonce, never sent."""
    return hmac.new(secret, b"strata-dist data links\0" + nonce.encode(), hashlib.sha256).digest()


def link_epoch_key(launch_key: bytes, label: str, epoch: int) -> bytes:
    """The key of one link (named by its bound end's endpoint) in one epoch of its receiver."""
    return hmac.new(launch_key, b"strata-dist link\0" + label.encode() + b"\0" + _LEN.pack(epoch),
                    hashlib.sha256).digest()


def new_nonce() -> str:
    return os.urandom(16).hex()


class LinkSeal:
    """A launch's data-link key, the epoch of each link whose receiver was replaced, and (for the
    receiving side) the last sequence taken from each sender. One per process; each channel takes
    an end of its link (`end`) with its own sender id and counter."""

    def __init__(self, key: bytes, epochs: Mapping[str, int] | None = None):
        if len(key) < 16:
            raise ValueError("a link key needs at least 16 bytes")
        self._key = key
        self.epochs: dict[str, int] = dict(epochs or {})   # label -> epoch (absent: 0)
        self._last: dict[bytes, int] = {}
        self._lock = threading.Lock()     # channels of several threads may share one seal
        self.rejected = 0                 # messages dropped: forged, damaged, replayed, other link
        self.stale = 0                    # messages dropped: sealed for the process replaced

    def set_epochs(self, epochs: Mapping[str, int]) -> None:
        """Links whose receiver was replaced: every end keys them by their new epoch from now on."""
        self.epochs = {**self.epochs, **epochs}   # one assignment: readers see the old or the new

    def epoch(self, label: str) -> int:
        return self.epochs.get(label, 0)

    def base(self, label: str, epoch: int):
        """A keyed HMAC to copy per message (keying once per link and epoch, not per message)."""
        return hmac.new(link_epoch_key(self._key, label, epoch), digestmod=hashlib.sha256)

    def end(self, label: str, *, bound: bool, identity: bytes = b"") -> "LinkEnd":
        """This process's end of the link named `label`: the bound end (PULL, ROUTER) or a
        connecting one (PUSH, DEALER with routing `identity`)."""
        return LinkEnd(self, label, bound, identity)

    def _take(self, sender: bytes, seq: int) -> bool:
        with self._lock:
            if seq <= self._last.get(sender, 0):
                self.rejected += 1
                return False
            self._last[sender] = seq
        return True

    def _count(self, stale: bool = False) -> None:
        with self._lock:
            if stale:
                self.stale += 1
            else:
                self.rejected += 1


def _mac(base, direction: int, peer: bytes, head: bytes, frames: Sequence) -> bytes:
    m = base.copy()
    m.update(bytes((direction,)) + _LEN.pack(len(peer)) + peer + head)
    for f in frames:
        view = memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B")
        m.update(_LEN.pack(view.nbytes))
        m.update(view)
    return m.digest()[:_MAC_BYTES]


class LinkEnd:
    """One channel's end of a sealed link: seals what it sends (its own sender id and counter) and
    opens what it receives, under the link's key in the current epoch of its label."""

    def __init__(self, seal: LinkSeal, label: str, bound: bool, identity: bytes = b""):
        self.owner, self.label, self.bound = seal, label, bound   # the process's LinkSeal
        self._identity = identity            # a DEALER's routing identity (replies name it)
        self._sender = os.urandom(8)
        self._seq = 0
        self._epoch = -1
        self._base = self._prev = None

    def _keys(self):
        e = self.owner.epoch(self.label)
        if e != self._epoch:                 # the receiver was replaced: key the new epoch
            self._epoch, self._base = e, self.owner.base(self.label, e)
            self._prev = self.owner.base(self.label, e - 1) if e > 0 else None
        return self._base, self._prev

    def seal(self, frames: list, peer: bytes = b"") -> list:
        """The frames with the trailer. `peer`: on the bound end of a ROUTER link, the identity
        of the DEALER the message is for."""
        base, _ = self._keys()
        self._seq += 1
        head = _HEAD.pack(self._sender, self._seq)
        direction = BACK if self.bound else TOWARD
        return list(frames) + [head + _mac(base, direction, peer if self.bound else b"", head, frames)]

    def open(self, frames: list) -> list | None:
        """The message's frames without the trailer, or None (counted) when it does not prove
        itself on this link: no trailer, a MAC of another key (another link, another epoch, no
        secret), or a sequence already seen from that sender."""
        if not frames:
            self.owner._count()
            return None
        last = frames[-1]
        trailer = bytes(last.buffer if hasattr(last, "buffer") else last)
        if len(trailer) != TRAILER_BYTES:
            self.owner._count()
            return None
        head, mac = trailer[:_HEAD.size], trailer[_HEAD.size:]
        body = frames[:-1]
        base, prev = self._keys()
        direction = TOWARD if self.bound else BACK
        peer = b"" if self.bound else self._identity
        if not hmac.compare_digest(mac, _mac(base, direction, peer, head, body)):
            # sealed for the process this one replaced: genuine, but never for this process
            stale = prev is not None and hmac.compare_digest(
                mac, _mac(prev, direction, peer, head, body))
            self.owner._count(stale)
            return None
        sender, seq = _HEAD.unpack(head)
        return body if self.owner._take(sender, seq) else None
