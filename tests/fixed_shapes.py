"""One sequence of calls that holds a build of fixed call shapes (engine/shapes.py) to a CPU build of dynamic ones:
tests/test_vulkan.py runs it on lavapipe, tests/test_cuda.py on a cuda build's program compiled for the CPU."""
from __future__ import annotations

import numpy as np


def same_calls(gpu, cpu, tol: float = 1e-4) -> float:
    """Calls of every padded length, every program the module holds, a window that slides (sinks shifted), scoring,
    a snapshot restored and a rewind: every logit and log-probability within `tol` of the CPU build's. Returns the
    largest difference."""
    shapes = gpu.shapes
    assert shapes is not None and cpu.shapes is None and shapes.ring == gpu.ring
    ran: set[str] = set()
    program = gpu.module._program

    def spy(kind: str, args: tuple):
        ran.add(gpu.module.program_name(kind, args))
        return program(kind, args)

    gpu.module._program = spy
    ids = [int(i) for i in np.random.RandomState(9).randint(0, gpu.cfg.vocab_size, 400)]
    worst, at = 0.0, 0

    def same(call) -> None:
        nonlocal worst
        got, want = call(gpu), call(cpu)
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got - want).max()))
        assert np.abs(got - want).max() < tol, (gpu.cfg.arch, worst)

    def feed(n: int) -> None:
        nonlocal at
        part = ids[at:at + n]
        at += n
        if n == 1:
            same(lambda e: e.decode(part[0]))
        else:
            same(lambda e: e.prefill(part))

    try:
        for e in (gpu, cpu):
            e.reset()
        # Lengths under, at and over each chunk size, decode steps between: the cache fills through every bucket.
        for n in (5, 1, 1, shapes.chunks[0], 1, shapes.chunks[-1] + 1, 1, 5, 1):
            feed(n)
        saved = [e.snapshot() for e in (gpu, cpu)]
        keep = gpu.position - 6  # a rewind (not where a local ring has wrapped: there a rewind rebuilds)
        assert gpu.truncate(keep) == cpu.truncate(keep) == (not gpu.ring)
        for n in (9, 2 * shapes.chunks[-1] - 1, 1):
            feed(n)
        while at < 3 * gpu.capacity:  # past the window: the ring wraps, every call reads the whole cache
            for n in (7, 1, 3):
                feed(n)
        assert gpu.evicted > 0 and gpu.mirror() == cpu.mirror()
        assert gpu.module.tokens_fed == cpu.module.tokens_fed
        same(lambda e: e.score(ids[:20], ids[1:21]))
        for e, snap in zip((gpu, cpu), saved):
            e.restore(snap)
        feed(1)
    finally:
        gpu.module._program = program
    names = {name for name, _, _ in shapes.programs()}
    assert ran == names, (gpu.cfg.arch, sorted(names - ran))
    return worst


