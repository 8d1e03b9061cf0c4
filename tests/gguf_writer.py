"""Writes a GGUF file from Hugging Face weights the way llama.cpp's convert_hf_to_gguf.py does, for tests.

Tensor names come from the gguf package's own HF -> GGUF map (what the converter uses), not from engine/arch.py,
so a wrong entry in Eddy's table shows up as a failed load rather than cancelling out.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp converts Mistral (dense, HF MistralForCausalLM) with its Llama class: general.architecture = llama.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma2": "gemma2", "gemma3": "gemma3"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Verbatim from llama.cpp's LlamaModel.permute: its rope kernel wants each head's halves interleaved.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, family: str, cfg: dict[str, Any], sd: dict[str, Any]) -> Path:
    import gguf

    arch = GGUF_ARCH[family]
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    add_config(w, arch, cfg)
    if family in ("phi3", "gemma2", "gemma3") and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family == "gemma3" and cfg.get("rope_scaling"):
        # As llama.cpp's Gemma 3 converter: the global layers' linear scaling (the local base is implied).
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])
    for hf_name, t in sd.items():
        base, suffix = hf_name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, hf_name
        arr = np.asarray(t, dtype=np.float32)
        if arch == "llama" and base.endswith("self_attn.q_proj") and suffix == "weight":
            arr = llamacpp_permute(arr, cfg["num_attention_heads"])
        elif arch == "llama" and base.endswith("self_attn.k_proj") and suffix == "weight":
            arr = llamacpp_permute(arr, cfg["num_key_value_heads"])
        if family.startswith("gemma") and base.endswith("norm"):
            arr = arr + 1  # llama.cpp's Gemma converter stores (1 + w) norms with the 1 added
        w.add_tensor(f"{gname}.{suffix}", arr)
    return finish(w, path)


def add_config(w: Any, arch: str, cfg: dict[str, Any]) -> None:
    """The metadata llama.cpp's converter writes for every family, and a stand-in token list."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])


def finish(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
