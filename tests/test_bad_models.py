"""Bad models and damaged artefacts: each gets a clear error (an EddyError with a useful message) or a rebuild.

test_checkpoint.py already checks the messages of resolve_model for most bad checkpoints; here the same
inputs go through the user's paths (open_model, `eddy chat --model BAD`: non-zero exit, one line, no
traceback), pickles are proven never to be unpickled (a pickle that would leave a file behind), and the
artefact cache meets truncated, foreign and stale files.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, TINY_SETTINGS
import engine.artefacts.store as artefacts
from engine.artefacts.store import MANIFEST, artefact_dir, ensure_artefacts, file_digest, read_manifest
from engine.config import BuildSettings
from engine.checkpoint import load_state_dict, read_config, resolve_model, save_tokenizer
from engine.errors import ArtefactError, BuildCancelled, EddyError, ModelError
from engine.loader import open_folder, open_model
from engine.run.session import ChatSettings


class _LeavesAMark:
    """Unpickling this creates a file: proof that someone unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def eddy(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> dict[str, Path]:
    """One of each bad model, and the file a pickle would create if anything unpickled it."""
    root = tmp_path_factory.mktemp("bad-models")
    default = resolve_model(None)
    tiny_cfg = {**read_config(resolve_model("tiny-random")), "model_type": "llama",
                "architectures": ["LlamaForCausalLM"]}
    tok_dir = root / "tok"
    save_tokenizer(default, tok_dir)
    mark = root / "UNPICKLED"

    def hf_folder(name: str, weights: dict[str, bytes], tokenizer: bool = True, cfg: dict | None = None) -> Path:
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg or tiny_cfg))
        if tokenizer:
            shutil.copy(tok_dir / "tokenizer.json", folder / "tokenizer.json")
            chat = json.loads((tok_dir / "chat.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps(
                {"bos_token": chat["bos_token"], "eos_token": chat["eos_token"],
                 "chat_template": chat["chat_template"]}))
        for fname, data in weights.items():
            (folder / fname).write_bytes(data)
        return folder

    from safetensors.numpy import save
    st_bytes = save({"model.embed_tokens.weight": np.zeros((tiny_cfg["vocab_size"], tiny_cfg["hidden_size"]),
                                                           dtype=np.float32)})
    evil = pickle.dumps(_LeavesAMark(mark))
    with open(default.path, "rb") as fh:
        head_of_gguf = fh.read(1 << 20)
    models = {
        "unsupported-architecture": hf_folder("gpt2", {"model.safetensors": st_bytes},
                                              cfg={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
        "truncated-gguf": root / "cut.gguf",
        "truncated-safetensors": hf_folder("cut-st", {"model.safetensors": st_bytes[: len(st_bytes) // 3]}),
        "missing-tokenizer": hf_folder("no-tok", {"model.safetensors": st_bytes}, tokenizer=False),
        "only-pickles": hf_folder("pickles", {"pytorch_model.bin": evil, "model.pt": evil, "optimizer.pt": evil}),
        "pickle-file": root / "weights.pt",
        "not-a-model": root / "notes.txt",
        "empty-folder": root / "empty",
    }
    models["truncated-gguf"].write_bytes(head_of_gguf)
    models["pickle-file"].write_bytes(evil)
    models["not-a-model"].write_text("hello")
    models["empty-folder"].mkdir()
    models["mark"] = mark
    return models


EXPECTED = {
    "unsupported-architecture": r'unsupported architecture "gpt2"',
    "truncated-gguf": r"cut\.gguf: the GGUF file is truncated",
    "truncated-safetensors": r"model\.safetensors: the \.safetensors file is truncated",
    "missing-tokenizer": r"no-tok: missing tokenizer",
    "only-pickles": r"pickled.*only reads safetensors or GGUF",
    "pickle-file": r"weights\.pt.*only reads safetensors or GGUF",
    "not-a-model": r"notes\.txt: not a model Eddy can read",
    "empty-folder": r"empty: missing config\.json",
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_model_is_a_clear_error_through_open_model(bad_models, case):
    with pytest.raises(ModelError, match=EXPECTED[case]):
        open_model(str(bad_models[case]), TINY_SETTINGS)
    assert not bad_models["mark"].exists(), "a pickle was unpickled"


def test_bad_models_through_the_cli_exit_non_zero_with_one_line(bad_models):
    for case, pattern in EXPECTED.items():
        run = eddy("chat", "--model", str(bad_models[case]), "--prompt", "hi")
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert run.returncode == 1, (case, run.stderr[-2000:])
        assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, case
        assert len(lines) == 1 and lines[0].startswith("eddy: error: "), (case, lines)
        assert re.search(pattern, lines[0]), (case, lines[0])
    assert not bad_models["mark"].exists(), "a pickle was unpickled"


def test_pickles_are_never_unpickled_even_when_asked_for_weights(bad_models, monkeypatch):
    from engine.checkpoint import ModelSource

    def forbidden(*a, **k):
        raise AssertionError("pickle loading must never be called")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(mod, name, forbidden)
    with pytest.raises(ModelError, match="only reads safetensors or GGUF"):
        load_state_dict(ModelSource("pickles", "hf", bad_models["only-pickles"]))
    with pytest.raises(ModelError):
        resolve_model(str(bad_models["only-pickles"] / "pytorch_model.bin"))
    assert not bad_models["mark"].exists()
    # The trap works: unpickling the file for real does leave the mark.
    monkeypatch.undo()
    probe = bad_models["mark"].with_name("PROBE")
    pickle.loads(pickle.dumps(_LeavesAMark(probe))).close()
    assert probe.exists()


# --- the artefact cache ----------------------------------------------------------------------------------


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entry_copy(tiny, private_cache) -> Path:
    """The tiny-random entry copied to where a private cache expects it."""
    folder = artefact_dir(tiny.source, TINY_SETTINGS)
    assert folder.is_relative_to(private_cache)
    shutil.copytree(tiny.folder, folder)
    return folder


def _forge_manifest(folder: Path) -> None:
    """Makes the manifest agree with the files as they are now (a damaged file that passes the cheap check)."""
    m = json.loads((folder / MANIFEST).read_text())
    for name, entry in m["files"].items():
        entry.update(size=(folder / name).stat().st_size, digest=file_digest(folder / name))
        entry.pop("sha256", None)
    (folder / MANIFEST).write_text(json.dumps(m))


DAMAGE = {
    "truncated-vmfb": lambda f: (f / "module.vmfb").write_bytes((f / "module.vmfb").read_bytes()[:1000]),
    "foreign-vmfb": lambda f: (f / "module.vmfb").write_bytes(os.urandom((f / "module.vmfb").stat().st_size)),
    "truncated-irpa": lambda f: (f / "weights.irpa").write_bytes((f / "weights.irpa").read_bytes()[:4096]),
    "foreign-irpa": lambda f: (f / "weights.irpa").write_bytes(
        os.urandom(1 << 20) + (f / "weights.irpa").read_bytes()[1 << 20:]),
    "missing-irpa": lambda f: (f / "weights.irpa").unlink(),
    "garbage-manifest": lambda f: (f / MANIFEST).write_text("{not json"),
    "tokenizer-swapped": lambda f: (f / "tokenizer.json").write_text("{}"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_rejected_before_it_is_loaded(tiny, private_cache, damage):
    folder = _entry_copy(tiny, private_cache)
    DAMAGE[damage](folder)
    with pytest.raises(ArtefactError, match=r"damaged|missing|no compiled model|incomplete"):
        read_manifest(folder)
    with pytest.raises(ArtefactError):
        open_folder(folder)


@pytest.mark.parametrize("damage", ["truncated-vmfb", "foreign-vmfb", "truncated-irpa", "foreign-irpa"])
def test_damaged_files_that_pass_the_manifest_still_fail_cleanly(tiny, private_cache, damage):
    # Belt and braces: files that slipped past the sampled hash (here: a manifest rewritten to match) make the
    # runtime fail with an ArtefactError, not an IndexError or a crash. A truncated .irpa and a .vmfb built for
    # other weights used to raise IndexError from IREE.
    folder = _entry_copy(tiny, private_cache)
    DAMAGE[damage](folder)
    _forge_manifest(folder)
    with pytest.raises(ArtefactError, match="cannot load the compiled module"):
        open_folder(folder)


def test_damaged_entry_is_rebuilt(tiny, private_cache):
    """A truncated module in the cache: the next start rebuilds the entry (a real build, about 40 s)."""
    folder = _entry_copy(tiny, private_cache)
    DAMAGE["truncated-vmfb"](folder)
    stages = []
    built = ensure_artefacts(tiny.source, TINY_SETTINGS, lambda stage, frac, detail: stages.append(stage))
    assert built == folder and stages, "the damaged entry was not rebuilt"
    read_manifest(built)
    assert (built / "module.vmfb").stat().st_size > 100_000  # not the 1000-byte stub it was cut to
    m = open_folder(built)
    assert m.chat(ChatSettings(max_new_tokens=3)).answer("hello").tokens > 0
    assert not list(built.parent.glob("*.building-*")), "a staging folder was left behind"


def test_compiler_version_change_means_a_new_entry(tiny, private_cache, monkeypatch):
    folder = _entry_copy(tiny, private_cache)
    assert ensure_artefacts(tiny.source, TINY_SETTINGS) == folder  # warm: found, not rebuilt
    real = artefacts._version
    monkeypatch.setattr(artefacts, "_version",
                        lambda dist: "99.0.0" if dist == "iree-base-compiler" else real(dist))
    newer = artefact_dir(tiny.source, TINY_SETTINGS)
    assert newer != folder
    # The stale entry is not reused: a build starts (cancelled at its first progress report to save time).
    started = []
    with pytest.raises(BuildCancelled):
        ensure_artefacts(tiny.source, TINY_SETTINGS, lambda stage, frac, detail: started.append(stage),
                         lambda: bool(started))
    assert started
    assert not newer.exists() and read_manifest(folder), "cancelling left a partial entry or hurt the old one"
    assert not list(folder.parent.glob("*.building-*"))


def test_cli_with_a_damaged_entry_that_passes_the_manifest_rebuilds_it(tiny, tmp_path):
    cache = tmp_path / "cache"
    env = {"EDDY_CACHE_DIR": str(cache)}
    old = os.environ.get("EDDY_CACHE_DIR")
    os.environ["EDDY_CACHE_DIR"] = str(cache)
    try:
        # What `eddy chat --sinks 4 --window 60 --dtype f32` looks for (the CLI keeps the default chunk bound).
        folder = artefact_dir(tiny.source, BuildSettings(sinks=4, window=60, dtype="f32"))
    finally:
        os.environ["EDDY_CACHE_DIR"] = old
    shutil.copytree(tiny.folder, folder)
    DAMAGE["truncated-irpa"](folder)
    _forge_manifest(folder)
    run = eddy("chat", "--model", "tiny-random", "--sinks", "4", "--window", "60", "--dtype", "f32",
               "--prompt", "hi", env=env)
    # The module does not load although the manifest matched: the entry is rebuilt once and answers.
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.strip(), "no reply after the rebuild"
    read_manifest(folder)
    assert (folder / "weights.irpa").stat().st_size == (tiny.folder / "weights.irpa").stat().st_size
