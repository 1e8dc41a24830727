"""Architectures, one module each (what a module provides: interface.py). `architecture_for(gguf)`
picks the module by the file's general.architecture and refuses the ones this product does not
run."""
from __future__ import annotations

from ..gguf_file.reader import GGUFError, GGUFModel
from . import qwen3moe, qwen3next, qwen35moe
from .interface import Architecture

# each module provides interface.Architecture (tests/test_model_interface.py checks it)
ARCHITECTURES: dict[str, Architecture] = {m.ARCH: m for m in (qwen3moe, qwen3next, qwen35moe)}


def architecture_for(gguf: GGUFModel) -> Architecture:
    module = ARCHITECTURES.get(gguf.arch)
    if module is None:
        raise GGUFError(gguf.path, f"unknown architecture '{gguf.arch}' "
                                   f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return module


# architectures a GPU rank does not run yet, and why
GPU_REFUSALS: dict[str, str] = {qwen35moe.ARCH: qwen35moe.GPU_REFUSAL}


def check_device_kind(gguf: GGUFModel, device_kind: str) -> None:
    """Refuse (GGUFError) a file whose architecture a rank of `device_kind` does not run: a plan
    that puts such a file on a GPU stops at start, before any rank loads it."""
    why = GPU_REFUSALS.get(gguf.arch) if device_kind != "cpu" else None
    if why:
        raise GGUFError(gguf.path, why)


def load_model(gguf: GGUFModel, backend, lb: int = 0, le: int | None = None, **kw):
    """The forward object of `gguf`'s architecture over layers [lb, le)."""
    module = architecture_for(gguf)
    return module.MODEL_CLASS(gguf, backend, lb, le, **kw)


def open_checked(path: str) -> GGUFModel:
    """Open a model file and check every tensor its architecture needs (GGUFError otherwise)."""
    gguf = GGUFModel(path)
    module = architecture_for(gguf)
    module.validate(gguf, module.read_geometry(gguf))
    return gguf
