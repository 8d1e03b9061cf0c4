"""From a model name and build settings to a ready chat: find or build the artefacts, then open them."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from .artefacts.store import (bundled_entries, check_cpu, compiler_available, ensure_artefacts, find_bundled,
                              no_compiler_error, read_manifest)
from .artefacts.cache import hold
from .checkpoint import DEFAULT_MODEL, TINY_RANDOM, ModelSource, resolve_model
from .artefacts.progress import Progress
from .config import BuildSettings, ModelConfig
from .errors import ArtefactError, ModelError
from .gpu import resolve_target
from .run.generation import ChatDefaults, chat_defaults, read_recommended
from .run.runtime import CompiledModule, StreamingEngine
from .run.session import ChatSession, ChatSettings
from .run.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    source: ModelSource
    folder: Path
    engine: StreamingEngine
    tokenizer: Tokenizer
    chat_defaults: ChatDefaults = field(default_factory=ChatDefaults)  # the sampling chat apps should start from
    # A shared lock on the entry while this model is alive, so `eddy cache rm` (or Settings) will not delete it.
    held: IO[bytes] | None = field(default=None, repr=False)

    def chat(self, settings: ChatSettings | None = None) -> ChatSession:
        return ChatSession(self.engine, self.tokenizer, settings)


def load_artefacts(folder: Path) -> tuple[CompiledModule, ModelConfig, BuildSettings]:
    """Opens a built artefact folder (checked against its manifest)."""
    manifest = read_manifest(folder)
    settings = BuildSettings(**manifest["settings"])
    return CompiledModule(folder, settings), ModelConfig(**manifest["config"]), settings


def open_folder(folder: Path, source: ModelSource | None = None) -> LoadedModel:
    check_cpu(folder)
    held = hold(folder)  # before loading: a delete that starts later sees it
    module, cfg, settings = load_artefacts(folder)
    # Read from the checkpoint, not the artefacts: it is not part of the compiled module, so editing a
    # folder's generation_config.json takes effect at the next start without a rebuild.
    defaults = chat_defaults(*read_recommended(source.kind, source.path)) if source else ChatDefaults()
    return LoadedModel(source, folder, StreamingEngine(module, cfg, settings), Tokenizer.from_dir(folder), defaults,
                       held)


def open_model(spec: str | None, settings: BuildSettings | None = None,
               progress: "Progress | None" = None,
               should_cancel: Callable[[], bool] | None = None) -> LoadedModel:
    """Resolves `spec`, builds its artefacts if needed (torch is imported only then) and opens them.

    A precompiled entry under $EDDY_BUNDLED_MODELS (a packaged Eddy) wins: it needs neither the checkpoint
    nor the compiler."""
    # A cuda build with no target named is this machine's GPU's, also for a packaged entry built for it.
    settings = resolve_target(settings or BuildSettings())
    name = DEFAULT_MODEL if spec is None or not spec.strip() else spec.strip()
    bundled = find_bundled(name, settings)
    if bundled is not None:
        return open_folder(bundled, ModelSource(name.lower(), "bundled", bundled))
    if not compiler_available() and any(str(m.get("model", "")).lower() == name.lower() for _, m in bundled_entries()):
        # The packaged model with other build settings: its checkpoint is not in the package either.
        raise no_compiler_error(f'The model "{name}" with these settings (sinks {settings.sinks}, window '
                                f"{settings.window}, {settings.dtype}, {settings.device})")
    try:
        source = resolve_model(spec)
    except ModelError:
        if name.lower() in (DEFAULT_MODEL, TINY_RANDOM) and not compiler_available():
            # A package without the checkpoints they are built from.
            raise no_compiler_error(f'The model "{name}"') from None
        raise
    folder = ensure_artefacts(source, settings, progress, should_cancel)
    try:
        return open_folder(folder, source)
    except ArtefactError:
        # The files passed the manifest's size and sampled-hash check yet do not load (damaged where the
        # sample does not look, or replaced with matching sizes): rebuild the entry once.
        shutil.rmtree(folder, ignore_errors=True)
        return open_folder(ensure_artefacts(source, settings, progress, should_cancel), source)
