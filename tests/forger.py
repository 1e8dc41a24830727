"""A process without the secret that pushes well-formed data-plane messages of every type at the
given TCP endpoints until killed (tests of the sealed links). Run as a script:

    python tests/forger.py push=tcp://10.0.0.2:7000 push=… dealer=tcp://10.0.0.2:7001 …
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from protocol import Cancel, Error, ExpertRequest, Hidden, PromptProgress, Token, Tokens  # noqa: E402
from protocol.codec import encode  # noqa: E402


def forged(request_id: int, hidden: int = 64) -> list:
    """Messages of every type a data socket takes, for one request id."""
    rows = np.full((1, hidden), 7.0, dtype=np.float32)
    return [
        (Token(request_id=request_id, session_id=0, token_id=1, pos=99, done=False), []),
        (Error(rank=0, request_id=request_id, message="forged failure"), []),
        (PromptProgress(request_id=request_id, session_id=0, pos=1, chunk_index=0, chunk_total=1,
                        ms=1.0), []),
        (Tokens(request_id=request_id, session_id=0, pos=0, ids=[5, 6, 7]), []),
        (Hidden(request_id=request_id, session_id=0, pos=0, n=1, dtype="float32",
                shape=[1, hidden]), [rows]),
        (Cancel(request_id=request_id), []),
    ]


def expert_request(hidden: int = 64) -> tuple:
    return (ExpertRequest(seq=1, layer=0, n=1),
            [np.ones((1, hidden), np.float32), np.zeros((1, 2), np.int32),
             np.ones((1, 2), np.float32)])


def attack(targets: list[tuple[str, str]], should_stop=lambda: False, pause_s: float = 0.005) -> None:
    ctx = zmq.Context.instance()
    socks = []
    for kind, ep in targets:
        s = ctx.socket(zmq.PUSH if kind == "push" else zmq.DEALER)
        s.linger, s.sndtimeo = 0, 100
        s.connect(ep)
        socks.append((kind, s))
    while not should_stop():
        for request_id in range(1, 4):
            for kind, s in socks:
                msgs = forged(request_id) if kind == "push" else [expert_request()]
                for msg, arrays in msgs:
                    try:
                        s.send_multipart(encode(msg, arrays))
                    except zmq.Again:
                        pass
        time.sleep(pause_s)
    for _, s in socks:
        s.close()


if __name__ == "__main__":
    attack([tuple(arg.split("=", 1)) for arg in sys.argv[1:]])
