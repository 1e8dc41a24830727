"""The operator's hand on the layout: which listed cards run stages (--stage-gpus) and explicit
helper tiers (--expert-cache-device N=MiB), resolved against the planning devices.

A card is named by its index as the plan table shows it (the first number of its `device` column:
a GPU's index in --gpus or an inventory's `index`, a CPU rank's number), or `host:N` where several
hosts list the same index. Everything here refuses with a PlanError naming the value and what it
was checked against; nothing is adjusted silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .device import Device
from .errors import PlanError
from .pricing import HELPER_RESERVE_BYTES, MIB


@dataclass(frozen=True)
class ExplicitTier:
    """An explicit helper tier: `budget_bytes` of expert blobs on `ref`'s card (its reserve,
    HELPER_RESERVE_BYTES, comes on top). `shown`: the device as the operator wrote it, where the
    launcher translated it into `ref` (a GPU index into its rank's number); `flag` repeats the
    operator's words in messages."""

    ref: str
    budget_bytes: int
    shown: str = ""

    @property
    def flag(self) -> str:
        return f"--expert-cache-device {self.shown or self.ref}={self.budget_bytes // MIB}"


def _listed(devices: Sequence[Device]) -> str:
    return ", ".join(_name(d, devices) for d in devices)


def _name(dev: Device, devices: Sequence[Device]) -> str:
    """How the operator names `dev`: its index, or host:index where another host has it too."""
    twice = sum(1 for d in devices if d.index == dev.index) > 1
    return f"{dev.host}:{dev.index}" if twice else str(dev.index)


def resolve(ref: str, devices: Sequence[Device], flag: str) -> Device:
    """The one device `ref` ("N" or "host:N") names, or a PlanError naming `flag` and the listed
    devices."""
    host, _, index = ref.strip().rpartition(":")
    if not index.isdigit():
        raise PlanError(f"{flag}: {ref!r} is not a device index (N, or host:N)")
    found = [d for d in devices if d.index == int(index) and (not host or d.host == host)]
    if not found:
        raise PlanError(f"{flag}: no listed device {ref} (listed: {_listed(devices)})")
    if len(found) > 1:
        raise PlanError(f"{flag}: device {ref} is listed on {len(found)} hosts "
                        f"({', '.join(d.host for d in found)}): name it host:{index}")
    return found[0]


def stage_devices(refs: Sequence[str], devices: Sequence[Device]) -> tuple[Device, ...]:
    """The devices --stage-gpus names, each once."""
    flag = f"--stage-gpus {','.join(refs)}"
    if not refs:
        raise PlanError("--stage-gpus names no device")
    out = [resolve(r, devices, flag) for r in refs]
    for i, d in enumerate(out):
        if d in out[:i]:
            raise PlanError(f"{flag}: device {_name(d, devices)} is named twice")
    return tuple(out)


def explicit_tiers(tiers: Sequence[ExplicitTier], devices: Sequence[Device]) -> dict[Device, ExplicitTier]:
    """{device: its explicit helper tier}. Refused: a card not listed, a card named
    twice, and a size past what the card has for a helper tier — its free memory less the helper
    reserve (a stage card's stage is checked by the search: the tier is taken off first)."""
    out: dict[Device, ExplicitTier] = {}
    for t in tiers:
        if t.budget_bytes <= 0:
            raise PlanError(f"{t.flag}: a helper tier needs at least 1 MiB")
        dev = resolve(t.ref, devices, t.flag)
        if dev in out:
            raise PlanError(f"{t.flag}: device {_name(dev, devices)} already has an explicit "
                            f"helper tier ({out[dev].flag})")
        room = dev.free_bytes - HELPER_RESERVE_BYTES
        if t.budget_bytes > room:
            raise PlanError(f"{t.flag}: asked {t.budget_bytes / MIB:.1f} MiB; device {dev.label} has "
                            f"{max(room, 0) / MIB:.1f} MiB for a helper tier ({dev.free_bytes / MIB:.1f} "
                            f"MiB free less the {HELPER_RESERVE_BYTES / MIB:.0f} MiB helper reserve)")
        out[dev] = t
    return out


def parse_explicit_tiers(values: Sequence[str]) -> tuple[ExplicitTier, ...]:
    """--expert-cache-device values (repeatable; each may be a comma list): N=MiB entries.
    Raises ValueError naming the entry."""
    out = []
    for value in values:
        for item in (x.strip() for x in value.split(",")):
            if not item:
                continue
            ref, eq, mib = item.partition("=")
            if not eq or not ref.strip() or not mib.strip().isdigit():
                raise ValueError(f"--expert-cache-device {item}: expected N=MiB (e.g. 2=3500)")
            out.append(ExplicitTier(ref.strip(), int(mib) * MIB))
    return tuple(out)


def ranks_of_gpus(refs: Sequence[str], gpu_of_rank: Sequence[int], flag: str,
                  one: bool = False) -> list[str]:
    """GPU indices as --gpus names them -> the rank numbers the plan's devices carry (rank i runs
    --gpus' i-th entry; a GPU listed twice runs two ranks: both, or with `one` a refusal)."""
    out = []
    listed = ",".join(map(str, gpu_of_rank))
    for ref in refs:
        if not ref.strip().isdigit():
            raise PlanError(f"{flag}: {ref!r} is not a GPU index (--gpus {listed})")
        ranks = [str(r) for r, g in enumerate(gpu_of_rank) if g == int(ref)]
        if not ranks:
            raise PlanError(f"{flag}: GPU {ref.strip()} is not in --gpus {listed}")
        if one and len(ranks) > 1:
            raise PlanError(f"{flag}: GPU {ref.strip()} runs {len(ranks)} ranks (--gpus {listed}); "
                            f"a helper tier goes on one")
        out += ranks
    return out
