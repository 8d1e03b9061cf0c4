"""Builds the packaged Eddy: a one-folder PyInstaller bundle with the precompiled default model, then a .deb.

    .venv/bin/python packaging/build.py [--out DIR] [--target-cpus x86-64-v3,x86-64-v4] [--no-deb]

Writes DIR/eddy/ (the bundle: run DIR/eddy/eddy) and DIR/eddy_<version>_amd64.deb (default DIR: dist/).
Needs the full development install (torch and the compiler build the model; they stay out of the bundle)
and PyInstaller (`pip install -e '.[package]'`). See packaging/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "packaging"
sys.path.insert(0, str(ROOT))

NAME = "eddy"
# Needed only to build models, never at run time: kept out explicitly (and checked for afterwards).
EXCLUDED = [
    "torch", "torchvision", "torchaudio", "transformers", "accelerate", "safetensors", "sentencepiece",
    "iree.compiler", "iree.turbine", "iree.build", "iree._runtime_libs_tracy",
    "triton", "sympy", "networkx", "scipy", "pandas", "matplotlib", "PIL", "IPython",
    "pytest", "pytestqt", "hypothesis", "tkinter", "_tkinter",
    # The export half of the engine and what only benchmarks and tests use.
    "engine.exporter.export", "engine.exporter.model",
]
# Paths (relative to the bundle) that must not exist: the check the smoke test repeats.
FORBIDDEN = ("torch", "transformers", "iree/compiler", "iree/turbine", "libtorch", "libtorch_cpu.so",
             "iree-compile", "libIREECompiler.so")
# Qt parts the app does not use but that PySide6's hooks may drag in.
QT_TRIM = ("Qt/qml", "Qt/translations", "Qt/lib/libQt6Quick", "Qt/lib/libQt6Qml", "Qt/lib/libQt6Pdf",
           "Qt/lib/libQt6VirtualKeyboard", "Qt/plugins/qmltooling", "Qt/plugins/virtualkeyboard")
DEB_DEPENDS = ("libc6 (>= 2.31), libgl1, libegl1, libfontconfig1, libfreetype6, libxkbcommon0, "
               "libxkbcommon-x11-0, libdbus-1-3, libx11-xcb1, libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1, "
               "libxcb-shape0, libxcb-xkb1, libxcb-render-util0, libxcb-image0")


def log(msg: str) -> None:
    print(f"[package] {msg}", flush=True)


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def du(path: Path) -> int:
    """Bytes on disk, each hard-linked file once."""
    if path.is_file():
        return path.stat().st_size
    seen: dict[tuple[int, int], int] = {}
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def build_model(target_cpu: str) -> Path:
    """The default model's artefacts for a portable CPU target (found in the cache, or built: ~2-4 min)."""
    from engine.artefacts.store import ensure_artefacts
    from engine.checkpoint import resolve_model
    from engine.config import BuildSettings

    settings = BuildSettings(target_cpu=target_cpu)
    last = [""]

    def progress(stage: str, fraction: float, detail: str = "") -> None:
        if stage != last[0]:
            last[0] = stage
            log(f"model: {stage}")

    return ensure_artefacts(resolve_model(None), settings, progress)


def pyinstaller(out: Path, work: Path) -> Path:
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN", "--onedir",
           "--name", NAME, "--distpath", str(out), "--workpath", str(work / "pyi"), "--specpath", str(work),
           "--paths", str(ROOT),
           # iree.runtime reaches its native extension through a trampoline PyInstaller cannot follow.
           "--hidden-import", "iree._runtime_libs._runtime", "--hidden-import", "iree._runtime_libs.version"]
    for mod in EXCLUDED:
        cmd += ["--exclude-module", mod]
    cmd.append(str(HERE / "eddy_entry.py"))
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out / NAME


def trim(bundle: Path) -> None:
    """Drops what the app never loads: the IREE tools, the profiler, unused Qt parts."""
    internal = bundle / "_internal"
    libs = internal / "iree" / "_runtime_libs"
    if libs.is_dir():
        for p in libs.iterdir():
            if p.name.startswith("iree-") or p.name == "share":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    pyside = internal / "PySide6"
    for rel in QT_TRIM:
        for p in pyside.glob(rel + "*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def add_models(bundle: Path, folders: list[Path]) -> Path:
    """Copies the entries into the bundle and seals them; files equal across entries (the weights are the
    same for every CPU target: only module.vmfb differs) are stored once, as hard links."""
    from engine.artefacts.store import BUILT_FILES, MANIFEST, seal

    models = bundle / "_internal" / "models"
    shutil.rmtree(models, ignore_errors=True)
    stored: dict[str, Path] = {}
    for folder in folders:
        dest = models / folder.name
        dest.mkdir(parents=True)
        for name in (*BUILT_FILES, MANIFEST):
            shutil.copyfile(folder / name, dest / name)
            os.chmod(dest / name, 0o644)
        manifest = seal(dest)  # full sha256 per file, checked at every start
        for name, entry in manifest["files"].items():
            first = stored.setdefault(entry["sha256"], dest / name)
            if first != dest / name:
                (dest / name).unlink()
                os.link(first, dest / name)
    return models


def forbidden_in(bundle: Path) -> list[str]:
    found = []
    for p in bundle.rglob("*"):
        rel = p.relative_to(bundle).as_posix()
        if any(f"/{f}" in f"/{rel}" and (rel.endswith(f) or f"/{f}/" in f"/{rel}/") for f in FORBIDDEN):
            found.append(rel)
    return found


def build_deb(bundle: Path, out: Path, work: Path) -> Path:
    ver = version()
    root = work / "debroot"
    shutil.rmtree(root, ignore_errors=True)
    opt = root / "opt" / NAME
    opt.parent.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(bundle), str(opt)], check=True)  # keeps the models' hard links
    (root / "usr" / "bin").mkdir(parents=True)
    for cmd in ("eddy", "eddy-gui"):
        (root / "usr" / "bin" / cmd).symlink_to(f"../../opt/{NAME}/{NAME}")  # relative: works in any root
    apps = root / "usr" / "share" / "applications"
    apps.mkdir(parents=True)
    desktop = (ROOT / "resources" / "eddy.desktop").read_text()
    (apps / "eddy.desktop").write_text(desktop.replace("Exec=eddy-gui", "Exec=eddy"))
    icons = root / "usr" / "share" / "icons" / "hicolor"
    for sub, src in (("256x256/apps/eddy.png", "eddy.png"), ("scalable/apps/eddy.svg", "eddy.svg")):
        (icons / sub).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "resources" / src, icons / sub)
    doc = root / "usr" / "share" / "doc" / NAME
    doc.mkdir(parents=True)
    shutil.copyfile(HERE / "copyright", doc / "copyright")
    debian = root / "DEBIAN"
    debian.mkdir()
    installed_kb = (du(root) + 1023) // 1024
    (debian / "control").write_text(
        f"Package: {NAME}\nVersion: {ver}\nSection: utils\nPriority: optional\nArchitecture: amd64\n"
        f"Maintainer: Eddy developers <eddy@localhost>\nInstalled-Size: {installed_kb}\n"
        f"Depends: {DEB_DEPENDS}\n"
        "Description: chat with local language models that never run out of context\n"
        " Eddy is a desktop chat client for local language models (StreamingLLM on IREE).\n"
        " This package runs offline and ships SmolLM2-135M-Instruct precompiled for x86-64-v3\n"
        " (AVX2) and x86-64-v4 (AVX-512) CPUs; it cannot compile other models\n"
        " (pip install 'eddy[compile]' can).\n")
    for d in [root, *root.rglob("*")]:
        if d.is_dir() and not d.is_symlink():
            d.chmod(0o755)
    deb = out / f"{NAME}_{ver}_amd64.deb"
    # zstd: several times faster to build than xz at nearly the same size; dpkg >= 1.21.18 / apt read it.
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zzstd", "-z9", "--build", str(root), str(deb)],
                   check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(root)
    return deb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "dist"), help="where the bundle and the .deb go (default dist/)")
    p.add_argument("--work", default=None, help="scratch folder (default build/package)")
    p.add_argument("--target-cpus", default="x86-64-v3,x86-64-v4",
                   help="CPU levels the model is compiled for, comma-separated; at start the app takes the highest "
                        "one the CPU supports (default x86-64-v3,x86-64-v4: AVX2, and AVX-512 where present)")
    p.add_argument("--no-deb", action="store_true", help="build the bundle only")
    a = p.parse_args(argv)
    out, work = Path(a.out).resolve(), Path(a.work or ROOT / "build" / "package").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    targets = [t.strip() for t in a.target_cpus.split(",") if t.strip()]
    if not targets or "host" in targets:
        p.error("--target-cpus needs portable CPU levels (a host build may not run on another machine)")
    models = []
    for target in targets:
        log(f"default model for {target}")
        models.append(build_model(target))
        log(f"model: {models[-1]}")
    t = time.perf_counter()
    bundle = pyinstaller(out, work)
    trim(bundle)
    dest = add_models(bundle, models)
    log(f"bundle: {bundle} ({du(bundle) / 1e6:.0f} MB, model {du(dest) / 1e6:.0f} MB, "
        f"PyInstaller {time.perf_counter() - t:.0f} s)")
    bad = forbidden_in(bundle)
    if bad:
        log("the bundle holds build-time parts it must not: " + ", ".join(bad[:10]))
        return 1
    result = {"bundle": str(bundle), "bundle_bytes": du(bundle)}
    if not a.no_deb:
        t = time.perf_counter()
        deb = build_deb(bundle, out, work)
        log(f"deb: {deb} ({deb.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t:.0f} s)")
        result.update(deb=str(deb), deb_bytes=deb.stat().st_size)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    (out / "package.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
