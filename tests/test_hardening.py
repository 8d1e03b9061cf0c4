"""Issue 42: a killed build leaves nothing running or behind, a template cannot take all memory by growing a
string, and bad command-line input gets one clear sentence."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT

# --- a build dies with the process that asked for it -----------------------------------------------------------

# A capacity no other test builds, so the build is never found warm.
KILL_SETTINGS = "BuildSettings(sinks=2, window=26, dtype='f32', max_chunk=8)"

PARENT = (
    "import sys\n"
    "from engine.artefacts.store import ensure_artefacts\n"
    "from engine.checkpoint import resolve_model\n"
    "from engine.config import BuildSettings\n"
    "def report(stage, fraction, detail=''):\n"
    "    print(stage, flush=True)\n"
    f"ensure_artefacts(resolve_model('tiny-random'), {KILL_SETTINGS}, report)\n"
)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig, stage, victim", [(signal.SIGTERM, "compiling", "parent"),
                                                (signal.SIGKILL, "exporting", "parent"),
                                                (signal.SIGKILL, "compiling", "build")],
                         ids=["SIGTERM-while-compiling", "SIGKILL-while-exporting", "build-SIGKILLed-while-compiling"])
def test_a_killed_parent_takes_its_build_and_compiler_with_it(tmp_path: Path, sig: int, stage: str,
                                                              victim: str) -> None:
    # "build": the build child itself is killed outright, as the kernel does to it when the parent dies; it runs
    # no code after that, so only the kernel can end its compiler.
    env = dict(os.environ, EDDY_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in parent.stdout:
            if line.strip() == stage:
                break
        else:
            pytest.fail(f"the build ended before {stage}: {parent.wait()}")
        me = psutil.Process(parent.pid)
        want = "iree-compile" if stage == "compiling" else "engine.exporter.process"
        deadline = time.monotonic() + 20
        while not any(want in " ".join(p.cmdline()) for p in _alive(me.children(recursive=True))):
            assert time.monotonic() < deadline, f"no {want} process appeared"
            time.sleep(0.05)
        build = me.children(recursive=True)
        if victim == "parent":
            os.kill(parent.pid, sig)
            parent.wait(timeout=10)
        else:
            child = next(p for p in build if "engine.exporter.process" in " ".join(p.cmdline()))
            child.send_signal(sig)
        deadline = time.monotonic() + 5
        while _alive(build) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(build), f"outlived their parent: {[p.cmdline()[:3] for p in _alive(build)]}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    if victim == "build":
        return  # the parent lived on to see its build fail and cleans up itself: no sweep to test here

    from engine.artefacts.cache import list_entries

    root = tmp_path / "artefacts"
    staging = [p for p in root.iterdir() if ".building-" in p.name]
    assert staging, "the killed build left no staging folder: the test did not test the sweep"
    assert list_entries(root) == [] and not any(p.exists() for p in staging)


def _fake_entry(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "weights.irpa").write_bytes(b"x" * 10)
    return folder


def test_a_dead_builds_staging_folder_is_swept_and_never_makes_a_key_ambiguous(tmp_path: Path, capsys,
                                                                              monkeypatch) -> None:
    from engine.artefacts.cache import find, list_entries
    from engine.cli import main

    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path))
    tmp_path = tmp_path / "artefacts"
    tmp_path.mkdir()
    key = "0123456789abcdef0123"
    built = _fake_entry(tmp_path, f"tiny-random-f32-2+26-{key}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = _fake_entry(tmp_path, f"{built.name}.building-{dead.pid}")
    # A live build of the same key (this process's) is listed as building, not swept, and not chosen by a key.
    live = _fake_entry(tmp_path, f"{built.name}.building-{os.getpid()}")
    assert find(key[:6], tmp_path).folder == built
    assert not stale.exists() and live.exists()
    assert {e.state for e in list_entries(tmp_path)} == {"damaged", "building"}
    assert main(["cache", "rm", key[:6]]) == 0
    assert not built.exists() and live.exists()
    assert "ambiguous" not in capsys.readouterr().err


# --- a template cannot take all memory by growing text ---------------------------------------------------------

DOUBLING = "{% set ns = namespace(s='xx') %}{% for i in range(100) %}{% set ns.s = GROW %}{% endfor %}{{ ns.s }}"
GROWTH = {
    "tilde": "ns.s ~ ns.s",
    "plus": "ns.s + ns.s",
    "join filter": "[ns.s, ns.s]|join",
    "str.join": "''.join([ns.s, ns.s])",
    "str.format": "'{}{}'.format(ns.s, ns.s)",
    "format filter": "'%s%s'|format(ns.s, ns.s)",
    "percent": "'%s%s' % (ns.s, ns.s)",
    "str.replace": "ns.s.replace('x', 'xx')",
    "replace filter": "ns.s|replace('x', 'xx')",
    "indent filter": "ns.s ~ '\\n' ~ ns.s|indent(8)",
    "center filter": "ns.s|center(ns.s|length * 2)",
    "str.ljust": "ns.s.ljust(ns.s|length * 2)",
    "set block": None,
    "list doubling": None,
}
ONE_SHOT = [
    "{{ 'x'|center(10**10) }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ '{:>10000000000}'.format('x') }}",
    "{{ '%10000000000s' % 'x' }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|tojson }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|string }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join }}",
    "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "{{ lipsum(n=10000000) }}",
    "{{ [1]|batch(1000000000, 'x')|list }}",
    "{{ [[[[1]]]]|tojson(indent=1000000000) }}",
]


def _growth_template(name: str) -> str:
    if name == "set block":
        return ("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set b %}{{ ns.s }}{{ ns.s }}{% endset %}"
                "{% set ns.s = b %}{% endfor %}{{ ns.s }}")
    if name == "list doubling":
        return "{% set ns = namespace(l=['x']) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}"
    return DOUBLING.replace("GROW", GROWTH[name])


def _fails_fast_and_small(template: str) -> None:
    import tracemalloc

    from engine.errors import ModelError
    from engine.run.template_sandbox import render_template

    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ModelError, match=r"chat template is unsafe: the template (builds|asks)"):
            render_template(template, [{"role": "user", "content": "hi"}], True)
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 1.0, f"the template ran for {took:.2f} s before it was stopped"
    assert peak < 200 << 20, f"the template reached {peak >> 20} MB before it was stopped"


@pytest.mark.parametrize("name", list(GROWTH))
def test_a_string_doubled_in_a_loop_fails_fast_whatever_grows_it(name: str) -> None:
    _fails_fast_and_small(_growth_template(name))


@pytest.mark.parametrize("template", ONE_SHOT)
def test_one_huge_value_is_refused_before_it_is_made(template: str) -> None:
    _fails_fast_and_small(template)


def test_a_template_that_accumulates_its_prompt_still_renders_a_long_chat() -> None:
    """The budget counts what is built, so a template that builds its prompt in a namespace (as some real ones
    build their system block) is well inside it for a long chat."""
    from engine.run.template_sandbox import render_template

    template = ("{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ '<|' ~ m['role'] ~ '|>' "
                "~ m['content'] | trim ~ '\\n' %}{% endfor %}{{ ns.s }}{{ '%s' % 'end' }}{{ messages|tojson(indent=2) }}")
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(200)]
    out = render_template(template, chat, True)
    assert out.count("<|user|>") == 100 and out.count("message 199") == 2 * 20 and out.endswith("}\n]")


# --- bad command-line input gets one clear sentence ------------------------------------------------------------


def eddy(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 600) \
        -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _one_clear_line(run: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert run.returncode == code, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert all(w in last for w in words), last


def test_an_impossible_window_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    env = dict(os.environ, EDDY_CACHE_DIR=str(tmp_path))
    for flags in (["--window", "1000000000"], ["--sinks", "1000000000"], ["--max-sinks", "9000", "--window", "8"]):
        run = eddy("compile", "--model", "tiny-random", "--dtype", "f32", *flags, env=env, timeout=120)
        _one_clear_line(run, 1, "eddy: error:", "8192 positions", "--window")
    assert not list((tmp_path / "artefacts").glob("*")) if (tmp_path / "artefacts").exists() else True
    from engine.config import BuildSettings, ModelConfig

    # The defaults and what a pinning build takes stay within the default model's positions.
    from engine.checkpoint import read_config, resolve_model

    cfg = ModelConfig.from_hf(read_config(resolve_model("smollm2-135m-instruct")))
    cfg.check_build(BuildSettings())
    cfg.check_build(BuildSettings(max_sinks=128, window=8064))


def test_an_empty_model_name_is_refused_not_taken_for_the_default() -> None:
    for command in ("chat", "compile", "bench"):
        _one_clear_line(eddy(command, "--model", "", "--prompt", "hi") if command == "chat"
                        else eddy(command, "--model", "  "), 2, "--model", "is empty")


@pytest.mark.parametrize("value", ["-3", "0", "many"])
def test_max_new_tokens_must_be_a_positive_number(value: str) -> None:
    _one_clear_line(eddy("chat", "--model", "tiny-random", "--max-new-tokens", value, "--prompt", "hi"), 2,
                    "--max-new-tokens", "must be")


def test_chat_answers_slash_commands_itself_and_never_sends_them_to_the_model(tiny) -> None:
    run = eddy("chat", "--model", "tiny-random", "--sinks", "4", "--window", "60", "--dtype", "f32",
               "--max-new-tokens", "2", "--json",
               stdin="/help\n/frobnicate\nhello\n//etc/hosts is a path\n/Exit\nnever sent\n")
    assert run.returncode == 0, run.stderr[-2000:]
    for command in ("/reset", "/quit", "/exit", "/help", "//text"):
        assert command in run.stderr
    assert "eddy: unknown command /frobnicate (/help lists them)" in run.stderr
    turns = [e for e in map(json.loads, filter(None, run.stdout.splitlines())) if e["event"] == "prefill"]
    assert len(turns) == 2  # "hello" and the escaped slash; no command, nothing after /exit
    from engine.cli import _chat_command

    assert [_chat_command(t) for t in ("/quit ", "/usr/bin", "/", "//x", "/help me")] == ["/quit", None, None, None,
                                                                                        None]


def test_progress_into_a_pipe_is_plain_lines(tmp_path: Path) -> None:
    env = dict(os.environ, EDDY_CACHE_DIR=str(tmp_path), TERM="xterm")
    run = eddy("compile", "--model", "tiny-random", "--sinks", "2", "--window", "22", "--dtype", "f32", env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("building: ")]
    assert [line.split()[1] for line in lines][:2] == ["loading", "exporting"] and lines[-1].startswith("building: done")
    assert "\r" not in run.stderr and "\x1b" not in run.stderr
