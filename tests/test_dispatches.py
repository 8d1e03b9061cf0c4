"""What a GPU build's programs cost in kernel launches, held where bench/dispatches.py measured it (docs/GPU.md): on a
GPU each dispatch is a launch of a few microseconds, the decode step's largest cost at the default model's size.
Counted in iree-compile's flow output at the default model's widths, 2 and 3 layers (a layer's count is the
difference), so a change that splits a fused op fails here without a GPU."""
from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import TINY_SETTINGS

from bench.dispatches import DEFAULT_MODEL, count_at, widest

# A layer's dispatches at most, per device and program (decode, prefill): bench/dispatches.py's figures of 2026-12-06.
MOST = {"cuda": (12, 16), "vulkan": (16, 25)}
TARGET = {"cuda": "sm_89", "vulkan": "ada"}


@pytest.mark.parametrize("device", sorted(MOST))
def test_a_gpu_layer_takes_no_more_dispatches_than_measured(device, tmp_path):
    settings = replace(TINY_SETTINGS, dtype="f16", device=device, gpu_target=TARGET[device])
    two, three = (count_at(DEFAULT_MODEL, n, settings, [], tmp_path) for n in (2, 3))
    for kind, most in zip(("decode", "prefill"), MOST[device]):
        program = widest(two, kind)
        per_layer = three[program] - two[program]
        assert 0 < per_layer <= most, (device, program, per_layer)
