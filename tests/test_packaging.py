"""The installer's smoke test: build the bundle and the .deb for real, then chat through them offline.

The packaged app runs with a bare environment (no venv on PATH, no PYTHONPATH, an empty cache), so it can
only answer from the precompiled model inside the bundle: it has no torch, no compiler and no GGUF.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
MAX_BUNDLE_BYTES = 400 * 10**6
# Build-time parts that must stay out of the package (path components or file names in the bundle).
FORBIDDEN_DIRS = ("torch", "transformers", "turbine", "accelerate", "safetensors")
FORBIDDEN_FILES = ("iree-compile", "libIREECompiler.so", "libtorch_cpu.so", "libtorch.so")


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict:
    """Builds the bundle and the .deb once (the default model compiles into the session's EDDY_CACHE_DIR)."""
    out = tmp_path_factory.mktemp("dist")
    work = tmp_path_factory.mktemp("work")
    proc = subprocess.run([sys.executable, str(ROOT / "packaging" / "build.py"), "--out", str(out), "--work", str(work)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shutil.rmtree(work, ignore_errors=True)
    return json.loads((out / "package.json").read_text())


def bare_env(tmp: Path) -> dict[str, str]:
    """What a user's desktop session would have: no Python of ours, an empty home and cache."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "QT_QPA_PLATFORM": "offscreen",
            "EDDY_CACHE_DIR": str(home / "cache"), "XDG_RUNTIME_DIR": str(home)}


def ask(exe: Path, tmp: Path, *args: str, text: str = QUESTION) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), "--ask", text, *args], env=bare_env(tmp), cwd=tmp, capture_output=True,
                          text=True, timeout=300)


def ask_greedy(exe: Path, tmp: Path) -> subprocess.CompletedProcess:
    """The question with greedy decoding chosen in Settings: the app's chat defaults sample (a fresh seed
    each time), and a smoke test needs the one answer that does not depend on the draw."""
    data = tmp / "greedy-data"
    data.mkdir(exist_ok=True)
    (data / "settings.ini").write_text("[General]\nsettings_version=2\ntemperature=0\n")
    return ask(exe, tmp, "--data-dir", str(data))


def check_answer(proc: subprocess.CompletedProcess, tmp: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout
    assert "first token" in proc.stderr
    # Nothing was compiled or cached: the answer came from the bundle.
    assert not (tmp / "home" / "cache" / "artefacts").exists()


def test_bundle_holds_the_runtime_and_the_model_and_no_build_tools(package):
    bundle = Path(package["bundle"])
    assert (bundle / "eddy").is_file() and os.access(bundle / "eddy", os.X_OK)
    paths = [p.relative_to(bundle) for p in bundle.rglob("*")]
    bad = [str(p) for p in paths if any(part in FORBIDDEN_DIRS for part in p.parts) or p.name in FORBIDDEN_FILES
           or p.as_posix().endswith(("iree/compiler", "iree/turbine"))]
    assert not bad, bad[:20]
    names = {p.name for p in paths}
    assert any(n.startswith("_runtime.cpython") for n in names)  # the IREE runtime
    assert any(n.startswith("libQt6Widgets") for n in names) and any(n.startswith("tokenizers") for n in names)
    entries = sorted((bundle / "_internal" / "models").iterdir())
    targets = set()
    for entry in entries:
        manifest = json.loads((entry / "manifest.json").read_text())
        assert manifest["model"] == "smollm2-135m-instruct"
        targets.add(manifest["settings"]["target_cpu"])
        assert set(manifest["files"]) == {"module.vmfb", "weights.irpa", "tokenizer.json", "chat.json"}
        assert all("sha256" in f for f in manifest["files"].values())
    # Portable levels only (a host build can die of illegal instructions elsewhere), AVX2 as the baseline.
    assert "x86-64-v3" in targets and "host" not in targets
    # The weights are the same for every level: stored once.
    assert len({(entry / "weights.irpa").stat().st_ino for entry in entries}) == 1
    assert package["bundle_bytes"] < MAX_BUNDLE_BYTES


def test_bundle_answers_offline_without_compiler(package, tmp_path):
    check_answer(ask_greedy(Path(package["bundle"]) / "eddy", tmp_path), tmp_path)


def test_damaged_bundle_names_the_file(package, tmp_path):
    """One flipped byte in the middle of the weights (where the cheap sampled digest does not look)."""
    bundle = Path(package["bundle"])
    copy = tmp_path / "eddy"
    shutil.copytree(bundle, copy, copy_function=os.link, symlinks=True)  # hard links: instant, no extra space
    for weights in (copy / "_internal" / "models").glob("*/weights.irpa"):  # every CPU level's entry
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.unlink()  # break the hard link before writing: the original bundle stays intact
        weights.write_bytes(bytes(data))
    proc = ask(copy / "eddy", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "weights.irpa" in proc.stderr and "damaged" in proc.stderr, proc.stderr[-3000:]
    assert "Reinstall" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["other model", "other settings"])
def test_what_needs_compiling_says_how_to_get_the_full_version(package, tmp_path, case):
    args = ["--model", "tiny-random"] if case == "other model" else ["--data-dir", str(tmp_path / "data")]
    if case == "other settings":
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "settings.ini").write_text("[General]\nwindow=252\n")
    proc = ask(Path(package["bundle"]) / "eddy", tmp_path, *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "cannot compile" in proc.stderr and "eddy[compile]" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_deb_installs_into_a_fresh_root_and_answers(package, tmp_path):
    deb = Path(package["deb"])
    info = subprocess.run(["dpkg-deb", "--field", str(deb), "Package", "Architecture"], capture_output=True,
                          text=True, check=True).stdout
    assert "eddy" in info and "amd64" in info
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    exe = root / "usr" / "bin" / "eddy"
    assert exe.is_symlink() and exe.resolve() == (root / "opt" / "eddy" / "eddy").resolve()
    desktop = (root / "usr" / "share" / "applications" / "eddy.desktop").read_text()
    assert "Exec=eddy" in desktop and "Icon=eddy" in desktop
    assert (root / "usr" / "share" / "icons" / "hicolor" / "256x256" / "apps" / "eddy.png").is_file()
    assert (root / "usr" / "share" / "icons" / "hicolor" / "scalable" / "apps" / "eddy.svg").is_file()
    # Through the /usr/bin symlink, as a user would start it.
    check_answer(ask_greedy(exe, tmp_path), tmp_path)


def test_target_cpu_is_a_checked_build_setting_in_the_key():
    from engine.artefacts.store import artefact_key
    from engine.checkpoint import resolve_model
    from engine.config import BuildSettings
    from engine.devices import compile_flags

    with pytest.raises(ValueError, match="target CPU"):
        BuildSettings(target_cpu="pentium-4")
    source = resolve_model(None)
    assert artefact_key(source, BuildSettings()) != artefact_key(source, BuildSettings(target_cpu="x86-64-v3"))
    assert "--iree-llvmcpu-target-cpu=x86-64-v3" in compile_flags("cpu", "x86-64-v3")
    assert "--iree-llvmcpu-target-cpu=host" in compile_flags("cpu")
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "compile", "--target-cpu", "pentium-4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--target-cpu" in proc.stderr
