"""A process without the secret that sends well-formed data-plane messages of every type at the
given TCP endpoints until killed (tests of the sealed links). Run as a script:

    python tests/forger.py push=tcp://10.0.0.2:7000 push=… dealer=tcp://10.0.0.2:7001 …

Every data-plane message type goes to every target, a stage's data socket (push) and a helper
tier's (dealer) alike: each receiver must drop what it would act on as well as what it would not
expect there. `DATA_PLANE_TYPES` is every message type that may travel on a data link
(tests/test_sealed_links.py checks that `forged` covers each, and that the protocol has no other
type outside the control plane).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from protocol import (Cancel, Error, ExpertReply, ExpertRequest, ExpertTier,  # noqa: E402
                      ExpertTierAsk, HandBack, Hidden, IpcHandle, PromptProgress, Release, Settle,
                      SlotFree, StepTokens, TierCounts, TierPairs, Token, Tokens)
from protocol.codec import encode  # noqa: E402
from protocol.messages import RowSlot  # noqa: E402

# the control plane: the handshake, registration, assignment and liveness (never on a data link),
# and the calibration probe (never on any link of a rank)
CONTROL_TYPES = frozenset({"hello", "challenge", "auth", "auth_ok", "register", "assign", "ready",
                           "stats", "stats_reply", "heartbeat", "shutdown", "link_probe"})
DATA_PLANE_TYPES = frozenset({"release", "cancel", "tokens", "hidden", "prompt_progress", "token",
                              "expert_request", "expert_reply", "ipc_handle", "slot_free",
                              "expert_tier_ask", "expert_tier", "tier_counts", "tier_pairs",
                              "error", "settle", "hand_back", "step_tokens"})


def forged(request_id: int, hidden: int = 64, k: int = 2) -> list:
    """Messages of every data-plane type, for one request id (and session 0, which the serving
    session is: a Release of it that got through would drop the session's KV)."""
    rows = np.full((1, hidden), 7.0, dtype=np.float32)
    slot = RowSlot(offset=0, nbytes=hidden * 4)
    return [
        (Token(request_id=request_id, session_id=0, token_id=1, pos=99, done=False), []),
        (Error(rank=0, request_id=request_id, message="forged failure", code="ipc"), []),
        (PromptProgress(request_id=request_id, session_id=0, pos=1, chunk_index=0, chunk_total=1,
                        ms=1.0), []),
        (Tokens(request_id=request_id, session_id=0, pos=0, ids=[5, 6, 7]), []),
        (Hidden(request_id=request_id, session_id=0, pos=0, n=1, dtype="float32",
                shape=[1, hidden]), [rows]),
        (Cancel(request_id=request_id), []),
        (Release(session_id=0), []),
        (Settle(request_id=request_id, session_id=0, pos=0), []),
        (HandBack(request_id=request_id), []),
        (StepTokens(request_id=request_id, tokens=[
            Token(request_id=request_id, session_id=0, token_id=1, pos=99, done=False)]), []),
        (SlotFree(name="hidden", slot=slot), []),
        (SlotFree(name="expert_rows", slot=RowSlot(offset=0, nbytes=0)), []),
        (IpcHandle(name="hidden", handle=bytes(64), device=0, nbytes=1 << 20, dtype="float32",
                   host="evil", pid=1), []),
        (ExpertRequest(seq=request_id, layer=0, n=1),
         [np.ones((1, hidden), np.float32), np.zeros((1, k), np.int32), np.ones((1, k), np.float32)]),
        (ExpertReply(seq=request_id, layer=0, n=1), [np.ones((1, k, hidden), np.float32)]),
        (ExpertTierAsk(), []),
        # a forged re-ranking: every pair of two layers hot, and pairs a tier never held
        (TierCounts(seq=request_id, lb=0, le=2), [np.full((2, 8), 1e6)]),
        (TierPairs(seq=request_id, pairs=[[0, 0]], swaps=1), []),
        # a forged tier: a handle to nothing, with pairs the plan never gave the helper
        (ExpertTier(handle=bytes(64), device=0, nbytes=1 << 20, pid=1),
         [np.array([[0, 0]], np.int32), np.zeros(1, np.int64)]),
    ]


def attack(targets: list[tuple[str, str]], should_stop=lambda: False, pause_s: float = 0.005) -> None:
    ctx = zmq.Context.instance()
    socks = []
    for kind, ep in targets:
        s = ctx.socket(zmq.PUSH if kind == "push" else zmq.DEALER)
        s.linger, s.sndtimeo = 0, 100
        s.connect(ep)
        socks.append(s)
    while not should_stop():
        for request_id in range(1, 4):
            for s in socks:
                for msg, arrays in forged(request_id):
                    try:
                        s.send_multipart(encode(msg, arrays))
                    except zmq.Again:
                        pass
        time.sleep(pause_s)
    for s in socks:
        s.close()


if __name__ == "__main__":
    attack([tuple(arg.split("=", 1)) for arg in sys.argv[1:]])
