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


def write_gguf(path: Path, family: str, cfg: dict[str, Any], sd: dict[str, Any], quant: str | None = None,
               tokenizer: bool = False) -> Path:
    """`quant` (a GGML type the gguf package quantises, e.g. "Q4_0"): the matrices stored in it, as llama.cpp's
    quantiser does; norms and biases stay float32. `tokenizer`: one Eddy can build with (add_tokenizer), not a
    stand-in list of tokens."""
    import gguf

    arch = GGUF_ARCH[family]
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    add_config(w, arch, cfg, tokenizer=tokenizer)
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
        if quant and quantisable(arr):
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(f"{gname}.{suffix}", quantise_rows(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{gname}.{suffix}", arr)
    return finish(w, path)


# Rows the gguf package quantises at a time: its numpy quantisers hold several float32 copies of what they are
# given, and a 256k-row embedding is 2.4 GB.
QUANT_ROWS = 8192


def quantisable(arr: np.ndarray) -> bool:
    """Whether write_gguf stores a tensor in its `quant` type: a matrix of whole 32-weight blocks."""
    return arr.ndim == 2 and arr.shape[1] % 32 == 0


def as_stored(arr: np.ndarray, quant: str) -> np.ndarray:
    """A matrix as a GGUF of type `quant` holds it: quantised and dequantised by the gguf package."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[quant]
    return quants.dequantize(quantise_rows(arr, qtype), qtype).reshape(arr.shape)


def quantise_rows(arr: np.ndarray, qtype: Any) -> np.ndarray:
    from gguf import quants

    first = quants.quantize(arr[:QUANT_ROWS], qtype)
    out = np.empty((arr.shape[0], first.shape[1]), dtype=first.dtype)
    out[:len(first)] = first
    for start in range(QUANT_ROWS, arr.shape[0], QUANT_ROWS):
        out[start:start + QUANT_ROWS] = quants.quantize(arr[start:start + QUANT_ROWS], qtype)
    return out


def add_config(w: Any, arch: str, cfg: dict[str, Any], tokenizer: bool = False) -> None:
    """The metadata llama.cpp's converter writes for every family, and a stand-in token list (or, `tokenizer`,
    a tokenizer: add_tokenizer)."""
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
    if tokenizer:
        add_tokenizer(w, cfg["vocab_size"])
    else:
        w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])


def add_tokenizer(w: Any, vocab_size: int) -> None:
    """A byte-level BPE tokenizer that a GGUF's reader can load (transformers converts it as llama.cpp writes
    it), in place of add_config's stand-in list: GPT-2's 256 byte tokens, a few merges, ChatML's special tokens,
    the rest padding up to the vocabulary, as llama.cpp pads a tokenizer smaller than the model's vocabulary."""
    import gguf

    chars = _byte_chars()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = chars + [m.replace(" ", "") for m in merges] + specials
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)) + [gguf.TokenType.CONTROL] * len(specials)
    pads = vocab_size - len(tokens)
    assert pads >= 0, vocab_size
    w.add_token_list(tokens + [f"[PAD{i}]" for i in range(pads)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pads)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (its bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def finish(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
