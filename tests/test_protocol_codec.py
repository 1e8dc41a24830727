"""Codec: every message round-trips, arrays stay zero-copy, and hostile bytes only ever raise ProtocolError."""

import random

import msgpack
import numpy as np
import pytest

from protocol import messages as m
from protocol.codec import decode, encode, from_dict, peek_type, to_dict
from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, ProtocolError, VersionMismatch

ROWS = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
IDS = np.array([[0, 5], [1, -1], [7, 2]], dtype=np.int32)
WTS = np.array([[0.6, 0.4], [1.0, 0.0], [0.5, 0.5]], dtype=np.float32)
OUT = np.ones((3, 2, 8), dtype=np.float16)
DEV = m.DeviceInfo(name="NVIDIA H200", kind="cuda", index=0, total_bytes=150 << 30, free_bytes=140 << 30,
                   mem_bandwidth_gbs=4800.0)
SAMPLING = m.Sampling(temperature=0.7, top_k=20, top_p=0.9, seed=7, max_new=64, stop_ids=[151645])


def examples():
    """One instance (plus its arrays) of every message type, fields away from their defaults where possible."""
    return {
        "hello": (m.Hello(client_id="rank-1", protocol_version=PROTOCOL_VERSION, nonce=b"\x00" * 32), []),
        "challenge": (m.Challenge(nonce=b"\xff" * 32, protocol_version=PROTOCOL_VERSION, server_id="coord"), []),
        "auth": (m.Auth(client_id="rank-1", mac=bytes(range(32))), []),
        "auth_ok": (m.AuthOk(mac=bytes(32)), []),
        "register": (m.Register(rank=None, host="hostA/boot-1", pid=4242,
                                devices=[DEV, m.DeviceInfo(name="cpu", kind="cpu", index=0, total_bytes=64 << 20,
                                                           free_bytes=64 << 20)],
                                model_fingerprint="sha256:abc", protocol_version=PROTOCOL_VERSION,
                                endpoints={"data": "ipc:///tmp/x/r1.sock"}), []),
        "assign": (m.Assign(rank=1, role="stage+helper", lb=12, le=24, first=False, last=True, device="cuda:1",
                            plan={"stages": [[0, 12], [12, 24]], "score_ms": 12.5, "note": None},
                            next_endpoint=None, first_endpoint="tcp://10.0.0.1:5001",
                            head_endpoint="ipc:///tmp/x/head.sock",
                            helpers=[m.PeerInfo(rank=2, endpoint="tcp://10.0.0.2:5002", host="hostB",
                                                 pairs=[[12, 3]])],
                            prompt_chunk=2048, max_context=32768, cache_slots=900, helper_slots=10,
                            loan_slots=128, helper_pairs=[[12, 3], [13, 7]], stage=1, host="a",
                            cache_pairs=[[12, 0]], next_host="a", next_kind="cuda", ipc=False,
                            helper_bind="ipc:///tmp/x/h1.sock"), []),
        "ready": (m.Ready(rank=1, allocated={"weights": 1 << 30, "session": 1 << 20, "cache": 5 << 30},
                          elapsed_ms=1234.5), []),
        "stats": (m.Stats(request_id=9), []),
        "stats_reply": (m.StatsReply(rank=0, counters={"hits": 10, "misses": 2}, gauges={"free_mib": 1.5},
                                     request_id=9), []),
        "heartbeat": (m.Heartbeat(rank=3, seq=17, pid=4242), []),
        "error": (m.Error(rank=2, request_id=None, message="boom", fatal=True, code=m.ERR_PEER), []),
        "shutdown": (m.Shutdown(reason="SIGTERM"), []),
        "release": (m.Release(session_id=5), []),
        "tokens": (m.Tokens(request_id=1, session_id=5, pos=0, ids=[1, 2, 3], chunk_index=1, chunk_total=3,
                            sampling=SAMPLING, checkpoint_at=[3]), []),
        "hidden": (m.Hidden(request_id=1, session_id=5, pos=10, n=3, dtype="float32", shape=[3, 8],
                            chunk_index=0, chunk_total=2, sampling=SAMPLING, checkpoint_at=[10, 13],
                            checkpoints=[4, 8], resume_any=True), [ROWS]),
        "cancel": (m.Cancel(request_id=9), []),
        "settle": (m.Settle(request_id=9, session_id=2, pos=41), []),
        "hand_back": (m.HandBack(request_id=9), []),
        "prompt_progress": (m.PromptProgress(request_id=1, session_id=5, pos=512, chunk_index=0,
                                             chunk_total=3, ms=12.5, checkpoints=[256, 512]), []),
        "token": (m.Token(request_id=1, session_id=5, token_id=42, pos=13, logprob=-0.25, done=True,
                          reason="length"), []),
        "token_handed_back": (m.Token(request_id=1, session_id=5, token_id=42, pos=13, drafts=[7, 8],
                                      handed_back=True), []),
        "step_tokens": (m.StepTokens(request_id=30, tokens=[
            m.Token(request_id=1, session_id=5, token_id=42, pos=13, drafts=[7, 8]),
            m.Token(request_id=2, session_id=0, token_id=9, pos=70, logprob=-1.5, top_ids=[9, 3],
                    top_logprobs=[-1.5, -2.0], done=True, reason="stop")]), []),
        "expert_request": (m.ExpertRequest(seq=3, layer=7, n=3), [ROWS, IDS, WTS]),
        "expert_request_ipc": (m.ExpertRequest(seq=4, layer=7, n=3, slot=m.RowSlot(offset=0, nbytes=96),
                                               out=m.RowSlot(offset=256, nbytes=192)), [IDS, WTS]),
        "expert_reply": (m.ExpertReply(seq=3, layer=7, n=3), [OUT]),
        "ipc_handle": (m.IpcHandle(name="hidden", handle=bytes(64), device=0, nbytes=1 << 20, dtype="float16",
                                   device_uuid="ab" * 16, host="hostA", pid=99), []),
        "expert_tier_ask": (m.ExpertTierAsk(), []),
        "expert_tier": (m.ExpertTier(handle=bytes(64), device=1, nbytes=1 << 30, device_uuid="cd" * 16, pid=7),
                        [np.array([[0, 3], [2, 5]], dtype=np.int32), np.array([0, 4096], dtype=np.int64)]),
        "tier_counts": (m.TierCounts(seq=4, lb=2, le=4), [np.ones((2, 8), dtype=np.float64)]),
        "tier_pairs": (m.TierPairs(seq=4, pairs=[[2, 5], [3, 1]], swaps=2), []),
        "slot_free": (m.SlotFree(name="hidden", slot=m.RowSlot(offset=4096, nbytes=2048)), []),
        "link_probe": (m.LinkProbe(seq=12), [np.zeros(1 << 10, dtype=np.uint8)]),
    }


def test_every_registered_type_has_an_example():
    assert {msg.TYPE for msg, _ in examples().values()} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("name", sorted(examples()))
def test_round_trip(name):
    msg, arrays = examples()[name]
    frames = encode(msg, arrays)
    assert len(frames) == 1 + len(arrays)
    got, got_arrays = decode([bytes(f) for f in frames])
    assert got == msg and type(got) is type(msg)
    assert len(got_arrays) == len(arrays)
    for a, b in zip(arrays, got_arrays):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert peek_type(frames) == msg.TYPE
    assert from_dict(type(msg), to_dict(msg)) == msg


def test_defaults_round_trip():
    for msg in [m.Stats(), m.Shutdown(), m.Hidden(request_id=0, session_id=0, pos=0, n=0, dtype="float32",
                                                  shape=[0, 4], slot=m.RowSlot(offset=0, nbytes=0))]:
        assert decode(encode(msg))[0] == msg


def test_arrays_are_zero_copy_both_ways():
    a = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    frames = encode(m.Hidden(request_id=1, session_id=1, pos=0, n=64, dtype="float32", shape=[64, 128]), [a])
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), a)  # sent without a copy
    recv_buf = bytearray(frames[1])  # stands in for the received frame's memory
    _, (b,) = decode([frames[0], recv_buf])
    assert np.shares_memory(b, np.frombuffer(recv_buf, np.uint8))  # viewed without a copy
    assert np.array_equal(a, b)


def test_non_contiguous_and_odd_arrays():
    a = np.arange(48, dtype=np.int64).reshape(6, 8)[:, ::2]  # not contiguous: copied once, values kept
    msg = m.ExpertReply(seq=0, layer=0, n=6)
    _, (b,) = decode(encode(msg, [a]))
    assert np.array_equal(a, b)
    for arr in [np.zeros((2, 0, 3), np.float32), np.array([[True, False]]), np.ones((1, 2), np.complex64),
                np.ones((3,), ">f4")]:
        msg = m.ExpertReply(seq=0, layer=0, n=arr.shape[0])
        _, (b,) = decode(encode(msg, [arr]))
        assert b.shape == arr.shape and np.array_equal(b, arr)


def test_unaligned_frame_is_copied_to_alignment():
    a = np.arange(16, dtype=np.float64).reshape(2, 8)
    frames = encode(m.ExpertReply(seq=0, layer=0, n=2), [a])
    raw = bytearray(1) + bytearray(frames[1])
    _, (b,) = decode([frames[0], memoryview(raw)[1:]])
    assert b.flags.aligned and np.array_equal(a, b)


def test_version_mismatch_names_both_versions():
    frames = encode(m.Heartbeat(rank=0, seq=1))
    header = msgpack.unpackb(frames[0])
    header["v"] = PROTOCOL_VERSION + 1
    with pytest.raises(VersionMismatch) as ei:
        decode([msgpack.packb(header)])
    text = str(ei.value)
    assert f"v{PROTOCOL_VERSION + 1}" in text and f"v{PROTOCOL_VERSION}" in text and "heartbeat" in text
    assert ei.value.theirs == PROTOCOL_VERSION + 1 and ei.value.ours == PROTOCOL_VERSION
    # A future version may change everything else in the header; the version is still what gets reported.
    with pytest.raises(VersionMismatch, match=f"v{PROTOCOL_VERSION}"):
        decode([msgpack.packb({"v": 99, "whatever": [1, 2]})])


def _header(tag="heartbeat", fields=None, buffers=None, **over):
    h = {"v": PROTOCOL_VERSION, "t": tag,
         "f": {"rank": 0, "seq": 1, "pid": 7} if fields is None else fields,
         "b": [] if buffers is None else buffers}
    h.update(over)
    return msgpack.packb(h, use_bin_type=True)


def _assign_fields(**over):
    f = to_dict(m.Assign(rank=0, role="stage", lb=0, le=1, first=True, last=True, device="cpu", plan={}))
    f.update(over)
    return f


@pytest.mark.parametrize("frames, needle", [
    ([], "empty"),
    ([b""], "msgpack"),
    ([b"\x91\x01"], "map"),
    ([msgpack.packb({"t": "heartbeat"})], "version"),
    ([_header(tag="nope")], "unknown message type 'nope'"),
    ([_header(tag=5)], "unknown message type"),
    ([_header(fields={"rank": 0, "pid": 7})], "missing fields ['seq']"),
    ([_header(fields={"rank": 0, "seq": 1, "pid": 7, "x": 2})], "unexpected fields ['x']"),
    ([_header(fields={"rank": "0", "seq": 1, "pid": 7})], "heartbeat.rank: expected int, got str"),
    ([_header(fields={"rank": True, "seq": 1, "pid": 7})], "expected int, got bool"),
    ([_header(fields={"rank": 0, "seq": 1.0, "pid": 7})], "expected int, got float"),
    ([_header(extra=1)], "header keys"),
    ([_header(buffers=[["<f4", [1]]])], "announces 1 buffer(s), 0 frame(s)"),
    ([_header(), b"xx"], "announces 0 buffer(s), 1 frame(s)"),
    ([_header(tag="expert_reply", fields={"seq": 0, "layer": 0, "n": 2, "slot": None},
              buffers=[["<f4", [2, 4]]]), b"\x00" * 31], "needs 32 bytes, frame has 31"),
    ([_header(tag="expert_reply", fields={"seq": 0, "layer": 0, "n": 1, "slot": None},
              buffers=[["|O", [1]]]), b"\x00" * 8], "not a plain numeric type"),
    ([_header(tag="expert_reply", fields={"seq": 0, "layer": 0, "n": 1, "slot": None},
              buffers=[["<f4", [-1]]]), b""], "shape must be"),
    ([_header(tag="shutdown", fields={"reason": ""}, buffers=[["<f4", [1]]]), b"\0" * 4], "at most 0 buffer"),
    ([_header(tag="hidden", fields={"request_id": 1, "session_id": 1, "pos": 0, "n": 2, "dtype": "float32",
                                    "shape": [2, 4], "slot": None, "chunk_index": 0, "chunk_total": 1,
                                    "sampling": None, "checkpoint_at": [], "checkpoints": [],
                                    "resume_any": False, "conversation": None,
                                    "conversations": [], "batch": None})], "expected 1 frame"),
    ([_header(tag="tokens", fields={"request_id": 1, "session_id": 1, "pos": 4, "ids": [1, 2], "chunk_index": 0,
                                    "chunk_total": 1, "sampling": None, "checkpoint_at": [5],
                                    "conversation": None, "batch": None})],
     "checkpoint_at 5 is not a boundary of rows [4, 6)"),
    ([_header(tag="assign", fields=_assign_fields(role="boss"))], "expected one of"),
    ([_header(tag="assign", fields=_assign_fields(lb=5, le=1))], "reversed"),
    ([_header(tag="assign", fields=_assign_fields(plan={"a": [{"b": b"bytes"}]}))], "not a JSON value"),
    ([_header(tag="assign", fields=_assign_fields(helpers=[{"rank": 1, "endpoint": "x"}]))], "missing fields"),
    ([_header(tag="slot_free", fields={"name": "h", "slot": {"offset": -1, "nbytes": 0}})], "offset must be >= 0"),
    ([_header(tag="expert_request", fields={"seq": 0, "layer": 0, "n": 1, "slot": {"offset": 0, "nbytes": 4},
                                            "out": None})], "must be set together"),
    ([_header(tag="release", fields={"session_id": 2 ** 64 - 1}), b"x"], "announces 0"),
    (b"not a list", "list of frames"),
])
def test_strict_validation(frames, needle):
    with pytest.raises(ProtocolError) as ei:
        decode(frames)
    assert needle in str(ei.value)


def test_encode_normalises_numpy_scalars_and_rejects_bad_fields():
    msg = m.Token(request_id=np.int64(3), session_id=1, token_id=np.int32(9), pos=0, logprob=np.float32(-1.5))
    got, _ = decode(encode(msg))
    assert got.token_id == 9 and type(got.token_id) is int and got.logprob == -1.5
    plan = {"split": (np.int64(3), 7), "cover": np.float64(0.5)}
    a = m.Assign(rank=0, role="stage", lb=0, le=1, first=True, last=True, device="cpu", plan=plan)
    assert decode(encode(a))[0].plan == {"split": [3, 7], "cover": 0.5}
    with pytest.raises(ProtocolError, match="heartbeat.rank: expected int, got str"):
        encode(m.Heartbeat(rank="0", seq=1))
    with pytest.raises(ProtocolError, match="not a JSON value"):
        encode(m.Assign(rank=0, role="stage", lb=0, le=1, first=True, last=True, device="cpu", plan={"b": b"x"}))
    with pytest.raises(ProtocolError, match="expected numpy.ndarray"):
        encode(m.ExpertReply(seq=0, layer=0, n=1), [[1.0]])
    with pytest.raises(ProtocolError, match="at most 1"):
        encode(m.ExpertReply(seq=0, layer=0, n=1), [np.zeros(1), np.zeros(1)])
    with pytest.raises(ProtocolError, match="header says"):
        encode(m.Hidden(request_id=1, session_id=1, pos=0, n=3, dtype="float16", shape=[3, 8]), [ROWS])


def _valid_corpus():
    return [encode(msg, arrays) for msg, arrays in examples().values()]


def _mutations(rng: random.Random, n: int):
    """Random bytes, truncations, bit flips, dropped/extra/swapped frames and structured nonsense."""
    corpus = [[bytes(f) for f in frames] for frames in _valid_corpus()]
    for i in range(n):
        frames = [bytearray(f) for f in rng.choice(corpus)]
        k = i % 8
        if k == 0:
            frames = [bytearray(rng.randbytes(rng.randrange(0, 200))) for _ in range(rng.randrange(0, 4))]
        elif k == 1:
            j = rng.randrange(len(frames))
            frames[j] = frames[j][: rng.randrange(0, len(frames[j]) + 1)]
        elif k in (2, 3):
            for _ in range(rng.randrange(1, 8)):
                j = rng.randrange(len(frames))
                if frames[j]:
                    p = rng.randrange(len(frames[j]))
                    frames[j][p] ^= 1 << rng.randrange(8)
        elif k == 4:
            frames.append(bytearray(rng.randbytes(rng.randrange(0, 64))))
        elif k == 5:
            frames = frames[:-1] if len(frames) > 1 else frames + frames
        elif k == 6:
            frames[0][rng.randrange(len(frames[0]))] = rng.randrange(256)
        else:  # well-formed msgpack with nonsense in it
            junk = rng.choice([None, 1, -1, 2 ** 63, 1.5, "x", b"y", [], {}, [[1]], {"a": {"b": []}}, True])
            h = msgpack.unpackb(bytes(frames[0]), raw=False)
            key = rng.choice(list(h["f"]) or ["v"])
            h["f"][key] = junk
            if rng.random() < 0.3:
                h[rng.choice(["t", "b", "v"])] = junk
            frames[0] = bytearray(msgpack.packb(h, use_bin_type=True))
        yield frames


def test_fuzz_decode_raises_only_protocol_error():
    rng = random.Random(1234)
    decoded = refused = 0
    for frames in _mutations(rng, 3000):
        try:
            msg, arrays = decode(frames)
        except ProtocolError:
            refused += 1
            continue
        decoded += 1  # a flip that still yields a valid message must yield a fully typed one
        assert type(msg) in MESSAGE_TYPES.values()
        decode(encode(msg, arrays))
    assert refused > 2000 and decoded + refused == 3000


def test_fuzz_pathological_msgpack():
    deep = b"\x91" * 100_000 + b"\x00"  # nesting far beyond any stack
    huge = b"\xdd\xff\xff\xff\xff"     # array header claiming 4G elements
    for raw in [deep, huge, b"\xc1", b"\xd4\x01\x00", b"\xc7\xff\x00", msgpack.packb({1: 2}),
                msgpack.packb({"v": PROTOCOL_VERSION, "t": "hello", "f": {"client_id": b"\xff", "nonce": "x",
                                                                          "protocol_version": 1}, "b": []})]:
        with pytest.raises(ProtocolError):
            decode([raw])
    for junk in [[None], [1], ["str"], [object()], [b"", None]]:
        with pytest.raises(ProtocolError):
            decode(junk)


def test_spec_names_every_message_and_field():
    """PROTOCOL.md must keep up with messages.py: every tag, record and field is named in it."""
    import dataclasses
    import os

    import protocol

    spec = open(os.path.join(os.path.dirname(protocol.__file__), "PROTOCOL.md")).read()
    assert f"version {PROTOCOL_VERSION}" in spec
    # the version rule's history says the same number, and its last entry is that version's
    rule = spec[spec.index("`PROTOCOL_VERSION` (an int, now"):]
    assert rule.startswith(f"`PROTOCOL_VERSION` (an int, now {PROTOCOL_VERSION};")
    history = rule[:rule.index("changes whenever")]
    assert f"v{PROTOCOL_VERSION} " in history
    assert f"v{PROTOCOL_VERSION + 1} " not in history
    for cls in list(MESSAGE_TYPES.values()) + list(m.STRUCT_TYPES.values()):
        row = next((line for line in spec.splitlines()
                    if line.startswith(f"| `{getattr(cls, 'TYPE', '') or cls.__name__}` |")), None)
        assert row is not None, f"PROTOCOL.md has no table row for {cls.__name__}"
        for f in dataclasses.fields(cls):
            assert f"`{f.name}:" in row, f"PROTOCOL.md row of {cls.__name__} does not name field {f.name}"


def test_a_steps_tokens_number_one_to_what_a_step_can_make():
    """StepTokens (v24): a batched step's Tokens in one message, at least one, at most every
    entry's whole verify window (protocol/batch.py), and each a Token checked as one."""
    one = m.Token(request_id=1, session_id=0, token_id=3, pos=4)
    most = m.StepTokens(request_id=8, tokens=[one] * m.MAX_STEP_TOKENS)
    assert decode([bytes(f) for f in encode(most)])[0] == most
    for n in (0, m.MAX_STEP_TOKENS + 1):
        with pytest.raises(ProtocolError, match=f"1 to {m.MAX_STEP_TOKENS}, not {n}"):
            decode([bytes(f) for f in encode(m.StepTokens(request_id=8, tokens=[one] * n))])
    with pytest.raises(ProtocolError, match=r"tokens\[0\].token_id: expected int"):
        encode(m.StepTokens(request_id=8, tokens=[m.Token(request_id=1, session_id=0,
                                                          token_id="3", pos=4)]))
