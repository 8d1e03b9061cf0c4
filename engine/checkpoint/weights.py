"""read_config, open_tensors and load_state_dict over every checkpoint kind, and the shape check between them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine import arch
from engine.errors import ModelError

from .gguf import check_gguf, gguf_config, gguf_tensors, read_gguf
from .hf import hf_config, hf_tensors
from .source import ModelSource, default_source
from .tiny import tiny_config, tiny_state_dict

if TYPE_CHECKING:
    import torch

    from .gguf import GGUFRows


def read_config(source: ModelSource) -> dict[str, Any]:
    """The model's shape as an HF-config-style dict: model_type (Eddy's family name), vocab_size, hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, rope_theta,
    rope_scaling, rms_norm_eps, tie_word_embeddings, max_position_embeddings, sliding_window."""
    if source.kind == "gguf":
        return gguf_config(source, check_gguf(source))
    if source.kind == "hf":
        return hf_config(source)
    if source.kind == "tiny-random":
        default = default_source()
        vocab = gguf_config(default, read_gguf(default.path))["vocab_size"]  # type: ignore[arg-type]
        return tiny_config(source.name, vocab)
    raise ModelError(f'Model "{source.name}": unknown checkpoint kind "{source.kind}".')


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    fam = arch.family(cfg.get("model_type", "llama"))
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    per_layer = arch.layer_shapes(fam, cfg)
    for n in range(cfg["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{n}.{name}"] = shape
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _check_shapes(source: ModelSource, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise ModelError(
            f"{source.name}: weights are missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}."
        )
    extra = [k for k in shapes if k not in expected]
    if extra:
        title = arch.family(cfg.get("model_type", "llama")).title
        raise ModelError(
            f"{source.name}: unexpected tensor(s) for a plain {title} model, "
            f"e.g. {', '.join(sorted(extra)[:3])}."
        )
    for k, shape in expected.items():
        if tuple(shapes[k]) != shape:
            raise ModelError(
                f"{source.name}: tensor {k} has shape {tuple(shapes[k])} but the config implies {shape}."
            )


@dataclass(frozen=True)
class CheckpointTensors:
    """A checked checkpoint's weights under Hugging Face names, read one at a time: `read(name)` gives the float32
    tensor the family's transformers class would hold after from_pretrained (lm_head only when untied);
    `read_stored(name)` the same values in the checkpoint's own type (GGUF blocks come dequantised to float32).
    The streamed build reads each tensor once, as stored, and lets it go, so memory follows the largest tensor."""
    shapes: dict[str, tuple[int, ...]]
    read_stored: Callable[[str], "torch.Tensor"]  # in the checkpoint's own floating type (bf16 stays bf16)
    # A matrix's 4-bit codes ({"weight": q4.pair_q4's bytes, "scale", "offset"}, engine/exporter/q4.py) where the
    # checkpoint keeps them (a GGUF's Q4_0, Q4_1 and Q4_K), else None: a q4 build takes them as they are.
    read_q4: Callable[[str], "dict[str, torch.Tensor] | None"] = lambda name: None
    # A matrix as float32 rows read when sliced (gguf.GGUFRows) where the checkpoint can, else None: a build that
    # converts it a block of rows at a time never holds it whole in float32.
    read_rows: Callable[[str], "GGUFRows | None"] = lambda name: None

    def read(self, name: str) -> "torch.Tensor":
        import torch

        return self.read_stored(name).to(torch.float32).contiguous()


def open_tensors(source: ModelSource) -> CheckpointTensors:
    """The checkpoint's tensors, checked against its config by name and shape (headers only, no weights read;
    the tiny random models are made whole, being tiny)."""
    cfg = read_config(source)
    if source.kind == "gguf":
        shapes, read, read_q4, read_rows = gguf_tensors(source, cfg)
        _check_shapes(source, cfg, shapes)
        return CheckpointTensors(shapes, read, read_q4, read_rows)
    if source.kind == "hf":
        shapes, read = hf_tensors(source, cfg)
    elif source.kind == "tiny-random":
        sd = tiny_state_dict(cfg)
        shapes, read = {k: tuple(v.shape) for k, v in sd.items()}, sd.__getitem__
    else:
        raise ModelError(f'Model "{source.name}": unknown checkpoint kind "{source.kind}".')
    _check_shapes(source, cfg, shapes)
    return CheckpointTensors(shapes, read)


def load_state_dict(source: ModelSource) -> dict[str, "torch.Tensor"]:
    """Every tensor of open_tensors in memory at once: float32 weights under Hugging Face names, equal to what the
    family's transformers class would hold after from_pretrained (lm_head only when untied)."""
    tensors = open_tensors(source)
    return {name: tensors.read(name) for name in tensors.shapes}
