"""tiny-random[-<family>]: small seeded random models built from transformers' own config classes, for tests
and benches. Small enough to export in seconds, with the default model's vocabulary so its real tokenizer works."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine import arch
from engine.errors import ModelError

if TYPE_CHECKING:
    import torch

TINY_RANDOM = "tiny-random"  # the Llama one; tiny-random-<family> for the others
TINY_SEED = 0
# The shape every family shares; a family's `tiny` entry adds what it needs.
TINY_SPEC: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def tiny_names() -> list[str]:
    return [TINY_RANDOM] + [f"{TINY_RANDOM}-{name}" for name in arch.FAMILIES if name != "llama"]


def is_tiny(name: str) -> bool:
    return name == TINY_RANDOM or name.startswith(TINY_RANDOM + "-")


def tiny_family(name: str) -> arch.Family:
    fam_name = "llama" if name == TINY_RANDOM else name[len(TINY_RANDOM) + 1:]
    if fam_name not in arch.FAMILIES:
        raise ModelError(f'Model "{name}": no such tiny random model (there are {", ".join(tiny_names())}).')
    fam = arch.FAMILIES[fam_name]
    return fam


def tiny_spec(name: str) -> dict[str, Any]:
    """The config (without vocab_size) of a tiny random model; the Llama one has no model_type key so its
    fingerprint stays what it was."""
    fam = tiny_family(name)
    return dict(TINY_SPEC) if fam.name == "llama" else {**TINY_SPEC, **fam.tiny, "model_type": fam.name}


def tiny_config(name: str, vocab_size: int) -> dict[str, Any]:
    spec = tiny_spec(name)
    return {"model_type": tiny_family(name).name, "sliding_window": spec.get("sliding_window"),
            "vocab_size": vocab_size, **spec}


def transformers_config(cfg: dict[str, Any]) -> Any:
    """transformers' own config object of a read_config dict (its family's config class)."""
    import transformers

    fam = arch.family(cfg.get("model_type", "llama"))
    config_class = getattr(transformers, fam.config_class)
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    if kwargs.get("sliding_window") is None:
        kwargs.pop("sliding_window", None)
    return config_class(**kwargs)


def tiny_state_dict(cfg: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    import torch
    import transformers

    fam = arch.family(cfg.get("model_type", "llama"))
    config = transformers_config(cfg)
    # Save/restore the global RNG so building the fixture does not perturb the caller's seed.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(TINY_SEED)
        model = getattr(transformers, fam.hf_class)(config).to(torch.float32)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if fam.name != "llama":
            # transformers initialises biases to 0 and norms to 1, which would hide a bias or norm weight that is
            # loaded wrongly (or not at all); the Llama model keeps its original weights.
            for k, v in sd.items():
                if k.endswith(".bias") or k.endswith("norm.weight"):
                    v.copy_(v + 0.1 * torch.randn(v.shape))
    finally:
        torch.random.set_rng_state(state)
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)
    return sd
