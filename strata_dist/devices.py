"""What a rank tells the coordinator about its device: NVML for GPUs, the --vram-budget for CPU
ranks. Also the size parser shared by every flag that takes bytes (512K, 64M, 16G)."""
from __future__ import annotations

import os
import re

from protocol import DeviceInfo

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = 1 << 50      # 1 PiB: more than any device; larger values are typos (and overflow the wire)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)

class DeviceError(ValueError):
    """A device that cannot be used or described (the message names it)."""


# A CPU rank's speed figure when none is given: a typical DDR4/5 desktop's usable bandwidth.
DEFAULT_CPU_BANDWIDTH_GBS = 20.0


def parse_size(text: str, default_unit: str = "M") -> int:
    """'512K', '64M', '16G', '1.5G', '2048' (in default_unit) -> bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"'{text}' is not a size (examples: 512K, 64M, 16G)")
    number, unit = m.group(1), m.group(2).upper()
    if not unit:
        unit = default_unit.upper()
    size = int(float(number) * _UNITS[unit])
    if size > MAX_SIZE:
        raise ValueError(f"'{text}' is larger than any device (at most 1024T)")
    return size


def parse_size_list(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def cpu_device(budget_bytes: int, index: int = 0, bandwidth_gbs: float | None = None) -> DeviceInfo:
    return DeviceInfo(name="cpu", kind="cpu", index=index, total_bytes=budget_bytes,
                      free_bytes=budget_bytes,
                      mem_bandwidth_gbs=bandwidth_gbs or DEFAULT_CPU_BANDWIDTH_GBS)


def physical_gpu_index(local_index: int) -> int:
    """NVML numbers every GPU of the host; CUDA numbers only the visible ones."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local_index < len(ids) and ids[local_index].isdigit():
            return int(ids[local_index])
    return local_index


def gpu_device(local_index: int, budget_bytes: int | None = None) -> DeviceInfo:
    """NVML's name and free/total memory; a budget (for emulating smaller cards) caps both.
    Raises DeviceError when NVML cannot answer (no driver, no such GPU)."""
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise DeviceError(f"GPU {local_index}: NVML is not available ({e}); is the NVIDIA driver "
                          f"installed?") from None
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(physical_gpu_index(local_index))
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        total, free = int(mem.total), int(mem.free)
        bandwidth = _nvml_bandwidth_gbs(pynvml, h)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    except pynvml.NVMLError as e:
        raise DeviceError(f"GPU {local_index}: NVML cannot read it ({e})") from None
    finally:
        pynvml.nvmlShutdown()
    if budget_bytes is not None:
        total, free = min(total, budget_bytes), min(free, budget_bytes)
    return DeviceInfo(name=name, kind="cuda", index=local_index, total_bytes=total,
                      free_bytes=free, mem_bandwidth_gbs=bandwidth, uuid=uuid)


def _nvml_bandwidth_gbs(pynvml, handle) -> float | None:
    """Peak memory bandwidth from the max memory clock and bus width (DDR: two transfers a clock)."""
    try:
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * clock_mhz * 1e6 * bus_bits / 8 / 1e9
    except Exception:  # not every driver answers both
        return None
