"""The machine a figure was measured on, for the bench scripts' JSON: CPU model, core count and SIMD flags
(figures from machines that differ are compared only as ratios measured in one run)."""
from __future__ import annotations

import platform
import subprocess


def cpu_info() -> dict:
    info = {"machine": platform.machine()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)"):
                info[key.strip()] = value.strip()
            if key.strip() == "Flags":
                info["simd"] = [f for f in value.split() if f.startswith(("avx", "fma", "amx"))]
    except (OSError, subprocess.SubprocessError):
        pass
    return info
