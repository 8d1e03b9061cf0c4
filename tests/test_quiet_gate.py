"""The quiet-machine gate's arithmetic (bench/quiet.py): others' CPU = system busy time less our own tree's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quiet import Gate, interference  # noqa: E402


def test_others_cpu_is_system_less_our_tree():
    other, quiet = interference(system_busy_s=1.30, tree_s=1.00, wall_s=1.0, ncpu=2, floor_s=0.03, fraction=0.05)
    assert abs(other - 0.30) < 1e-9 and not quiet  # 0.3 s of others' CPU > 5 % of 2 CPU-seconds


def test_quiet_within_fraction_or_floor():
    assert interference(1.08, 1.00, 1.0, 2, 0.03, 0.05)[1]  # 0.08 s <= 0.1 s (5 % of 2 CPU-seconds)
    assert interference(0.045, 0.02, 0.05, 2, 0.03, 0.05)[1]  # a short sample: 25 ms is under the 30 ms floor
    assert not interference(0.07, 0.02, 0.05, 2, 0.03, 0.05)[1]


def test_tick_rounding_never_gives_negative_others():
    assert interference(0.99, 1.00, 1.0, 2, 0.03, 0.05) == (0.0, True)


def test_gate_retries_are_bounded_and_counted(monkeypatch):
    import bench.quiet as q

    busy = iter(range(0, 10_000, 5))  # the system gains 5 CPU-seconds per reading: never quiet
    monkeypatch.setattr(q, "system_cpu", lambda: (float(next(busy)), 0.0))
    monkeypatch.setattr(q, "tree_cpu", lambda root: 0.0)
    gate = Gate(root=1, samples=2, max_retries=3, backoff_s=0.0)
    fig = gate.figure("x", lambda: None)
    assert len(fig.samples) == 2 and fig.noisy == 2 and fig.retries == 2 * 3


def test_gate_stops_retrying_when_its_budget_is_spent(monkeypatch):
    import bench.quiet as q

    busy = iter(range(0, 10_000, 5))
    monkeypatch.setattr(q, "system_cpu", lambda: (float(next(busy)), 0.0))
    monkeypatch.setattr(q, "tree_cpu", lambda root: 0.0)
    gate = Gate(root=1, samples=3, max_retries=5, backoff_s=0.0, retry_budget_s=0.0)
    fig = gate.figure("x", lambda: None)
    assert len(fig.samples) == 3 and fig.noisy == 3 and fig.retries == 0 and fig.budget_out
