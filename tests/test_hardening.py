"""Issue 42: a killed build leaves nothing running or behind, a template cannot take all memory by growing a
string, and bad command-line input gets one clear sentence."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT

# --- a build dies with the process that asked for it -----------------------------------------------------------

# A capacity no other test builds, so the build is never found warm.
KILL_SETTINGS = "BuildSettings(sinks=2, window=26, dtype='f32', max_chunk=8)"

PARENT = (
    "import sys\n"
    "from engine.build.artefacts import ensure_artefacts\n"
    "from engine.build.checkpoint import resolve_model\n"
    "from engine.config import BuildSettings\n"
    "def report(stage, fraction, detail=''):\n"
    "    print(stage, flush=True)\n"
    f"ensure_artefacts(resolve_model('tiny-random'), {KILL_SETTINGS}, report)\n"
)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig, stage", [(signal.SIGTERM, "compiling"), (signal.SIGKILL, "exporting")])
def test_a_killed_parent_takes_its_build_and_compiler_with_it(tmp_path: Path, sig: int, stage: str) -> None:
    env = dict(os.environ, EDDY_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in parent.stdout:
            if line.strip() == stage:
                break
        else:
            pytest.fail(f"the build ended before {stage}: {parent.wait()}")
        me = psutil.Process(parent.pid)
        want = "iree-compile" if stage == "compiling" else "engine.build.process"
        deadline = time.monotonic() + 20
        while not any(want in " ".join(p.cmdline()) for p in _alive(me.children(recursive=True))):
            assert time.monotonic() < deadline, f"no {want} process appeared"
            time.sleep(0.05)
        build = me.children(recursive=True)
        os.kill(parent.pid, sig)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _alive(build) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(build), f"outlived their parent: {[p.cmdline()[:3] for p in _alive(build)]}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()

    from engine.build.cache import list_entries

    root = tmp_path / "artefacts"
    staging = [p for p in root.iterdir() if ".building-" in p.name]
    assert staging, "the killed build left no staging folder: the test did not test the sweep"
    assert list_entries(root) == [] and not any(p.exists() for p in staging)


def _fake_entry(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "weights.irpa").write_bytes(b"x" * 10)
    return folder


def test_a_dead_builds_staging_folder_is_swept_and_never_makes_a_key_ambiguous(tmp_path: Path, capsys,
                                                                              monkeypatch) -> None:
    from engine.build.cache import find, list_entries
    from engine.cli import main

    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path))
    tmp_path = tmp_path / "artefacts"
    tmp_path.mkdir()
    key = "0123456789abcdef0123"
    built = _fake_entry(tmp_path, f"tiny-random-f32-2+26-{key}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = _fake_entry(tmp_path, f"{built.name}.building-{dead.pid}")
    # A live build of the same key (this process's) is listed as building, not swept, and not chosen by a key.
    live = _fake_entry(tmp_path, f"{built.name}.building-{os.getpid()}")
    assert find(key[:6], tmp_path).folder == built
    assert not stale.exists() and live.exists()
    assert {e.state for e in list_entries(tmp_path)} == {"damaged", "building"}
    assert main(["cache", "rm", key[:6]]) == 0
    assert not built.exists() and live.exists()
    assert "ambiguous" not in capsys.readouterr().err
