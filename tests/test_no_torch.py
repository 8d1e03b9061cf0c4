"""Only the exporter may import torch: every other module of engine/ and app/ is on the runtime path (the app,
the tokenizer, the IREE runtime, the server), which must start without torch, transformers or the compiler."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "iree.turbine", "iree.compiler")


def runtime_modules() -> list[str]:
    names = []
    for folder in ("engine", "app"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[:2] == ("engine", "exporter") or rel.name == "__main__":  # __main__ starts the app
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            names.append(".".join(parts))
    return names


def test_nothing_but_the_exporter_imports_torch() -> None:
    names = runtime_modules()
    assert "engine.checkpoint.gguf" in names and "app.main_window" in names
    assert not any(n.startswith("engine.exporter") for n in names)
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout[-2000:]
