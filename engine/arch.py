"""The model families Eddy knows: one entry each, read by the checkpoint readers, the exportable model and
ModelConfig. Adding a family is an entry here plus whatever is truly new in engine/exporter/model.py.

Torch-free: read_config runs on the warm-start path.

Weights are kept under Hugging Face names throughout (the checkpoint readers translate GGUF names with
`gguf_layer` / TOP_TENSORS); per layer they live under `model.layers.{i}.`, per block `blk.{i}.` in GGUF.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ModelError

# Outside the layers, every family names these the same way.
TOP_TENSORS = {  # GGUF -> HF
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LLAMA_ATTN = {  # HF (under model.layers.{i}.) -> GGUF (under blk.{i}.)
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
}
_QKV_BIAS = {
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
_QK_NORM = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
_LLAMA_MLP = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_PRE_NORMS = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
_SANDWICH_NORMS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_SPLIT_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_SPLIT_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class Family:
    name: str  # Eddy's name, also the `model_type` read_config reports
    title: str  # for messages
    hf_model_types: tuple[str, ...]
    hf_class: str  # transformers' causal-LM class: the tiny random model and the tests' reference
    gguf_archs: tuple[str, ...]  # general.architecture values
    layer: dict[str, str]  # HF tensor suffix -> GGUF tensor name, per layer
    qkv: tuple[str, ...] = _SPLIT_QKV  # HF projections concatenated into the model's one q|k|v matrix
    gate_up: tuple[str, ...] = _SPLIT_GATE_UP  # ... and into its gate|up matrix
    # Norm roles -> HF suffix: "attn" before attention, "ffn" before the MLP; "post_attn"/"post_ffn" after.
    norms: dict[str, str] = field(default_factory=lambda: {
        "attn": "input_layernorm.weight", "ffn": "post_attention_layernorm.weight"})
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's (1 + w)
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    rope_layout: str = "rotate_half"  # HF's layout; GGUF q/k of `gguf_permute_qk` families are interleaved
    gguf_permute_qk: bool = False  # llama.cpp's converter permutes q/k rows of llama-arch models only
    tie_default: bool = False  # tie_word_embeddings when config.json does not say
    norm_eps_default: float = 1e-6
    act_names: tuple[str, ...] = ("silu",)  # hidden_act values that mean `activation`
    # Local sliding-window layers (config layer_types) beside global ones, with attention / final logit soft-caps
    # and query_pre_attn_scalar (Gemma 2). Local layers attend to the last sliding_window tokens.
    local_layers: bool = False
    local_pattern: int = 2  # without layer_types (and in GGUF), every local_pattern-th layer is global
    softcaps: tuple[float | None, float | None] = (None, None)  # attention, final: defaults of the config class
    local_rope_base: float | None = None  # the local layers' own RoPE base, when they have one (Gemma 3)
    # llama.cpp scales queries by head_dim ** -0.5 but for the 27B models, of this many layers, by (hidden /
    # heads) ** -0.5: GGUF has no query_pre_attn_scalar.
    gguf_query_by_hidden_layers: int | None = None
    tiny: dict[str, Any] = field(default_factory=dict)  # tiny-random-<name>: config beyond the shared shape
    hf_config_class: str | None = None  # transformers' config class, where it is not hf_class's name + Config

    @property
    def config_class(self) -> str:
        return self.hf_config_class or self.hf_class.replace("ForCausalLM", "Config")

    def gguf_to_hf_layer(self) -> dict[str, str]:
        return {g: h for h, g in self.layer.items()}


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "Llama", ("llama",), "LlamaForCausalLM", ("llama",), {**_LLAMA_ATTN, **_LLAMA_MLP, **_PRE_NORMS},
           gguf_permute_qk=True),
    # Mistral 7B v0.1's sliding window (4096) is wider than Eddy's default window; a build whose window exceeds
    # it is refused (ModelConfig.check_build). Its GGUF files say general.architecture = llama.
    Family("mistral", "Mistral", ("mistral",), "MistralForCausalLM", (), {**_LLAMA_ATTN, **_LLAMA_MLP, **_PRE_NORMS},
           gguf_permute_qk=True, tiny={"sliding_window": 4096}),
    Family("qwen2", "Qwen2 / Qwen2.5", ("qwen2",), "Qwen2ForCausalLM", ("qwen2",),
           {**_LLAMA_ATTN, **_QKV_BIAS, **_LLAMA_MLP, **_PRE_NORMS}, qkv_bias=True),
    Family("qwen3", "Qwen3", ("qwen3",), "Qwen3ForCausalLM", ("qwen3",),
           {**_LLAMA_ATTN, **_QK_NORM, **_LLAMA_MLP, **_PRE_NORMS}, qk_norm=True,
           # Qwen3's heads are wider than hidden / heads (0.6B: 128 against 1024 / 16).
           tiny={"head_dim": 32}),
    Family("phi3", "Phi-3", ("phi3",), "Phi3ForCausalLM", ("phi3",),
           {"self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
            # llama.cpp keeps Phi-3's fused gate|up matrix whole, as ffn_up.
            "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight", **_PRE_NORMS},
           qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",), norm_eps_default=1e-5),
    Family("gemma2", "Gemma 2", ("gemma2",), "Gemma2ForCausalLM", ("gemma2",),
           {**_LLAMA_ATTN, **_LLAMA_MLP, **_SANDWICH_NORMS},
           norms={"attn": "input_layernorm.weight", "post_attn": "post_attention_layernorm.weight",
                  "ffn": "pre_feedforward_layernorm.weight", "post_ffn": "post_feedforward_layernorm.weight"},
           norm_offset=1.0, activation="gelu_tanh", embed_scale=True, tie_default=True,
           act_names=("gelu_pytorch_tanh",), local_layers=True, softcaps=(50.0, 30.0), gguf_query_by_hidden_layers=46,
           # Soft caps far below Gemma 2's 50 / 30 and a local window shorter than the tests' prompts, so a
           # missing cap or window shows in the logits of a tiny random model.
           tiny={"query_pre_attn_scalar": 16, "sliding_window": 8, "attn_logit_softcapping": 5.0,
                 "final_logit_softcapping": 2.0, "layer_types": ["sliding_attention", "full_attention"]}),
    Family("gemma3", "Gemma 3", ("gemma3", "gemma3_text"), "Gemma3ForCausalLM", ("gemma3",),
           {**_LLAMA_ATTN, **_QK_NORM, **_LLAMA_MLP, **_SANDWICH_NORMS},
           norms={"attn": "input_layernorm.weight", "post_attn": "post_attention_layernorm.weight",
                  "ffn": "pre_feedforward_layernorm.weight", "post_ffn": "post_feedforward_layernorm.weight"},
           qk_norm=True, norm_offset=1.0, activation="gelu_tanh", embed_scale=True, tie_default=True,
           act_names=("gelu_pytorch_tanh",), local_layers=True, local_pattern=6, local_rope_base=10000.0,
           gguf_query_by_hidden_layers=62,
           # Gemma 3's own layout (five local layers, then a global one) and RoPE (local base 10000, a scaled
           # global one); a local window shorter than the tests' prompts.
           tiny={"num_hidden_layers": 6, "query_pre_attn_scalar": 16, "sliding_window": 8,
                 "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "rope_theta": 1000000.0,
                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 10000.0,
                 "attn_logit_softcapping": None, "final_logit_softcapping": None},
           hf_config_class="Gemma3TextConfig"),  # Gemma3Config is the multimodal model's
)}

# Families in the wild that Eddy knows by name but cannot run, with what it lacks for them (HF model_type or
# GGUF general.architecture).
_MOE = "mixture-of-experts layers, which Eddy's model lacks"
_KNOWN_OTHERS = {"mixtral": f"Mixtral: {_MOE}", "qwen2_moe": f"Qwen2-MoE: {_MOE}", "qwen2moe": f"Qwen2-MoE: {_MOE}",
                 "qwen3_moe": f"Qwen3-MoE: {_MOE}", "qwen3moe": f"Qwen3-MoE: {_MOE}",
                 "gemma": "Gemma 1: its GeGLU without sandwich norms has no entry yet",
                 "gemma3n": "Gemma 3n: per-layer embeddings and AltUp, which Eddy's model lacks",
                 "phi": "Phi-1/Phi-2: parallel attention and MLP with LayerNorm, which Eddy's model lacks",
                 "phi4": "Phi-4", "falcon": "Falcon", "gpt2": "GPT-2"}


def supported_names() -> str:
    return ", ".join(f.title for f in FAMILIES.values())


def _unsupported(model: str, shown: str) -> ModelError:
    what = f" ({_KNOWN_OTHERS[shown]})" if shown in _KNOWN_OTHERS else ""
    return ModelError(f'{model}: unsupported architecture "{shown}"{what} (Eddy supports {supported_names()}).')


def for_hf(model: str, model_type: str | None, architectures: list[str]) -> Family:
    """The family of a config.json (very old configs lack model_type: the architectures list decides)."""
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types or (model_type is None and fam.hf_class in architectures):
            return fam
    raise _unsupported(model, model_type or (architectures[0] if architectures else "unknown"))


def for_gguf(model: str, architecture: Any) -> Family:
    for fam in FAMILIES.values():
        if architecture in fam.gguf_archs:
            return fam
    raise _unsupported(model, str(architecture))


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ModelError(f'unknown model family "{name}"') from None


def default_layer_types(fam: Family, layers: int, pattern: int | None = None) -> list[str]:
    """Local and global layers where the checkpoint does not list them: every pattern-th layer global (the
    config classes' rule, and llama.cpp's)."""
    every = int(pattern or fam.local_pattern)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]


def layer_shapes(fam: Family, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each per-layer HF tensor's shape for a read_config dict."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.qkv_proj.weight": (q + 2 * kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.gate_up_proj.weight": (2 * i, h),
        "mlp.down_proj.weight": (h, i),
    }
    return {name: shapes.get(name, (h,)) for name in fam.layer}  # the rest are norms over hidden
