"""The largest frame each kind of socket takes: its ZMQ_MAXMSGSIZE, computed here and nowhere else.

libzmq disconnects a peer that announces a bigger frame before reading it, so a stranger's huge frame on
an exposed port costs the receiver nothing; without a cap, a 1 GiB frame was buffered whole (twice)
before the seal or the decoder could drop it. The caps follow from what the socket legally carries:

- control (the coordinator's ROUTER) and the head's inbox: handshake, Register, Ready, Heartbeat,
  StatsReply, Error, PromptProgress, Token — small messages (CONTROL);
- a rank's own control connection: the Assign, which carries the plan (ASSIGN, the decoder's header cap);
- a stage's data socket: a prompt chunk (Tokens: its ids in the header) or its hidden rows
  (Hidden: one float32 row of the model's width per token of the plan's prompt chunk);
- a helper tier's socket: an expert request's rows (decode rows, never more than a prompt chunk's)
  and their (row, top-k) ids and weights;
  both where bound on TCP (`Channel.cap_frames`): an ipc:// socket is in a directory only the
  launching user can open;
- a `strata-dist calibrate --serve` peer: a link probe's payload.

Note that libzmq bounds each frame, not a message's frame count: a peer that may connect can still
send a message of many capped frames. Only CURVE (or a private network) keeps strangers from sending
at all (docs/DEPLOY.md, "What is exposed").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .codec import MAX_HEADER_BYTES

ROW_ITEM_BYTES = 4          # rows and expert outputs travel as float32 (handoff.py, tiers.py)
MSGPACK_INT_BYTES = 9       # the most one int takes in a msgpack header (a token id, a position)


@dataclass(frozen=True)
class FrameCaps:
    """The caps of one stage rank's bound sockets, from the model's width and the plan's prompt chunk
    (`for_stage`); the fixed caps of the other sockets as class constants."""

    CONTROL: ClassVar[int] = 1 << 20      # a control message: fields only, a few KiB in practice
    ASSIGN: ClassVar[int] = MAX_HEADER_BYTES   # the plan inside an Assign; the decoder refuses more anyway

    data: int          # a stage's data PULL
    helper: int        # a helper tier's ROUTER

    @classmethod
    def for_stage(cls, hidden: int, top_k: int, prompt_chunk: int) -> "FrameCaps":
        """Caps for a rank of a model `hidden` wide routing `top_k` experts a token, in a plan whose
        prompt chunk is `prompt_chunk` tokens (0: one row)."""
        if hidden < 1 or top_k < 0 or prompt_chunk < 0:
            raise ValueError(f"frame caps need hidden >= 1, top_k >= 0, prompt_chunk >= 0; got {hidden}, "
                             f"{top_k}, {prompt_chunk}")
        rows = max(prompt_chunk, 1)
        header = cls.CONTROL + MSGPACK_INT_BYTES * rows      # a Tokens chunk lists its ids
        return cls(data=max(header, rows * hidden * ROW_ITEM_BYTES),
                   helper=max(header, rows * max(hidden, top_k) * ROW_ITEM_BYTES))

    @classmethod
    def before_assign(cls) -> "FrameCaps":
        """Until its Assign names the chunk, a rank's data and helper sockets take control messages only
        (nothing else is sent to them before the plan runs)."""
        return cls(data=cls.CONTROL, helper=cls.CONTROL)

    @classmethod
    def probe(cls, payload_bytes: int) -> int:
        """A calibration peer's cap: the prober's payload frame and a control message."""
        return max(cls.CONTROL, payload_bytes + cls.CONTROL)


__all__ = ["FrameCaps", "ROW_ITEM_BYTES"]
