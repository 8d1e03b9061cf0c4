"""The device table is the one place a device is described, and the artefact key covers it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_one_device_table_feeds_config_cli_and_runtime():
    from engine import devices
    from engine.cli import parser
    from engine.config import DEVICES, BuildSettings

    assert DEVICES == tuple(devices.TABLE) == ("cpu", "vulkan", "cuda")
    chat = parser()._subparsers._group_actions[0].choices["chat"]
    device_option = next(a for a in chat._actions if "--device" in a.option_strings)
    assert tuple(device_option.choices) == DEVICES
    assert devices.driver("cpu") == "local-task"
    for name in DEVICES:
        BuildSettings(device=name)  # every row is a valid build setting
        flags = devices.compile_flags(name, {"cuda": "sm_89", "vulkan": "llvmpipe"}.get(name, ""))
        assert any(f.startswith("--iree-hal-target-device=") for f in flags)


def test_export_code_hash_covers_model_export_and_compile_flags():
    from engine.artefacts import export_code

    sources = export_code.export_sources()
    assert all(p.is_file() for p in sources)
    covered = {p.relative_to(ROOT / "engine").as_posix() for p in sources}
    assert {"exporter/model.py", "exporter/export.py", "devices.py"} <= covered
    # Every engine module an export loads is in the key (exporter/kernels/prefill_products.py once was not).
    run = subprocess.run([sys.executable, "-c", "import sys, engine.exporter.export, engine.exporter.model; "
                          "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items()) "
                          "if n.startswith('engine') and getattr(m, '__file__', None)))"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = {Path(f).resolve().relative_to(ROOT / "engine").as_posix() for f in run.stdout.split()}
    no_effect = {"__init__.py", "errors.py", "paths.py"}  # messages and cache locations, not what is compiled
    assert loaded - no_effect <= covered, loaded - no_effect - covered
    # Nothing the compiled module depends on hides in a module the hash does not read.
    assert "COMPILE_FLAGS" not in (ROOT / "engine" / "exporter" / "export.py").read_text()
    assert len(export_code.export_code_hash()) == 16
