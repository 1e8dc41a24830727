"""A model published as shards (`<prefix>-00001-of-00003.gguf`, …): the first shard carries the
model's metadata, every shard carries `split.no` (0-based), `split.count` and
`split.tensors.count` (the tensors of all shards together), and each shard is a GGUF file of its
own holding some of the tensors. Opening the first shard finds the others by name and checks them
all before any weight is read: a missing shard, one more than `split.count` says, a shard whose
split keys disagree with its place, or a total that does not add up is refused, naming the file
and the key.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from gguf import GGUFValueType as VT
from gguf import Keys

from .fields import Field, Header, HeaderProblem, check_layout, parse_header

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = (Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT,
                                        Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SHARDS = 99999          # the five digits of a shard's number
INTEGER_TYPES = {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}


def shard_name(prefix: str, index: int, count: int) -> str:
    """The file name of shard `index` (0-based) of `count`: numbers in names are 1-based."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


class ShardProblem(Exception):
    """What is wrong, in which file, and the key or tensor it concerns."""

    def __init__(self, path: str, message: str, key: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path, self.key, self.tensor = path, key, tensor


@dataclass(frozen=True)
class Shard:
    path: str
    header: Header
    size: int


def read_shard(path: str) -> Shard:
    """One GGUF file, its header read through bounds and its tensor layout checked."""
    try:
        header, size = parse_header(path)
        check_layout(header, size)
    except HeaderProblem as e:
        raise ShardProblem(path, str(e), key=e.key, tensor=e.tensor) from None
    return Shard(path, header, size)


def _split_int(shard: Shard, key: str) -> int | None:
    field: Field | None = shard.header.fields.get(key)
    if field is None:
        return None
    if field.type not in INTEGER_TYPES:
        raise ShardProblem(shard.path, f"is {field.type.name}, not an integer", key=key)
    return int(field.value)


def open_shards(first: Shard) -> list[Shard]:
    """Every shard of the model whose first file is `first` (just [first] for a single file), in
    order, each checked against the first's split keys."""
    count = _split_int(first, SPLIT_COUNT)
    number = _split_int(first, SPLIT_NO)
    if count is None and number is None:
        return [first]
    if count is None or not 1 <= count <= MAX_SHARDS:
        raise ShardProblem(first.path, f"is {count}; a split model has 1 to {MAX_SHARDS} shards",
                           key=SPLIT_COUNT)
    if number is None:
        raise ShardProblem(first.path, f"is missing ('{SPLIT_COUNT}' is {count})", key=SPLIT_NO)
    if number != 0:
        raise ShardProblem(first.path, f"is {number}: this is shard {number} (0-based) of "
                                       f"{count}; open the first shard (-00001-of-{count:05d})",
                           key=SPLIT_NO)
    total = _split_int(first, SPLIT_TENSORS)
    if total is None or total < 0:
        raise ShardProblem(first.path, f"is {total}; a split model says how many tensors its "
                                       f"shards hold together", key=SPLIT_TENSORS)
    if count == 1:
        shards = [first]
    else:
        folder, name = os.path.split(first.path)
        m = SHARD_NAME.match(name)
        if not m or int(m["no"]) != 1 or int(m["count"]) != count:
            raise ShardProblem(first.path, f"is {count} but the file is not named "
                                           f"<prefix>-00001-of-{count:05d}.gguf, so its other "
                                           f"shards cannot be found", key=SPLIT_COUNT)
        prefix = os.path.join(folder, m["prefix"])
        _refuse_extra_shards(first.path, prefix, count)
        shards = [first] + [_next_shard(first.path, prefix, i, count, total)
                            for i in range(1, count)]
    _check_tensor_total(shards, total)
    return shards


def _refuse_extra_shards(first_path: str, prefix: str, count: int) -> None:
    """A file numbered past `count` in the same set is a shard this model does not account for
    (left from another download or split): which one is meant cannot be known."""
    pattern = glob.escape(prefix) + f"-[0-9][0-9][0-9][0-9][0-9]-of-{count:05d}.gguf"
    for path in sorted(glob.glob(pattern)):
        m = SHARD_NAME.match(os.path.basename(path))
        if m and int(m["no"]) > count:
            raise ShardProblem(path, f"is shard {int(m['no'])} of a model of {count} shards "
                                     f"('{SPLIT_COUNT}' = {count} in {first_path}): an extra shard",
                               key=SPLIT_COUNT)


def _next_shard(first_path: str, prefix: str, index: int, count: int, total: int) -> Shard:
    path = shard_name(prefix, index, count)
    if not os.path.isfile(path):
        raise ShardProblem(path, f"missing: shard {index + 1} of {count} of {first_path} "
                                 f"('{SPLIT_COUNT}' = {count})", key=SPLIT_COUNT)
    shard = read_shard(path)
    for key, want in ((SPLIT_NO, index), (SPLIT_COUNT, count), (SPLIT_TENSORS, total)):
        got = _split_int(shard, key)
        if got != want:
            # split.no counts from 0 and file names from 1: say which shard the file holds
            held = (f" (counted from 0: this file holds shard {got + 1} of its set; shards "
                    f"renamed or swapped?)" if key == SPLIT_NO else "")
            raise ShardProblem(path, f"is {got}, expected {want} for shard {index + 1} of "
                                     f"{count} of {first_path}{held}", key=key)
    return shard


def _check_tensor_total(shards: list[Shard], total: int) -> None:
    owner: dict[str, str] = {}
    for shard in shards:
        for t in shard.header.tensors:
            if t.name in owner:
                raise ShardProblem(shard.path, f"is also in {owner[t.name]}", tensor=t.name)
            owner[t.name] = shard.path
    if len(owner) != total:
        counts = ", ".join(f"{os.path.basename(s.path)}: {len(s.header.tensors)}" for s in shards)
        raise ShardProblem(shards[0].path, f"is {total} but the {len(shards)} shards hold "
                                           f"{len(owner)} tensors ({counts})", key=SPLIT_TENSORS)
