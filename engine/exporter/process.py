"""Builds a model's artefacts in a child process.

Why a child: Cancel stops a build at once whatever stage it is in (the torch export holds the GIL for tens
of seconds and cannot be interrupted from another thread); an exporter or compiler crash cannot take the
app down; and the gigabyte or so that torch needs for the export goes back to the system when the build
ends, so the app that asked for it never holds torch at all.

The parent passes the model and settings as JSON on the command line; the child answers one JSON object
per line on stdout: {"progress": [stage, fraction, detail]} (engine/artefacts/progress.py; a two-item one, from an
older child, has no detail), then {"done": {"config": ..., "seconds": ...}} or {"error": {"type": ...,
"message": ...}}.

A build dies with the process that asked for it, however that one ends (Cancel, an exception, SIGTERM, SIGKILL):
the child holds the read end of a pipe on its stdin whose only writer is the parent, and ends its whole process
group (itself and iree-compile) when that pipe reaches end-of-file, which the kernel guarantees once the parent
is gone. On Linux PR_SET_PDEATHSIG backs this up as a chain the kernel keeps: the child dies with the parent and
iree-compile with the child (die_with_parent), so a child killed before its watch thread runs strands nothing.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..config import BuildSettings
from ..errors import ArtefactError, BuildCancelled
from .child import answer, child_env, die_with_parent, error_from
from ..artefacts.progress import Progress, ignore

if TYPE_CHECKING:
    from ..checkpoint import ModelSource

POLL_S = 0.1


def build_in_child(source: "ModelSource", settings: BuildSettings, out_dir: Path,
                   progress: Progress | None = None,
                   should_cancel: Callable[[], bool] | None = None, module: Path | None = None) -> dict:
    """Writes the tokenizer files, module.vmfb and weights.irpa into out_dir from a child process; `module`, a
    module.vmfb built before for this shape and these settings (store.built_module), is taken instead of an export
    and a compile.

    Returns {"config": ModelConfig dict, "seconds": per-stage times}. Raises the child's EddyError as the
    same class, BuildCancelled as soon as should_cancel() says so, ArtefactError if the child dies."""
    report = progress or ignore
    cancelled = should_cancel or (lambda: False)
    job = {"source": {"name": source.name, "kind": source.kind, "path": str(source.path) if source.path else None},
           "settings": settings.to_dict(), "out": str(out_dir), "module": str(module) if module else None}
    env = child_env()
    with tempfile.TemporaryFile() as log:
        # A session of its own, so Cancel can end the child and the iree-compile it started in one go.
        # stdin is the lifeline (see _watch_parent): nothing is ever written to it, it only closes.
        child = subprocess.Popen([sys.executable, "-m", "engine.exporter.process", json.dumps(job)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                 start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True)
        reader.start()
        result: dict | None = None
        try:
            while True:
                if cancelled():
                    raise BuildCancelled("the build was cancelled")
                try:
                    line = lines.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if line is None:
                    break
                msg = _parse(line)
                if "progress" in msg:
                    stage, fraction, *detail = msg["progress"]
                    report(str(stage), float(fraction), str(detail[0]) if detail else "")
                elif "done" in msg:
                    result = msg["done"]
                elif "error" in msg:
                    raise error_from(msg["error"], "the build failed")
            child.wait()
        finally:
            if child.poll() is None:
                _kill(child)
            reader.join(timeout=5)
            if child.stdin:
                child.stdin.close()  # only now: closing it is what tells a live child to end
        if result is None or child.returncode:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-15:]
            raise ArtefactError(f"building the model failed (the build process ended with code {child.returncode})"
                                + (":\n" + "\n".join(tail) if tail else ""))
    return result


def _pump(stream, lines: "queue.Queue[str | None]") -> None:
    for raw in stream:
        lines.put(raw.decode(errors="replace"))
    lines.put(None)


def _parse(line: str) -> dict:
    try:
        msg = json.loads(line)
    except ValueError:
        return {}  # something else wrote to stdout (a library's print); not ours
    return msg if isinstance(msg, dict) else {}


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _watch_parent() -> None:
    """Ends this build's process group (this process and the iree-compile it runs) once the parent is gone.

    A new session (for Cancel's killpg) also takes the child out of the parent's terminal group, so a SIGTERM
    or Ctrl-C sent to the parent never reaches it; and SIGKILL runs no cleanup at all. The parent's end of
    the stdin pipe is closed by the kernel however the parent dies, so EOF here is the one reliable signal."""
    die_with_parent()
    # A private copy of the pipe, and stdin itself pointed at /dev/null: the interpreter's shutdown (which
    # closes sys.stdin, and aborts when a thread sits in its buffered reader) and iree-compile never touch it.
    lifeline = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def watch() -> None:
        try:
            while os.read(lifeline, 4096):
                pass  # the parent never writes; anything it did is of no interest
        except OSError:
            return  # not a pipe that can say the parent is gone; PR_SET_PDEATHSIG still stands
        try:
            os.killpg(0, signal.SIGKILL)
        except OSError:
            os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child(job: dict) -> None:
    from . import side_job

    # The other half of the build starts before this one imports torch: a second or two sooner.
    side = side_job.start(job)
    from . import export
    from ..checkpoint import ModelSource, read_config
    from ..config import ModelConfig

    def work(say: Callable[[dict], None]) -> None:
        s = job["source"]
        source = ModelSource(s["name"], s["kind"], Path(s["path"]) if s["path"] else None)
        cfg = ModelConfig.from_hf(read_config(source))
        seconds = export.build(source, cfg, BuildSettings(**job["settings"]), Path(job["out"]),
                               lambda stage, f, detail="": say({"progress": [stage, f, detail]}), side=side,
                               module=Path(job["module"]) if job.get("module") else None)
        say({"done": {"config": cfg.to_dict(), "seconds": seconds}})

    answer(job, work, "building the model")

if __name__ == "__main__":
    _watch_parent()
    _child(json.loads(sys.argv[1]))
