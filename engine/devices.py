"""The devices Eddy can build for and run on: one row each, read by the runtime, the export and the CLI.

Torch-free: the runtime picks its IREE driver here and the export its iree-compile flags, so a device is
added (or a flag changed) in one place.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    driver: str  # iree.runtime driver that runs the module
    flags: tuple[str, ...]  # iree-compile flags that target it


_CPU_TARGET_FLAG = "--iree-llvmcpu-target-cpu="

TABLE: dict[str, Device] = {d.name: d for d in (
    Device("cpu", "local-task", (
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        _CPU_TARGET_FLAG + "host",
        # The llvm-cpu defaults prefill ~8x slower: data tiling with microkernels is what makes it fast
        # (data tiling without microkernels is slower than the defaults).
        "--iree-opt-level=O3",
        "--iree-opt-data-tiling",
        "--iree-llvmcpu-enable-ukernels=all",
    )),
    Device("vulkan", "vulkan", ("--iree-hal-target-device=vulkan", "--iree-vulkan-target=host")),
    # iree-compile 3.13 does not know sm_90 by name; sm_89 code runs on Hopper too.
    Device("cuda", "cuda", ("--iree-hal-target-device=cuda", "--iree-cuda-target=sm_89")),
)}
DEVICES = tuple(TABLE)


def driver(device: str) -> str:
    """The iree.runtime driver name for a device."""
    return TABLE[device].driver


def compile_flags(device: str, target_cpu: str = "host") -> list[str]:
    """iree-compile flags for a device; on cpu, `target_cpu` replaces "host" (portable packages)."""
    return [_CPU_TARGET_FLAG + target_cpu if f.startswith(_CPU_TARGET_FLAG) else f for f in TABLE[device].flags]
