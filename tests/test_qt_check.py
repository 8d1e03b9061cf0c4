"""app/qt_check.py: eddy-gui names the X11 libraries Qt's xcb plugin lacks (and the apt-get line) instead of Qt's
'Could not load the Qt platform plugin "xcb"' abort. Real ldd on a shared object built here that needs a library
that is gone, real ldd on PySide6's own plugin, and `python -m app` end to end. No window opens: a few seconds."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import main as app_main
from app import qt_check
from app.qt_check import (PACKAGES, advice, missing_platform_libraries, no_screen, package_for, startup_problem,
                          xcb_plugin_files)

REPO = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the xcb plugin is Linux's")
needs_ldd = pytest.mark.skipif(shutil.which("ldd") is None, reason="no ldd on this machine")


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any display or Qt platform choice, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def fake_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared object that needs libeddy-present.so.1 (beside it, found through $ORIGIN) and
    libeddy-absent.so.7 (deleted after linking): what a plugin with one missing library looks like to ldd."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a plugin with a missing library")
    d = tmp_path_factory.mktemp("fake_plugin")
    (d / "stub.c").write_text("int eddy_stub(void) { return 1; }\n")
    (d / "plugin.c").write_text("int eddy_plugin(void) { return 2; }\n")
    for soname in ("libeddy-present.so.1", "libeddy-absent.so.7"):
        subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(d / soname), str(d / "stub.c")],
                       check=True)
    plugin = d / "libqfake.so"
    # --no-as-needed: both stay NEEDED although the plugin calls neither.
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(plugin), str(d / "plugin.c"), "-Wl,--no-as-needed",
                    f"-L{d}", "-l:libeddy-present.so.1", "-l:libeddy-absent.so.7", "-Wl,-rpath,$ORIGIN"],
                   check=True)
    (d / "libeddy-absent.so.7").unlink()
    return plugin


def _ldd_not_found(files: list[Path]) -> list[str]:
    """ldd's own verdict, read independently of qt_check's parser: the names on '=> not found' lines."""
    out = subprocess.run(["ldd", *map(str, files)], capture_output=True, text=True,
                         env={**os.environ, "LC_ALL": "C"}).stdout
    names = [line.split()[0] for line in out.splitlines() if "=> not found" in line]
    return list(dict.fromkeys(names))


def test_sonames_map_to_debian_packages() -> None:
    expected = {"libxcb-cursor.so.0": "libxcb-cursor0", "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
                "libxcb-icccm.so.4": "libxcb-icccm4", "libxcb-keysyms.so.1": "libxcb-keysyms1",
                "libxcb-image.so.0": "libxcb-image0", "libxcb-render-util.so.0": "libxcb-render-util0",
                "libxcb-xinerama.so.0": "libxcb-xinerama0", "libxcb-xkb.so.1": "libxcb-xkb1",
                "libxcb-shape.so.0": "libxcb-shape0", "libxcb-randr.so.0": "libxcb-randr0",
                "libEGL.so.1": "libegl1", "libGL.so.1": "libgl1", "libfontconfig.so.1": "libfontconfig1",
                "libdbus-1.so.3": "libdbus-1-3"}
    assert {s: package_for(s) for s in expected} == expected
    assert package_for("libeddy-absent.so.7") == "libeddy-absent.so.7"  # unknown: kept by soname


@needs_ldd
@linux_only
def test_the_table_knows_every_system_library_the_real_plugin_needs() -> None:
    # Whatever this PySide6's plugin tree needs from the system (not from PySide6 itself) gets a package name,
    # so a machine lacking any of them is told what to install.
    files = xcb_plugin_files()
    if not files:
        pytest.skip("PySide6's xcb plugin is not installed here")
    out = subprocess.run(["ldd", *map(str, files)], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if "=>" in line}
    system = {n for n in names if n.startswith(("libxcb", "libX", "libxkb", "libGL", "libEGL", "libfontconfig",
                                                "libdbus", "libglib", "libgthread", "libfreetype"))}
    assert system - set(PACKAGES) == set()


def test_advice_names_the_libraries_and_the_install_lines() -> None:
    text = advice(["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-randr.so.0", "libxcb-shape.so.0",
                   "libeddy-absent.so.7"])
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1, libxcb-randr.so.0, libxcb-shape.so.0, libeddy-absent.so.7" in text
    assert "\n    sudo apt-get install libxcb-icccm4 libxcb-keysyms1 libxcb-randr0 libxcb-shape0\n" in text
    # Fedora ships randr and shape in one package: named once.
    assert "sudo dnf install xcb-util-wm xcb-util-keysyms libxcb)" in text
    assert "provides libeddy-absent.so.7 with `apt-file search NAME`" in text
    assert "apt-get" not in advice(["libeddy-absent.so.7"])  # nothing known to install: no empty command


@needs_ldd
@linux_only
def test_a_missing_library_is_found_and_a_present_one_is_not(fake_plugin: Path) -> None:
    for env in ({"DISPLAY": ":99"}, {"DISPLAY": ":99", "QT_QPA_PLATFORM": "xcb"},
                {"DISPLAY": ":99", "QT_QPA_PLATFORM": "xcb:dpi=96;wayland"}):
        assert missing_platform_libraries(env, [fake_plugin]) == ["libeddy-absent.so.7"], env
    # Two files sharing the missing library: reported once.
    assert missing_platform_libraries({"DISPLAY": ":1"}, [fake_plugin, fake_plugin]) == ["libeddy-absent.so.7"]
    assert missing_platform_libraries({"DISPLAY": ":1"}, []) == []


@pytest.mark.parametrize("env", [
    {"DISPLAY": ":99", "QT_QPA_PLATFORM": "offscreen"},
    {"DISPLAY": ":99", "QT_QPA_PLATFORM": "minimal"},
    {"DISPLAY": ":99", "QT_QPA_PLATFORM": "wayland"},
    {"DISPLAY": ":99", "QT_QPA_PLATFORM": "wayland;xcb"},  # xcb only as the fallback: never stop this start
    {"DISPLAY": ":99", "WAYLAND_DISPLAY": "wayland-0"},  # Qt may pick wayland in a Wayland session
    {"QT_QPA_PLATFORM": "xcb"},  # no X display: the no-screen message's case, not a library one
    {},
], ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "nothing")
def test_no_library_check_when_xcb_is_not_about_to_be_used(fake_plugin: Path, env: dict[str, str]) -> None:
    assert missing_platform_libraries(env, [fake_plugin]) == []


def test_other_systems_are_not_checked(fake_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert missing_platform_libraries({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, [fake_plugin]) == []
    assert not no_screen({})


def test_without_ldd_or_when_it_fails_qt_decides_as_before(fake_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qt_check.shutil, "which", lambda _name: None)
    assert missing_platform_libraries({"DISPLAY": ":99"}, [fake_plugin]) == []
    monkeypatch.undo()

    def broken(*_a: object, **_k: object) -> None:
        raise OSError("exec format error")
    monkeypatch.setattr(qt_check.subprocess, "run", broken)
    assert missing_platform_libraries({"DISPLAY": ":99"}, [fake_plugin]) == []


@linux_only
def test_no_screen_only_when_qt_would_need_one() -> None:
    assert no_screen({}) and no_screen({"QT_QPA_PLATFORM": "xcb"})
    assert no_screen({"QT_QPA_PLATFORM": "xcb", "WAYLAND_DISPLAY": "wayland-0"})  # forced X11, no X display
    for env in ({"DISPLAY": ":0"}, {"WAYLAND_DISPLAY": "wayland-0"}, {"QT_QPA_PLATFORM": "offscreen"},
                {"QT_QPA_PLATFORM": "wayland"}, {"QT_QPA_PLATFORM": "vnc"}):
        assert not no_screen(env), env
    assert startup_problem({}) == qt_check.NO_SCREEN
    assert "eddy chat" in qt_check.NO_SCREEN and "QT_QPA_PLATFORM=offscreen" in qt_check.NO_SCREEN


def test_a_broken_check_never_blocks_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: object) -> None:
        raise RuntimeError("unexpected")
    monkeypatch.setattr(qt_check, "startup_problem", broken)
    assert app_main._platform_problem() is None


@needs_ldd
@linux_only
def test_this_machines_verdict_is_ldds(tmp_path: Path) -> None:
    files = xcb_plugin_files()
    if not files:
        pytest.skip("PySide6's xcb plugin is not installed here")
    code = "from app.qt_check import missing_platform_libraries as m; print(' '.join(m()) or '-')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env=_clean_env(DISPLAY=":99", QT_QPA_PLATFORM="xcb"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == (_ldd_not_found(files) or ["-"])


@needs_ldd
@linux_only
def test_eddy_gui_prints_the_apt_line_instead_of_qts_abort(tmp_path: Path) -> None:
    files = xcb_plugin_files()
    missing = _ldd_not_found(files) if files else []
    if not missing:
        pytest.skip("this machine has every library the xcb plugin needs (and no X server on :99 to start on)")
    run = subprocess.run([sys.executable, "-m", "app", "--data-dir", str(tmp_path / "data")], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=_clean_env(DISPLAY=":99", QT_QPA_PLATFORM="xcb"))
    assert run.returncode == 1, run.stderr
    known = [package_for(s) for s in missing if s in PACKAGES]
    if known:
        assert f"sudo apt-get install {' '.join(dict.fromkeys(known))}" in run.stderr
    assert ", ".join(missing) in run.stderr
    assert "Could not load the Qt platform plugin" not in run.stderr and "Reinstalling" not in run.stderr
    assert not (tmp_path / "data").exists()  # stopped before anything was set up


@linux_only
def test_eddy_gui_without_a_screen_says_so(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "app", "--data-dir", str(tmp_path / "data")], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=_clean_env())
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip() == qt_check.NO_SCREEN
