"""Split GGUF files for the tests: a model rewritten as shards through gguf-py's writer, which lays
them out as the gguf-split tool does (`<stem>-00001-of-00003.gguf`, …; the model's metadata in the
first shard, `split.no`/`split.count`/`split.tensors.count` in every one), and a way to change one
split key of one shard in place."""
from __future__ import annotations

import struct
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def split_gguf(src, folder, stem: str, max_tensors: int) -> list[Path]:
    """`src` rewritten as shards of at most `max_tensors` tensors each, in `folder`: the paths of
    the shards in order (the first is the one a user opens)."""
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(Path(folder) / f"{stem}.gguf", arch, split_max_tensors=max_tensors)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)   # quantized data: byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = -(-len(r.tensors) // max_tensors)
    if n == 1:      # the writer does not split a model that fits one shard
        return [Path(folder) / f"{stem}.gguf"]
    return [Path(folder) / f"{stem}-{i + 1:05d}-of-{n:05d}.gguf" for i in range(n)]


_SPLIT_KEY_FORMAT = {"split.no": "<H", "split.count": "<H", "split.tensors.count": "<i"}


def set_split_key(path, key: str, value: int) -> None:
    """Overwrite one split key of one shard in place (same type, same size: the layout holds)."""
    data = bytearray(Path(path).read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
    struct.pack_into(_SPLIT_KEY_FORMAT[key], data, at, value)
    Path(path).write_bytes(bytes(data))
