"""What a build reports while it runs, shared by the build, its child process and every display of it.

A report is (stage, fraction, detail): the stage's name (STAGES, then "done"), the fraction of the whole build
done so far, and a short line for people saying what the stage is at ("tensor 12 of 272", or "" when it has
nothing to count; `finished(seconds)` once it is over). The weights are written while the export and the
compiler run (engine/exporter/side_job.py), so reports of "saving weights" come between the others'; the fraction is
of the build's expected time (BuildClock), so a display can tell the time left from it and the time so far.
Torch-free: the app and the terminal import it."""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from ..config import BuildSettings, ModelConfig
from ..shapes import call_shapes

# In the order a build starts them (engine.exporter.export.build reports these names); "saving weights" runs
# beside "exporting" and "compiling".
STAGES = ("loading weights", "exporting", "saving weights", "compiling")
FINISHED = "done in "


class Progress(Protocol):
    def __call__(self, stage: str, fraction: float, detail: str = "") -> None: ...


def ignore(stage: str, fraction: float, detail: str = "") -> None:
    """A Progress for callers that show nothing."""


# The exporting stage's detail when the build copies an export kept from a build of the same model shape and
# settings (engine.exporter.export.kept_export): seconds instead of minutes.
REUSED_EXPORT = "reusing the export of a model of the same shape"
# Its detail when the build takes the compiled module of an earlier build of the same shape and settings for this
# device (engine.artefacts.store.built_module): no export and no compiler, only the weights file.
REUSED_MODULE = "reusing the compiled module of a model of the same shape"


def megabytes(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    if n < 1e5:
        return f"{n / 1e3:,.0f} kB"
    return f"{n / 1e6:,.1f} MB" if n < 1e7 else f"{n / 1e6:,.0f} MB"


def weights_detail(done: int, total: int, bytes_done: int, bytes_total: int) -> str:
    if bytes_total <= 0:
        return f"tensor {done} of {total}"
    return f"tensor {done} of {total}, {megabytes(bytes_done)} of {megabytes(bytes_total)}"


def compile_detail(elapsed_s: float, expected_s: float) -> str:
    # iree-compile reports nothing while it runs: the time is all there is, and the bar is an estimate.
    if elapsed_s <= expected_s:
        return f"iree-compile running for {_clock(elapsed_s)} (about {_clock(expected_s)} expected)"
    # The estimate only counts layers: a busy or slower machine outruns it, and the bar then waits at 99%.
    return f"iree-compile running for {_clock(elapsed_s)} (longer than the {_clock(expected_s)} estimated)"


def finished(seconds: float) -> str:
    """The last detail a stage reports."""
    return f"{FINISHED}{_clock(seconds)}"


def time_left(fraction: float, elapsed_s: float) -> str:
    """"about 0:18 left" from a report's fraction (of the build's expected time) and the time since it started."""
    if fraction <= 0.02 or fraction >= 1.0:
        return ""
    return f"about {_clock(elapsed_s * (1 - fraction) / fraction + 0.5)} left"


@dataclass(frozen=True)
class Expected:
    """Seconds this machine is expected to take: the export and iree-compile, a fixed part and a part per layer;
    the weights file per byte; the tokenizer. Fitted to the builds this machine has made (`from_manifests`); the
    defaults are a 2-core Zen 5's (the default model's 30 layers: export 21 s, compile 11 s)."""
    export_per_layer_s: float = 0.65
    compile_per_layer_s: float = 0.3
    save_per_byte_s: float = 1.5e-8
    tokenizer_s: float = 2.0

    EXPORT_FIXED_S = 2.0
    COMPILE_FIXED_S = 4.0

    @staticmethod
    def from_manifests(manifests: Iterable[dict]) -> "Expected":
        export, compile_, save, tokenizer = [], [], [], []
        for m in manifests:
            try:
                t, layers = m["build_seconds"], traced_layers(m["config"], m.get("settings"))
                size = int(m["files"]["weights.irpa"]["size"])
                if float(t.get("export", 0)) > 1.0:  # a reused export says nothing of the trace's speed
                    export.append(max(0.0, float(t["export"]) - Expected.EXPORT_FIXED_S) / layers)
                if "compile" in t:  # none where the module was reused
                    compile_.append(max(0.0, float(t["compile"]) - Expected.COMPILE_FIXED_S) / layers)
                if size > 1 << 24:  # a tiny model's file is all fixed cost
                    save.append(float(t["save"]) / size)
                if "tokenizer" in t:
                    tokenizer.append(float(t["tokenizer"]))
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                continue
        d = Expected()
        pick = lambda xs, default: statistics.median(xs) if xs else default  # noqa: E731
        return Expected(pick(export, d.export_per_layer_s), pick(compile_, d.compile_per_layer_s),
                        pick(save, d.save_per_byte_s), pick(tokenizer, d.tokenizer_s))

    def seconds(self, layers: float, weights_bytes: int, reused_export: bool,
                reused_module: bool = False) -> dict[str, float]:
        """BuildClock's expected seconds for a build of `layers` layers (traced_layers) writing `weights_bytes`; one
        that takes a module built before runs neither the export nor the compiler."""
        export = self.EXPORT_FIXED_S + self.export_per_layer_s * layers
        return {"export": 0.1 if reused_module else 0.5 if reused_export else export,
                "compile": 0.0 if reused_module else self.COMPILE_FIXED_S + self.compile_per_layer_s * layers,
                "save": 1.0 + self.save_per_byte_s * weights_bytes, "tokenizer": self.tokenizer_s}


def traced_layers(config: dict, settings: dict | None) -> float:
    """A build's layers weighted by the prefill and decode programs it traces and compiles: a dynamic build's two
    count as its layers, a GPU build's one per call shape (engine/shapes.py: 16 for the default model) as eight
    times them. What the export and iree-compile take grows with both."""
    layers = int(config["n_layers"])
    try:
        shapes = call_shapes(ModelConfig(**config), BuildSettings(**settings)) if settings else None
    except (TypeError, ValueError, KeyError):  # a manifest of an older layout: as a dynamic build
        shapes = None
    return layers * (len(shapes.programs()) / 2 if shapes else 1)


class BuildClock:
    """The parts of a build as they run side by side (export then compile; the weights file then the tokenizer
    beside them) and the time left: each running part's rate where it reports one (the weights' bytes), else
    what was expected of it less its time so far. `fraction()` is the time so far over that plus the time
    left, never going back."""

    PATHS = (("export", "compile"), ("save", "tokenizer"))

    def __init__(self, expected_s: dict[str, float], now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._start = now()
        self._expected = dict(expected_s)
        self._began: dict[str, float] = {}
        self._ended: dict[str, float] = {}
        self._share: dict[str, float] = {}
        self._last = 0.0
        self._lock = threading.Lock()

    def expected(self, part: str) -> float:
        return self._expected.get(part, 0.0)

    def begin(self, part: str) -> None:
        with self._lock:
            self._began.setdefault(part, self._now())

    def end(self, part: str) -> float:
        """Marks the part finished; returns its seconds."""
        with self._lock:
            now = self._now()
            self._began.setdefault(part, now)
            self._ended.setdefault(part, now)
            return self._ended[part] - self._began[part]

    def share(self, part: str, done: float) -> None:
        with self._lock:
            self._began.setdefault(part, self._now())
            self._share[part] = min(1.0, max(0.0, done))

    def _left(self, part: str, now: float) -> float:
        if part in self._ended:
            return 0.0
        expected = self._expected.get(part, 0.0)
        if part not in self._began:
            return expected
        spent = now - self._began[part]
        share = self._share.get(part, 0.0)
        if share >= 0.05:
            return spent * (1 - share) / share
        # Past its estimate a part is not done: a tenth of its time so far stands in for what is left.
        return max(expected - spent, 0.1 * spent)

    def left(self) -> float:
        with self._lock:
            now = self._now()
            return max(sum(self._left(p, now) for p in path) for path in self.PATHS)

    def fraction(self) -> float:
        left = self.left()
        with self._lock:
            spent = self._now() - self._start
            f = spent / (spent + left) if spent + left > 0 else 1.0
            self._last = max(self._last, min(f, 0.99))
            return self._last


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"
