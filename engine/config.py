"""Model and build settings shared by the export side (torch) and the runtime side (numpy only)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .arch import family
from .devices import DEVICES, GPU_TARGETS, TABLE
from .errors import ModelError

DTYPES = ("f32", "f16", "bf16", "q8", "q4")
# The types whose decode products are written by hand on x86 (engine/exporter/kernels/dot_products.py).
QUANTISED = ("q8", "q4")
# The weight type a build takes when none is named: the checkpoint's own choice (ModelSource.auto_dtype), so a
# 4-bit GGUF builds at q4 and everything else at q8. Resolved before anything is keyed or built (for_source).
AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPES)
# The KV cache's element type: 16 bits halve what attention reads per token over a long window (bf16 keeps f32's
# range with 8 bits of precision, f16 11 bits with a narrower range).
KV_DTYPES = ("f32", "f16", "bf16")
# The KV cache type a build takes when none is named, by weight type: f32 stays the exact parity build; the others
# already round their products, and f16's 11 bits cost no measurable quality (docs/QUALITY.md: ppl 35.669 against
# 35.670 at q4) while decode over a full window gains ~16 % (docs/BENCHMARKS.md). bf16 weights keep bf16's range.
AUTO_KV_DTYPE = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8": "f16", "q4": "f16"}
KV_CHOICES = (AUTO_DTYPE, *KV_DTYPES)
# q4's group: weights per scale and offset along a row (GGUF Q4_0/Q4_1's block, so their codes pass through).
Q4_GROUP = 32
# q8 matrices that are multiplied are stored in tiles of this many rows, a tile's 4 positions at a time
# (engine/exporter/kernels/tiles.py, tile_q8): decode's product keeps one output row per vector lane, with no horizontal
# sums, and its hand-written form (engine/exporter/kernels/dot_products.py) takes 16 rows x 4 positions a load.
TILE_ROWS = 32
# q4's tiles are of 16 rows: one AVX-512 register of int32 sums in its hand-written decode product
# (engine/exporter/kernels/dot_products.py), whose layout groups a tile's codes in blocks of 16 rows x 4 positions.
Q4_TILE_ROWS = 16
# A multiplied q4 matrix's group numbers are 8-bit factors of three float16 units per super-block of groups along a
# row (engine/exporter/q4.py): at most Q4_SUPER_GROUPS (Q4_K's 256 weights, 4.69 bits a weight instead of float16
# numbers' 5) in a row narrower than Q4_WIDE_GROUPS groups (2048 weights), at most Q4_WIDE_SUPER_GROUPS (1024
# weights, 4.55 bits) from there. Decode at 1B-8B reads its matrices at the memory's speed: the longer blocks took the
# 8B's decode at 1000 up 3-11 % (bench/decode_ab.py, docs/BENCHMARKS.md). The default model (576 wide), bound by its
# dispatches rather than its bytes, gained nothing measurable with them and lost 0.12 % perplexity (docs/QUALITY.md),
# so narrower models keep the blocks of 8 and their builds are what they were.
Q4_SUPER_GROUPS = 8
Q4_WIDE_SUPER_GROUPS = 32
Q4_WIDE_GROUPS = 64


def super_groups(groups: int) -> int:
    """q4 groups per super-block in a row of `groups` groups: the most that divide it, up to Q4_SUPER_GROUPS, or
    Q4_WIDE_SUPER_GROUPS in a row of Q4_WIDE_GROUPS or more."""
    limit = Q4_WIDE_SUPER_GROUPS if groups >= Q4_WIDE_GROUPS else Q4_SUPER_GROUPS
    return max(g for g in range(1, limit + 1) if groups % g == 0)

# llvm-cpu targets: "host" (this machine's CPU, fastest, for local builds) or a portable one for packages
# that run on other machines (a module built for "host" can die of illegal instructions elsewhere).
# x86-64-v3 = AVX2 + FMA (Intel Haswell 2013+, AMD Zen 1+); x86-64 = any 64-bit x86 (slow: no AVX).
TARGET_CPUS = ("host", "x86-64-v3", "x86-64-v2", "x86-64", "x86-64-v4")
# Sink slots of a build that pins the system prompt, unless the user names another bound: room for a system
# prompt of a paragraph or two, one build for all of them.
PIN_SLOTS = 128
# A call attends to the cache's first slots up to its last used one, in blocks of this many slots (at most 15
# empty slots read): the slot count is a dynamic dimension of the module, and blocks of a fixed size give IREE a
# static innermost dimension to vectorise the softmax along (engine/exporter/model.py). The cache has whole blocks.
ATTEND_STEP = 16
# A head of at least this many weights (vocabulary x width) is read by a q4 decode in 4 bits (a 1B's 8-bit head was a
# third of its step's bytes), and the REFINED_ROWS likeliest logits made again from its 8-bit rows by a second call
# (engine/exporter/model.py, coarse_head). Under it a step's bytes are mostly its layers' and the second call costs
# more than it saves (the default model's head is 28M).
COARSE_HEAD_WEIGHTS = 64 << 20
# Enough for every sampler setting that truncates (top-k up to 64, and top-p / min-p in all but flat distributions).
REFINED_ROWS = 64
ROPE_TYPES = ("default", "linear", "llama3")  # what engine/run/rope.py computes


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_positions: int = 2048
    arch: str = "llama"  # the family in engine/arch.py
    sliding_window: int | None = None  # the model attends at most this many recent tokens (Mistral, Phi-3)
    # Gemma 2: layers that attend only to the last local_window tokens, soft caps, query scaling.
    local_layers: tuple[int, ...] = ()
    local_window: int | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scalar: float | None = None  # scores scaled by query_scalar ** -0.5 instead of head_dim ** -0.5
    rope_local_theta: float | None = None  # Gemma 3: the local layers' own RoPE base (unscaled)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config-style dict (as engine.checkpoint.read_config returns)."""
        heads = int(d["num_attention_heads"])
        fam = family(d.get("model_type") or "llama")
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            dim=int(d["hidden_size"]),
            n_layers=int(d["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            intermediate=int(d["intermediate_size"]),
            rope_theta=float(d.get("rope_theta") or 10000.0),
            rope_scaling=d.get("rope_scaling") or None,
            norm_eps=float(d.get("rms_norm_eps") or 1e-5),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_positions=int(d.get("max_position_embeddings") or 2048),
            arch=fam.name,
            **cls._windows(d),
            attn_softcap=float(d["attn_logit_softcapping"]) if d.get("attn_logit_softcapping") else None,
            final_softcap=float(d["final_logit_softcapping"]) if d.get("final_logit_softcapping") else None,
            query_scalar=float(d["query_pre_attn_scalar"]) if d.get("query_pre_attn_scalar") else None,
            rope_local_theta=float(d["rope_local_base_freq"]) if d.get("rope_local_base_freq") else None,
        )
        if cfg.n_heads % cfg.n_kv_heads:
            raise ModelError(f"{cfg.n_heads} attention heads are not a multiple of {cfg.n_kv_heads} KV heads")
        scaling = cfg.rope_scaling or {}
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise ModelError(f"rope scaling type {kind!r} is not supported (Eddy supports {', '.join(ROPE_TYPES)})")
        return cfg

    @staticmethod
    def _windows(d: dict[str, Any]) -> dict[str, Any]:
        window = int(d["sliding_window"]) if d.get("sliding_window") else None
        types = d.get("layer_types")
        if not types:
            return {"sliding_window": window}
        # With layer_types the window is that of the local layers only; global layers see the whole cache.
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return {"local_layers": local, "local_window": window if local else None}

    def rope_table(self, layer: int) -> int:
        """Which of the host's RoPE tables a layer rotates with: 0 the model's (scaled) one, 1 the local one."""
        return 1 if self.rope_local_theta and layer in self.local_layers else 0

    @property
    def rope_tables(self) -> int:
        return 2 if self.rope_local_theta and self.local_layers else 1

    def local_ring(self, settings: "BuildSettings") -> int:
        """Slots of the local layers' own ring, or 0 when they read the shared cache.

        A local layer attends to its last local_window tokens only. When those always fit in the window, a ring of
        exactly that size holds them and the StreamingLLM cache (sinks + window) is kept for the global layers
        alone: Gemma 3 at a window of 8188 then keeps 1024 slots in five layers of six. When the window is
        narrower, local layers read the shared cache masked to their window: they keep the sinks a narrow window
        needs, as the global layers do. So do the layers of a model that are all local (a Gemma 3 cut to fewer
        than six layers), which would leave the StreamingLLM cache to no layer at all.
        """
        if (self.local_layers and self.local_window and self.local_window <= settings.window
                and len(self.local_layers) < self.n_layers):
            return self.local_window
        return 0

    def coarse_head(self, settings: "BuildSettings") -> bool:
        """Whether decode's logits come from a 4-bit copy of the head, the likeliest then made again from the 8-bit
        head's rows (engine/exporter/model.py, StreamingLlama.refine): a q4 build on a CPU whose head is big enough
        that its bytes matter (COARSE_HEAD_WEIGHTS) and makes whole q4 groups and tiles."""
        return (settings.dtype == "q4" and settings.device == "cpu" and self.dim % Q4_GROUP == 0
                and self.vocab_size % Q4_TILE_ROWS == 0 and self.vocab_size * self.dim >= COARSE_HEAD_WEIGHTS)

    def prefill_bound(self, settings: "BuildSettings") -> int:
        """Most tokens one prefill call may feed: a call never wraps a ring onto tokens it still reads."""
        ring = self.local_ring(settings)
        return min(settings.chunk, ring) if ring else settings.chunk

    def check_build(self, settings: "BuildSettings") -> None:
        """Refuses build settings under which the compiled model would attend further back than the model does."""
        # The cache's slots are its positions (RoPE counts within the cache), so a cache longer than the model's
        # trained positions reads positions it never learnt, and a window of 10**9 asks for a KV cache of
        # hundreds of gigabytes: both refused here, before a build starts.
        sinks = max(settings.sinks, settings.max_sinks)
        if sinks + settings.window > self.max_positions:
            raise ModelError(f"this model has {self.max_positions} positions, so sinks + window can be at most "
                             f"{self.max_positions} (got {sinks} + {settings.window}): use --window "
                             f"{max(self.max_positions - sinks, 1)} or less")
        if self.sliding_window and settings.window > self.sliding_window:
            raise ModelError(f"this {family(self.arch).title} model attends to at most {self.sliding_window} recent "
                             f"tokens (its sliding window), so the window can be at most {self.sliding_window} "
                             f"(got {settings.window})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BuildSettings:
    """Everything that changes the compiled module besides the weights."""

    sinks: int = 4  # the sink count when no system prompt is pinned
    window: int = 1020
    dtype: str = AUTO_DTYPE  # see DTYPE_CHOICES
    device: str = "cpu"
    max_chunk: int = 512
    target_cpu: str = "host"  # llvm-cpu only; see TARGET_CPUS
    # Sink slots compiled (0: just `sinks`). The sink count is chosen per conversation up to this bound: a pinned
    # system prompt's tokens all become sinks; slots not used as sinks stay empty.
    max_sinks: int = 0
    kv_dtype: str = AUTO_DTYPE  # see KV_CHOICES; "auto" follows the weight type (AUTO_KV_DTYPE)
    # GPU devices only: the CUDA or Vulkan target (devices.GPU_TARGETS); "" until engine.gpu.resolve_target takes it
    # from this machine's GPU.
    gpu_target: str = ""

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"need sinks >= 0 and window >= 1 (got sinks={self.sinks}, window={self.window})")
        if self.max_sinks < 0:
            raise ValueError(f"need max sinks >= 0 (got {self.max_sinks})")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got {self.dtype!r})")
        if self.kv_dtype not in KV_CHOICES:
            raise ValueError(f"KV cache dtype must be one of {', '.join(KV_CHOICES)} (got {self.kv_dtype!r})")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)} (got {self.device!r})")
        if self.target_cpu not in TARGET_CPUS:
            raise ValueError(f"target CPU must be one of {', '.join(TARGET_CPUS)} (got {self.target_cpu!r})")
        if self.gpu_target and self.device not in GPU_TARGETS:
            raise ValueError(f"a GPU target is for a GPU device, {' or '.join(GPU_TARGETS)} (got device "
                             f"{self.device!r})")
        if self.gpu_target and self.gpu_target not in GPU_TARGETS[self.device]:
            known = GPU_TARGETS[self.device]
            raise ValueError(f"a {self.device} GPU target must be one of {', '.join(known)} (got {self.gpu_target!r})"
                             + ("; Hopper GPUs (sm_90) run sm_89 code" if self.device == "cuda" else ""))

    def for_source(self, source: Any) -> "BuildSettings":
        """These settings with "auto" replaced by the weight type `source` (a ModelSource) takes by default, and
        an "auto" KV cache type by the one that weight type takes."""
        dtype = source.auto_dtype() if self.dtype == AUTO_DTYPE else self.dtype
        return replace(self, dtype=dtype, kv_dtype=auto_kv_dtype(dtype, self.kv_dtype, self.device))

    @property
    def target(self) -> str:
        """What the device's compiler is told to build for: the CPU, or the GPU's CUDA or Vulkan target."""
        return self.gpu_target if self.device in GPU_TARGETS else self.target_cpu

    @property
    def capacity(self) -> int:
        """Tokens the cache holds with the default sink count."""
        return self.sinks + self.window

    @property
    def sink_slots(self) -> int:
        return max(self.sinks, self.max_sinks)

    @property
    def slots(self) -> int:
        """Slots in the compiled cache: the sink slots, the window's ring, then empty slots up to whole blocks of
        ATTEND_STEP."""
        return -(-(self.sink_slots + self.window) // ATTEND_STEP) * ATTEND_STEP

    @property
    def chunk(self) -> int:
        """Longest prefill call: a chunk never wraps the window ring onto itself."""
        return min(self.max_chunk, self.window)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def auto_kv_dtype(dtype: str, kv_dtype: str = AUTO_DTYPE, device: str = "cpu") -> str:
    """The KV cache type a build of weight type `dtype` (not "auto") for `device` gets: `kv_dtype` unless that is
    "auto", then the device's own choice (engine/devices.py) or else the weight type's."""
    if kv_dtype != AUTO_DTYPE:
        return kv_dtype
    return TABLE[device].auto_kv or AUTO_KV_DTYPE[dtype]
