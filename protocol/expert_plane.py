"""The messages of the expert plane: a stage asks a helper for expert outputs (ExpertRequest /
ExpertReply), reads a helper's tier in place (ExpertTierAsk / ExpertTier) and re-ranks it
(TierCounts / TierPairs); and the CUDA IPC buffers both ends of a link share (IpcHandle, the RowSlot
doorbell, SlotFree). Kept apart from messages.py, which re-exports every name here."""

from __future__ import annotations

from dataclasses import field

from .structs import Message, Struct, _nonneg, message, struct


@struct
class RowSlot(Struct):
    """A region of a CUDA IPC buffer (exchanged once via IpcHandle): the doorbell payload."""

    offset: int
    nbytes: int

    def check(self, arrays: list) -> None:
        _nonneg(offset=self.offset, nbytes=self.nbytes)


@message
class ExpertRequest(Message):
    """Stage → helper (decode only). Frames, in order: rows (n, d), expert_ids (n, k) int32 with -1 = not asked,
    weights (n, k) float32. With ``slot`` set the rows are in the stage's IPC buffer and only ids/weights follow;
    the helper then writes the outputs into the same buffer at ``out`` (both or neither are set)."""

    TYPE = "expert_request"
    MAX_ARRAYS = 3
    seq: int
    layer: int
    n: int
    slot: RowSlot | None = None
    out: RowSlot | None = None

    def check(self, arrays: list) -> None:
        if (self.slot is None) != (self.out is None):
            raise ValueError(f"expert_request: slot={self.slot} and out={self.out} must be set together")
        _expert_frames(self, arrays, 2 if self.slot is not None else 3)


@message
class ExpertReply(Message):
    """Helper → stage: outputs (n, k, d), one row per asked (row, top-k rank) so the stage combines in rank order.
    With ``slot`` set the outputs are in the stage's IPC buffer (the request's ``out``) instead of a frame."""

    TYPE = "expert_reply"
    MAX_ARRAYS = 1
    seq: int
    layer: int
    n: int
    slot: RowSlot | None = None

    def check(self, arrays: list) -> None:
        _expert_frames(self, arrays, 0 if self.slot is not None else 1)


def _expert_frames(msg: ExpertRequest | ExpertReply, arrays: list, want: int) -> None:
    _nonneg(seq=msg.seq, layer=msg.layer, n=msg.n)
    if len(arrays) != want:
        raise ValueError(f"{msg.TYPE}: expected {want} frame(s) (slot={msg.slot}), got {len(arrays)}")
    for a in arrays:
        if a.ndim == 0 or a.shape[0] != msg.n:
            raise ValueError(f"{msg.TYPE}: frame of shape {list(a.shape)} does not start with n={msg.n}")


@message
class IpcHandle(Message):
    """Sent once per link: the sender's CUDA IPC buffer. Valid only for peers with the same host identity."""

    TYPE = "ipc_handle"
    name: str      # what the buffer is for ("hidden", "expert_rows", ...)
    handle: bytes  # cudaIpcMemHandle_t, 64 bytes
    device: int           # index in the *sender's* CUDA numbering
    nbytes: int
    dtype: str
    device_uuid: str = ""  # stable across processes whose CUDA_VISIBLE_DEVICES differ
    host: str = ""
    pid: int = 0


@message
class ExpertTierAsk(Message):
    """Stage → helper on the same host, after its IpcHandle: the helper's tier buffer, so that the stage's
    decode graph reads the helper's blobs in place (over NVLink from another card) instead of asking."""

    TYPE = "expert_tier_ask"


@message
class ExpertTier(Message):
    """Helper → stage: the helper tier's device buffer as a CUDA IPC handle, and in frames the pairs it holds
    (n, 2) int32 (layer, expert) and each pair's blob offset (n,) int64 in that buffer. Answered with
    Error(code="ipc_tier") by a helper that cannot export its tier."""

    TYPE = "expert_tier"
    MAX_ARRAYS = 2
    handle: bytes  # cudaIpcMemHandle_t, 64 bytes
    device: int    # index in the helper's CUDA numbering
    nbytes: int
    device_uuid: str = ""
    pid: int = 0

    def check(self, arrays: list) -> None:
        _nonneg(device=self.device, nbytes=self.nbytes)
        if len(arrays) != 2:
            raise ValueError(f"expert_tier: expected 2 frames (pairs, offsets), got {len(arrays)}")
        pairs, offsets = arrays
        if pairs.ndim != 2 or pairs.shape[1] != 2 or offsets.shape != (pairs.shape[0],):
            raise ValueError(f"expert_tier: pairs {list(pairs.shape)} and offsets {list(offsets.shape)} "
                             f"are not (n, 2) and (n,)")

    def ipc_handle(self, host: str = "") -> IpcHandle:
        """The buffer as the IpcHandle that cuda_ipc.IpcMapping opens."""
        return IpcHandle(name="expert_tier", handle=self.handle, device=self.device, nbytes=self.nbytes,
                         dtype="uint8", device_uuid=self.device_uuid, host=host, pid=self.pid)


@message
class TierCounts(Message):
    """Stage → helper, at each round of the stage's adaptive cache (strata_dist/experts/adapt.py): in a frame the
    decayed routing counts (le - lb, n_expert) float64 of the stage's layers [lb, le), 0 where its own cache
    holds the pair. The helper re-ranks its tier over every stage's latest counts and answers TierPairs."""

    TYPE = "tier_counts"
    MAX_ARRAYS = 1
    seq: int
    lb: int
    le: int

    def check(self, arrays: list) -> None:
        _nonneg(seq=self.seq, lb=self.lb, le=self.le)
        if self.lb >= self.le:
            raise ValueError(f"tier_counts: layer range [{self.lb}, {self.le}) is empty")
        if len(arrays) != 1 or arrays[0].ndim != 2 or arrays[0].shape[0] != self.le - self.lb:
            raise ValueError(f"tier_counts: expected one frame of {self.le - self.lb} layer rows")


@message
class TierPairs(Message):
    """Helper → stage: the pairs of the asking stage's layers its tier holds after the round (``seq``
    echoed), and how many pairs the round swapped across all stages' layers."""

    TYPE = "tier_pairs"
    seq: int
    pairs: list[list[int]] = field(default_factory=list)
    swaps: int = 0


@message
class SlotFree(Message):
    """Receiver → writer of an IPC buffer: the rows at ``slot`` were consumed, the writer may reuse them."""

    TYPE = "slot_free"
    name: str
    slot: RowSlot
