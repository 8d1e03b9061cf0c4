"""The half of a build that needs the checkpoint but not the export: the tokenizer files and weights.irpa, written
by a process of its own while the build child exports and compiles (needs torch).

Why another process: the export is pure Python and holds the GIL, and the tokenizer's conversion is pure Python
too, so threads would take turns on one core; as processes the two halves use both cores of a 2-core machine,
and a 1B model's first token comes 15-20 s sooner (docs/BENCHMARKS.md). The build child starts it with
`start()` and reads its answers, one JSON object per line on stdout:
{"weights": [pieces done, pieces, bytes done, bytes]}, {"tokenizer": seconds}, then {"done": {"save": seconds,
"tokenizer": seconds}} or {"error": {"type", "message"}}. It dies with the build child (tied_to_me) and is in
its process group, so Cancel's killpg ends it too.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ..config import BuildSettings
from .child import answer, child_env, tied_to_me


# glibc maps each allocation over 32 MB on its own and unmaps it when freed, so every chunk of float32 rows,
# every tile copy and every tensor of codes started as untouched pages: on the 2-core VM of docs/BENCHMARKS.md a
# fresh page cost ~11 us (0.36 GB/s), and an 8B's weights file spent more time faulting pages in than converting
# them. From the heap, freed chunks are reused: an 8B's weights file in 22 s instead of 42 (one thread), its peak
# 2.2 GB instead of 1.9; the 1B's 4.2 s instead of 8.9.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def start(job: dict) -> subprocess.Popen:
    """Starts the side job for a build job ({"source", "settings", "out"}, engine/exporter/process.py's)."""
    env = child_env()
    # numpy asks for transparent huge pages for large arrays; where the kernel then compacts memory on each fault
    # (defrag=madvise, the common default) a fresh gigabyte took 6.7 s to fill instead of 0.5 s.
    env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    env.update(MALLOC_ENV)
    return subprocess.Popen([sys.executable, "-m", "engine.exporter.side_job", json.dumps(job)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, preexec_fn=tied_to_me())


def piece_bytes(model) -> tuple[list[int], int]:
    """Bytes each piece of the model writes (its module's weight and q8 scale, or its bias), and their total (0
    when they do not add up to the parameters', and progress counts pieces instead): the embedding alone can be a
    tenth of a model, so counting pieces alone would stall on it."""
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    each = [sum(n for name, n in sizes.items() if name.startswith(piece.module + ".")
                and name.endswith(".bias") == (piece.kind == "bias")) for piece in model.pieces()]
    return each, (sum(each) if sum(each) == sum(sizes.values()) else 0)


def _run(job: dict, say) -> None:
    import torch

    from ..config import ModelConfig
    from ..checkpoint import ModelSource, open_tensors, read_config, save_tokenizer
    from .model import StreamingLlama
    from .weights_file import write_weights

    s = job["source"]
    source = ModelSource(s["name"], s["kind"], Path(s["path"]) if s["path"] else None)
    settings = BuildSettings(**job["settings"])
    out_dir = Path(job["out"])
    cfg = ModelConfig.from_hf(read_config(source))
    # One thread beside the export, which holds the other core (and iree-compile wants both after it); both where
    # the build takes a module built before (the job's "module") and the weights are all there is to do: a 1B's in
    # 7.9 s instead of 9.4.
    torch.set_num_threads(2 if job.get("module") else 1)
    model = StreamingLlama.skeleton(cfg, settings)
    tensors = open_tensors(source)
    each, total = piece_bytes(model)
    start_s = time.perf_counter()
    written = 0

    def progress(done: int, pieces: int) -> None:
        nonlocal written
        written += each[done - 1]
        say({"weights": [done, pieces, written if total else 0, total]})

    write_weights(model, tensors, out_dir / "weights.irpa", progress)
    save_s = time.perf_counter() - start_s
    del model, tensors
    start_s = time.perf_counter()
    save_tokenizer(source, out_dir)
    tokenizer_s = time.perf_counter() - start_s
    say({"done": {"save": save_s, "tokenizer": tokenizer_s}})


def main(job: dict) -> None:
    answer(job, lambda say: _run(job, say), "writing the weights file")

if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
