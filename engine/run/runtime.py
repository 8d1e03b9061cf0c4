"""Runs a compiled StreamingLLM module with iree.runtime. No torch on this path.

`CompiledModule` is the thin IREE wrapper; `StreamingEngine` keeps the host side of the cache: which token
sits in which slot (the token-level mirror), where the next tokens go, and the statistics the UI shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import iree.runtime as rt

from . import rope
from .sampling import largest
from ..config import ATTEND_STEP, REFINED_ROWS, BuildSettings, ModelConfig
from ..events import CacheStats
from ..devices import driver
from ..errors import ArtefactError, DeviceError
from ..gpu import check_runnable
from ..shapes import call_shapes, decode_name, prefill_name, score_name

EMPTY_SLOT = 2**62  # must equal engine.exporter.model.EMPTY_SLOT: later than every token, so always masked


class CompiledModule:
    """The .vmfb and its .irpa loaded into one IREE context; the KV cache lives in the module's globals."""

    def __init__(self, folder: Path, settings: BuildSettings | None = None) -> None:
        vmfb, irpa = folder / "module.vmfb", folder / "weights.irpa"
        for f in (vmfb, irpa):
            if not f.is_file():
                raise ArtefactError(f"compiled artefact missing: {f}")
        settings = settings or BuildSettings()
        device = self.device_kind = settings.device
        if device != "cpu":
            check_runnable(settings)  # a sentence naming what is missing, before IREE's status code
        try:
            self.device = rt.get_device(driver(device))
        except RuntimeError as e:  # a driver IREE cannot start (no Vulkan loader, a CUDA driver too old)
            raise DeviceError(f"cannot open the {device} device: {e}") from e
        try:
            self.instance = rt.VmInstance()
            index = rt.ParameterIndex()
            index.load(str(irpa))
            params = rt.create_io_parameters_module(self.instance, index.create_provider(scope="model"))
            hal = rt.create_hal_module(self.instance, self.device)
            main = rt.VmModule.mmap(self.instance, str(vmfb))
            self.context = rt.SystemContext(vm_modules=[hal, params, main], config=rt.Config(device=self.device))
            functions = self._functions = self.context.modules.module
            # One prefill, decode and score of dynamic shapes (a CPU build), or one per call shape (engine/shapes.py).
            self.fixed = "prefill" not in main.function_names
            # decode's logits come from a 4-bit copy of the head, the likeliest made again by refine (model.py).
            self.refines = "refine" in main.function_names
            self._programs: dict[str, object] = {}  # looked up once each
            self._reset = functions["reset"]
            self._snapshot, self._restore = functions["snapshot"], functions["restore"]
        # IREE reports a bad file as RuntimeError, ValueError or IndexError (a parameter index or a parameter out
        # of the file's range: a truncated .irpa, or a .vmfb built for other weights), OSError for unreadable files.
        except (RuntimeError, ValueError, LookupError, OSError) as e:
            raise ArtefactError(f"cannot load the compiled module in {folder}: {e}") from e
        self.tokens_fed = 0  # tokens written into the cache since the last reset, counted at the module's door
        self.next_position = 0  # one past the last position the module was given
        # The cache as loaded is empty: reset() skips the module's own until something was written. Its reset
        # stores a new zeroed cache and IREE keeps the buffer it replaces for reuse, so a reset straight after the
        # load held two caches for nothing (46 of the default model's 301 MB peak in a one-shot answer).
        self.clean = True

    def _count(self, token_pos: np.ndarray) -> None:
        # The module itself keeps no counter (the host passes every position), so this is the module-side
        # record of what it was actually fed; tests check it against StreamingEngine's bookkeeping. A call's
        # positions run on from its first (padding repeats its last), so its first and last count its tokens.
        self.clean = False
        self.tokens_fed += int(token_pos[-1]) - int(token_pos[0]) + 1
        self.next_position = int(token_pos[-1]) + 1

    def program_name(self, kind: str, args: tuple[np.ndarray, ...]) -> str:
        """The name of the "prefill" or "decode" program that takes a call of these arguments."""
        if not self.fixed:
            return kind
        return decode_name(len(args[4])) if kind == "decode" else prefill_name(len(args[0]), len(args[4]))

    def _program(self, kind: str, args: tuple[np.ndarray, ...]):
        return self._function(self.program_name(kind, args))

    def _function(self, name: str):
        fn = self._programs.get(name)
        if fn is None:
            try:
                fn = self._programs[name] = self._functions[name]
            except (KeyError, AttributeError) as e:  # the host pads to the module's shapes: a mismatch is a bug
                raise ArtefactError(f"the compiled module has no program {name}") from e
        return fn

    # Results are copied out: to_host() is a view of a device buffer that IREE recycles once the result
    # object is collected, so a kept view would silently change under a later call.
    # Every entry point takes the new tokens' positions (token_pos) as its last argument.
    def prefill(self, *args: np.ndarray) -> np.ndarray:
        out = self._host(self._program("prefill", args)(*args))
        self._count(args[-1])
        return out

    def decode(self, *args: np.ndarray) -> np.ndarray:
        out = self._host(self._program("decode", args)(*args))
        self._count(args[-1])
        return out

    def refine(self, ids: np.ndarray) -> np.ndarray:
        """The 8-bit head's logits of tokens `ids` [REFINED_ROWS] after the last decode."""
        return self._host(self._function("refine")(ids))

    def _host(self, result: rt.DeviceArray) -> np.ndarray:
        """A call's result as an array of its own. On vulkan through a staging buffer: iree.runtime's to_host()
        imports a fresh numpy array as device-visible memory where the driver offers imports, and Vulkan drivers
        may want the pointer page-aligned (lavapipe: "minImportedHostPointerAlignment 4096"), which numpy's is
        not."""
        if self.device_kind != "vulkan":
            return np.array(result.to_host())
        view = result._buffer_view  # iree.runtime 3.13 (pinned): the result's HAL buffer view
        source = view.get_buffer()
        staging = self.device.allocator.allocate_buffer(
            memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
            allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
            allocation_size=source.byte_length())
        done = self.device.create_semaphore(0)
        self.device.queue_copy(source, staging, wait_semaphores=rt.HalFence.create_at(done, 0),
                               signal_semaphores=rt.HalFence.create_at(done, 1))
        rt.HalFence.create_at(done, 1).wait()
        dtype = rt.HalElementType.map_to_dtype(view.element_type)
        return np.array(staging.map().asarray(tuple(view.shape), dtype))

    def score(self, tokens: np.ndarray, targets: np.ndarray, *rest: np.ndarray) -> np.ndarray:
        """prefill's arguments with the targets after the tokens: the log-probabilities of the targets. The module's
        score reads the hidden rows its prefill keeps (engine/exporter/model.py), so this is those two calls."""
        self._program("prefill", (tokens, *rest))(tokens, *rest)
        if self.fixed:  # the targets padded as the tokens were
            n, padded = len(targets), np.zeros(len(tokens), targets.dtype)
            padded[:n] = targets
            out = self._host(self._function(score_name(len(tokens)))(padded))[:n]
        else:
            out = self._host(self._function("score")(targets))
        self._count(rest[-1])
        return out

    def reset(self) -> None:
        if not self.clean:
            self._reset()
            self.clean = True
        self.tokens_fed = self.next_position = 0

    def snapshot(self) -> tuple:
        """The cache globals as the module returns them: device arrays, left on the device (no host copy)."""
        out = self._snapshot()
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def restore(self, saved: tuple, next_position: int) -> None:
        self._restore(*saved)
        self.clean = False
        self.next_position = next_position


@dataclass(frozen=True)
class CacheSnapshot:
    """A conversation's whole cache state: the module's buffers and the host's record of what is in them."""
    buffers: tuple
    position: int
    sinks: int
    pinned: int
    slot_pos: np.ndarray
    slot_token: np.ndarray
    ring_pos: np.ndarray


class StreamingEngine:
    """A conversation's cache: sinks kept forever, then a ring over the window."""

    def __init__(self, module: CompiledModule, cfg: ModelConfig, settings: BuildSettings) -> None:
        self.module, self.cfg, self.settings = module, cfg, settings
        self.freqs = rope.inv_freqs(cfg)
        self.ring = cfg.local_ring(settings)  # the local layers' own ring (0: none)
        self.chunk = cfg.prefill_bound(settings)  # most tokens per prefill call
        self.shapes = call_shapes(cfg, settings)  # None: the module's calls take any shape
        self.reset()

    def reset(self) -> None:
        s = self.settings
        self.module.reset()
        self.position = 0  # tokens fed so far in this conversation
        self.sinks, self.pinned = s.sinks, 0  # this conversation's sink count (see pin)
        self.slot_pos = np.full(s.slots, EMPTY_SLOT, dtype=np.int64)
        self.slot_token = np.full(s.slots, -1, dtype=np.int64)
        self.ring_pos = np.full(self.ring, EMPTY_SLOT, dtype=np.int64)  # position held by each ring slot

    def pin(self, tokens: int) -> None:
        """Makes this conversation's first `tokens` tokens sinks (at least the build's sink count): a pinned system
        prompt stays in the cache forever. Only before the first token; ValueError past the compiled bound."""
        if self.position:
            raise ValueError("the sink count is chosen before a conversation's first token")
        if tokens > self.settings.sink_slots:
            raise ValueError(f"{tokens} tokens to pin, but the cache has {self.settings.sink_slots} sink slots")
        self.sinks, self.pinned = max(self.settings.sinks, tokens), tokens

    @property
    def capacity(self) -> int:
        """Tokens the cache holds in this conversation: its sinks and the window."""
        return self.sinks + self.settings.window

    @property
    def stats(self) -> CacheStats:
        cap = self.capacity
        return CacheStats(self.sinks, self.settings.window, cap, min(self.position, cap), self.evicted, self.position,
                          self.pinned)

    @property
    def evicted(self) -> int:
        return max(0, self.position - self.capacity)

    def snapshot(self) -> CacheSnapshot:
        """Saves the cache (about a millisecond per 10 MB of cache on a CPU); `restore` brings it back."""
        return CacheSnapshot(self.module.snapshot(), self.position, self.sinks, self.pinned, self.slot_pos.copy(),
                             self.slot_token.copy(), self.ring_pos.copy())

    def restore(self, snap: CacheSnapshot) -> None:
        self.module.restore(snap.buffers, snap.position)
        self.position, self.sinks, self.pinned = snap.position, snap.sinks, snap.pinned
        self.slot_pos, self.slot_token, self.ring_pos = snap.slot_pos.copy(), snap.slot_token.copy(), snap.ring_pos.copy()

    def can_truncate(self, k: int) -> bool:
        """Whether the cache can go back to its first k tokens in place: nothing it held then has left it since.

        Once a token was evicted, or (local rings) a ring slot was written twice, the state at k is gone and
        only a rebuild recovers it.
        """
        if not 0 <= k <= self.position:
            return False
        if k == self.position:
            return True
        return self.position <= self.capacity and (not self.ring or self.position <= self.ring)

    def truncate(self, k: int) -> bool:
        """Forgets every token after the first k (the mirror and positions rewind; their slots read as empty, so
        the module's stale entries are masked and then overwritten). False, with nothing changed, when
        can_truncate(k) is not true: the caller rebuilds."""
        if not self.can_truncate(k):
            return False
        gone = self.slot_pos >= k
        self.slot_pos[gone], self.slot_token[gone] = EMPTY_SLOT, -1
        self.ring_pos[self.ring_pos >= k] = EMPTY_SLOT
        self.position = self.module.next_position = k
        return True

    def mirror(self) -> list[int]:
        """The tokens the cache holds, in conversation order."""
        used = self.slot_pos != EMPTY_SLOT
        order = np.argsort(self.slot_pos[used], kind="stable")
        return self.slot_token[used][order].tolist()

    def attended(self) -> int:
        """How many of the cache's first slots a call reads: every used slot (the cache fills from slot 0: sinks,
        then the window's ring after the sink slots), so attention costs what the conversation holds."""
        used = np.flatnonzero(self.slot_pos != EMPTY_SLOT)
        if self.shapes:
            return self.shapes.bucket_for(int(used[-1]) + 1 if used.size else 1)
        blocks = -(-(int(used[-1]) + 1 if used.size else 1) // ATTEND_STEP)
        # At least 2 blocks, as the module was exported (engine/exporter/export.py); the cache has whole blocks.
        return ATTEND_STEP * min(max(blocks, 2), len(self.slot_pos) // ATTEND_STEP)

    def slot_of(self, positions: np.ndarray) -> np.ndarray:
        s, sinks = self.settings, self.sinks
        return np.where(positions < sinks, positions, s.sink_slots + (positions - sinks) % s.window)

    def _inputs(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        n = len(ids)
        positions = np.arange(self.position, self.position + n, dtype=np.int64)
        slots = self.slot_of(positions)
        self.slot_pos[slots] = positions
        self.slot_token[slots] = ids
        self.position += n
        # Sinks sit `evicted` positions closer to every query in the cache than in the conversation.
        shift = rope.module_tables(self.freqs, [self.evicted])[:, :, 0]
        # The local ring's positions go after the cache's, as they were before this call (the module attends
        # to the ring and the new tokens, then writes these at position % ring).
        slot_pos = np.concatenate([self.slot_pos[:self.attended()], self.ring_pos])
        if self.ring:
            self.ring_pos[positions % self.ring] = positions
        return ids, slots, rope.module_tables(self.freqs, positions), shift, slot_pos, positions

    def _chunks(self, ids: Sequence[int]) -> list[np.ndarray]:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            raise ValueError("a prefill evaluates at least one token")
        if arr.min() < 0 or arr.max() >= self.cfg.vocab_size:
            # The module's embedding gather does not check bounds.
            raise ValueError(f"token id out of range 0..{self.cfg.vocab_size - 1}")
        step = self.chunk
        return [arr[i : i + step] for i in range(0, len(arr), step)]

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Appends tokens (chunked within the compiled bound); returns the logits after the last [vocab]."""
        logits = None
        for chunk in self._chunks(ids):
            logits = self.module.prefill(*self._padded(self._inputs(chunk)))
        return logits[0]

    def _padded(self, args: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """A prefill call's inputs as the module takes them: padded to a chunk size where its shapes are fixed."""
        return self.shapes.pad(args) if self.shapes else args

    def decode(self, token: int) -> np.ndarray:
        """Appends one token; returns the logits after it [vocab]."""
        if self.position < self.sinks:  # a sink: the module's decode does not keep sink keys (Attention.write_cache)
            return self.prefill([token])
        logits = self.module.decode(*self._inputs(np.array([token], dtype=np.int64)))[0]
        if self.module.refines:  # the likeliest from the 8-bit head, the rest as its 4-bit copy gave them
            ids = largest(logits, REFINED_ROWS)
            logits[ids] = self.module.refine(ids)
        return logits

    def score(self, ids: Sequence[int], targets: Sequence[int]) -> np.ndarray:
        """Appends tokens; returns log p(targets[i]) after each [n]."""
        tg = np.asarray(targets, dtype=np.int64)
        out, done = [], 0
        for chunk in self._chunks(ids):
            tokens, *rest = self._padded(self._inputs(chunk))
            out.append(self.module.score(tokens, tg[done : done + len(chunk)], *rest))
            done += len(chunk)
        return np.concatenate(out)

