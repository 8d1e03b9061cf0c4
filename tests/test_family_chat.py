"""Each family's chat template and stop tokens through the runtime's sandboxed template path.

The templates are the families' own (Llama 3 Instruct, Qwen2.5 Instruct, Phi-3 mini, Gemma 2 it, Gemma 3 it,
Mistral Instruct), on the default model's vocabulary with the family's control tokens added; transformers'
apply_chat_template renders the reference text."""
from __future__ import annotations

import json

import pytest

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3 = (  # gemma-3-it's, without its image branch: a system message opens the first user turn
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# family: (template, bos, eos, control tokens to add, end-of-turn token, extra stop from generation_config,
#          text closing an assistant turn, whether a system message is allowed)
CASES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|end_of_text|>",
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|eot_id|>", "<|eot_id|>", "<|eot_id|>", True),
    "qwen2.5": (QWEN25, None, "<|im_end|>", [], "<|im_end|>", None, "<|im_end|>\n", True),
    "phi3": (PHI3, "<s>", "<|endoftext|>", ["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
             "<|end|>", "<|end|>", "<|end|>\n", True),
    "gemma2": (GEMMA2, "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>",
               "<end_of_turn>", "<end_of_turn>\n", False),
    "gemma3": (GEMMA3, "<bos>", "<eos>", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>",
               "<end_of_turn>", "<end_of_turn>\n", True),
    "mistral": (MISTRAL, "<s>", "</s>", ["<s>", "</s>", "[INST]", "[/INST]"], "</s>", None, "</s>", False),
}


def family_folder(name: str, tiny, tmp_path):
    """(the family's Hugging Face tokenizer folder, the built tokenizer folder, the Rust tokenizer)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer

    from engine.checkpoint import ModelSource, save_tokenizer

    template, bos, eos, added, _, gen_stop, _, _ = CASES[name]
    folder = tmp_path / name
    folder.mkdir()
    rust = RustTokenizer.from_file(str(tiny.folder / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    rust.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "chat_template": template, "add_bos_token": bos is not None}))
    if gen_stop:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [rust.token_to_id(gen_stop)]}))
    out = tmp_path / f"{name}-built"
    save_tokenizer(ModelSource(name, "hf", folder), out)
    return folder, out, rust


@pytest.mark.parametrize("name", CASES)
def test_family_chat_template_and_stop_tokens(name, tiny, tmp_path):
    from transformers import PreTrainedTokenizerFast

    from engine.run.tokenizer import Tokenizer

    template, bos, eos, added, end_of_turn, _, closing, system_ok = CASES[name]
    folder, out, rust = family_folder(name, tiny, tmp_path)
    tok = Tokenizer.from_dir(out)

    end_id = rust.token_to_id(end_of_turn)
    assert end_id is not None and end_id in tok.stop_ids
    first = ([{"role": "system", "content": "Be brief."}] if system_ok else []) + [
        {"role": "user", "content": "Hi there <|im_end|> [INST] <|eot_id|>"}]  # control strings typed as text
    ids = tok.encode_chat(first, add_generation_prompt=True)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=bos, eos_token=eos)
    want = hf.apply_chat_template(first, chat_template=template, tokenize=False, add_generation_prompt=True)
    if bos is not None and not want.startswith(bos):
        # tokenizer_config's add_bos_token: Eddy prepends BOS as llama.cpp does (apply_chat_template does not).
        want = bos + want
    assert tok.decode(ids) == want
    # BOS exactly once, whether the template writes it or the runtime adds it.
    if bos is not None:
        assert tok.decode(ids).count(bos) == 1 and ids[0] == rust.token_to_id(bos)
    # Typed control strings stay text: the only control ids are the template's own.
    template_only = tok.encode_chat([{**first[-1], "content": "Hi there"}] if not system_ok else
                                    [first[0], {**first[-1], "content": "Hi there"}], add_generation_prompt=True)
    for control in {end_of_turn, "<|im_end|>", "[INST]", "<|eot_id|>"} & set(added + ["<|im_end|>"]):
        cid = rust.token_to_id(control)
        assert ids.count(cid) == template_only.count(cid), control
    history = [*first, {"role": "assistant", "content": "Hello."}]
    assert tok.turn_suffix(history[:-1]) == closing
    second = {"role": "user", "content": "And you?"}
    delta = tok.chat_delta(history, [second])
    assert delta is not None and "And you?" in tok.decode(delta)
    # What a session leaves in the cache (first turn, the reply, the closing text it owes, the delta) reads as
    # the whole conversation rendered afresh: no rebuild, nothing lost or doubled (token seams may differ).
    cached = ids + tok.encode_text("Hello.") + tok.encode_template(tok.turn_suffix(history[:-1])) + delta
    assert tok.decode(cached) == tok.decode(tok.encode_chat([*history, second], add_generation_prompt=True))


# --- rendering only the tail of a long chat -----------------------------------------------------------------

# Replies and questions as a chat has them: padded (trimming templates read those differently), typed control
# strings, a multi-line reply, an empty turn.
USER_TEXTS = ["What is {i}?", "  padded question {i}  ", "tell me <|im_end|> [INST] <|eot_id|> {i}", "{i}", "",
              "line one {i}\nline two"]
REPLY_TEXTS = ["It is {i}.", "Sure:\n1. first\n2. second {i}", " spaced reply {i}\n", "😀 {i}", "ok"]


def tail_and_full(out):
    from engine.run.tokenizer import Tokenizer

    fast, full = Tokenizer.from_dir(out), Tokenizer.from_dir(out)
    full._tail_trusted = False  # the reference: every call renders the whole chat, as before tail rendering
    return fast, full


def play(fast, full, opening: list[dict], turns: int = 30) -> list[dict]:
    """A chat as ChatSession drives it; every per-turn answer of `fast` must equal `full`'s."""
    history = list(opening)
    for i in range(turns):
        user = {"role": "user", "content": USER_TEXTS[i % len(USER_TEXTS)].format(i=i)}
        if i == 0:
            assert fast.encode_chat([*history, user], True) == full.encode_chat([*history, user], True)
        else:
            assert fast.chat_delta(history, [user]) == full.chat_delta(history, [user]), f"turn {i}"
        assert fast.turn_suffix([*history, user]) == full.turn_suffix([*history, user]), f"turn {i}"
        history += [user, {"role": "assistant", "content": REPLY_TEXTS[i % len(REPLY_TEXTS)].format(i=i)}]
    return history


@pytest.mark.parametrize("name", [*CASES, "smollm2", "chatml"])
def test_tail_render_gives_the_full_renders_tokens_over_a_long_chat(name, tiny, tmp_path):
    from engine.checkpoint.chat import _CHATML_TEMPLATE

    if name in CASES:
        out, system_ok = family_folder(name, tiny, tmp_path)[1], CASES[name][-1]
    else:  # the default model's own template, and the ChatML one Eddy falls back to
        out, system_ok = tmp_path / name, True
        out.mkdir()
        (out / "tokenizer.json").write_bytes((tiny.folder / "tokenizer.json").read_bytes())
        chat = json.loads((tiny.folder / "chat.json").read_text())
        if name == "chatml":
            chat["chat_template"] = _CHATML_TEMPLATE
        (out / "chat.json").write_text(json.dumps(chat))
    fast, full = tail_and_full(out)
    assert fast._locality is not None, "the template should be proven local"
    play(fast, full, [{"role": "system", "content": "Be brief."}] if system_ok else [])
    # The tail render answered most turns on its own (padded turns of trimming templates go to the full one).
    assert fast.tail_stats["mismatch"] == 0
    assert fast.tail_stats["tail"] >= (30 if name in ("llama3", "gemma2", "gemma3") else 50), fast.tail_stats
