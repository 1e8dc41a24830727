"""RoutingProfile: how often each (layer, expert) pair was routed to, and the global ranking of pairs.

Every cache in the plan fills in this ranking's order, so the ranking is deterministic: ties break
by the expert's rank within its layer, then by layer. For a uniform profile that interleaves the
layers ((e0,l0), (e0,l1), ...), so a partly filled cache spreads over its layers evenly instead of
filling its first layer completely and leaving its last layer empty.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"STRPROF1"


@dataclass(frozen=True, eq=False)
class RoutingProfile:
    """counts[l, e]: routing events of expert e in layer l (float64, >= 0), shape [n_layers, n_experts]."""

    counts: np.ndarray

    def __post_init__(self) -> None:
        c = np.array(self.counts, dtype=np.float64)  # a private copy: the profile is a value
        if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 1:
            raise ValueError(f"RoutingProfile: counts must be 2-D [n_layers, n_experts], got shape {c.shape}")
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise ValueError("RoutingProfile: counts must be finite and >= 0")
        c.setflags(write=False)
        object.__setattr__(self, "counts", c)

    @classmethod
    def uniform(cls, n_layers: int, n_experts: int) -> "RoutingProfile":
        """The fallback when no profile was recorded (the CLI warns)."""
        return cls(np.ones((n_layers, n_experts)))

    @property
    def n_layers(self) -> int:
        return self.counts.shape[0]

    @property
    def n_experts(self) -> int:
        return self.counts.shape[1]

    @property
    def is_uniform(self) -> bool:
        """True when the profile carries no information: every layer's counts are flat (or empty)."""
        return bool(np.all(self.counts == self.counts[:, :1]))

    def check(self, n_layers: int, n_experts: int) -> None:
        if self.counts.shape != (n_layers, n_experts):
            raise ValueError(f"routing profile is [{self.n_layers} layers, {self.n_experts} experts], "
                             f"the model is [{n_layers}, {n_experts}]")

    def mass(self) -> np.ndarray:
        """Measured share of all routed expert activations per pair (sums to 1). Every layer sees
        every token, so each layer is normalised to 1/n_layers; a layer without data is uniform."""
        totals = self.counts.sum(axis=1, keepdims=True)
        flat = np.full_like(self.counts, 1.0 / self.n_experts)
        per_layer = np.divide(self.counts, totals, out=flat, where=totals > 0)
        return per_layer / self.n_layers

    def ranking(self) -> np.ndarray:
        """All pairs as flat ids (layer * n_experts + expert), hottest first (int64, length L*E).
        Restricted to one layer it is that layer's own descending order."""
        L, E = self.counts.shape
        # rank of each expert within its layer: by count descending, expert id ascending
        order_in_layer = np.argsort(-self.counts, axis=1, kind="stable")
        within = np.empty((L, E), dtype=np.int64)
        within[np.arange(L)[:, None], order_in_layer] = np.arange(E)[None, :]
        layer = np.repeat(np.arange(L), E)
        return np.lexsort((layer, within.ravel(), -self.mass().ravel())).astype(np.int64)

    # --- pure (de)serialisation; reading/writing files is the caller's ---------------------------
    def to_dict(self) -> dict:
        return {"n_layers": self.n_layers, "n_experts": self.n_experts, "counts": self.counts.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "RoutingProfile":
        prof = cls(np.asarray(d["counts"], dtype=np.float64))
        prof.check(int(d["n_layers"]), int(d["n_experts"]))
        return prof

    def to_bytes(self) -> bytes:
        return _MAGIC + struct.pack("<II", self.n_layers, self.n_experts) + self.counts.astype("<f8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "RoutingProfile":
        if data[:8] != _MAGIC or len(data) < 16:
            raise ValueError("not a strata routing profile (bad magic)")
        L, E = struct.unpack("<II", data[8:16])
        body = data[16:]
        if len(body) != L * E * 8:
            raise ValueError(f"routing profile body is {len(body)} bytes, expected {L * E * 8} for [{L}, {E}]")
        return cls(np.frombuffer(body, dtype="<f8").reshape(L, E))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutingProfile) and np.array_equal(self.counts, other.counts)

    __hash__ = None  # type: ignore[assignment]
