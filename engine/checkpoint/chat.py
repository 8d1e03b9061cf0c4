"""The tokenizer and chat settings of a built model: tokenizer.json and chat.json (see engine/run/tokenizer.py),
from a GGUF file's tokenizer.ggml.* data or a Hugging Face folder's tokenizer files."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

from engine.errors import ModelError

from .gguf import check_gguf
from .hf import hf_tokenizer_file, load_json
from .source import ModelSource, default_source

_STOP_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<end_of_turn>",
                    "<|end|>")

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_tokenizer(source: ModelSource, out_dir: Path) -> None:
    """Write out_dir/tokenizer.json (HF tokenizers format) and out_dir/chat.json
    ({chat_template, bos_token, eos_token, stop_tokens, add_bos_token}).

    add_bos_token means "the runtime must prepend bos_token itself": encode with
    add_special_tokens=False and prepend it when this is true."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if source.kind in ("gguf", "tiny-random"):
        _save_gguf_tokenizer(default_source() if source.kind == "tiny-random" else source, out_dir)
    elif source.kind == "hf":
        _save_hf_tokenizer(source, out_dir)
    else:
        raise ModelError(f'Model "{source.name}": unknown checkpoint kind "{source.kind}".')


def _save_gguf_tokenizer(source: ModelSource, out_dir: Path) -> None:
    assert source.path is not None
    info = check_gguf(source)
    f = info.fields
    try:
        # The fast tokenizer class itself, not AutoTokenizer: AutoTokenizer first reads the GGUF's whole config
        # with gguf's reader to pick a class (3-12 s), and every class it picks builds this same backend (the
        # tokenizer.json is byte for byte the same for the default model, Gemma 3 and a Llama 3 vocabulary).
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, local_files_only=True
        )
        backend = tok.backend_tokenizer
        backend.save(str(out_dir / "tokenizer.json"))
    except ModelError:
        raise
    except Exception as exc:  # transformers raises many kinds; the user needs one message
        raise ModelError(f"{source.name}: could not read the tokenizer from the GGUF file ({exc}).") from None

    tokens: list[str] = f["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = f.get(key)
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    add_bos = f.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp's default: SentencePiece vocabularies add BOS, BPE ones do not.
        add_bos = f.get("tokenizer.ggml.model") == "llama"
    extra = [token(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    _write_chat_json(
        source,
        out_dir,
        backend,
        template=f.get("tokenizer.chat_template"),
        bos=token("tokenizer.ggml.bos_token_id"),
        eos=token("tokenizer.ggml.eos_token_id"),
        adds_bos=bool(add_bos),
        extra_stops=[t for t in extra if t],
    )


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _save_hf_tokenizer(source: ModelSource, out_dir: Path) -> None:
    assert source.path is not None
    folder = source.path
    tok_file = hf_tokenizer_file(source)
    from tokenizers import Tokenizer

    if tok_file.name == "tokenizer.json":
        try:
            backend = Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise ModelError(f"{tok_file}: tokenizer.json is corrupt or unsupported ({exc}).") from None
        shutil.copyfile(tok_file, out_dir / "tokenizer.json")
    else:
        try:
            from transformers import AutoTokenizer

            backend = AutoTokenizer.from_pretrained(str(folder), local_files_only=True).backend_tokenizer
        except Exception as exc:
            raise ModelError(
                f"{source.name}: has only tokenizer.model and converting it failed ({exc}). "
                f"Add a tokenizer.json to the folder."
            ) from None
        backend.save(str(out_dir / "tokenizer.json"))

    def optional_json(name: str) -> dict:
        p = folder / name
        data = load_json(p, name) if p.is_file() else {}
        return data if isinstance(data, dict) else {}

    tok_cfg = optional_json("tokenizer_config.json")
    special_map = optional_json("special_tokens_map.json")
    model_cfg = optional_json("config.json")
    gen_cfg = optional_json("generation_config.json")

    def by_id(idx: Any) -> str | None:
        return backend.id_to_token(idx) if isinstance(idx, int) else None

    def special(name: str) -> str | None:
        return (
            _special(tok_cfg.get(f"{name}_token"))
            or _special(special_map.get(f"{name}_token"))
            or by_id(model_cfg.get(f"{name}_token_id"))
        )

    bos, eos = special("bos"), special("eos")

    template: str | None = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = optional_json("chat_template.json").get("chat_template")
    else:
        template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)

    adds_bos = tok_cfg.get("add_bos_token")
    if not isinstance(adds_bos, bool):
        # No explicit flag: observe what the tokenizer's post-processor actually does.
        bos_id = backend.token_to_id(bos) if bos else None
        adds_bos = bos_id is not None and backend.encode("Hi", add_special_tokens=True).ids[:1] == [bos_id]

    gen_eos = gen_cfg.get("eos_token_id")
    gen_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    extra = [by_id(i) for i in gen_ids]
    _write_chat_json(
        source, out_dir, backend, template=template if isinstance(template, str) else None,
        bos=bos, eos=eos, adds_bos=adds_bos, extra_stops=[t for t in extra if t],
    )


def _write_chat_json(
    source: ModelSource,
    out_dir: Path,
    backend: Any,
    *,
    template: str | None,
    bos: str | None,
    eos: str | None,
    adds_bos: bool,
    extra_stops: list[str],
) -> None:
    if not template:
        warnings.warn(
            f"{source.name}: the model has no chat template; using a plain ChatML template, "
            f"which the model may not have been trained on.",
            stacklevel=4,  # point at save_tokenizer's caller
        )
        template = _CHATML_TEMPLATE
    stops: list[str] = []
    for t in [eos, *(c for c in _STOP_CANDIDATES if backend.token_to_id(c) is not None), *extra_stops]:
        if t and t not in stops:
            stops.append(t)
    chat = {
        "chat_template": template,
        "bos_token": bos,
        "eos_token": eos,
        "stop_tokens": stops,
        "add_bos_token": bool(adds_bos and bos and not _template_emits_bos(template, bos, eos)),
    }
    text = json.dumps(chat, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "chat.json").write_text(text, encoding="utf-8")



def _template_emits_bos(template: str, bos: str, eos: str | None) -> bool:
    """Whether rendering the template already produces the BOS string (so adding it again would double it).
    Rendered for real, in the runtime's hardened sandbox with its work budget, because templates usually
    write {{ bos_token }}; a template that cannot be rendered is judged by its text."""
    from engine.run.template_sandbox import render_template

    try:
        rendered = render_template(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   bos_token=bos, eos_token=eos or "")
    except ModelError:
        return bos in template or "bos_token" in template
    return bos in rendered
