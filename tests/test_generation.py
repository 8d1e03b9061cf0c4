"""Chat sampling defaults: read from a checkpoint's own generation settings, else Eddy's; `eddy chat` greedy
unless --chat-defaults."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from engine.run.generation import EDDY_CHAT_DEFAULTS, ChatDefaults, chat_defaults, read_recommended, sampling_params


@pytest.fixture(scope="module")
def hf_folder_with_generation_config(tmp_path_factory, tiny_reference):
    """tiny-random saved as a Hugging Face folder by transformers, with a generation_config.json it wrote."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from engine.checkpoint import resolve_model, save_tokenizer

    cfg, sd = tiny_reference
    folder = tmp_path_factory.mktemp("tiny-hf")
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        model.load_state_dict(sd, strict=False)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05,
                     bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    tok = tmp_path_factory.mktemp("tok")
    save_tokenizer(resolve_model(None), tok)
    chat = json.loads((tok / "chat.json").read_text())
    (folder / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": chat["bos_token"], "eos_token": {"content": chat["eos_token"], "special": True},
        "chat_template": chat["chat_template"], "add_bos_token": False}))
    return folder


def test_defaults_come_from_the_checkpoints_generation_config(tiny, hf_folder_with_generation_config):
    from engine.checkpoint import resolve_model
    from engine.loader import open_folder

    source = resolve_model(str(hf_folder_with_generation_config))
    # The same compiled module, opened for this checkpoint: what the loader hands the app and the CLI.
    loaded = open_folder(tiny.folder, source)
    d = loaded.chat_defaults
    assert d.origin == "generation_config.json"
    assert d.from_model == {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "repeat_penalty": 1.05}
    # What the checkpoint does not say comes from Eddy's defaults.
    assert d.values == {**EDDY_CHAT_DEFAULTS, **d.from_model}
    assert "generation_config.json" in d.describe() and "temperature 0.6" in d.describe()
    s = sampling_params(d, {"top_k": 5}, seed=3)  # the user's value wins over the model's
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.seed) == (0.6, 5, 0.9, 0.05, 1.05, 3)


def test_a_greedy_or_broken_generation_config_recommends_nothing(tmp_path):
    # do_sample false (transformers' default) describes greedy decoding: no chat recommendation.
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert read_recommended("hf", tmp_path) == ({}, "generation_config.json")
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_recommended("hf", tmp_path)[0] == {}
    (tmp_path / "generation_config.json").unlink()
    assert read_recommended("hf", tmp_path)[0] == {}
    # Values out of range are dropped one by one, the rest are kept.
    d = chat_defaults({"temperature": -1.0, "top_p": 0.8, "top_k": 2.5}, "generation_config.json")
    assert d.from_model == {"top_p": 0.8} and d.values["temperature"] == EDDY_CHAT_DEFAULTS["temperature"]
    assert chat_defaults({}, "GGUF metadata") == ChatDefaults()


def test_defaults_come_from_gguf_sampling_metadata(tmp_path):
    import gguf

    path = tmp_path / "sampling.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_sampling_temp(0.8)
    w.add_sampling_top_k(30)
    w.add_sampling_min_p(0.1)
    w.add_sampling_penalty_repeat(1.15)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    recommended, origin = read_recommended("gguf", path)
    assert origin == "GGUF metadata"
    assert recommended == {"temperature": 0.8, "top_k": 30, "min_p": 0.1, "repeat_penalty": 1.15}
    # The shipped default model recommends nothing: Eddy's defaults apply.
    from engine.checkpoint import resolve_model

    default = resolve_model(None)
    assert read_recommended(default.kind, default.path)[0] == {}
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    assert read_recommended("gguf", tmp_path / "junk.gguf")[0] == {}


def test_chat_defaults_round_trip_as_plain_data():
    d = chat_defaults({"temperature": 0.3}, "GGUF metadata")
    assert ChatDefaults.from_dict(json.loads(json.dumps(d.to_dict()))) == d


def test_eddy_chat_is_greedy_unless_asked_for_chat_defaults(tiny):
    import subprocess
    import sys

    def reply(*extra: str) -> str:
        run = subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--model", "tiny-random", "--sinks", "4",
                              "--window", "60", "--dtype", "f32", "--max-new-tokens", "12", "--json",
                              "--prompt", "Tell me a story", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return "".join(json.loads(line).get("text", "") for line in run.stdout.splitlines())

    greedy = reply()
    assert reply("--chat-defaults", "--temperature", "0") == greedy  # a flag given wins over the defaults
    sampled = reply("--chat-defaults", "--seed", "5")
    assert sampled != greedy  # tiny-random's flat distribution: sampling at 0.7 leaves the argmax path
    assert reply("--chat-defaults", "--seed", "5") == sampled
    run = subprocess.run([sys.executable, "-m", "engine.cli", "chat", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert "greedy unless --chat-defaults" in " ".join(run.stdout.split())
