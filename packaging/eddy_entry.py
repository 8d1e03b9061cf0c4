"""Entry point of the packaged app (PyInstaller freezes this file as the `eddy` executable).

It points the engine at the precompiled models inside the bundle, then runs the desktop app
(`eddy [--model M] [--data-dir DIR] [--ask TEXT]`, the same options as `eddy-gui`).
"""
import os
import sys
from pathlib import Path

if getattr(sys, "frozen", False):
    # The bundle's own models first; a user's $EDDY_BUNDLED_MODELS may add more after them.
    models = str(Path(sys._MEIPASS) / "models")
    extra = os.environ.get("EDDY_BUNDLED_MODELS")
    os.environ["EDDY_BUNDLED_MODELS"] = models + (os.pathsep + extra if extra else "")

from app.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
