"""Streaming a synthetic model into one GGUF, or into shards (`--split-max-size`).

Shards follow the split layout readers of split GGUFs expect: `<prefix>-00001-of-0000N.gguf`
(the prefix is the output path without `.gguf`), each shard a whole GGUF whose tensor offsets are
its own; every shard holds `split.no` (u16, 0-based), `split.count` (u16) and
`split.tensors.count` (i32, the model's total); the first shard alone holds the model metadata (the
split keys after it). Tensors go to shards in order: a shard takes the next tensor unless its
tensors' aligned sizes would pass the cap, so a tensor larger than the cap gets a shard of its own.
Sizes in decimal units (4G = 4,000,000,000 bytes), counted on tensor data as the split tool does.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator, Protocol

import gguf
import numpy as np

from ..gguf_file.split import shard_name

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}


class TensorSource(Protocol):
    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    nbytes: int

    def data(self) -> Iterator[np.ndarray]: ...


def parse_size(text: str) -> int:
    """`4G`, `500M`, `64K` or a byte count -> bytes (decimal units)."""
    m = _SIZE.match(str(text))
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"bad split size {text!r}: expected a positive number with an optional "
                         f"K, M or G suffix, as in 4G")
    return int(m.group(1)) * _UNIT[m.group(2).upper()]


def shard_path(path: Path, index: int, count: int) -> Path:
    """Shard `index` (0-based) of `count` for the output `path` (`m.gguf` -> `m-00001-of-00003.gguf`)."""
    stem = path.name[:-5] if path.name.endswith(".gguf") else path.name
    return path.with_name(shard_name(stem, index, count))


def assign_shards(sizes: list[int], max_size: int) -> list[int]:
    """Shard index of each tensor, in order, from the tensors' aligned data sizes."""
    out, shard, used = [], 0, 0
    for n in sizes:
        if used > 0 and used + n > max_size:
            shard, used = shard + 1, 0
        out.append(shard)
        used += n
    return out


def write_gguf(path: Path, arch: str, metadata: Callable[[gguf.GGUFWriter], None],
               tensors: list[TensorSource], progress: Callable[[int, int], None] | None,
               split_max_size: int = 0, what: str = "") -> list[Path]:
    """Stream `tensors` into `path` (or its shards): each file written as `.part` and renamed once
    all are complete; nothing is left behind on failure. Returns the files written, in order."""
    pad = gguf.GGUFWriter.ggml_pad
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    sizes = [pad(t.nbytes, align) for t in tensors]
    need, free = sum(sizes), shutil.disk_usage(path.parent).free
    if need > free:  # refuse at the start rather than fail an hour in
        mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
        raise ValueError(f"{what} needs {mib(need)}, {path.parent} has {mib(free)} free")
    which = assign_shards(sizes, split_max_size) if split_max_size else [0] * len(tensors)
    count = which[-1] + 1 if which else 1
    paths = [shard_path(path, i, count) for i in range(count)] if split_max_size else [path]
    parts = [p.with_name(p.name + ".part") for p in paths]
    writers: list[gguf.GGUFWriter] = []
    for i, part in enumerate(parts):
        w = gguf.GGUFWriter(part, arch)
        if i == 0:
            metadata(w)
        else:                                            # later shards: the split keys alone
            w.kv_data[0].clear()
        if split_max_size:
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, i)
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, count)
            w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(tensors))
        for t, s in zip(tensors, which):
            if s == i:
                w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
        writers.append(w)

    ok = False
    try:
        starts, done = [], 0
        for w in writers:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            assert w.fout is not None and len(w.fout) == 1
            starts.append(pad(w.fout[0].tell(), align))
        total = sum(starts) + need
        for i, w in enumerate(writers):
            # Data as GGUFWriter.write_tensor_data lays it out (each tensor aligned, then padded),
            # but in chunks: that method wants the whole tensor in memory.
            f = w.fout[0]
            f.write(bytes(starts[i] - f.tell()))
            done += starts[i]
            if progress is not None:
                progress(done, total)
            for t, s in zip(tensors, which):
                if s != i:
                    continue
                written = 0
                for chunk in t.data():
                    chunk.tofile(f)
                    written += chunk.nbytes
                    if progress is not None:
                        progress(done + written, total)
                if written != t.nbytes:
                    raise AssertionError(f"{t.name}: generated {written} bytes, expected {t.nbytes}")
                f.write(bytes(pad(written, align) - written))
                done += pad(written, align)
            f.flush()
            if f.tell() != starts[i] + sum(n for n, s in zip(sizes, which) if s == i):
                raise AssertionError(f"{paths[i]}: wrote {f.tell()} bytes, not the planned size")
        ok = True
    finally:
        for w in writers:
            w.close()
        if not ok:
            for part in parts:
                part.unlink(missing_ok=True)
    for part, p in zip(parts, paths):
        os.replace(part, p)
    return paths
