"""Hugging Face folders: config.json, safetensors shards (header checks without torch, then the weights) and
where the tokenizer is."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine import arch
from engine.errors import ModelError

if TYPE_CHECKING:
    import torch

    from .source import ModelSource


class _Truncated(Exception):
    pass


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path.parent}: missing {path.name}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: {what} is not valid JSON ({exc}).") from None


def hf_config(source: "ModelSource") -> dict[str, Any]:
    """The model's shape from config.json, as read_config reports it; ModelError if Eddy cannot run it."""
    assert source.path is not None
    raw = load_json(source.path / "config.json", "config.json")
    if not isinstance(raw, dict):
        raise ModelError(f"{source.path / 'config.json'}: expected a JSON object.")
    fam = arch.for_hf(source.name, raw.get("model_type"), raw.get("architectures") or [])
    if isinstance(raw.get("text_config"), dict):
        raise ModelError(f"{source.name}: a multimodal {fam.title} checkpoint (its config.json holds a text_config); "
                         f"Eddy runs the text model alone: use its GGUF (llama.cpp writes the text model to its own "
                         f"file) or a {fam.hf_model_types[0]} folder.")
    flags = ("mlp_bias",) if fam.qkv_bias else ("attention_bias", "mlp_bias")
    for flag in flags:
        if raw.get(flag):
            raise ModelError(f"{source.name}: {flag} = true is not supported ({fam.title} as Eddy builds it "
                             f"has no such biases).")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or fam.act_names[0]
    if act not in fam.act_names:
        raise ModelError(f'{source.name}: activation "{act}" is not supported ({fam.title} uses {fam.act_names[0]}).')
    partial = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get("partial_rotary_factor")
    if float(partial or 1.0) != 1.0:
        raise ModelError(f"{source.name}: partial rotary embeddings (partial_rotary_factor {partial}) are "
                         f"not supported.")
    if raw.get("use_sliding_window"):
        raise ModelError(f"{source.name}: use_sliding_window = true (sliding-window layers beside full ones) "
                         f"is not supported for {fam.title}.")

    # Defaults are LlamaConfig's, so a sparse config.json means what transformers thinks it means.
    hidden = int(raw.get("hidden_size", 4096))
    heads = int(raw.get("num_attention_heads", 32))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelError(f"{source.name}: inconsistent head counts ({heads} heads, {kv_heads} kv heads).")
    head_dim = int(raw.get("head_dim") or hidden // heads)

    # transformers 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or {}
    local_params: dict[str, Any] = {}
    if "full_attention" in params:  # one entry per layer type (Gemma 3): the global layers' is the model's
        local_params, params = params.get("sliding_attention") or {}, params["full_attention"]
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    # Mistral's and Phi-3's window (every layer), Gemma's (its local layers); Qwen's sliding_window only counts
    # with use_sliding_window (refused above).
    window = raw.get("sliding_window") if fam.name in ("mistral", "phi3") or fam.local_layers else None
    layers = int(raw.get("num_hidden_layers", 32))

    return {
        **(_local_layer_config(raw, layers, fam, local_params) if fam.local_layers else {}),
        "model_type": fam.name,
        "vocab_size": int(raw.get("vocab_size", 32000)),
        "hidden_size": hidden,
        "intermediate_size": int(raw.get("intermediate_size", 11008)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "rms_norm_eps": float(raw.get("rms_norm_eps", fam.norm_eps_default)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", fam.tie_default)),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
        "sliding_window": int(window) if window else None,
    }


def _local_layer_config(raw: dict[str, Any], layers: int, fam: arch.Family,
                        local_params: dict[str, Any]) -> dict[str, Any]:
    # Defaults are the config class's: every local_pattern-th layer global, the family's soft caps.
    # Configs written before layer_types name the pattern (Gemma 3's first releases: sliding_window_pattern).
    types = raw.get("layer_types") or arch.default_layer_types(fam, layers, raw.get("sliding_window_pattern"))
    config = {
        "layer_types": list(types),
        "query_pre_attn_scalar": raw.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": raw.get("attn_logit_softcapping", fam.softcaps[0]),
        "final_logit_softcapping": raw.get("final_logit_softcapping", fam.softcaps[1]),
    }
    if fam.local_rope_base:
        kind = local_params.get("rope_type") or "default"
        if kind != "default":
            raise ModelError(f"rope scaling {kind!r} on {fam.title}'s local layers is not supported.")
        base = raw.get("rope_local_base_freq") or local_params.get("rope_theta") or fam.local_rope_base
        config["rope_local_base_freq"] = float(base)
    return config


def hf_weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = load_json(index, "the safetensors index")
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


def check_safetensors(path: Path) -> None:
    """Validate the header and size without reading the tensors, so a truncated download is
    caught when the model is chosen rather than halfway through an export."""
    safetensors_header(path)


def safetensors_header(path: Path) -> dict[str, Any]:
    """A checked .safetensors file's tensor entries ({name: {"dtype", "shape", "data_offsets"}}); ModelError if
    the header is corrupt or the file's size is not what the header describes."""
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
        entries = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, stop = entry["data_offsets"]
            end = max(end, int(stop))
            entries[key] = {**entry, "shape": tuple(int(d) for d in entry["shape"])}
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
    return entries


def hf_tokenizer_file(source: "ModelSource") -> Path:
    assert source.path is not None
    for name in ("tokenizer.json", "tokenizer.model"):
        if (source.path / name).is_file():
            return source.path / name
    raise ModelError(
        f"{source.name}: missing tokenizer (no tokenizer.json or tokenizer.model in {source.path})."
    )



def hf_tensors(source: "ModelSource", cfg: dict[str, Any]
               ) -> tuple[dict[str, tuple[int, ...]], Callable[[str], "torch.Tensor"]]:
    """The weights' HF names and shapes from the shards' headers, and a reader of one tensor by name (in its
    stored floating type).
    Each read opens its shard for that tensor alone: a mapping held open over the whole build would keep
    every tensor read so far resident."""
    assert source.path is not None
    files = hf_weight_files(source.path)
    if not files:
        raise_no_weights(source)
    where: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for shard in files:
        for key, entry in safetensors_header(shard).items():
            if key.endswith("rotary_emb.inv_freq"):
                continue  # a derived buffer some old checkpoints saved
            name = key if key.startswith(("model.", "lm_head.")) else "model." + key
            if name in where:
                raise ModelError(f"{source.name}: tensor {key} appears in more than one .safetensors file.")
            where[name] = (shard, key, entry["shape"])
    if cfg["tie_word_embeddings"]:
        # from_pretrained ties lm_head to embed_tokens and ignores a stored copy.
        where.pop("lm_head.weight", None)

    def read(name: str) -> "torch.Tensor":
        from safetensors import SafetensorError, safe_open

        shard, key, _ = where[name]
        try:
            with safe_open(str(shard), framework="pt") as f:
                t = f.get_tensor(key)
            # Integer or float64 tensors are no weights Eddy knows; float32 keeps whatever they hold.
            return t if t.dtype.is_floating_point and t.element_size() <= 4 else t.float()
        except SafetensorError as exc:
            raise ModelError(f"{shard.name}: the .safetensors file is truncated or corrupt ({exc}).") from None

    return {name: shape for name, (_, _, shape) in where.items()}, read


def raise_no_weights(source: "ModelSource") -> None:
    assert source.path is not None
    names = sorted(p.name for p in source.path.iterdir())
    pickled = [n for n in names if Path(n).suffix.lower() in PICKLE_SUFFIXES]
    if pickled:
        raise pickle_refusal(source.name, pickled)
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    hint = f" To use {ggufs[0]}, give the path of that file instead." if ggufs else ""
    raise ModelError(f"{source.path}: no .safetensors weights found next to config.json.{hint}")


def pickle_refusal(name: str, files: list[str]) -> ModelError:
    shown = ", ".join(files[:3]) + (" ..." if len(files) > 3 else "")
    return ModelError(
        f"{name}: has only pickled PyTorch weights ({shown}). Eddy only reads safetensors or GGUF, "
        f"because loading pickles can run arbitrary code. Convert the model to .safetensors "
        f"(or .gguf) with a tool you trust."
    )
