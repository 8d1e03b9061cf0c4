"""What every build process shares (engine/exporter/process.py's build child, engine/exporter/side_job.py's weights
writer): the environment it starts in, how it answers its parent, and dying with that parent."""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from .. import errors
from ..errors import ArtefactError, DiskSpaceError


def child_env() -> dict[str, str]:
    """The environment of a build process: it imports `engine` from where this one came from, installed or not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    return env


def error_from(err: dict, default: str) -> errors.EddyError:
    """A build process's {"error": {"type", "message"}} answer as the same EddyError class (else ArtefactError)."""
    cls = getattr(errors, str(err.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.EddyError)):
        cls = ArtefactError
    return cls(err.get("message", default))


def answer(job: dict, work: Callable[[Callable[[dict], None]], None], what: str) -> None:
    """Runs a build process's `work(say)`, which answers one JSON object per line on stdout, and answers its
    failure as {"error": ...} and exit code 1: an EddyError as itself, a full disk (the room was checked before the
    build; something else filled it meanwhile, or the estimate was short) as DiskSpaceError, and running out of
    memory, rather than a traceback. `what` names the work in the last ("building the model"). Does not return: the
    process ends, with 0 once the work is done."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library prints must not mix with the answers

    def say(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        work(say)
    except errors.EddyError as e:
        say({"error": {"type": type(e).__name__, "message": str(e)}})
        sys.exit(1)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        say({"error": {"type": DiskSpaceError.__name__,
                       "message": f"the disk holding {job['out']} filled up while the model was built: free some "
                                  f"space (eddy cache list shows what compiled models take) and start again"}})
        sys.exit(1)
    except MemoryError:
        say({"error": {"type": "ArtefactError", "message": f"{what} ran out of memory"}})
        sys.exit(1)
    # Everything the work wrote is closed by now (the weights file, the tokenizer's files; iree-compile and the side
    # job have ended), so the interpreter's own ending (torch, turbine and the compiler's bindings, a second or
    # more) is not waited for: the parent reads the end of this output as the build's end.
    sys.stderr.flush()
    os._exit(0)


def die_with_parent(parent: int | None = None) -> None:
    """Asks the kernel to SIGKILL this process when its parent ends (Linux; elsewhere the pipe watch stands alone).

    Also a Popen preexec_fn (pass the parent's pid): a parent that died between fork and this call has already
    handed the process to another, so the process ends at once rather than run unowned."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _load_prctl():
    # Resolved once, at import: a preexec_fn runs between fork and exec, where loading a library is not safe.
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


PR_SET_PDEATHSIG = 1
_prctl = _load_prctl()


def tied_to_me() -> Callable[[], None] | None:
    """A Popen preexec_fn that makes the new process die with this one; None where the kernel cannot."""
    me = os.getpid()
    return (lambda: die_with_parent(me)) if _prctl is not None else None
