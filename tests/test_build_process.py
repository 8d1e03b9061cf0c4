"""Builds run in a child process: Cancel ends them at once in any stage, errors keep their class, and the
process that asked for the build never imports torch."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT
from engine.config import BuildSettings
from engine.errors import BuildCancelled, ModelError

# A capacity no other test builds, so these builds never find a warm entry.
SETTINGS = BuildSettings(sinks=2, window=22, dtype="f32", max_chunk=8)


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("stage", ["exporting", "compiling"])
def test_cancel_stops_the_build_at_once_in_any_stage(tmp_path: Path, monkeypatch, stage: str) -> None:
    from engine.build.artefacts import artefact_dir, ensure_artefacts
    from engine.build.checkpoint import resolve_model

    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path))
    source = resolve_model("tiny-random")
    seen: list[str] = []
    asked: list[float] = []

    def cancel() -> bool:
        if stage in seen and not asked:
            asked.append(time.perf_counter())
        return bool(asked)

    with pytest.raises(BuildCancelled):
        ensure_artefacts(source, SETTINGS, lambda s, f: seen.append(s), cancel)
    took = time.perf_counter() - asked[0]
    assert took < 3.0, f"the build went on for {took:.1f} s after Cancel"
    assert not _children(), "a build process outlived the cancel"
    folder = artefact_dir(source, SETTINGS)
    assert not folder.exists() and not list(folder.parent.glob("*.building-*")), "a partial entry was left"


def test_an_engine_error_in_the_child_arrives_as_the_same_class(tmp_path: Path) -> None:
    from engine.build.process import build_in_child
    from engine.build.checkpoint import ModelSource

    with pytest.raises(ModelError, match="unknown checkpoint kind"):
        build_in_child(ModelSource("nonsense", "no-such-kind", None), SETTINGS, tmp_path)
    assert not _children()


def test_the_process_that_asks_for_a_build_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from engine.build.artefacts import ensure_artefacts\n"
        "from engine.build.checkpoint import resolve_model\n"
        "from engine.config import BuildSettings\n"
        f"ensure_artefacts(resolve_model('tiny-random'), BuildSettings(sinks=2, window=22, dtype='f32', max_chunk=8))\n"
        "loaded = [m for m in ('torch', 'iree.turbine', 'iree.compiler', 'transformers') if m in sys.modules]\n"
        "print('imported:', loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    env = dict(os.environ, EDDY_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
