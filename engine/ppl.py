"""`eddy ppl`: perplexity of a model over a long text, fed through the compiled module. No torch here.

Every mode scores log p(token | what the cache holds when it is predicted) with the module's `score` export.
The text is tokenised as one string (bos prepended when the tokenizer has one); the first token is not scored,
so a text of N tokens gives N - 1 losses, at positions 1 .. N-1 (a loss's position is its target's index).

Modes, for `--sinks S --window W` (capacity C = S + W):
  streaming  the StreamingLLM cache (S sinks + a ring of W recent tokens), fed in chunks of `chunk` tokens.
             A chunk first makes room for itself, so once the cache is full the i-th token of a chunk
             (0-based) sees the S sinks and W - chunk + 1 + i recent tokens (itself included): between
             W - chunk + 1 and W. chunk=1 is token-by-token decoding (it runs the `decode` export, the one
             chat generates with, and takes the log-softmax on the host; other chunks run `score`).
  window     the same capacity without sinks (sinks 0, window S + W): the oldest tokens simply leave.
  recompute  every `stride`-th position, the cache is reset and the C tokens before the target are scored
             from scratch (no eviction happens within C tokens): a sliding window with re-computation, the
             quality reference. Costs C token evaluations per scored position.
  dense      no eviction at all: a build whose capacity holds the whole scored text. Limited to the model's
             trained positions (max_positions): longer texts are cut to their first max_positions tokens.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

import numpy as np

from .config import BuildSettings, ModelConfig
from .errors import EddyError

MODES = ("streaming", "window", "recompute", "dense")
DEFAULT_CHUNK = 16
DEFAULT_STRIDE = 64
DENSE_MIN = 64  # smallest dense build; dense capacities are powers of two, so nearby lengths share one build


class TextError(EddyError):
    """The text to score is missing, unreadable or too short."""


def read_text(path: str | os.PathLike) -> str:
    p = Path(path)
    if not p.is_file():
        raise TextError(f"text file not found: {p}" if not p.exists() else f"not a file: {p}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TextError(f"{p} is not UTF-8 text: {e}") from None


def text_ids(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """The token ids to score: bos (when the tokenizer has one) then the text, cut to max_tokens."""
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode_text(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return ids


def dense_capacity(n_tokens: int, max_positions: int) -> int:
    """Capacity of a dense build for n tokens: the next power of two (at least DENSE_MIN), at most max_positions."""
    return min(max_positions, max(DENSE_MIN, 1 << (max(n_tokens, 1) - 1).bit_length()))


def build_settings(mode: str, sinks: int, window: int, dtype: str = BuildSettings.dtype, device: str = "cpu",
                   max_chunk: int = BuildSettings.max_chunk, dense_tokens: int = 0,
                   kv_dtype: str = BuildSettings.kv_dtype) -> BuildSettings:
    """The compiled module each mode runs on."""
    common = {"dtype": dtype, "device": device, "max_chunk": max_chunk, "kv_dtype": kv_dtype}
    if mode in ("streaming", "recompute"):
        return BuildSettings(sinks=sinks, window=window, **common)
    if mode == "window":
        return BuildSettings(sinks=0, window=sinks + window, **common)
    if mode == "dense":
        return BuildSettings(sinks=0, window=dense_tokens, **common)
    raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")


class Progress:
    """A one-line \\r progress report on a stream: tokens done / total, tokens/s, running perplexity."""

    def __init__(self, label: str, total: int, stream: TextIO | None, every_s: float = 0.5) -> None:
        self.label, self.total, self.stream, self.every = label, total, stream, every_s
        self.start = self.last = time.perf_counter()
        self.nll, self.count = 0.0, 0
        try:
            self.live = bool(stream is not None and stream.isatty())
        except (AttributeError, OSError, ValueError):
            self.live = False

    def update(self, done: int, losses: np.ndarray) -> None:
        self.nll += float(np.sum(losses))
        self.count += len(losses)
        now = time.perf_counter()
        if self.stream is not None and (now - self.last >= self.every or done >= self.total):
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            ppl = math.exp(self.nll / max(self.count, 1))
            line = f"ppl {self.label}: {done}/{self.total} tokens, {rate:.1f} tok/s, ppl {ppl:.3f}"
            if self.live:
                self.stream.write(f"\r\033[K{line}")
            elif done >= self.total:
                self.stream.write(line)  # a pipe or log gets the outcome, without terminal escapes
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def score_stream(engine, ids: list[int], chunk: int, progress: Progress | None = None) -> np.ndarray:
    """Feeds ids[:-1] from an empty cache, `chunk` tokens per call; returns the losses of ids[1:]."""
    engine.reset()
    arr = np.asarray(ids, dtype=np.int64)
    n = len(arr) - 1
    out = np.empty(n, dtype=np.float64)
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        if chunk == 1:
            # Token by token through `decode`, the export chat generates with (much cheaper per call than
            # `score`); the log-softmax is taken here.
            logits = engine.decode(int(arr[i])).astype(np.float64)
            top = logits.max()
            out[i] = top + math.log(np.exp(logits - top).sum()) - logits[arr[i + 1]]
        else:
            out[i:j] = -engine.score(arr[i:j], arr[i + 1 : j + 1])
        if progress:
            progress.update(j, out[i:j])
    return out


def score_recompute(engine, ids: list[int], positions: np.ndarray, context: int,
                    progress: Progress | None = None) -> np.ndarray:
    """For each target position t: reset, score ids[t-context : t] from scratch, keep the loss of ids[t]."""
    arr = np.asarray(ids, dtype=np.int64)
    out = np.empty(len(positions), dtype=np.float64)
    for k, t in enumerate(positions):
        lo = max(0, int(t) - context)
        engine.reset()
        out[k] = -engine.score(arr[lo:t], arr[lo + 1 : t + 1])[-1]
        if progress:
            progress.update(k + 1, out[k : k + 1])
    return out


def tokenizer_for(source):
    """The model's runtime tokenizer, kept in the cache next to the artefacts (written once per model)."""
    from .paths import cache_dir
    from .run.tokenizer import Tokenizer

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[-40:]
    folder = cache_dir() / "tokenizers" / f"{safe}-{source.fingerprint()[:20]}"
    if not ((folder / "tokenizer.json").is_file() and (folder / "chat.json").is_file()):
        from .checkpoint import save_tokenizer

        staging = folder.with_name(f"{folder.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            save_tokenizer(source, staging)
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return Tokenizer.from_dir(folder)


def _ppl(losses: np.ndarray) -> float | None:
    return float(math.exp(float(np.mean(losses)))) if len(losses) else None


def run_ppl(model: str | None, text_file: str | os.PathLike, mode: str, sinks: int = 4, window: int = 1020,
            dtype: str = BuildSettings.dtype, device: str = "cpu", max_chunk: int = BuildSettings.max_chunk,
            chunk: int = DEFAULT_CHUNK, stride: int = DEFAULT_STRIDE, max_tokens: int | None = None,
            json_file: str | os.PathLike | None = None, stream: TextIO | None = sys.stderr,
            build_progress: Callable[[str, float], None] | None = None,
            kv_dtype: str = BuildSettings.kv_dtype) -> dict:
    """Scores the text in one mode; returns the summary (and writes it with per-position losses to json_file)."""
    from .artefacts.store import ensure_artefacts
    from .checkpoint import read_config, resolve_model
    from .loader import open_folder

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    if chunk < 1 or stride < 1:
        raise ValueError(f"need chunk >= 1 and stride >= 1 (got chunk={chunk}, stride={stride})")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"need max_tokens >= 2: the first token is not scored (got {max_tokens})")
    BuildSettings(sinks=sinks, window=window, dtype=dtype, device=device, max_chunk=max_chunk, kv_dtype=kv_dtype)  # validates
    text = read_text(text_file)
    if not text.strip():
        raise TextError(f"{text_file} holds no text to score")
    source = resolve_model(model)
    # "auto": the weight and KV cache types reported are the ones built
    built = BuildSettings(dtype=dtype, kv_dtype=kv_dtype).for_source(source)
    dtype, kv_dtype = built.dtype, built.kv_dtype
    cfg = ModelConfig.from_hf(read_config(source))
    note = None
    if mode == "dense":
        ids = text_ids(tokenizer_for(source), text, max_tokens)
        if len(ids) > cfg.max_positions:
            note = f"dense: cut to the model's {cfg.max_positions} positions (the text has {len(ids)} tokens)"
            ids = ids[: cfg.max_positions]
        settings = build_settings(mode, sinks, window, dtype, device, max_chunk,
                                  dense_capacity(len(ids), cfg.max_positions), kv_dtype)
        loaded = open_folder(ensure_artefacts(source, settings, build_progress), source)
    else:
        settings = build_settings(mode, sinks, window, dtype, device, max_chunk, kv_dtype=kv_dtype)
        loaded = open_folder(ensure_artefacts(source, settings, build_progress), source)
        ids = text_ids(loaded.tokenizer, text, max_tokens)
    if len(ids) < 2:
        raise TextError(f"{text_file} has {len(ids)} token(s): at least 2 are needed (the first is not scored)")

    engine, capacity = loaded.engine, sinks + window
    bound = engine.chunk
    start = time.perf_counter()
    if mode == "recompute":
        positions = np.arange(stride, len(ids), stride, dtype=np.int64)
        if len(positions) == 0:
            raise TextError(f"{text_file} has {len(ids)} tokens: too few for stride {stride}")
        prog = Progress(mode, len(positions), stream)
        losses = score_recompute(engine, ids, positions, capacity, prog)
        used_chunk, evaluated = bound, int(sum(min(int(t), capacity) for t in positions))
    else:
        used_chunk = bound if mode == "dense" else min(chunk, bound)  # no eviction in dense: chunk is moot
        positions = np.arange(1, len(ids), dtype=np.int64)
        prog = Progress(mode, len(positions), stream)
        losses = score_stream(engine, ids, used_chunk, prog)
        evaluated = len(positions)
    seconds = time.perf_counter() - start
    prog.close()

    beyond = positions >= capacity  # predictions whose context is longer than the cache can hold
    result = {
        "ppl": _ppl(losses),
        "tokens": int(len(losses)),
        "mode": mode,
        "tok_s": len(losses) / seconds if seconds > 0 else None,
        "nll": float(np.mean(losses)),
        "ppl_beyond_capacity": _ppl(losses[beyond]),
        "tokens_beyond_capacity": int(beyond.sum()),
        "seconds": seconds,
        "evaluated_tokens": evaluated,
        "evaluated_tok_s": evaluated / seconds if seconds > 0 else None,
        "model": source.name,
        "text": str(text_file),
        "text_tokens": len(ids),
        "bos": loaded.tokenizer.bos_id is not None,
        "sinks": sinks,
        "window": window,
        "capacity": capacity,
        "chunk": used_chunk,
        "stride": stride if mode == "recompute" else 1,
        "dtype": dtype,
        "device": device,
        "build": settings.to_dict(),
    }
    if note:
        result["note"] = note
    if json_file is not None:
        full = {**result, "positions": positions.tolist(), "losses": [round(float(x), 5) for x in losses]}
        Path(json_file).write_text(json.dumps(full, separators=(",", ":")) + "\n")
    return result
