"""What an architecture module provides (models/qwen3moe.py, models/qwen3next.py): the names the
rest of the product reads from the module `architecture_for(gguf)` returns. A new architecture is
one more module with these names; tests/test_model_interface.py checks both modules against this
Protocol, signature by signature."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..gguf_file.reader import GGUFModel


@runtime_checkable
class Architecture(Protocol):
    ARCH: str            # general.architecture of the files it runs
    ROUTER_PART: str     # the per-layer router tensor's part name (blk.N.<part>.weight)
    MODEL_CLASS: type    # the forward: MODEL_CLASS(gguf, backend, lb, le, **kw)

    def read_geometry(self, gguf: GGUFModel) -> Any:
        """The geometry from the file's metadata (a frozen dataclass of the architecture)."""

    def validate(self, gguf: GGUFModel, g: Any) -> None:
        """Every tensor the architecture needs exists with its shape; GGUFError naming it."""

    def dense_tensor_names(self, g: Any, lb: int, le: int, first: bool, last: bool) -> list[str]:
        """The dense tensors a stage running [lb, le) loads (what the planner prices)."""

    def keeps_f32(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether a dense tensor stays float32 on every backend."""

    def layer_kinds(self, g: Any) -> tuple[str, ...]:
        """Each layer's mixer: "attention" or "linear"."""

    def kv_elems_per_cell(self, g: Any, layer: int) -> int:
        """K + V elements per context cell of a layer (0 without attention)."""

    def recurrent_elems(self, g: Any, layer: int) -> int:
        """Recurrent state elements of a layer (0 for attention)."""

    def rope_dim(self, g: Any) -> int:
        """Elements per cell of the session's RoPE table."""

    def prompt_buffers(self, g: Any, blob_bytes: int, dense16_bytes: int) -> list:
        """Every buffer a prompt chunk's layer writes on the GPU path (plan/workspace.py Buffer):
        the layout a loan is priced and carved by."""
