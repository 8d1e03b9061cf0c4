"""The model picker at the top of the chat: the models Eddy can run, and switching between them.

It lists, recent first: the models used lately, the builds in the artefact cache, the models already on disk
(Hugging Face's cache, LM Studio's, GPT4All's and Jan's folders, Ollama's store: engine/discover.py, found in
the background) and the default. Each says its family, size and weight type and whether its build is cached (a
model that is not built takes a first build, a minute or more); one Eddy cannot run is listed greyed with why.
Picking one is a model switch (the controller's switch_model): the chat stays, and is put into the new model's
cache.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel
from PySide6.QtWidgets import QComboBox, QWidget

SCAN_SECONDS = 5.0  # a scan of the disk stops after this long, with what it found
# A weights-only build's start beside its weights: the build's processes and torch's import (5 s of a 1B fine-tune's
# 8, bench/new_model.py --tuned, Zen 5, 2026-12-07).
WEIGHTS_ONLY_FIXED_S = 5.0


@dataclass(frozen=True)
class ModelChoice:
    spec: str      # what the settings' model field takes ("" = the default model)
    label: str     # the model's name
    detail: str    # family · size · weights · built or not
    runnable: bool = True
    reason: str = ""  # why not, when not


@dataclass(frozen=True)
class BuildTimes:
    """What this machine's earlier builds took (their manifests' build_seconds): a fixed part (export and
    compile, which follow the model's shape more than its size) and seconds per byte of weights written."""
    fixed_s: float = 75.0  # the default model's on a 2-core machine, before anything was built here
    per_byte_s: float = 1e-7

    @staticmethod
    def of(folders: list[Path]) -> "BuildTimes":
        import json
        import statistics

        fixed, per_byte = [], []
        for folder in folders:
            try:
                m = json.loads((folder / "manifest.json").read_text())
                t, size = m["build_seconds"], m["files"]["weights.irpa"]
                fixed.append(float(t.get("export", 0)) + float(t.get("compile", 0)))
                if size > 0:
                    per_byte.append(float(t.get("save", 0)) / size)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        if not fixed:
            return BuildTimes()
        return BuildTimes(max(fixed), statistics.median(per_byte) if per_byte else BuildTimes.per_byte_s)

    def first_build(self, size_bytes: int) -> str:
        seconds = self.fixed_s + self.per_byte_s * size_bytes
        return f"first build about {max(1, round(seconds / 60))} min"

    def weights_only(self, size_bytes: int) -> str:
        """A model whose shape is built here: its build takes that module and writes only its weights."""
        return f"weights only, about {_clock(self.per_byte_s * size_bytes + WEIGHTS_ONLY_FIXED_S)}"


def choices(recent: list[str], entries: list[Any], found: list[Any], current: str,
            built: set[str] | frozenset[str] = frozenset(), times: BuildTimes = BuildTimes(),
            shaped: set[str] | frozenset[str] = frozenset()) -> list[ModelChoice]:
    """Every model to offer, recent first, each once (by its spec). `built`: the specs whose build for the
    current settings is in the cache; `shaped`: those whose build would take a module built before (ModelCatalog
    works both out)."""
    from engine.checkpoint import DEFAULT_MODEL

    out: dict[str, ModelChoice] = {}

    def add(choice: ModelChoice) -> None:
        key = choice.spec or DEFAULT_MODEL
        if key not in out:
            out[key] = choice

    def state(spec: str, size: int = 0) -> str:
        if spec in built:
            return "built"
        return times.weights_only(size) if spec in shaped else times.first_build(size)

    for spec in [current, *recent]:
        remote = spec.startswith(("http://", "https://"))
        add(ModelChoice(spec, _name(spec) or DEFAULT_MODEL, "remote server" if remote else state(spec)))
    add(ModelChoice("", DEFAULT_MODEL, "llama · 135M · q4 · " + state("")))
    for f in found:
        bits = [b for b in (f.family, f.params, f.weights, _size(f.size_bytes)) if b]
        add(ModelChoice(str(f.path), f.name, " · ".join(bits + ([state(str(f.path), f.size_bytes)] if f.runnable else []))
                        + f" · {f.source}", f.runnable, f.reason))
    for e in entries:
        if getattr(e, "state", "ready") == "ready" and e.model not in {c.label for c in out.values()}:
            add(ModelChoice(e.model, e.model, "built (another build's settings)"))
    return list(out.values())


def _specs_where(specs: list[str], holds: Callable[[Any], bool]) -> set[str]:
    """The local `specs` whose model (a ModelSource) `holds`; one that cannot be resolved or read does not."""
    from engine.checkpoint import resolve_model

    out = set()
    for spec in specs:
        if spec.startswith(("http://", "https://")):
            continue
        try:
            if holds(resolve_model(spec or None)):
                out.add(spec)
        except Exception:
            continue
    return out


def built_specs(specs: list[str], settings: Any) -> set[str]:
    """Which of `specs` have their build for `settings` in the artefact cache (the key hashes a file's first
    and last MiB: cheap even for a large GGUF)."""
    from engine.artefacts.store import artefact_dir

    return _specs_where(specs, lambda source: artefact_dir(source, settings).is_dir())


def shaped_specs(specs: list[str], settings: Any) -> set[str]:
    """Which of `specs` would build by taking a module built before: a fine-tune of a model built here
    (engine.artefacts.store.takes_a_built_module)."""
    from engine.artefacts.store import takes_a_built_module

    return _specs_where(specs, lambda source: takes_a_built_module(source, settings))


def _clock(seconds: float) -> str:
    s = max(1, round(seconds))
    return f"{s} s" if s < 60 else f"{s // 60}:{s % 60:02d} min"


def _name(spec: str) -> str:
    if spec.startswith(("http://", "https://")):
        return spec
    return Path(spec).name if ("/" in spec or spec.endswith(".gguf")) else spec


def _size(n: int) -> str:
    if not n:
        return ""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


class ModelCatalog(QObject):
    """Finds the models in the background (the cache and a bounded scan of the disk); `ready` hands them over."""

    # (cache entries, found models, the specs built for the settings, BuildTimes, the specs whose shape is built)
    ready = Signal(object, object, object, object, object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.folders: list[Path] = []
        self._busy = False
        self._again: tuple[list[str], Any] | None = None
        self.ready.connect(self._next)

    def refresh(self, specs: list[str] = (), settings: Any = None) -> None:
        """Finds the models again; `specs` (recent ones) are checked for a build with `settings` too."""
        if self._busy:
            self._again = (list(specs), settings)  # asked during a scan: once more when it ends, with these
            return
        self._busy, self._again = True, None
        threading.Thread(target=self._scan, args=(list(specs), settings), name="model-scan", daemon=True).start()

    def _scan(self, specs: list[str], settings: Any) -> None:
        entries: list = []
        found: list = []
        try:
            from engine.artefacts.cache import list_entries

            entries = list_entries()
        except Exception:  # an unreadable cache offers fewer models; the picker still works
            pass
        try:
            from engine.discover import scan

            found = scan(extra_folders=self.folders, time_limit_s=SCAN_SECONDS)
        except Exception:
            pass
        built: set[str] = set()
        shaped: set[str] = set()
        if settings is not None:
            candidates = ["", *specs, *(str(f.path) for f in found if f.runnable)]
            built = built_specs(candidates, settings)
            shaped = shaped_specs([s for s in candidates if s not in built], settings)
        self.ready.emit(entries, found, built, BuildTimes.of([e.folder for e in entries]), shaped)

    def _next(self, *_: object) -> None:  # on the GUI thread, after each scan
        self._busy = False
        again, self._again = self._again, None
        if again is not None:
            self.refresh(*again)


class ModelPicker(QComboBox):
    """The combo box itself: picking a runnable model emits `picked(spec)`."""

    picked = Signal(str)
    opened = Signal()  # the list is about to show: a fresh scan fills it in as it ends

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Model")
        self.setToolTip("The model this chat talks to: pick another to switch (the chat stays)")
        # As wide as a model's name, not as its whole line: the list that opens is as wide as it needs.
        self.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(16)
        self.items = QStandardItemModel(self)
        self.setModel(self.items)
        self.choices: list[ModelChoice] = []
        self._quiet = False
        self.activated.connect(self._activated)

    def set_choices(self, items: list[ModelChoice], current: str) -> None:
        self._quiet = True
        try:
            self.items.clear()
            self.choices = list(items)
            for c in self.choices:
                item = QStandardItem(f"{c.label}  —  {c.detail}" if c.detail else c.label)
                item.setToolTip(c.reason or (c.spec or "the default model, inside Eddy"))
                if not c.runnable:
                    item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEnabled)  # greyed, with why in its tooltip
                    item.setText(f"{c.label}  —  can't run: {c.reason}")
                self.items.appendRow(item)
            at = next((i for i, c in enumerate(self.choices) if c.spec == current), 0)
            self.setCurrentIndex(at)
            metrics = self.view().fontMetrics()
            widest = max((metrics.horizontalAdvance(self.items.item(i).text()) for i in range(self.items.rowCount())),
                         default=0)
            self.view().setMinimumWidth(min(widest + 40, 900))
        finally:
            self._quiet = False

    def showPopup(self) -> None:  # noqa: N802 (Qt API)
        self.opened.emit()
        super().showPopup()

    def _activated(self, index: int) -> None:
        if self._quiet or not 0 <= index < len(self.choices):
            return
        choice = self.choices[index]
        if choice.runnable:
            self.picked.emit(choice.spec)
