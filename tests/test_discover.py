"""Finding the models other apps downloaded (engine/discover.py and `eddy models`): fake Hugging Face, LM Studio,
GPT4All, Jan and Ollama stores in a temporary home, holding real GGUF files (tiny ones written here, and the
default model's for Ollama's blob)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests"):  # plain `pytest` only puts tests/ on sys.path
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from conftest_tokenizer_helper import gguf_path  # noqa: E402
from engine import cli  # noqa: E402
from engine.discover import FoundModel, default_roots, scan  # noqa: E402
from gguf_writer import add_config, finish  # noqa: E402

TINY = {"vocab_size": 8, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256}
Q4_K_M = 15  # llama.cpp's LlamaFileType.MOSTLY_Q4_K_M
REV = "0123456789abcdef0123456789abcdef01234567"


def tiny_gguf(path: Path, arch: str = "llama", file_type: int | None = None, size_label: str | None = None) -> Path:
    """A GGUF header Eddy's checks accept for `arch` (llama runs; other architectures are refused by name)."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    add_config(w, "llama", TINY)
    if file_type is not None:
        w.add_file_type(file_type)
    if size_label:
        w.add_size_label(size_label)
    w.add_tensor("token_embd.weight", np.zeros((TINY["vocab_size"], TINY["hidden_size"]), np.float32))
    return finish(w, path)


def safetensors_file(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A valid bf16 .safetensors file of zeros (its header is all Eddy's checks read)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def place(src: Path, dst: Path) -> Path:
    """The default model's GGUF at dst: a hard link where the file system allows (no 98 MB copy)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def ollama_manifest(models: Path, name: str, tag: str, digest: str, namespace: str = "library") -> None:
    manifest = models / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 1},
        ]}))


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home folder as the apps leave it (written once: the tests only read it)."""
    home = tmp_path_factory.mktemp("home")
    # Hugging Face hub cache ($HF_HOME/hub): snapshot files are symlinks into blobs/.
    repo = home / "hf" / "hub" / "models--bartowski--Tiny-GGUF"
    blob = tiny_gguf(repo / "blobs" / ("a" * 64), file_type=Q4_K_M, size_label="1.2B")
    snapshot = repo / "snapshots" / REV
    snapshot.mkdir(parents=True)
    (snapshot / "Tiny-Q4_K_M.gguf").symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    folder = home / "hf" / "hub" / "models--Qwen--Tiny-Chat" / "snapshots" / REV
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
    (folder / "tokenizer.json").write_text("{}")
    safetensors_file(folder / "model.safetensors", {"model.embed_tokens.weight": (1000, 64), "lm_head.weight": (8, 64)})
    # LM Studio: publisher/model/file.gguf, and a vision projector beside it, which is no model of its own.
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    tiny_gguf(lms / "Tiny-Q8_0.gguf")
    tiny_gguf(lms / "mmproj-Tiny-F16.gguf", arch="clip")
    # GPT4All and Jan.
    tiny_gguf(home / ".local" / "share" / "nomic.ai" / "GPT4All" / "gpt4all-tiny.gguf")
    tiny_gguf(home / "jan" / "models" / "tiny" / "model.gguf")
    # Ollama: two tags of one model share a blob, a GGUF without an extension.
    models = home / "ollama"
    digest = hashlib.sha256(b"smollm2").hexdigest()
    place(gguf_path(), models / "blobs" / f"sha256-{digest}")
    ollama_manifest(models, "smollm2", "135m", digest)
    ollama_manifest(models, "smollm2", "latest", digest)
    ollama_manifest(models, "gone", "latest", hashlib.sha256(b"gone").hexdigest())  # an unfinished pull
    # A user's folder: what Eddy cannot run, a split model, a symlink loop.
    mine = home / "models"
    tiny_gguf(mine / "mamba-tiny.gguf", arch="mamba")
    cut = tiny_gguf(mine / "cut.gguf")
    cut.write_bytes(cut.read_bytes()[:-1000])
    tiny_gguf(mine / "big" / "Big-Q4_0-00001-of-00002.gguf")
    tiny_gguf(mine / "big" / "Big-Q4_0-00002-of-00002.gguf")
    (mine / "loop").symlink_to(mine, target_is_directory=True)
    (mine / "lmstudio").symlink_to(home / ".lmstudio", target_is_directory=True)  # the same folder twice
    (mine / "linked.gguf").symlink_to(lms / "Tiny-Q8_0.gguf")  # the same file twice
    return home


@pytest.fixture
def env(home, monkeypatch) -> dict[str, str]:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(home / "ollama"))
    return dict(os.environ)


def by_name(models: list[FoundModel]) -> dict[str, FoundModel]:
    names = [m.name for m in models]
    assert len(names) == len(set(names)), names
    return {m.name: m for m in models}


def test_default_roots_follow_the_apps_and_their_variables(env, home):
    roots = default_roots()
    assert ("hf-cache", home / "hf" / "hub") in roots
    assert ("ollama", home / "ollama") in roots and ("ollama", home / ".ollama" / "models") not in roots
    assert {s for s, _ in roots} == {"hf-cache", "lmstudio", "gpt4all", "jan", "ollama"}


def test_every_store_is_found_where_it_lies(env, home):
    found = scan(extra_folders=[home / "models"])
    assert found.complete
    m = by_name(found)

    hub = m["Tiny-Q4_K_M"]  # named by the snapshot's file, not by its blob's hash
    assert hub.source == "hf-cache" and hub.runnable and hub.reason == ""
    assert hub.path == home / "hf" / "hub" / "models--bartowski--Tiny-GGUF" / "snapshots" / REV / "Tiny-Q4_K_M.gguf"
    assert (hub.family, hub.weights, hub.params) == ("llama", "Q4_K_M", "1.2B")
    assert hub.size_bytes == hub.path.stat().st_size

    folder = m["Qwen/Tiny-Chat"]
    assert folder.source == "hf-cache" and folder.runnable and folder.path.name == REV
    assert (folder.family, folder.weights, folder.params) == ("qwen2", "bf16 safetensors", "65K")

    ollama = m["smollm2:135m"]
    assert ollama.source == "ollama" and ollama.runnable
    assert ollama.path.parent == home / "ollama" / "blobs" and ollama.path.suffix == ""
    assert (ollama.family, ollama.weights, ollama.params) == ("llama", "Q4_1", "135M")
    assert m["smollm2:latest"].path == ollama.path  # each tag is listed
    assert not m["gone:latest"].runnable and "missing" in m["gone:latest"].reason

    lms = m["Tiny-Q8_0"]
    assert lms.source == "lmstudio" and lms.runnable and lms.weights == "F32"  # no file_type: its tensors' type
    assert not any("mmproj" in name for name in m)
    assert m["gpt4all-tiny"].source == "gpt4all" and m["model"].source == "jan"

    # Found again through the user's folder (symlinks to LM Studio's folder and file): listed once, under its app.
    assert [x.source for x in found if x.name == "Tiny-Q8_0"] == ["lmstudio"] and "linked" not in m
    assert found[: sum(x.runnable for x in found)] == [x for x in found if x.runnable]  # runnable first


def test_what_eddy_cannot_run_is_listed_with_the_reason(env, home):
    m = by_name(scan(roots=[], extra_folders=[home / "models"]))
    mamba = m["mamba-tiny"]
    assert mamba.source == "folder" and not mamba.runnable and mamba.family == "mamba"
    assert mamba.reason.startswith('unsupported architecture "mamba"') and "Eddy supports Llama" in mamba.reason
    assert not m["cut"].runnable and "truncated" in m["cut"].reason
    split = m["Big-Q4_0-00001-of-00002"]
    assert not split.runnable and "split into 2 files" in split.reason and "llama-gguf-split --merge" in split.reason
    assert "Big-Q4_0-00002-of-00002" not in m  # the other parts are not models of their own
    # The loop ended; LM Studio's file, reached first through its symlink, is listed once, by that name.
    assert set(m) == {"mamba-tiny", "cut", "Big-Q4_0-00001-of-00002", "linked"}
    assert m["linked"].runnable and m["linked"].path == home / "models" / "linked.gguf"


def test_a_bare_root_is_read_by_its_layout(env, home):
    sources = {m.name: m.source for m in scan(roots=[home / "ollama", home / "hf" / "hub"])}
    assert sources == {"smollm2:135m": "ollama", "smollm2:latest": "ollama", "gone:latest": "ollama",
                       "Tiny-Q4_K_M": "hf-cache", "Qwen/Tiny-Chat": "hf-cache"}


def test_the_time_limit_is_kept(env, home):
    start = time.monotonic()
    found = scan(extra_folders=[home / "models"], time_limit_s=0)
    assert time.monotonic() - start < 1.0
    assert list(found) == [] and not found.complete
    assert home / "models" in found.searched


def test_eddy_models_json_lists_them_without_torch(env, home):
    run = subprocess.run([sys.executable, "-m", "engine.cli", "models", "--json", "--all",
                          "--folder", str(home / "models")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    listed = {m["name"]: m for m in json.loads(run.stdout)}
    assert listed["smollm2:135m"]["runnable"] and listed["smollm2:135m"]["source"] == "ollama"
    assert listed["Tiny-Q4_K_M"]["path"].endswith("Tiny-Q4_K_M.gguf")
    assert not listed["mamba-tiny"]["runnable"] and listed["mamba-tiny"]["reason"]
    assert list(listed.values())[-1]["runnable"] is False
    # Without --all, only what runs; a model found this way loads as --model takes it.
    run = subprocess.run([sys.executable, "-c", RUNNABLE_PROBE], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


RUNNABLE_PROBE = """
import contextlib, io, json, sys
from engine import cli
from engine.checkpoint import resolve_model
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert cli.main(["models", "--json"]) == 0
models = json.loads(out.getvalue())
assert len(models) == 7 and all(m["runnable"] for m in models), models
assert all(resolve_model(m["path"]) for m in models)
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("ok")
"""


def test_eddy_models_table(env, home, capsys):
    assert cli.main(["models", "--folder", str(home / "models")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FAMILY", "PARAMS", "WEIGHTS", "SIZE", "SOURCE", "PATH"]
    assert any(line.startswith("smollm2:135m ") and "135M" in line and "Q4_1" in line for line in out)
    assert not any("mamba" in line for line in out[1:-1])
    assert out[-1] == "4 more that Eddy cannot run: eddy models --all lists them and why."

    assert cli.main(["models", "--all", "--folder", str(home / "models")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-1] == "RUNS"
    assert "no: " in out[-1]  # what cannot run comes last
    assert any("mamba-tiny" in line and 'no: unsupported architecture "mamba"' in line for line in out)


def test_eddy_models_with_nothing_found(tmp_path, monkeypatch, capsys):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No models found in: ") and str(tmp_path / ".lmstudio" / "models") in out
    assert cli.main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
