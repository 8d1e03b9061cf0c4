"""What a build reports while it runs, shared by the build, its child process and every display of it.

A report is (stage, fraction, detail): the stage's name (STAGES, then "done"), the fraction of the whole build
done so far, and a short line for people saying what the stage is at ("tensor 12 of 272", or "" when it has
nothing to count). Torch-free: the app and the terminal import it."""
from __future__ import annotations

from typing import Protocol

# In the order a build runs them (engine.build.export.build reports these names).
STAGES = ("loading weights", "exporting", "saving weights", "compiling")


class Progress(Protocol):
    def __call__(self, stage: str, fraction: float, detail: str = "") -> None: ...


def ignore(stage: str, fraction: float, detail: str = "") -> None:
    """A Progress for callers that show nothing."""


# The exporting stage's detail when the build copies an export kept from a build of the same model shape and
# settings (engine.build.export.kept_export): seconds instead of minutes.
REUSED_EXPORT = "reusing the export of a model of the same shape"


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


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"
