"""The artefact cache as users manage it: `eddy cache list` and `eddy cache rm`, the lock that keeps a loaded
entry from being deleted, and the refusal of a build the disk has no room for, before anything is written."""
from __future__ import annotations

import gc
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from conftest import TINY_SETTINGS
from engine import cli
from engine.errors import DiskSpaceError

FAKE_KEY = "0123456789abcdef0123"


def _cache_with_copies(tiny, tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A private cache holding two copies of the tiny entry (the real one's name, and one with another key)."""
    cache = tmp_path / "cache"
    root = cache / "artefacts"
    root.mkdir(parents=True)
    real = root / tiny.folder.name
    shutil.copytree(tiny.folder, real)
    other = root / f"tiny-random-f32-4+60-{FAKE_KEY}"
    shutil.copytree(tiny.folder, other)
    monkeypatch.setenv("EDDY_CACHE_DIR", str(cache))
    return root, real, other


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cache_list_shows_each_build_with_its_size_and_rm_deletes_it(tiny, tmp_path, monkeypatch, capsys):
    root, real, other = _cache_with_copies(tiny, tmp_path, monkeypatch)
    code, out, _ = _run(capsys, "cache", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["KEY", "MODEL", "BUILD"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {real.name[-20:][:12], FAKE_KEY[:12]}
    row = rows[FAKE_KEY[:12]]
    assert "tiny-random" in row and "f32, 4 sinks + 60 window, chunk 16, cpu" in row and row.endswith(str(other))
    weights = (other / "weights.irpa").stat().st_size
    size_mb = float(row.split("window, chunk 16, cpu")[1].split("MB")[0])
    assert size_mb * 1e6 >= weights * 0.9  # the entry's size on disk, weights and all
    assert lines[-1].startswith("2 cached builds,") and lines[-1].endswith(f"in {root}")

    code, out, _ = _run(capsys, "cache", "rm", FAKE_KEY[:6])
    assert code == 0 and out.startswith(f"deleted {FAKE_KEY[:12]}") and "freed" in out
    assert not other.exists() and real.is_dir()
    code, out, _ = _run(capsys, "cache", "list")
    assert FAKE_KEY[:12] not in out and out.splitlines()[-1].startswith("1 cached build,")


def test_the_listing_names_a_kv_cache_type_only_when_it_is_not_the_weight_types_own():
    from engine.artefacts.cache import settings_summary

    assert settings_summary({"dtype": "q4", "kv_dtype": "f16"}) == "q4, 4 sinks + 1020 window, cpu"
    assert settings_summary({"dtype": "f32", "kv_dtype": "f32"}) == "f32, 4 sinks + 1020 window, cpu"
    assert settings_summary({"dtype": "q4", "kv_dtype": "f32"}) == "q4, 4 sinks + 1020 window, KV cache f32, cpu"
    gpu = {"device": "cuda", "gpu_target": "sm_89"}
    assert settings_summary({"dtype": "q4", "kv_dtype": "f32", **gpu}) == "q4, 4 sinks + 1020 window, cuda sm_89"
    assert settings_summary({"dtype": "q4", "kv_dtype": "f16", **gpu}) == \
        "q4, 4 sinks + 1020 window, KV cache f16, cuda sm_89"


def test_cache_rm_of_an_unknown_key_is_a_clear_error(tiny, tmp_path, monkeypatch, capsys):
    root, real, other = _cache_with_copies(tiny, tmp_path, monkeypatch)
    code, _, err = _run(capsys, "cache", "rm", "nonexistent")
    assert code == 1 and 'no cached build matches "nonexistent"' in err
    code, _, err = _run(capsys, "cache", "rm", "01")
    assert code == 1 and "too short" in err
    code, _, err = _run(capsys, "cache", "rm")
    assert code == 1 and "--all" in err
    assert real.is_dir() and other.is_dir()  # nothing deleted by a bad request


def test_an_entry_a_running_eddy_has_loaded_is_not_deleted(tiny, tmp_path, monkeypatch, capsys):
    from engine.loader import open_folder

    root, real, other = _cache_with_copies(tiny, tmp_path, monkeypatch)
    loaded = open_folder(other)  # as the app or eddy serve holds it
    code, out, _ = _run(capsys, "cache", "list")
    assert "tiny-random (in use)" in next(line for line in out.splitlines() if line.startswith(FAKE_KEY[:12]))
    code, _, err = _run(capsys, "cache", "rm", FAKE_KEY)
    assert code == 1 and "loaded by a running Eddy" in err and other.is_dir()
    code, out, err = _run(capsys, "cache", "rm", "--all")
    assert code == 0 and "kept:" in err and other.is_dir() and not real.exists()
    assert loaded.chat().answer("hi").tokens > 0  # the model it kept still runs
    del loaded
    gc.collect()
    code, out, _ = _run(capsys, "cache", "rm", FAKE_KEY)
    assert code == 0 and not other.exists()


def test_cache_rm_never_follows_a_symlink_out_of_the_cache(tiny, tmp_path, monkeypatch, capsys):
    root, real, other = _cache_with_copies(tiny, tmp_path, monkeypatch)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (root / f"tiny-random-f32-4+60-{'f' * 20}").symlink_to(outside, target_is_directory=True)
    (other / "link-out").symlink_to(outside / "keep.txt")
    code, out, _ = _run(capsys, "cache", "list")
    assert "f" * 12 not in out  # a symlink is no entry of the cache
    code, _, err = _run(capsys, "cache", "rm", "f" * 12)
    assert code == 1 and "no cached build matches" in err
    code, out, _ = _run(capsys, "cache", "rm", "--all")
    assert code == 0 and not real.exists() and not other.exists()
    assert (outside / "keep.txt").read_text() == "mine"


DiskUsage = namedtuple("DiskUsage", "total used free")


def test_a_build_the_disk_has_no_room_for_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDDY_CACHE_DIR", str(cache))
    asked = []

    def full_disk(path):
        asked.append(Path(path))
        return DiskUsage(10**12, 10**12 - 1000, 1000)

    monkeypatch.setattr(shutil, "disk_usage", full_disk)
    code, _, err = _run(capsys, "compile", "--model", "tiny-random", "--sinks", "3", "--window", "30",
                        "--dtype", "f32")
    assert code == 1
    assert "Not enough disk space to build tiny-random" in err
    assert str(cache / "artefacts") in err and "(1,000 bytes) is free" in err
    needed = int(err.split("about ")[1].split("(")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 12_000_000  # at least tiny-random's f32 weights
    assert asked and all(cache in (p, *p.parents) for p in asked)
    assert not (cache / "artefacts").exists() or not any((cache / "artefacts").iterdir()), "a file was written"


@pytest.mark.parametrize("dtype", ["f32", "q4"])
def test_the_room_estimate_is_the_weights_file_of_a_real_build(tiny, dtype):
    from dataclasses import replace

    from engine.artefacts.store import read_manifest
    from engine.artefacts.room import build_size, weights_bytes
    from engine.config import ModelConfig
    from engine.loader import open_model

    settings = replace(TINY_SETTINGS, dtype=dtype)
    # The q4 build is the one test_engine.py's q4 tests make (one cache for the session).
    folder = tiny.folder if settings == TINY_SETTINGS else open_model("tiny-random", settings).folder
    manifest = read_manifest(folder)
    cfg = ModelConfig(**manifest["config"])
    actual = manifest["files"]["weights.irpa"]["size"]
    estimate = weights_bytes(cfg, settings)
    # The file adds a header, names and 64-byte alignment to the tensors' bytes: within 4 KiB per tensor.
    assert estimate <= actual <= estimate + 4096 * 64
    size = build_size(cfg, settings)
    built = sum(f["size"] for f in manifest["files"].values())
    assert size.total > built
