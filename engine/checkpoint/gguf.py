"""GGUF files: the header (read with struct over an mmap, no torch), the config and the weights.

gguf.GGUFReader builds numpy views for every metadata item (each of the ~100k tokenizer strings), which costs
~2 s for the default model; a struct-based walk over an mmap does the same job in a fraction of that, which
matters because resolve runs on every start. Arrays of strings (the vocabulary, the merges) are only stepped
over there and decoded when first read (`_Strings`): decoding them took 110 of the 120 ms resolve spent on the
default model, a quarter of a one-shot answer, and only a build reads them.
"""
from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine import arch
from engine.errors import ModelError

if TYPE_CHECKING:
    import torch

    from .source import ModelSource

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


class _Strings(Sequence):
    """A GGUF array of `count` strings at byte `start` of the file, decoded on first use."""

    def __init__(self, path: Path, endian: str, start: int, count: int) -> None:
        self.path, self.endian, self.start, self.count = path, endian, start, count
        self._items: list[str] | None = None

    def _load(self) -> list[str]:
        if self._items is None:
            length = struct.Struct(self.endian + "Q").unpack_from
            items, pos = [], self.start
            with open(self.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for _ in range(self.count):
                    (n,) = length(mm, pos)
                    items.append(mm[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
                    pos += 8 + n
            self._items = items
        return self._items

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):  # type: ignore[override]
        return self._load()[i]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented


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
            if item_type == _GGUF_STRING:
                # Stepped over, not decoded; a length past the end makes unpack_from raise struct.error (corrupt).
                start, length = pos, struct.Struct(e + "Q").unpack_from
                for _ in range(count):
                    pos += 8 + length(mm, pos)[0]
                need(0)
                return _Strings(path, e, start, count)
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



def read_gguf(path: Path) -> _GGUFInfo:
    """The parsed header of a GGUF file (memoised while the file is unchanged)."""
    return _read_gguf(path)


def main_code_bits(info: _GGUFInfo) -> float:
    """Bits a weight of the type that holds most of the file's matrix weights (Q4_K_M: Q4_K's 4.5, beside its
    Q6_K tensors; the default model's Q4_1: 5.0, beside its Q8_0 embedding)."""
    weights: dict[int, int] = {}
    bits: dict[int, float] = {}
    for t in info.tensors.values():
        if len(t.shape) >= 2:
            n = math.prod(t.shape)
            weights[t.ggml_type] = weights.get(t.ggml_type, 0) + n
            bits[t.ggml_type] = 8 * t.nbytes / n
    if not weights:
        raise ModelError(f"{info.path.name}: the file holds no weight matrices.")
    return bits[max(weights, key=weights.__getitem__)]


def family_of(source: "ModelSource", info: _GGUFInfo) -> arch.Family:
    return arch.for_gguf(source.name, info.fields.get("general.architecture"))


def check_gguf(source: "ModelSource") -> _GGUFInfo:
    """The header of a GGUF model Eddy can run; ModelError naming what is wrong otherwise."""
    assert source.path is not None
    info = _read_gguf(source.path)
    family_of(source, info)  # refuses an architecture Eddy cannot run
    prefix = info.fields["general.architecture"]
    if info.fields.get(f"{prefix}.expert_count", 0):
        raise ModelError(
            f"{source.name}: mixture-of-experts models ({prefix}.expert_count = "
            f"{info.fields[f'{prefix}.expert_count']}) are not supported (Eddy supports dense "
            f"{arch.supported_names()})."
        )
    if "tokenizer.ggml.tokens" not in info.fields or "tokenizer.ggml.model" not in info.fields:
        raise ModelError(f"{source.name}: missing tokenizer (the GGUF file has no tokenizer.ggml.* data).")
    tok_model = info.fields["tokenizer.ggml.model"]
    if tok_model not in ("gpt2", "llama"):
        raise ModelError(
            f'{source.name}: tokenizer type "{tok_model}" is not supported '
            f'(need "gpt2" BPE or "llama" SentencePiece).'
        )
    gguf_config(source, info)
    return info


def gguf_config(source: "ModelSource", info: _GGUFInfo) -> dict[str, Any]:
    """The model's shape from the GGUF metadata, as read_config reports it."""
    f = info.fields
    name = source.name
    fam = family_of(source, info)
    prefix = f["general.architecture"]  # metadata keys are named after the architecture

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = f.get(f"{prefix}.{key}", default)
        if value is None and required:
            raise ModelError(f"{name}: GGUF metadata {prefix}.{key} is missing.")
        if isinstance(value, list):
            # Some converters write per-layer lists; a uniform list is still a plain model.
            if not value or any(v != value[0] for v in value):
                raise ModelError(f"{name}: {prefix}.{key} differs between layers, which is not supported.")
            value = value[0]
        return value

    embed = info.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelError(f"{name}: the GGUF file has no usable token_embd.weight tensor.")
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
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
    window = get("attention.sliding_window")
    layers = int(get("block_count", required=True))
    local = {}
    if fam.local_layers:
        caps = {k: f.get(f"{prefix}.{k}") for k in ("attn_logit_softcapping", "final_logit_softcapping")}
        local = {
            # llama.cpp's layout: every local_pattern-th layer global; its query scale (see the Family field).
            "layer_types": arch.default_layer_types(fam, layers),
            "query_pre_attn_scalar": hidden // heads if layers == fam.gguf_query_by_hidden_layers else head_dim,
            **{k: float(v) if v is not None else None for k, v in caps.items()},
        }
        if fam.local_rope_base:  # llama.cpp's own value unless the file names one
            local["rope_local_base_freq"] = float(get("rope.freq_base_swa", fam.local_rope_base))
    config = {
        **local,
        "model_type": fam.name,
        "vocab_size": int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta,
        "rope_scaling": _gguf_rope_scaling(source, info, prefix, head_dim, rope_theta),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in info.tensors,
        "max_position_embeddings": int(get("context_length", 2048)),
        "sliding_window": int(window) if window else None,
    }
    return config


def _gguf_rope_scaling(source: "ModelSource", info: _GGUFInfo, prefix: str, head_dim: int,
                       theta: float) -> dict | None:
    f = info.fields
    kind = f.get(f"{prefix}.rope.scaling.type")
    factor = f.get(f"{prefix}.rope.scaling.factor")
    if any(t.startswith("rope_factors_") for t in info.tensors):
        raise ModelError(f'{source.name}: LongRoPE scaling (rope_factors_* tensors) is not supported '
                         f'(only linear and llama3).')
    if "rope_freqs.weight" in info.tensors:
        return _llama3_rope_from_freqs(source, info, prefix, head_dim, theta)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ModelError(f'{source.name}: rope scaling "{kind}" is not supported (only linear and llama3).')


def _llama3_rope_from_freqs(source: "ModelSource", info: _GGUFInfo, prefix: str, head_dim: int,
                            theta: float) -> dict | None:
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
    old_ctx = float(info.fields.get(f"{prefix}.rope.scaling.original_context_length") or 8192)
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



# Tensors that are not weights: rope factors are read into rope_scaling by gguf_config.
_GGUF_SKIP = {"rope_freqs.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def _unpermute(w: Any, n_head: int) -> Any:
    # llama.cpp's converter interleaves each head's rotary halves of llama-arch q/k (for its rope kernel);
    # HF keeps them as [first half | second half]. This inverts llama.cpp's
    # reshape(n_head, 2, d, ...).swapaxes(1, 2).
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(fam: arch.Family, layer_names: dict[str, str], gname: str) -> str | None:
    if gname in arch.TOP_TENSORS:
        return arch.TOP_TENSORS[gname]
    m = _BLK.fullmatch(gname)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    return None


# Rows dequantised at a time: gguf's dequantize holds several float temporaries the size of its input, which for
# a whole 128k-row embedding would be gigabytes. Rows are whole blocks, so chunks give the same floats.
DEQUANT_ROWS = 2048


def gguf_tensors(source: "ModelSource", cfg: dict[str, Any]
                 ) -> tuple[dict[str, tuple[int, ...]], Callable[[str], "torch.Tensor"],
                            Callable[[str], "dict[str, torch.Tensor] | None"], Callable[[str], "GGUFRows | None"]]:
    """The weights' HF names and shapes from the header, a reader of one tensor by HF name (float32, with what
    llama.cpp's converter did to each family's tensors undone), a reader of a matrix's 4-bit codes as q4
    rows where its type keeps them (engine/checkpoint/gguf_q4.py; None otherwise), and one of a matrix as
    GGUFRows, read a block of rows at a time (None for a permuted one). Each read opens the file and reads just
    the bytes it needs (no mapping of the whole file that would stay resident)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    assert source.path is not None
    info = check_gguf(source)
    fam = family_of(source, info)
    layer_names = fam.gguf_to_hf_layer()
    where: dict[str, tuple[str, _GGUFTensorInfo]] = {}
    for gname, t in info.tensors.items():
        if gname in _GGUF_SKIP:
            continue
        hf_name = _hf_name(fam, layer_names, gname)
        if hf_name is None:
            raise ModelError(f"{source.name}: unexpected tensor {gname} for a {fam.title} model.")
        qtype = GGMLQuantizationType(t.ggml_type)
        if t.shape[0] % GGML_QUANT_SIZES[qtype][0]:
            raise ModelError(
                f"{source.name}: tensor {gname} has a row size that does not fit {qtype.name} blocks."
            )
        where[hf_name] = (gname, t)

    def read(hf_name: str) -> "torch.Tensor":
        gname, t = where[hf_name]
        return _read_gguf_tensor(source, info.path, gname, t, hf_name, cfg, fam)

    def read_q4(hf_name: str) -> "dict[str, torch.Tensor] | None":
        import numpy as np
        import torch

        from .gguf_q4 import Q4_BLOCK_TYPES, q4_rows

        gname, t = where[hf_name]
        if GGMLQuantizationType(t.ggml_type).name not in Q4_BLOCK_TYPES or len(t.shape) != 2:
            return None
        rows = q4_rows(_read_raw(source, info.path, gname, t), GGMLQuantizationType(t.ggml_type).name)
        if rows is None:
            return None
        for k, v in rows.items():
            rows[k] = torch.from_numpy(np.ascontiguousarray(_undo_permute(v, hf_name, cfg, fam)))
        return rows

    def read_rows(hf_name: str) -> GGUFRows | None:
        gname, t = where[hf_name]
        if len(t.shape) != 2 or _permuted_heads(hf_name, cfg, fam):
            return None
        return GGUFRows(source, info.path, gname, t)

    # numpy order is ggml's reversed.
    return {name: tuple(reversed(t.shape)) for name, (_, t) in where.items()}, read, read_q4, read_rows


def _read_raw(source: "ModelSource", path: Path, gname: str, t: _GGUFTensorInfo,
              rows: tuple[int, int] | None = None) -> "np.ndarray":
    """The tensor's bytes as uint8 [rows, bytes a row]: rows of raw blocks, as dequantize and q4_rows take them;
    `rows` (start, stop) reads just those."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    row_bytes = t.shape[0] // block * type_size
    start, stop = rows if rows is not None else (0, t.nbytes // row_bytes)
    raw = np.empty((stop - start) * row_bytes, dtype=np.uint8)
    try:
        with open(path, "rb") as fh:
            fh.seek(t.offset + start * row_bytes)
            got = fh.readinto(raw)
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the file ({exc}).") from None
    if got != raw.nbytes:
        raise ModelError(f"{path.name}: the GGUF file is truncated (tensor {gname} is cut short). Download it again.")
    return raw.reshape(-1, row_bytes)


class GGUFRows:
    """A GGUF matrix whose rows are read and dequantised to float32 when sliced (`m[start:stop]`), for a build
    that converts a matrix a block of rows at a time (engine/exporter/linear.py's stored_matrix): an 8B's Q6_K LM
    head is 2.1 GB in float32, which the build held whole beside its q8 copy. Only for matrices whose rows come
    back in the file's order (not a llama-arch q or k, whose rows are permuted)."""

    def __init__(self, source: "ModelSource", path: Path, gname: str, t: _GGUFTensorInfo) -> None:
        import torch

        self.dtype = torch.float32
        self.shape = tuple(reversed(t.shape))
        self._where = (source, path, gname, t)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> "torch.Tensor":
        import torch

        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "rows are read in runs"
        source, path, gname, t = self._where
        return torch.from_numpy(_dequantised(source, gname, t, _read_raw(source, path, gname, t, (start, stop))))

    def contiguous(self) -> "torch.Tensor":
        return self[:]


def _dequantised(source: "ModelSource", gname: str, t: _GGUFTensorInfo, raw: "np.ndarray") -> "np.ndarray":
    """float32 [rows, weights a row] from rows of raw blocks, DEQUANT_ROWS at a time (ours where we have the type,
    engine/checkpoint/gguf_dequant.py, else gguf-py's)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from .gguf_dequant import dequantise_into

    qtype = GGMLQuantizationType(t.ggml_type)
    w = np.empty((raw.shape[0], t.shape[0]), dtype=np.float32)
    try:
        for start in range(0, raw.shape[0], DEQUANT_ROWS):
            chunk = raw[start:start + DEQUANT_ROWS]
            if not dequantise_into(chunk, qtype.name, w[start:start + DEQUANT_ROWS]):
                w[start:start + DEQUANT_ROWS] = dequantize(chunk, qtype)
    except NotImplementedError:
        raise ModelError(f"{source.name}: tensor {gname} uses {qtype.name}, which Eddy cannot dequantise.") from None
    return w


def _permuted_heads(hf_name: str, cfg: dict[str, Any], fam: arch.Family) -> int | None:
    """The head count a llama-arch q or k matrix's rows were permuted by (llama.cpp's converter), else None."""
    if fam.gguf_permute_qk and hf_name.endswith("self_attn.q_proj.weight"):
        return cfg["num_attention_heads"]
    if fam.gguf_permute_qk and hf_name.endswith("self_attn.k_proj.weight"):
        return cfg["num_key_value_heads"]
    return None


def _undo_permute(w: "np.ndarray", hf_name: str, cfg: dict[str, Any], fam: arch.Family) -> "np.ndarray":
    """Rows of a llama-arch q or k matrix (or of anything aligned with its rows) back in HF's order."""
    heads = _permuted_heads(hf_name, cfg, fam)
    return w if heads is None else _unpermute(w, heads)


def _read_gguf_tensor(source: "ModelSource", path: Path, gname: str, t: _GGUFTensorInfo, hf_name: str,
                      cfg: dict[str, Any], fam: arch.Family) -> "torch.Tensor":
    import numpy as np
    import torch

    w = _dequantised(source, gname, t, _read_raw(source, path, gname, t))
    w = _undo_permute(w.reshape(tuple(reversed(t.shape))), hf_name, cfg, fam)
    if fam.norm_offset and gname.endswith("norm.weight"):
        w = w - fam.norm_offset  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
