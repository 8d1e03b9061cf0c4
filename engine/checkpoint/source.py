"""Resolving a model spec (a built-in name, a .gguf file or a Hugging Face folder) to a checked ModelSource.

Only safetensors and GGUF are ever read: both are plain data, whereas .bin/.pt/.pth files are pickles that can
run arbitrary code when loaded, so they are refused outright. Cheap: headers, config and tokenizer presence
only, never weights, never torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelError

from .bundled import DEFAULT_MODEL, default_gguf_path, dist_version  # noqa: F401 (this module's API too)
from .gguf import check_gguf
from .hf import (PICKLE_SUFFIXES, check_safetensors, hf_config, hf_tokenizer_file, hf_weight_files, pickle_refusal,
                 raise_no_weights)
from .tiny import is_tiny, tiny_family, tiny_names

# Besides config, weights and tokenizer.json/.model: the files whose content shapes the chat.
HF_TOKENIZER_EXTRAS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# Bits a weight of the narrowest 5-bit GGUF types (Q5_0, Q5_K): below it a GGUF counts as 4-bit (Q4_1 takes 5.0).
FIVE_BIT = 5.5


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
            return [default_gguf_path()]
        if self.kind == "hf":
            assert self.path is not None
            folder = self.path
            found: list[Path] = [folder / "config.json"]
            index = folder / "model.safetensors.index.json"
            if index.is_file():
                found.append(index)
            found.extend(hf_weight_files(folder))
            for name in ("tokenizer.json", "tokenizer.model", *HF_TOKENIZER_EXTRAS):
                if (folder / name).is_file():
                    found.append(folder / name)
            return found
        raise ModelError(f'Model "{self.name}": unknown checkpoint kind "{self.kind}".')

    def auto_dtype(self) -> str:
        """The weight type a build takes when none is named: q4 for a GGUF of 4-bit codes (or fewer), which
        Eddy's q4 holds as they are (Q4_0/Q4_1) or close to (K-quants), so the build is about the size of the
        file the user chose; q8 for everything else (5-bit and wider GGUFs, 16-bit checkpoints)."""
        if self.kind != "gguf":
            return "q8"
        from .gguf import main_code_bits, read_gguf

        assert self.path is not None
        return "q4" if main_code_bits(read_gguf(self.path)) < FIVE_BIT else "q8"

    def fingerprint(self) -> str:
        """sha256 hex identifying the model's content; file hashes are memoised on disk."""
        from .fingerprint import fingerprint

        return fingerprint(self)


def default_source() -> ModelSource:
    return ModelSource(DEFAULT_MODEL, "gguf", default_gguf_path())


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a model spec (None, a built-in name, a .gguf path or a Hugging Face folder) into a
    checked ModelSource. Built-in names win over same-named paths. Cheap: reads headers,
    config and tokenizer presence only, never weights, never torch."""
    # A blank spec (e.g. an empty settings field) means "no choice made", like None.
    if spec is None or not spec.strip() or spec.strip().lower() == DEFAULT_MODEL:
        path = default_gguf_path()
        source = ModelSource(DEFAULT_MODEL, "gguf", path)
        check_gguf(source)
        return source
    if is_tiny(spec.strip().lower()):
        name = spec.strip().lower()
        tiny_family(name)  # an unknown or unsupported family is refused here
        # The tokenizer (and the vocab size) come from the default model, so it must be there.
        check_gguf(default_source())
        return ModelSource(name, "tiny-random", None)

    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(
            f'Model "{spec}" not found: there is no such file or folder ({path}), and it is not a '
            f"built-in model name ({DEFAULT_MODEL}, {', '.join(tiny_names())})."
        )
    # Display the name the user chose, not a symlink target (e.g. an Ollama blob hash).
    name = path.name
    path = path.resolve()
    name = name or path.name or str(path)  # "." or ".." have no name of their own
    if path.is_dir():
        return _resolve_folder(path, name)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise pickle_refusal(path.name, [path.name])
    if path.suffix.lower() == ".safetensors" or path.name == "config.json":
        raise ModelError(
            f"{path}: point Eddy at the Hugging Face model folder (the one holding config.json, "
            f"the .safetensors weights and tokenizer.json), not at a single file inside it."
        )
    if path.suffix.lower() != ".gguf" and not has_gguf_magic(path):
        raise ModelError(
            f"{path.name}: not a model Eddy can read. Give a .gguf file or a Hugging Face folder "
            f"with config.json and .safetensors weights."
        )
    source = ModelSource(name, "gguf", path)
    check_gguf(source)
    return source


def _resolve_folder(folder: Path, name: str) -> ModelSource:
    config_path = folder / "config.json"
    if not config_path.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            # A folder holding just one GGUF file is unambiguous, so take it.
            source = ModelSource(ggufs[0].name, "gguf", ggufs[0])
            check_gguf(source)
            return source
        raise ModelError(
            f"{folder}: missing config.json. A Hugging Face model folder needs config.json, "
            f".safetensors weights and tokenizer.json (or give a .gguf file)."
        )
    source = ModelSource(name, "hf", folder)
    hf_config(source)  # architecture and config sanity
    weights = hf_weight_files(folder)
    if not weights:
        raise_no_weights(source)
    for shard in weights:
        check_safetensors(shard)
    hf_tokenizer_file(source)  # fail now rather than after a long export
    return source


def has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


