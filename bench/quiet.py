"""A quiet-machine gate for benchmark samples: a sample counts only when nothing outside our own process tree
used the CPU while it ran; otherwise it is taken again, up to a bound, and the retries are reported.

Other processes' CPU time during a sample = the system's busy time (/proc/stat: user, nice, system, irq, softirq
and steal, i.e. everything but idle and iowait, over all CPUs) less the CPU time of our own process tree (the
bench's root process and all its descendants, psutil; plus any child reaped during the sample, from its rusage).
Both counters tick in 1/USER_HZ steps (10 ms), so a floor absorbs their rounding.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user).
_BUSY = (0, 1, 2, 5, 6, 7)
_STEAL = 7


def system_cpu() -> tuple[float, float]:
    """(busy seconds over all CPUs since boot, of which steal), from /proc/stat."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    fields += [0] * (10 - len(fields))
    return sum(fields[i] for i in _BUSY) * TICK, fields[_STEAL] * TICK


def tree_cpu(root: int) -> float:
    """User + system seconds of `root` and all its live descendants (threads included)."""
    import psutil

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def interference(system_busy_s: float, tree_s: float, wall_s: float, ncpu: int, floor_s: float,
                 fraction: float) -> tuple[float, bool]:
    """(other processes' CPU seconds during a sample, whether the sample counts as quiet).

    Quiet: the others used at most max(floor_s, fraction * wall_s * ncpu) CPU seconds, i.e. at most `fraction`
    of the machine over the sample, with `floor_s` for the counters' tick rounding on short samples."""
    other = max(0.0, system_busy_s - tree_s)
    return other, other <= max(floor_s, fraction * wall_s * ncpu)


@dataclass
class Figure:
    """One figure: its accepted samples (seconds), what the gate saw, and its median."""

    name: str
    samples: list[float] = field(default_factory=list)
    other_cpu_s: list[float] = field(default_factory=list)  # others' CPU during each accepted sample
    retries: int = 0  # samples thrown away because the machine was not quiet
    noisy: int = 0  # accepted samples that never got a quiet try (retries exhausted): the least disturbed try
    extra: list[Any] = field(default_factory=list)  # what each accepted sample's body returned
    budget_out: bool = False  # the gate's retry budget ran out during this figure

    @property
    def median(self) -> float:
        s = sorted(self.samples)
        n = len(s)
        return (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2) if n else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "samples_s": self.samples, "retries": self.retries, "noisy": self.noisy,
                "retry_budget_out": self.budget_out, "other_cpu_s": [round(x, 3) for x in self.other_cpu_s],
                **({"extra": self.extra} if any(e is not None for e in self.extra) else {})}


class Gate:
    """Takes samples of a timed body, each retried while other processes use the CPU."""

    def __init__(self, root: int | None = None, samples: int = 5, max_retries: int = 10, fraction: float = 0.05,
                 floor_s: float = 0.03, backoff_s: float = 1.0, enabled: bool = True, retry_budget_s: float = 1e9,
                 log: Callable[[str], None] | None = None) -> None:
        self.root = root or int(os.environ.get("PEERS_ROOT_PID", os.getpid()))
        self.samples, self.max_retries, self.fraction, self.floor_s = samples, max_retries, fraction, floor_s
        self.backoff_s, self.enabled, self.log = backoff_s, enabled, log or (lambda s: None)
        # Seconds of thrown-away tries (and their back-off) this gate may spend in all; past it, each sample is
        # taken once and counted noisy when not quiet, so a machine that is never quiet still ends.
        self.retry_budget_s, self.retry_spent_s = retry_budget_s, 0.0
        self.ncpu = os.cpu_count() or 1
        self.figures: dict[str, Figure] = {}

    def config(self) -> dict[str, Any]:
        return {"samples": self.samples, "max_retries_per_sample": self.max_retries, "quiet_fraction": self.fraction,
                "quiet_floor_s": self.floor_s, "backoff_s": self.backoff_s, "enabled": self.enabled,
                "cpus": self.ncpu, "tick_s": TICK, "retry_budget_s": self.retry_budget_s}

    def figure(self, name: str, body: Callable[[], Any], setup: Callable[[], Any] | None = None) -> Figure:
        """`samples` accepted samples of body()'s wall time. body() may return a dict with `reaped_cpu_s` (CPU
        seconds of children it started and reaped, which have left our live tree by the end) and anything else,
        kept in Figure.extra. setup() runs before each try, outside the timing."""
        fig = Figure(name)
        for _ in range(self.samples):
            tries: list[tuple[float, float, Any, bool]] = []
            for attempt in range(self.max_retries + 1):
                if setup:
                    setup()
                t0 = tree_cpu(self.root)
                s0, _ = system_cpu()
                start = time.perf_counter()
                out = body()
                wall = time.perf_counter() - start
                s1, _ = system_cpu()
                t1 = tree_cpu(self.root)
                reaped = out.get("reaped_cpu_s", 0.0) if isinstance(out, dict) else 0.0
                other, quiet = interference(s1 - s0, t1 - t0 + reaped, wall, self.ncpu, self.floor_s, self.fraction)
                tries.append((wall, other, out, quiet or not self.enabled))
                if quiet or not self.enabled or attempt == self.max_retries:
                    break
                if self.retry_spent_s >= self.retry_budget_s:
                    fig.budget_out = True
                    break
                self.retry_spent_s += wall + self.backoff_s
                self.log(f"  {name}: not quiet ({other * 1e3:.0f} ms of others' CPU in {wall * 1e3:.0f} ms), "
                         f"retry {attempt + 1}/{self.max_retries}")
                time.sleep(self.backoff_s)
            if tries[-1][3]:
                wall, other, out, _ = tries[-1]
            else:  # never quiet: keep the least disturbed try, counted as noisy
                wall, other, out, _ = min(tries, key=lambda t: t[1])
                fig.noisy += 1
            fig.retries += len(tries) - 1
            fig.samples.append(wall)
            fig.other_cpu_s.append(other)
            fig.extra.append({k: v for k, v in out.items() if k != "reaped_cpu_s"} if isinstance(out, dict) else None)
        self.figures[name] = fig
        self.log(f"  {name}: median {fig.median * 1e3:.1f} ms over {len(fig.samples)} "
                 f"(retries {fig.retries}, noisy {fig.noisy})")
        return fig
