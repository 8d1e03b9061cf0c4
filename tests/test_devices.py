"""The device table is the one place a device is described, and the artefact key covers it."""
from __future__ import annotations

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
        flags = devices.compile_flags(name, "sm_89" if name == "cuda" else "")
        assert any(f.startswith("--iree-hal-target-device=") for f in flags)


def test_export_code_hash_covers_model_export_and_compile_flags():
    from engine.build import artefacts

    sources = [ROOT / "engine" / name for name in artefacts.EXPORT_SOURCES]
    assert all(p.is_file() for p in sources)
    covered = {p.relative_to(ROOT / "engine").as_posix() for p in sources}
    assert {"build/model.py", "build/export.py", "devices.py"} <= covered
    # Nothing the compiled module depends on hides in a module the hash does not read.
    assert "COMPILE_FLAGS" not in (ROOT / "engine" / "build" / "export.py").read_text()
    assert len(artefacts.export_code_hash()) == 16
