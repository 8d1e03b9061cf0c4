"""The shapes of the checkpoints people download: each one's config.json (the fields Eddy and transformers read),
for builds with random weights at real widths, heads, head sizes and vocabularies. The tests' real-shapes matrix
builds each family's smallest checkpoint cut to a few layers (tests/test_real_shapes.py); bench/families.py and
bench/scale.py build them whole. Toy shapes hide kernels that fail at real ones: a head_dim of 128 or 256, a
262k vocabulary, a single KV head.

`random_folder` writes one with transformers' own config and model classes (what the tests compare against);
bench/scale.py writes the big ones a tensor at a time instead (an 8B model does not fit in memory in float32).
Export side only (the writing needs torch and transformers).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import arch

_LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# name -> config.json, from the models' own cards. head_dim is written out where the checkpoint leaves it implied
# (hidden / heads): the shape checks read it.
CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-360m": dict(
        model_type="llama", hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
        num_key_value_heads=5, head_dim=64, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192),
    "smollm2-1.7b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, head_dim=64, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=130000.0, max_position_embeddings=8192),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE),
    "llama-3.2-3b": dict(
        model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    "mistral-7b-v0.3": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768, sliding_window=None),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False, sliding_window=32768),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False, sliding_window=32768),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960),
    "qwen3-1.7b": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960),
    "phi-3-mini-4k": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=96, vocab_size=32064, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, sliding_window=2047),
    "gemma-2-2b": dict(
        model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=8192, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma-3-270m": dict(
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        hidden_activation="gelu_pytorch_tanh"),
    "gemma-3-1b": dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        hidden_activation="gelu_pytorch_tanh"),
    "gemma-3-4b": dict(
        model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
        query_pre_attn_scalar=256, sliding_window=1024, hidden_activation="gelu_pytorch_tanh"),
}

# Each family's smallest popular checkpoint: the one its row of the tests' matrix is shaped like.
SMALLEST: dict[str, str] = {"llama": "llama-3.2-1b", "mistral": "mistral-7b-v0.3", "qwen2": "qwen2.5-0.5b",
                            "qwen3": "qwen3-0.6b", "phi3": "phi-3-mini-4k", "gemma2": "gemma-2-2b",
                            "gemma3": "gemma-3-270m"}


def config(name: str, layers: int | None = None) -> dict[str, Any]:
    """`name`'s config.json, with all its layers or cut to `layers`. Cut, a family with local and global layers
    keeps both: local ones, then a global one last (its checkpoints' own order; their first global layer comes
    later than a short cut reaches)."""
    cfg = dict(CONFIGS[name])
    fam = arch.for_hf(name, cfg["model_type"], [])
    cfg["architectures"] = [fam.hf_class]  # llama.cpp's converter picks its model class by it
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    n = cfg["num_hidden_layers"]
    if fam.local_layers:
        cfg["layer_types"] = (arch.default_layer_types(fam, n) if layers is None
                              else ["sliding_attention"] * (n - 1) + ["full_attention"])
    return cfg


def random_folder(name: str, folder: Path, layers: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Writes a Hugging Face folder (config.json and safetensors, no tokenizer) of `name`'s shape
    (config(name, layers)) with random float32 weights in transformers' own model class; returns the config.

    The model is made on the meta device and its tensors drawn here (matrices at the config's initializer_range,
    norms and biases around their neutral values, which would hide one loaded wrongly): transformers' own
    initialisation took 13 s for a two-layer Llama 3.2 1B, most of a test's setup."""
    import torch
    import transformers

    from .tiny import transformers_config

    cfg = config(name, layers)
    fam = arch.for_hf(name, cfg["model_type"], [])
    hf_config = transformers_config({**cfg, "model_type": fam.name})
    with torch.device("meta"):
        model = getattr(transformers, fam.hf_class)(hf_config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives a tied matrix two tensors
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in model.named_parameters():
            noise = torch.randn(t.shape, generator=gen)
            if key.endswith("norm.weight"):  # Gemma's norms scale by 1 + w
                t.copy_((0.0 if fam.norm_offset else 1.0) + 0.1 * noise)
            elif key.endswith(".bias"):
                t.copy_(0.1 * noise)
            else:
                t.copy_(hf_config.initializer_range * noise)
    model.save_pretrained(folder, safe_serialization=True)
    return cfg
