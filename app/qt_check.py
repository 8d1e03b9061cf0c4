"""Before the window: can Qt's X11 (xcb) platform plugin load on this machine?

PySide6's wheel ships the xcb plugin but not the X11 libraries it links to. On a fresh Debian/Ubuntu machine
some are missing, and Qt then aborts with 'Could not load the Qt platform plugin "xcb" ... Reinstalling the
application may fix this problem', which names neither the libraries nor a fix. These checks run before
QApplication exists, so eddy-gui can say what to install instead (and exit 1 rather than abort).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

# The xcb plugin and the Qt library it loads, relative to the PySide6 package: ldd on these two lists the
# whole tree of libraries the xcb platform needs.
XCB_FILES = ("Qt/plugins/platforms/libqxcb.so", "Qt/lib/libQt6XcbQpa.so.6")

# soname -> (Debian/Ubuntu package, Fedora package): the libraries PySide6's xcb plugin links to, directly
# or through libQt6XcbQpa/libQt6Gui. Debian's names follow its policy (name + soversion); Fedora's do not.
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xinerama.so.0": ("libxcb-xinerama0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libXau.so.6": ("libxau6", "libXau"),
    "libXdmcp.so.6": ("libxdmcp6", "libXdmcp"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libGLX.so.0": ("libglx0", "libglvnd-glx"),
    "libGLdispatch.so.0": ("libglvnd0", "libglvnd"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2"),
}

NO_SCREEN = ("eddy-gui: cannot open a window: there is no screen to show it on (DISPLAY is not set, "
             "as over ssh or in a container).\n"
             "Chat in this terminal with `eddy chat` instead, or set QT_QPA_PLATFORM=offscreen for tests and scripts.")

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$", re.MULTILINE)


def _platform(env: Mapping[str, str]) -> str:
    """The platform Qt tries first: QT_QPA_PLATFORM may be 'xcb', 'xcb:option=…' or a list 'wayland;xcb'."""
    first = env.get("QT_QPA_PLATFORM", "").split(";")[0]
    return first.split(":")[0].strip().lower()


def no_screen(env: Mapping[str, str] | None = None) -> bool:
    """True when Qt would look for a display (X11 or Wayland) and there is none to connect to."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return False
    platform = _platform(env)
    if platform == "xcb":
        return not env.get("DISPLAY")
    # Left to Qt, it picks Wayland or X11, whichever the session has; offscreen, minimal, vnc… need no screen.
    return platform == "" and not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY")


def _xcb_will_be_used(env: Mapping[str, str]) -> bool:
    if not sys.platform.startswith("linux") or not env.get("DISPLAY"):
        return False
    platform = _platform(env)
    # Unset with a Wayland session: Qt may take its wayland plugin and never need xcb's libraries, so a
    # missing one must not stop a start that would have worked.
    return platform == "xcb" or (platform == "" and not env.get("WAYLAND_DISPLAY"))


def xcb_plugin_files() -> list[Path]:
    """The xcb plugin and libQt6XcbQpa inside the installed PySide6 (found without importing it), if present."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    return [root / rel for rel in XCB_FILES if (root / rel).is_file()]


def unresolved_libraries(files: Sequence[Path]) -> list[str]:
    """The sonames the dynamic loader cannot find for `files` (their whole dependency tree), in ldd's order.

    No ldd, or ldd failing, gives [] so that Qt's own loading (and message) decides, as before this check."""
    ldd = shutil.which("ldd")
    if not ldd or not files:
        return []
    try:
        out = subprocess.run([ldd, *map(str, files)], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    # Each file lists the shared part of the tree again: keep the first of each.
    return list(dict.fromkeys(_NOT_FOUND.findall(out)))


def missing_platform_libraries(env: Mapping[str, str] | None = None,
                               files: Sequence[Path] | None = None) -> list[str]:
    """The libraries the xcb platform plugin needs and this system lacks; [] when xcb will not be used."""
    env = os.environ if env is None else env
    if not _xcb_will_be_used(env):
        return []
    return unresolved_libraries(xcb_plugin_files() if files is None else files)


def package_for(soname: str) -> str:
    """The Debian/Ubuntu package that ships `soname`; the soname itself when the table does not know it."""
    return PACKAGES.get(soname, (soname, ""))[0]


def advice(missing: Sequence[str]) -> str:
    """What eddy-gui prints instead of Qt's abort: the missing libraries and the command that installs them."""
    known = [s for s in missing if s in PACKAGES]
    unknown = [s for s in missing if s not in PACKAGES]
    lines = ["eddy-gui: cannot open a window: Qt's X11 (xcb) platform plugin needs libraries this system "
             f"lacks: {', '.join(missing)}."]
    if known:
        debian = dict.fromkeys(PACKAGES[s][0] for s in known)
        fedora = dict.fromkeys(PACKAGES[s][1] for s in known)
        lines += ["Install them (Debian/Ubuntu):", f"    sudo apt-get install {' '.join(debian)}",
                  f"(Fedora: sudo dnf install {' '.join(fedora)})"]
    if unknown:
        lines.append(f"Find the package that provides {', '.join(unknown)} with `apt-file search NAME` "
                     "(Debian/Ubuntu) or `dnf provides '*/NAME'` (Fedora).")
    return "\n".join(lines)


def startup_problem(env: Mapping[str, str] | None = None) -> str | None:
    """The message to print instead of starting Qt, or None when nothing is known to stop it."""
    env = os.environ if env is None else env
    if no_screen(env):
        return NO_SCREEN
    missing = missing_platform_libraries(env)
    return advice(missing) if missing else None
