"""The fixed call shapes of a module built for a GPU (engine/devices.py: Device.fixed_shapes). Torch-free: the export
takes the programs to trace from here, the runtime the program a call runs and how it is padded.

IREE's GPU code generation tiles only what it can see: with the token count and the attended slots dynamic, a
512-token chunk ran 6.2x slower than the same model with both fixed (docs/GPU.md, the H200 probe). So a GPU build
holds a prefill program per chunk size and attended-slot bucket, and a decode program per bucket; the host pads a
call up to the next chunk size and reads the cache's first slots up to the next bucket. A padded token is masked out
of every real token's attention and written to a slot nobody reads: the cache's slot `trash` (one past the slots a
call can attend to), the local ring's slot `ring`. The CPU keeps one program of each, dynamic in both (its
hand-written kernels read the used slots in blocks, and padding would cost it what it computes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ATTEND_STEP, BuildSettings, ModelConfig
from .devices import fixed_shapes

# Chunk sizes: the prefill bound and these fractions of it (512: 512, 128, 32), none under MIN_CHUNK. A chat turn of
# 30 tokens then costs a 32-token call, not a 512-token one; a 600-token document 512 + 128.
CHUNK_DIVISORS = (1, 4, 16)
MIN_CHUNK = 4
# Attended-slot buckets: the cache's slots and up to three halvings (1024: 1024, 512, 256, 128), each a whole number
# of blocks: a short conversation reads an eighth of the cache, not all of it.
BUCKET_HALVINGS = 3


@dataclass(frozen=True)
class CallShapes:
    chunks: tuple[int, ...]  # prefill sizes, ascending
    buckets: tuple[int, ...]  # how many of the cache's first slots a call attends to, ascending
    trash: int  # the cache slot a padded token is written to (the cache has one more than settings.slots)
    ring: int  # the local ring's slots (0: none): a padded token goes to ring slot `ring`, one past them

    def chunk_for(self, n: int) -> int:
        """The prefill size a call of n tokens is padded to (n is never more than the largest)."""
        return next(c for c in self.chunks if c >= n)

    def bucket_for(self, used: int) -> int:
        """The attended slots a call reads when its last used slot is `used` - 1."""
        return next(b for b in self.buckets if b >= used)

    def programs(self) -> list[tuple[str, int, int]]:
        """(name, new tokens, attended slots) of every prefill and decode program the module holds."""
        return ([(prefill_name(c, b + self.ring), c, b) for c in self.chunks for b in self.buckets]
                + [(decode_name(b + self.ring), 1, b) for b in self.buckets])

    def pad(self, args: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """A prefill call's (tokens, slots, rope, shift, slot_pos, token_pos) padded to the next chunk size: padded
        tokens are id 0 at the trash slot, with the last real token's position and rotation (so their own attention
        is the last token's, finite, and the module masks them out of everyone else's)."""
        tokens, slots, rope, shift, slot_pos, token_pos = args
        n = len(tokens)
        extra = self.chunk_for(n) - n
        if not extra:
            return args
        return (np.concatenate([tokens, np.zeros(extra, tokens.dtype)]),
                np.concatenate([slots, np.full(extra, self.trash, slots.dtype)]),
                np.concatenate([rope, np.repeat(rope[:, :, -1:], extra, axis=2)], axis=2),
                shift, slot_pos,
                np.concatenate([token_pos, np.full(extra, token_pos[-1], token_pos.dtype)]))


def prefill_name(tokens: int, slot_pos: int) -> str:
    """A fixed prefill program's name, by its inputs' lengths (new tokens, and slot_pos: attended slots + ring)."""
    return f"prefill_{tokens}_{slot_pos}"


def decode_name(slot_pos: int) -> str:
    return f"decode_{slot_pos}"


def score_name(tokens: int) -> str:
    """The scoring program after a prefill of this chunk size (its targets padded alike)."""
    return f"score_{tokens}"


def call_shapes(cfg: ModelConfig, settings: BuildSettings) -> CallShapes | None:
    """The fixed shapes of a build for `settings.device` and its target, or None where its programs are dynamic
    (the CPU, engine/devices.py's DYNAMIC_TARGETS)."""
    if not fixed_shapes(settings.device, settings.target):
        return None
    bound, slots = cfg.prefill_bound(settings), settings.slots
    chunks = sorted({bound} | {bound // d for d in CHUNK_DIVISORS if bound // d >= MIN_CHUNK})
    buckets = sorted({-(-(slots >> k) // ATTEND_STEP) * ATTEND_STEP for k in range(BUCKET_HALVINGS + 1)
                      if slots >> k >= ATTEND_STEP})
    return CallShapes(tuple(chunks), tuple(buckets), slots, cfg.local_ring(settings))
