"""From a model name and build settings to a ready chat: find or build the artefacts, then open them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .artefacts import ensure_artefacts
from .checkpoint import ModelSource, resolve_model
from .config import BuildSettings
from .runtime import StreamingEngine, load_artefacts
from .session import ChatSession, ChatSettings
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    source: ModelSource
    folder: Path
    engine: StreamingEngine
    tokenizer: Tokenizer

    def chat(self, settings: ChatSettings | None = None) -> ChatSession:
        return ChatSession(self.engine, self.tokenizer, settings)


def open_folder(folder: Path, source: ModelSource | None = None) -> LoadedModel:
    module, cfg, settings = load_artefacts(folder)
    return LoadedModel(source, folder, StreamingEngine(module, cfg, settings), Tokenizer.from_dir(folder))


def open_model(spec: str | None, settings: BuildSettings | None = None,
               progress: Callable[[str, float], None] | None = None,
               should_cancel: Callable[[], bool] | None = None) -> LoadedModel:
    """Resolves `spec`, builds its artefacts if needed (torch is imported only then) and opens them."""
    source = resolve_model(spec)
    folder = ensure_artefacts(source, settings or BuildSettings(), progress, should_cancel)
    return open_folder(folder, source)
