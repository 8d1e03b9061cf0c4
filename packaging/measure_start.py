"""Time from starting the packaged app to its first token, over several runs (median).

    python3 packaging/measure_start.py [dist/eddy/eddy] [--runs 5] [--drop-caches]

Each run is a new process: `eddy --ask "Hi"` (offscreen, empty temporary data and cache folders). The app
reports on stderr how long after its process started the first token came; this script also times the
first byte of the reply on stdout from outside. --drop-caches (root only) empties the page cache before each
run, so the model is read from disk as on the first start after boot.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(exe: Path, drop: bool) -> tuple[float, float]:
    if drop:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    with tempfile.TemporaryDirectory() as home:
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "QT_QPA_PLATFORM": "offscreen",
               "EDDY_CACHE_DIR": os.path.join(home, "cache"), "XDG_RUNTIME_DIR": home}
        start = time.perf_counter()
        proc = subprocess.Popen([str(exe), "--ask", "Hi"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = proc.stdout.read(1)
        outside = time.perf_counter() - start
        rest, err = proc.communicate(timeout=300)
        if proc.returncode or not first:
            sys.exit(f"run failed ({proc.returncode}): {err.decode()[-2000:]}")
        m = re.search(r"first token ([0-9.]+) s", err.decode())
        inside = float(m.group(1)) if m else float("nan")
        return inside, outside


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exe", nargs="?", default=str(Path(__file__).resolve().parents[1] / "dist" / "eddy" / "eddy"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--drop-caches", action="store_true")
    a = p.parse_args()
    inside, outside = [], []
    for i in range(a.runs):
        ins, out = one_run(Path(a.exe), a.drop_caches)
        inside.append(ins)
        outside.append(out)
        print(f"run {i + 1}: first token {ins:.2f} s after process start (app), first stdout byte {out:.2f} s", flush=True)
    print(f"median of {a.runs}: {statistics.median(inside):.2f} s (app), {statistics.median(outside):.2f} s (outside)"
          f"{' [page cache dropped before each run]' if a.drop_caches else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
