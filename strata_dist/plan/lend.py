"""Prompt loans (DESIGN §4, seed #216): each stage's prompt path borrows the tail of ITS OWN expert
cache for its prompt buffers and refills those slots afterwards, so outside a prompt the whole cache
is expert cache.

The rule, exactly:
- One chunk for all participants: with `--prefill auto`, the largest of LEND_CHUNKS every participant
  that can lend at all can lend.
- Lending a chunk must leave SLOT_FLOOR (128) slots of the participant's cache.
- The percentage cap (STRATA_PREFILL_LEND_PCT, default 85) applies to the AUTO chunk only; an explicit
  `--prefill N` is the operator's number and a loan of it only has to leave the floor.
- A participant whose cache already holds every pair it may (its budget has room to spare) does not
  lend: its own prompt buffers take the room the cache left, when they fit there. Lending would only
  evict experts to free memory that is already free. Such a participant never streams a miss, so its
  own buffers are the resident layout (`resident_bytes`: no stream buffer) wherever they fit in that
  room; where they do not, they evict pairs and the full layout is priced.
- A participant that cannot lend falls back to its own prompt buffers (a note names both numbers),
  taken from the room its cache would have used: with the auto chunk they stay within the same
  percentage cap (which bounds the auto chunk); with an explicit chunk they only have to fit.
- With one participant this is exactly the single-GPU plan (the rule has no multi-stage special case).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence, Union

from .errors import PlanError
from .pricing import MIB

LEND_CHUNKS = (8192, 6144, 4096, 3072, 2048, 1024, 512, 256)
SLOT_FLOOR = 128

# a prompt chunk's buffers: bytes per token, or the bytes of a chunk of n tokens
# (ModelShape.prompt_bytes: the architecture's fixed layout, plan/workspace.py)
PromptBytes = Union[int, Callable[[int], int]]


def prompt_chunk_bytes(prompt_bytes: PromptBytes, prompt_chunk: int) -> int:
    return prompt_bytes(prompt_chunk) if callable(prompt_bytes) else prompt_bytes * prompt_chunk


def loan_slots(prompt_chunk: int, bytes_per_token: PromptBytes, slot_bytes: int) -> int:
    """Cache slots a prompt chunk of prompt_chunk tokens borrows: ceil(its buffers' bytes / slot_bytes).
    slot_bytes is the participant's SMALLEST blob, so evicting that many tail pairs always frees at
    least the buffers' bytes, whatever layers the tail pairs belong to."""
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
    return -(-prompt_chunk_bytes(bytes_per_token, prompt_chunk) // slot_bytes)


@dataclass(frozen=True)
class Participant:
    """A stage's prompt path: its cache (slots = pairs held), the slot size for loans, the bytes
    its own buffers may take instead (its cache budget) if it cannot lend, and the part of that
    budget its cache leaves unused (every pair of its layers held: nothing to evict for).
    holds_all: its cache holds every pair of its layers (without a loan it streams nothing)."""

    name: str
    slots: int
    slot_bytes: int
    room_bytes: int
    spare_bytes: int = 0
    holds_all: bool = False


@dataclass(frozen=True)
class Loan:
    name: str
    lends: bool
    slots: int        # cache slots borrowed for the prompt (0 if it uses its own buffers)
    bytes: int        # slots * slot_bytes
    own_bytes: int    # own prompt buffers when it cannot lend, else 0
    note: str = ""


@dataclass(frozen=True)
class LendPlan:
    prompt_chunk: int
    auto: bool
    loans: tuple[Loan, ...]


def can_lend(p: Participant, prompt_chunk: int, bytes_per_token: PromptBytes,
             lend_pct: int | None) -> tuple[bool, int]:
    """(can p lend `prompt_chunk`, slots it needs). lend_pct None = explicit chunk: the floor only."""
    need = loan_slots(prompt_chunk, bytes_per_token, p.slot_bytes)
    ok = p.slots - need >= SLOT_FLOOR
    if lend_pct is not None:
        ok = ok and need * 100 <= lend_pct * p.slots
    return ok, need


def _why_not(p: Participant, prompt_chunk: int, need: int, lend_pct: int | None) -> str:
    cap = "" if lend_pct is None else f", cap {lend_pct}% = {lend_pct * p.slots // 100} slots"
    return (f"{p.name} cannot lend a {prompt_chunk}-token chunk: it needs {need} slots, its cache "
            f"has {p.slots} (floor {SLOT_FLOOR}{cap})")


def own_prompt_room(own_bytes: int, auto: bool, lend_pct: int) -> int:
    """The least room (bytes) of a stage's cache budget from which its own prompt buffers of
    `own_bytes` may be taken: an auto chunk's within the loan's percentage cap of that room
    (lend_pct), an explicit chunk's only have to fit. plan_lend and --kv-resident auto
    (kv_auto.py) both keep it."""
    if not 0 < lend_pct <= 100:
        raise ValueError(f"lend_pct {lend_pct}: a percentage in (0, 100]")
    return -(-own_bytes * 100 // lend_pct) if auto else own_bytes


def with_own_bytes(loan: Loan, own_bytes: int) -> Loan:
    """`loan` (one that does not lend) with own prompt buffers of own_bytes, its note saying so."""
    if own_bytes == loan.own_bytes:
        return loan
    note = loan.note.replace(f"({loan.own_bytes / MIB:.1f} MiB)", f"({own_bytes / MIB:.1f} MiB)")
    return replace(loan, own_bytes=own_bytes, note=note)


def plan_lend(participants: Sequence[Participant], bytes_per_token: PromptBytes,
              prompt_chunk: int | None = None,
              lend_pct: int = 85, max_chunk: int | None = None, loans: bool = True,
              resident_bytes: PromptBytes | None = None) -> LendPlan:
    """The prompt chunk and each participant's loan. prompt_chunk=None is `--prefill auto`, which never
    picks a chunk above max_chunk (the context: a longer chunk could never be filled) unless even
    the smallest one is. loans=False: nobody lends, every participant withholds its own buffers
    (the A/B against loans). resident_bytes: the own buffers of a participant that holds every
    pair and lends nothing, so streams no miss (default: bytes_per_token)."""
    if not participants:
        raise ValueError("plan_lend: no participants")
    auto = prompt_chunk is None
    pct = lend_pct if auto else None

    def lendable(p: Participant, c: int, bpt: PromptBytes, cap: int | None) -> tuple[bool, int]:
        ok, need = can_lend(p, c, bpt, cap)
        return ok and loans, need

    def own(p: Participant, c: int) -> int:
        """p's own prompt buffers for a chunk of c tokens. Resident ones (no stream buffer) where
        its cache holds every pair and they fit in the room it leaves: the cache then keeps every
        pair, so the stage streams nothing (stage.py carves by the same rule)."""
        if p.holds_all and resident_bytes is not None:
            resident = prompt_chunk_bytes(resident_bytes, c)
            if resident <= p.spare_bytes:
                return resident
        return prompt_chunk_bytes(bytes_per_token, c)

    def spared(p: Participant, c: int) -> bool:  # its buffers fit where its cache left room
        return loans and own(p, c) <= p.spare_bytes

    if auto:
        sizes = [c for c in LEND_CHUNKS if max_chunk is None or c <= max_chunk] or [LEND_CHUNKS[-1]]
        # each participant's largest lendable chunk (lendability only shrinks as the chunk grows)
        best = [next((c for c in sizes if spared(p, c) or lendable(p, c, bytes_per_token, pct)[0]),
                     None) for p in participants]
        lenders = [c for c in best if c is not None]
        cands = [c for c in sizes if not lenders or c <= min(lenders)]
        # a participant that cannot lend takes its own buffers out of its cache's room; the auto
        # chunk keeps those within the same percentage cap a loan has
        fallbacks = [p for p, b in zip(participants, best) if b is None]
        for p in fallbacks:
            cands = [c for c in cands if own_prompt_room(own(p, c), True, lend_pct) <= p.room_bytes]
        if not cands:
            c = LEND_CHUNKS[-1]
            p = next(p for p in fallbacks
                     if own_prompt_room(own(p, c), True, lend_pct) > p.room_bytes)
            why = _why_not(p, c, can_lend(p, c, bytes_per_token, pct)[1], pct) if loans else \
                f"{p.name}: prompt loans are off"
            raise PlanError(f"{why}, and its own "
                            f"prompt buffers for {c} tokens ({own(p, c) / MIB:.1f} MiB) exceed "
                            f"{lend_pct}% of its {p.room_bytes / MIB:.1f} MiB of room")
        prompt_chunk = max(cands)
    elif prompt_chunk < 1:
        raise PlanError(f"--prefill {prompt_chunk}: the chunk must be at least 1 token")

    out = []
    for p in participants:
        if spared(p, prompt_chunk):
            out.append(Loan(p.name, False, 0, 0, own(p, prompt_chunk),
                            f"{p.name} holds every pair of its layers: its prompt buffers "
                            f"({own(p, prompt_chunk) / MIB:.1f} MiB) take the "
                            f"{p.spare_bytes / MIB:.1f} MiB its cache leaves, no loan"))
            continue
        ok, need = lendable(p, prompt_chunk, bytes_per_token, pct)
        if ok:
            out.append(Loan(p.name, True, need, need * p.slot_bytes, 0))
            continue
        # explicit chunks only: the auto chunk was picked within every fallback's room above
        if own_prompt_room(own(p, prompt_chunk), auto, lend_pct) > p.room_bytes:
            why = _why_not(p, prompt_chunk, need, pct) if loans else f"{p.name}: prompt loans are off"
            raise PlanError(f"--prefill {prompt_chunk}: {why}, and its own prompt buffers "
                            f"({own(p, prompt_chunk) / MIB:.1f} MiB) exceed its "
                            f"{p.room_bytes / MIB:.1f} MiB of room")
        why = _why_not(p, prompt_chunk, need, pct) if loans else f"{p.name}: prompt loans are off"
        note = f"{why}; it uses its own prompt buffers ({own(p, prompt_chunk) / MIB:.1f} MiB)"
        out.append(Loan(p.name, False, 0, 0, own(p, prompt_chunk), note))
    return LendPlan(int(prompt_chunk), auto, tuple(out))
