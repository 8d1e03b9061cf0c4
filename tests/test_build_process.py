"""Builds run in a child process: Cancel ends them at once in any stage, errors keep their class, the process
that asked for the build never imports torch, and it hears each tensor written and the compiler's time."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import ROOT
from engine.config import BuildSettings
from engine.errors import BuildCancelled, ModelError

# A capacity no other test builds, so these builds never find a warm entry.
SETTINGS = BuildSettings(sinks=2, window=22, dtype="f32", max_chunk=8)


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# "saving weights" cancels once the child has said a tensor is written: while the weights file is being filled.
CANCEL_AT = {"exporting": r"", "saving weights": r"tensor [1-9]", "compiling": r""}


@pytest.mark.parametrize("stage", list(CANCEL_AT))
def test_cancel_stops_the_build_at_once_in_any_stage(tmp_path: Path, monkeypatch, stage: str) -> None:
    from engine.artefacts.store import artefact_dir, ensure_artefacts
    from engine.checkpoint import resolve_model

    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path))
    source = resolve_model("tiny-random")
    seen: list[tuple[str, str]] = []
    asked: list[float] = []

    def cancel() -> bool:
        if not asked and any(s == stage and re.match(CANCEL_AT[stage], d) for s, d in seen):
            asked.append(time.perf_counter())
        return bool(asked)

    with pytest.raises(BuildCancelled):
        ensure_artefacts(source, SETTINGS, lambda s, f, d: seen.append((s, d)), cancel)
    assert asked, f"the build never reached {stage}"
    took = time.perf_counter() - asked[0]
    assert took < 3.0, f"the build went on for {took:.1f} s after Cancel"
    assert not _children(), "a build process outlived the cancel"
    folder = artefact_dir(source, SETTINGS)
    assert not folder.exists() and not list(folder.parent.glob("*.building-*")), "a partial entry was left"


def test_builds_that_differ_only_in_the_cpu_share_one_export(tmp_path: Path, monkeypatch) -> None:
    """The package builds the default model for two CPU levels, and the suite builds it for this one: one export
    (minutes for a real model) serves them all, and each build still compiles for its own CPU."""
    from engine.artefacts.store import ensure_artefacts, read_manifest
    from engine.checkpoint import resolve_model
    from engine.artefacts.progress import REUSED_EXPORT

    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path))
    source = resolve_model("tiny-random")
    folders, details = [], []
    for target in ("host", "x86-64-v3", "host"):
        seen: list[str] = []
        settings = BuildSettings(sinks=2, window=22, dtype="f32", max_chunk=8, target_cpu=target)
        folders.append(ensure_artefacts(source, settings, lambda s, f, d: seen.append(d) if s == "exporting" else None))
        details.append(seen)
    assert details[0] and REUSED_EXPORT not in details[0]  # the first build exported
    assert REUSED_EXPORT in details[1]  # the second, for another CPU, copied that export
    assert details[2] == [] and folders[2] == folders[0]  # the first entry found again: nothing built
    assert len(list((tmp_path / "exports").glob("*.mlir"))) == 1
    assert folders[0] != folders[1]
    assert [read_manifest(f)["settings"]["target_cpu"] for f in folders[:2]] == ["host", "x86-64-v3"]
    from engine.loader import open_folder

    host, portable = (open_folder(f, source).engine for f in folders[:2])
    assert np.allclose(host.prefill([5, 6, 7]), portable.prefill([5, 6, 7]), atol=1e-4)
    # Another shape or other settings are another export.
    ensure_artefacts(source, BuildSettings(sinks=2, window=30, dtype="f32", max_chunk=8))
    assert len(list((tmp_path / "exports").glob("*.mlir"))) == 2


def test_a_model_of_a_shape_built_before_takes_its_module_and_writes_only_its_weights(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """A fine-tune, or another file of a model already built here, has the module of that build: no export and no
    compiler run, the module file is the same (a hard link), and the logits are the new weights' own (transformers'
    class on them). Another CPU or other settings compile their own."""
    import torch
    from dataclasses import replace
    from safetensors.torch import save_file

    from conftest import transformers_model
    from engine.artefacts.progress import REUSED_MODULE
    from engine.artefacts.store import ensure_artefacts, read_manifest, takes_a_built_module
    from engine.checkpoint import load_state_dict, read_config, resolve_model, save_tokenizer
    from engine.config import ModelConfig
    from engine.artefacts.export_code import module_key
    from engine.loader import open_folder

    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path / "cache"))
    tiny = resolve_model("tiny-random")
    cfg, state = read_config(tiny), load_state_dict(tiny)
    first = ensure_artefacts(tiny, SETTINGS)
    # The same shape, other weights: a Hugging Face folder, as a fine-tune comes.
    tuned = {k: v * torch.linspace(0.5, 1.5, v.shape[-1]) for k, v in state.items()}
    folder = tmp_path / "tuned"
    save_tokenizer(resolve_model(None), folder)
    chat = json.loads((folder / "chat.json").read_text())
    (folder / "chat.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": chat["bos_token"], "eos_token": chat["eos_token"], "chat_template": chat["chat_template"]}))
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    save_file(tuned, str(folder / "model.safetensors"))
    source = resolve_model(str(folder))
    # What the model picker says of it before it is built: its build is its weights.
    assert takes_a_built_module(source, SETTINGS) and not takes_a_built_module(source, replace(SETTINGS, window=30))
    reports: list[tuple[str, str]] = []
    second = ensure_artefacts(source, SETTINGS, lambda s, f, d: reports.append((s, d)))

    assert second != first
    assert ("exporting", REUSED_MODULE) in reports
    assert not any(d.startswith("iree-compile running") for _, d in reports)  # the compiler never ran
    manifests = [read_manifest(f) for f in (first, second)]
    assert manifests[0]["module_key"] == manifests[1]["module_key"] and "compile" not in manifests[1]["build_seconds"]
    a, b = (os.stat(f / "module.vmfb") for f in (first, second))
    assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
    ids = [5, 6, 7, 8, 9]
    old, new = (open_folder(f, s).engine.prefill(ids) for f, s in ((first, tiny), (second, source)))
    with torch.no_grad():
        want = transformers_model(cfg, tuned)(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(new - want).max() < 1e-4 and np.abs(old - want).max() > 1e-2
    # What iree-compile is told is in the key: another CPU, other settings, another module.
    model_cfg = ModelConfig.from_hf(cfg)
    keys = {module_key(model_cfg, s) for s in (SETTINGS, replace(SETTINGS, target_cpu="x86-64-v3"),
                                               replace(SETTINGS, window=30))}
    assert len(keys) == 3


def test_an_engine_error_in_the_child_arrives_as_the_same_class(tmp_path: Path) -> None:
    from engine.exporter.process import build_in_child
    from engine.checkpoint import ModelSource

    with pytest.raises(ModelError, match="unknown checkpoint kind"):
        build_in_child(ModelSource("nonsense", "no-such-kind", None), SETTINGS, tmp_path)
    assert not _children()


def test_the_process_that_asks_for_a_build_never_imports_torch(tmp_path: Path) -> None:
    """One real build, watched from a process without torch: what it imports, and every progress report."""
    code = (
        "import json, sys\n"
        "from engine.artefacts.store import ensure_artefacts\n"
        "from engine.checkpoint import resolve_model\n"
        "from engine.config import BuildSettings\n"
        "reports = []\n"
        "ensure_artefacts(resolve_model('tiny-random'), BuildSettings(sinks=2, window=22, dtype='f32', max_chunk=8),\n"
        "                 lambda stage, fraction, detail: reports.append([stage, fraction, detail]))\n"
        "loaded = [m for m in ('torch', 'iree.turbine', 'iree.compiler', 'transformers') if m in sys.modules]\n"
        "print(json.dumps({'imported': loaded, 'reports': reports}))\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    env = dict(os.environ, EDDY_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    reports = json.loads(run.stdout.splitlines()[-1])["reports"]
    stages = [s for s, _, _ in reports]
    # The weights file is written beside the export and the compiler: its reports come between theirs.
    assert stages[0] == "loading weights" and stages[-1] == "done"
    assert sorted(set(stages[1:-1])) == ["compiling", "exporting", "saving weights"]
    assert stages.index("exporting") < stages.index("compiling")
    fractions = [f for _, f, _ in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    for stage in ("exporting", "saving weights", "compiling"):  # each says once that it is over
        assert [d for s, _, d in reports if s == stage][-1].startswith("done in ")
    weights = [d for s, _, d in reports if s == "saving weights"][:-1]
    counts = [tuple(map(int, re.match(r"tensor (\d+) of (\d+), ", d).groups())) for d in weights]
    total = counts[0][1]
    assert total > 5 and counts == [(i, total) for i in range(1, total + 1)]  # every tensor, in order
    done_mb, all_mb = re.search(r", ([\d.]+) MB of ([\d.]+) MB$", weights[-1]).groups()
    assert done_mb == all_mb and float(all_mb) > 1
    compiling = [d for s, _, d in reports if s == "compiling"][:-1]
    assert compiling and all(d.startswith("iree-compile running for ") for d in compiling)


def test_the_build_clock_counts_the_longer_of_the_two_halves_and_each_part_s_own_rate() -> None:
    """The export and the compiler run beside the weights file: the time left is the longer path's, a part that
    reports its share (the weights' bytes) is timed by its own rate, and the fraction never goes back."""
    from engine.artefacts.progress import BuildClock, Expected, time_left

    now = [0.0]
    clock = BuildClock({"export": 10, "compile": 8, "save": 30, "tokenizer": 2}, now=lambda: now[0])
    assert clock.left() == 32  # the weights path (30 + 2) is longer than export + compile (18)
    clock.begin("export")
    clock.begin("save")
    now[0] = 5
    clock.share("save", 0.5)  # half the bytes in 5 s: 5 s more, not the 25 expected
    assert clock.left() == 5 + 8  # now the export (5 s of its 10 left) and the compiler lead
    f = clock.fraction()
    assert abs(f - 5 / (5 + 13)) < 1e-9
    now[0] = 30  # the export runs long: past its estimate a tenth of its time stands in for what is left
    clock.share("save", 0.95)
    assert abs(clock.left() - (0.1 * 30 + 8)) < 1e-9
    clock.end("export")
    clock.share("save", 0.1)  # a late, smaller share does not move the bar back
    assert clock.fraction() >= f
    assert time_left(0.6, 30) == "about 0:20 left" and time_left(0.0, 5) == ""
    manifests = [{"build_seconds": {"export": 16.0, "compile": 8.0, "save": 10.0, "tokenizer": 1.5},
                  "config": {"n_layers": 16}, "files": {"weights.irpa": {"size": 10 ** 9}}},
                 {"build_seconds": {"export": 0.01, "compile": 8.0, "save": 10.0},  # an export reused
                  "config": {"n_layers": 16}, "files": {"weights.irpa": {"size": 10 ** 9}}},
                 {"build_seconds": {"export": 0.01, "save": 10.0},  # a module reused: no compiler ran
                  "config": {"n_layers": 16}, "files": {"weights.irpa": {"size": 10 ** 9}}}, {"broken": True}]
    e = Expected.from_manifests(manifests)
    assert (e.export_per_layer_s, e.compile_per_layer_s, e.save_per_byte_s, e.tokenizer_s) == (0.875, 0.25, 1e-8, 1.5)
    assert e.seconds(16, 10 ** 9, False) == {"export": 16.0, "compile": 8.0, "save": 11.0, "tokenizer": 1.5}
    assert e.seconds(16, 10 ** 9, True)["export"] == 0.5
    assert e.seconds(16, 10 ** 9, True, reused_module=True) == {"export": 0.1, "compile": 0.0, "save": 11.0,
                                                                 "tokenizer": 1.5}


def test_a_gpu_builds_expected_time_counts_its_programs():
    """A GPU build traces and compiles a prefill and a decode per call shape (engine/shapes.py), where a CPU build
    has one of each: its layers count that many times over, in what it is expected to take and in what its time
    says of the next build's."""
    from dataclasses import replace

    from conftest import TINY_SETTINGS

    from engine.artefacts.progress import Expected, traced_layers
    from engine.config import ModelConfig

    config = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                         intermediate=128).to_dict()
    vulkan = replace(TINY_SETTINGS, device="vulkan", gpu_target="llvmpipe")
    # chunks (4, 16) x buckets (16, 32, 64), and a decode per bucket: 9 programs where the CPU's have 2
    assert traced_layers(config, vulkan.to_dict()) == 2 * 9 / 2
    assert traced_layers(config, TINY_SETTINGS.to_dict()) == 2
    assert traced_layers(config, replace(vulkan, gpu_target="vp_android_baseline_2022").to_dict()) == 2  # dynamic
    assert traced_layers(config, None) == 2 and traced_layers(config, {"old": 1}) == 2
    built = {"build_seconds": {"export": 2.0 + 9.0, "compile": 4.0 + 18.0, "save": 1.0}, "config": config,
             "settings": vulkan.to_dict(), "files": {"weights.irpa": {"size": 10}}}
    e = Expected.from_manifests([built])
    assert (e.export_per_layer_s, e.compile_per_layer_s) == (1.0, 2.0)
