"""Routing profiles on disk: record one from real runs, save it, load it for the planner.

Recording. `record_profile` runs each prompt through the single-process `SingleProcessRunner` with the model's
`on_route(layer, expert_ids[n, k])` hook counting every (layer, expert) choice: every prompt token
(prefill, in chunks of `prompt_chunk`) and, with `max_new > 0`, every greedily decoded token that is
fed back (a generation of m tokens feeds m - 1 of them; end-of-sequence stops it early). Each routed
token adds exactly `top_k` to every layer's row, so a profile's rows all sum to tokens x top_k.

File format (`save_profile`), one JSON object, UTF-8:

    {"format": "strata-routing-profile", "version": 1,
     "n_layers": L, "n_experts": E,
     "model_fingerprint": "<GGUFModel(path).fingerprint, or null>",
     "meta": {...free-form: tokens, prompts, max_new, model file name...},
     "counts": [[c_00, ..., c_0(E-1)], ..., [c_(L-1)0, ...]]}

`counts[l][e]` is how many times expert e of layer l was in a token's top-k (finite, >= 0; integers
when recorded, any non-negative number when written by hand). `load_profile` also accepts the
binary form of `RoutingProfile.to_bytes` (it starts with the magic `STRPROF1`). The fingerprint is
informational: a profile recorded on a Q8_0 file is meant for the Q4_K file of the same model too, so
a different fingerprint is a warning (when the caller passes one), never a refusal; a different
shape is a refusal.
"""
from __future__ import annotations

import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from protocol.bounded_read import MIB, read_capped

from ..plan.profile import _MAGIC, RoutingProfile

FORMAT = "strata-routing-profile"
VERSION = 1
# past these a file is not what its flag wants (/dev/zero, a log): refused unread. A profile of
# 128 layers x 1,024 experts written as JSON is about 3 MiB; the prompt ids file holds prompts of
# up to a context each: 16 MiB is some 2 million ids (a 1M-token context at 7 bytes an id, twice)
PROFILE_FILE_MAX = 16 * MIB
PROMPT_IDS_FILE_MAX = 16 * MIB


# ---------------------------------------------------------------- recording
def record_profile(model_path: str | os.PathLike[str], prompts: list[list[int]], device: str = "cpu",
                   max_new: int = 0, prompt_chunk: int = 512,
                   progress: Callable[[int, int], None] | None = None) -> RoutingProfile:
    """Counts of every (layer, expert) routing over `prompts` run through the real forward.

    `progress(done, total)` is called after each prompt. Raises ValueError for an empty prompt list,
    an empty prompt, an out-of-range token id or a prompt that does not fit the model's context
    (each naming the prompt, 1-based)."""
    from ..models import architecture_for, open_checked
    from .single_process import SingleProcessRunner

    if max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}")
    if not prompts:
        raise ValueError("no prompts to profile")
    for i, p in enumerate(prompts, 1):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
    need = max(len(p) for p in prompts) + max_new
    # a profile stays inside the trained context (checked before the session is allocated)
    gguf = open_checked(str(model_path))
    trained = architecture_for(gguf).read_geometry(gguf).trained_context
    if need > trained:
        raise ValueError(f"the longest prompt ({max(len(p) for p in prompts)} tokens) + --max-new {max_new} "
                         f"exceeds the model's context of {trained}")
    engine = SingleProcessRunner(str(model_path), device=device, max_context=need, prompt_chunk=prompt_chunk)
    model = engine.model
    g = model.g
    if not hasattr(model, "on_route"):
        raise ValueError(f"{model_path}: this architecture has no routing hook to profile")
    for i, p in enumerate(prompts, 1):
        bad = [t for t in p if not 0 <= int(t) < g.n_vocab]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is out of range [0, {g.n_vocab})")

    counts = np.zeros((g.n_layers, g.n_expert), dtype=np.int64)

    def on_route(layer: int, expert_ids) -> None:
        ids = np.asarray(expert_ids).ravel()
        ids = ids[ids >= 0]                  # a row whose logits picked nothing (NaN)
        counts[layer] += np.bincount(ids, minlength=g.n_expert)[: g.n_expert]

    model.on_route = on_route
    try:
        for i, p in enumerate(prompts, 1):
            engine.generate([int(t) for t in p], max_new)
            if progress is not None:
                progress(i, len(prompts))
    finally:
        model.on_route = None
    return RoutingProfile(counts.astype(np.float64))


def tokens_routed(profile: RoutingProfile, top_k: int) -> int:
    """Tokens behind a recorded profile (every layer routes each token to top_k experts)."""
    return int(round(float(profile.counts[0].sum()) / top_k))


def summary_line(profile: RoutingProfile, top_k: int) -> str:
    """One line for the CLI: tokens routed and the hottest pair's share."""
    mass = profile.mass()
    flat = int(np.argmax(mass))
    layer, expert = divmod(flat, profile.n_experts)
    in_layer = mass[layer, expert] * profile.n_layers
    k = max(1, profile.n_experts // 4)
    top_quarter = float(np.mean(np.sort(mass, axis=1)[:, ::-1][:, :k].sum(axis=1) * profile.n_layers))
    return (f"{tokens_routed(profile, top_k)} tokens routed over {profile.n_layers} layers x "
            f"{profile.n_experts} experts (top-{top_k}); top pair (layer {layer}, expert {expert}) "
            f"holds {100 * in_layer:.1f}% of its layer ({100 * mass[layer, expert]:.2f}% of all); "
            f"top {k} experts per layer hold {100 * top_quarter:.1f}% on average")


# ---------------------------------------------------------------- files
def save_profile(profile: RoutingProfile, path: str | os.PathLike[str], *,
                 model_fingerprint: str | None = None, meta: dict | None = None) -> None:
    """Write `profile` as the JSON format above (atomically: a temporary file, then renamed)."""
    path = Path(path)
    c = profile.counts
    counts = c.astype(np.int64).tolist() if np.all(c == np.round(c)) and c.max() < 2 ** 53 else c.tolist()
    doc = {"format": FORMAT, "version": VERSION, "n_layers": profile.n_layers,
           "n_experts": profile.n_experts, "model_fingerprint": model_fingerprint,
           "meta": dict(meta or {}), "counts": counts}
    tmp = path.with_name(path.name + ".tmp")
    head = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k != "counts")
    try:
        with open(tmp, "w", encoding="utf-8") as f:  # one layer per line: diffable, greppable
            f.write("{" + head + ', "counts": [\n  ' + ",\n  ".join(json.dumps(r) for r in counts) + "]}\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_profile_file(path: str | os.PathLike[str]) -> tuple[RoutingProfile, str | None, dict]:
    """(profile, model fingerprint or None, meta) of a profile file; ValueError naming the file if
    it is not one."""
    path = Path(path)
    try:
        data = read_capped(path, PROFILE_FILE_MAX, "--expert-profile")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the routing profile ({e.strerror or e})") from None
    if data[:8] == _MAGIC:
        try:
            return RoutingProfile.from_bytes(data), None, {}
        except ValueError as e:
            raise ValueError(f"{path}: malformed routing profile: {e}") from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not a routing profile (neither JSON nor STRPROF1 binary): "
                         f"{e if not isinstance(e, RecursionError) else 'nested too deep'}") from None

    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: malformed routing profile: {why}")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f"'format' is not {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise bad(f"unsupported version {doc.get('version')!r} (this build reads {VERSION})")
    L, E = doc.get("n_layers"), doc.get("n_experts")
    if not (isinstance(L, int) and isinstance(E, int) and L >= 1 and E >= 1):
        raise bad(f"n_layers and n_experts must be positive integers, got {L!r}, {E!r}")
    rows = doc.get("counts")
    if (not isinstance(rows, list) or len(rows) != L
            or not all(isinstance(r, list) and len(r) == E for r in rows)):
        raise bad(f"'counts' must be {L} rows of {E} numbers")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for r in rows for x in r):
        raise bad("'counts' holds something that is not a number")
    try:
        prof = RoutingProfile(np.asarray(rows, dtype=np.float64))
    except ValueError as e:
        raise bad(str(e)) from None
    fp = doc.get("model_fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise bad("'model_fingerprint' must be a string or null")
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise bad("'meta' must be an object")
    return prof, fp, meta


def load_profile(path: str | os.PathLike[str], n_layers: int, n_experts: int, *,
                 model_fingerprint: str | None = None) -> RoutingProfile:
    """The profile in `path`, checked against the model's shape [n_layers, n_experts].

    ValueError naming the file for a malformed file, and naming both shapes for a mismatch. With
    `model_fingerprint`, a profile recorded on a different file is loaded with a warning."""
    prof, fp, _ = read_profile_file(path)
    try:
        prof.check(n_layers, n_experts)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if model_fingerprint is not None and fp is not None and fp != model_fingerprint:
        warnings.warn(f"{path}: routing profile was recorded on model {fp}, this model is "
                      f"{model_fingerprint} (same shape; using it anyway)", stacklevel=2)
    return prof


# ---------------------------------------------------------------- learnt live
class LiveProfile:
    """A profile learnt while serving (--expert-profile-out): the routing every stage counted
    since it started (StatsReply.routing, rank -> (first layer, rows)), written in the format
    above, atomically, every `every_s` seconds while it grows and once more at a clean shutdown;
    `--expert-profile` reads the file at the next start."""

    def __init__(self, path: str | os.PathLike[str], n_layers: int, n_experts: int,
                 every_s: float, model_fingerprint: str | None = None, meta: dict | None = None):
        self.path, self.every_s = Path(path), float(every_s)
        self.shape = (n_layers, n_experts)
        self.fingerprint, self.meta = model_fingerprint, dict(meta or {})
        self.written_at = time.monotonic()
        self.writes = 0
        self._last: np.ndarray | None = None

    def due(self) -> bool:
        return time.monotonic() - self.written_at >= self.every_s

    def write(self, routing: dict) -> bool:
        """Write the counts of `routing` if they changed since the last write (none counted: no
        file). Whether it wrote."""
        self.written_at = time.monotonic()
        counts = np.zeros(self.shape, dtype=np.int64)
        for lb, rows in routing.values():
            block = np.asarray(rows, dtype=np.int64).reshape(-1, self.shape[1])
            counts[lb:lb + len(block)] = block
        if not counts.any() or (self._last is not None and np.array_equal(counts, self._last)):
            return False
        save_profile(RoutingProfile(counts), self.path, model_fingerprint=self.fingerprint,
                     meta=dict(self.meta, learnt="live", routed=int(counts.sum())))
        self._last = counts
        self.writes += 1
        return True


# ---------------------------------------------------------------- prompts
_SEP = re.compile(r"[\s,]+")


def read_prompt_ids_file(path: str | os.PathLike[str]) -> list[list[int]]:
    """Prompts as token ids, one prompt per line, ids separated by commas and/or whitespace.

    Blank lines and comments (from '#' to the end of the line) are skipped. A line with anything
    but non-negative integers raises ValueError naming the file and the line number (1-based); so
    does a file with no prompt at all or one that cannot be read."""
    path = Path(path)
    try:
        text = read_capped(path, PROMPT_IDS_FILE_MAX, "--prompt-ids-file").decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the prompt ids file ({getattr(e, 'strerror', None) or e})") from None
    prompts: list[list[int]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip().strip(",").strip()
        if not body:
            continue
        ids = []
        for tok in _SEP.split(body):
            if not re.fullmatch(r"\+?\d+", tok):
                shown = tok if len(tok) <= 20 else tok[:20] + "…"
                raise ValueError(f"{path}:{lineno}: '{shown}' is not a token id "
                                 f"(want non-negative integers separated by commas or spaces)")
            ids.append(int(tok))
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts (every line is blank or a comment)")
    return prompts


__all__ = ["record_profile", "save_profile", "LiveProfile", "load_profile", "read_profile_file", "read_prompt_ids_file",
           "tokens_routed", "summary_line", "FORMAT", "VERSION"]
