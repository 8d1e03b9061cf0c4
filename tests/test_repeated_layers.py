"""engine/exporter/layers.py: an export that traces a few layers and copies the rest is, byte for byte, the MLIR of
the export that traces every layer: each family at its smallest checkpoint's real widths (engine/checkpoint/shapes.py)
with its own pattern of local and global layers, a float32 build's pinned sink slots, a q8 build without sinks, and
the GPUs' programs of fixed shapes (vulkan's first layer is a kind of its own). Export only: the same MLIR compiles to
the same module. "must-repeat" fails where the copy does not match, instead of tracing every layer."""
from __future__ import annotations

import pytest

from conftest import FAMILIES
from engine.checkpoint.shapes import SMALLEST

# (checkpoint, layers, build settings): enough layers that some are copied, not traced (Gemma 2 alternates local
# and global layers, Gemma 3 has five local ones to a global one). A GPU build holds a program per call shape: a
# short window and chunk keep them few (engine/shapes.py).
GPU = {"window": 60, "max_chunk": 8}
CASES = [(SMALLEST[fam], {"gemma2": 5, "gemma3": 7}.get(fam, 3), {"dtype": "q4"}) for fam in FAMILIES]
CASES += [("llama-3.2-1b", 3, {"dtype": "f32", "max_sinks": 64}), ("qwen2.5-0.5b", 3, {"dtype": "q8", "sinks": 0}),
          ("llama-3.2-1b", 4, {"dtype": "f16", "device": "vulkan", **GPU}),
          ("qwen3-0.6b", 3, {"dtype": "q4", "device": "cuda", **GPU})]


def _skeleton(name: str, layers: int, settings: dict):
    from engine import arch
    from engine.checkpoint.shapes import config
    from engine.config import BuildSettings, ModelConfig
    from engine.exporter.model import StreamingLlama

    cfg = config(name)
    fam = arch.for_hf(name, cfg["model_type"], [])
    cfg.update(num_hidden_layers=layers, model_type=fam.name)
    if fam.local_layers:  # the checkpoint's own pattern (config() ends a cut model with its one global layer)
        cfg["layer_types"] = arch.default_layer_types(fam, layers)
    return StreamingLlama.skeleton(ModelConfig.from_hf(cfg), BuildSettings(**settings))


@pytest.mark.parametrize("name,layers,settings", CASES,
                         ids=[f"{n}-{k}-{'-'.join(map(str, s.values()))}" for n, k, s in CASES])
def test_copied_layers_export_the_traced_ones_mlir(name, layers, settings):
    import iree.turbine.aot as aot

    from engine.exporter import export
    from engine.exporter.layers import probe

    texts = {}
    for how in ("must-repeat", "all"):
        model = _skeleton(name, layers, settings)
        if how == "must-repeat":
            traced = probe(model)[1]
            assert len(traced) < layers, f"{name}: every layer traced ({traced})"
        aot.externalize_module_parameters(model)
        texts[how] = export.export_text(export.export_module(model, how))
    assert texts["must-repeat"] == texts["all"]


def test_layers_of_a_kind_are_traced_twice():
    from engine.exporter.layers import probe

    # Gemma 3: five local layers to a global one, each local layer's ring its own.
    kinds, traced = probe(_skeleton("gemma-3-270m", 13, {"dtype": "q4"}))
    assert traced == (0, 1, 5, 11) and len(set(kinds)) == 2
    # Vulkan sums the first layer's norms in groups: a kind of its own.
    kinds, traced = probe(_skeleton("llama-3.2-1b", 16, {"dtype": "f16", "device": "vulkan"}))
    assert traced == (0, 1, 2) and len(set(kinds)) == 2
