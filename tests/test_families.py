"""Each family's checkpoint formats: a GGUF written the llama.cpp way and a safetensors folder of the same tiny
weights read to the same model, whose compiled logits match transformers' own GGUF load; and the limits a family
brings (sliding windows, rope variants) refused before a build."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import TINY_SETTINGS
from gguf_writer import GGUF_ARCH, write_gguf

TOL = 1e-4


def _hf_folder(folder, family_model, cfg, state):
    from conftest import transformers_model

    transformers_model(cfg, state).save_pretrained(folder, safe_serialization=True)
    # The tiny models share the default model's tokenizer: the built entry holds it.
    shutil.copyfile(family_model.folder / "tokenizer.json", folder / "tokenizer.json")
    chat = json.loads((family_model.folder / "chat.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": chat["bos_token"], "eos_token": chat["eos_token"], "chat_template": chat["chat_template"]}))
    return folder


def test_gguf_and_safetensors_folder_give_the_same_logits(family, family_model, family_reference, tmp_path):
    import transformers

    from engine.checkpoint import load_state_dict, read_config, resolve_model
    from engine.checkpoint.tiny import transformers_config

    cfg, state = family_reference
    folder = _hf_folder(tmp_path / f"{family}-hf", family_model, cfg, state)
    gguf_path = write_gguf(tmp_path / f"{family}.gguf", family, cfg, {k: v.numpy() for k, v in state.items()})

    hf_src, gguf_src = resolve_model(str(folder)), resolve_model(str(gguf_path))
    assert (hf_src.kind, gguf_src.kind) == ("hf", "gguf")
    hf_cfg, gguf_cfg = read_config(hf_src), read_config(gguf_src)
    assert hf_cfg == cfg
    assert gguf_cfg["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"])  # GGUF stores float32
    want = {**cfg, "rms_norm_eps": gguf_cfg["rms_norm_eps"]}
    if GGUF_ARCH[family] != family:
        # llama.cpp writes Mistral as a Llama and keeps no sliding window: Eddy then reads a Llama.
        want.update(model_type=GGUF_ARCH[family], sliding_window=None)
    assert gguf_cfg == want
    hf_sd, gguf_sd = load_state_dict(hf_src), load_state_dict(gguf_src)
    assert set(hf_sd) == set(gguf_sd) == set(state)
    assert all(torch.equal(hf_sd[k], state[k]) for k in state)
    # Exact, but for Gemma's norms: llama.cpp stores 1 + w in float32, and taking the 1 off again rounds.
    shifted = {k for k in state if family.startswith("gemma") and k.endswith("norm.weight")}
    assert all(torch.equal(gguf_sd[k], state[k]) for k in set(state) - shifted)
    assert all(torch.allclose(gguf_sd[k], state[k], rtol=0, atol=1e-6) for k in shifted)

    # Independently of Eddy's readers: transformers loads the same GGUF (its own name map and q/k
    # un-permutation) and agrees with the compiled module built from these weights. The config is passed
    # because transformers' GGUF config map lacks Qwen3's attention.key_length (head_dim).
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, config=transformers_config(gguf_cfg), dtype=torch.float32).eval()
    ids = np.random.RandomState(11).randint(0, cfg["vocab_size"], 24).tolist()
    with torch.no_grad():
        ref = from_gguf(torch.tensor([ids])).logits[0].numpy()
    eng = family_model.engine
    eng.reset()
    got = [eng.prefill(ids[:20])] + [eng.decode(t) for t in ids[20:]]
    for g, w in zip(got, [ref[19], *ref[20:]]):
        assert np.abs(g - w).max() < TOL


def test_each_family_builds_its_own_features(family, family_model):
    """The compiled entry records the family it was built as (a Qwen2 built as a Llama would drop its biases)."""
    from engine.arch import FAMILIES

    manifest = json.loads((family_model.folder / "manifest.json").read_text())
    assert manifest["config"]["arch"] == family in FAMILIES
    assert family_model.engine.cfg.arch == family


def test_a_window_wider_than_the_models_sliding_window_is_refused(tmp_path, tiny):
    from engine.checkpoint import load_state_dict, read_config, resolve_model
    from engine.errors import ModelError
    from engine.loader import open_model

    src = resolve_model("tiny-random-mistral")
    cfg = {**read_config(src), "sliding_window": TINY_SETTINGS.window - 1}
    folder = _hf_folder(tmp_path / "narrow-mistral", tiny, cfg, load_state_dict(src))
    with pytest.raises(ModelError, match=rf"at most {TINY_SETTINGS.window - 1} recent tokens"):
        open_model(str(folder), TINY_SETTINGS)


def test_unsupported_rope_variant_is_refused_before_a_build():
    from engine.config import ModelConfig
    from engine.errors import ModelError

    cfg = {"model_type": "phi3", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "intermediate_size": 8,
           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}
    with pytest.raises(ModelError, match="'longrope' is not supported"):
        ModelConfig.from_hf(cfg)
    assert ModelConfig.from_hf({**cfg, "rope_scaling": None}).arch == "phi3"


def test_local_layers_keep_their_own_ring_and_leave_the_cache_to_the_global_ones():
    """Gemma 3's five local layers in six keep a ring of their window (8 slots here); the StreamingLLM cache holds
    the global layer alone. A window narrower than the local one shares the cache again (see the next test)."""
    from engine.checkpoint import read_config, resolve_model
    from engine.exporter.model import StreamingLlama
    from engine.config import BuildSettings, ModelConfig

    cfg = ModelConfig.from_hf(read_config(resolve_model("tiny-random-gemma3")))
    assert cfg.local_layers == (0, 1, 2, 3, 4) and cfg.local_window == 8 and cfg.rope_tables == 2
    kvh, d = cfg.n_kv_heads, cfg.head_dim
    model = StreamingLlama(cfg, TINY_SETTINGS)
    assert tuple(model.cache.shape) == (1, 2, kvh, TINY_SETTINGS.capacity, d)
    assert tuple(model.ring_cache.shape) == (5, 2, kvh, 8, d)
    assert cfg.prefill_bound(TINY_SETTINGS) == 8  # a prefill call never wraps the ring onto what it still reads
    narrow = BuildSettings(sinks=4, window=6, dtype="f32", max_chunk=16)
    model = StreamingLlama(cfg, narrow)
    # Its 10 slots are padded to whole blocks of attended slots (BuildSettings.slots).
    assert model.ring_cache is None and tuple(model.cache.shape) == (6, 2, kvh, narrow.slots, d) and narrow.slots == 16


def test_local_layers_in_a_narrow_window_read_the_shared_cache_with_their_own_rope():
    """A window narrower than Gemma 3's local one: local layers read the StreamingLLM cache masked to their window,
    their sinks re-rotated with the local RoPE table; the torch reference agrees through eviction."""
    from engine.checkpoint import load_state_dict, read_config, resolve_model
    from engine.config import BuildSettings
    from engine.loader import open_model
    from streaming_reference import StreamingReference

    narrow = BuildSettings(sinks=4, window=6, dtype="f32", max_chunk=16)
    eng = open_model("tiny-random-gemma3", narrow).engine
    assert eng.ring == 0 and eng.chunk == 6
    source = resolve_model("tiny-random-gemma3")
    ref = StreamingReference(load_state_dict(source), read_config(source), narrow.sinks, narrow.window)
    rng = np.random.RandomState(3)
    worst = 0.0
    for n in [5, 1, 1, 6, 1, 3, 1, 1, 6, 2, 1, 1, 1, 4]:
        ids = rng.randint(0, 49152, n).tolist()
        got = eng.decode(ids[0]) if n == 1 else eng.prefill(ids)
        worst = max(worst, float(np.abs(got - ref.feed(ids)[-1].numpy()).max()))
    assert eng.stats.evicted == 34 - narrow.capacity
    assert worst < TOL


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_a_gemma3_whose_layers_are_all_local_or_all_global_builds_and_matches_transformers(kind, tmp_path, tiny):
    """A Gemma 3 cut below six layers has no global layer (its pattern puts one in six); one with layer_types all
    global has no local one. Each builds and runs, past its local window, as transformers' model does."""
    import torch

    from conftest import transformers_model
    from engine.checkpoint import load_state_dict, read_config, resolve_model
    from engine.loader import open_model

    source = resolve_model("tiny-random-gemma3")
    cfg, state = read_config(source), load_state_dict(source)
    cfg = {**cfg, "layer_types": [kind] * cfg["num_hidden_layers"]}
    folder = _hf_folder(tmp_path / f"gemma3-{kind}", tiny, cfg, state)
    eng = open_model(str(folder), TINY_SETTINGS).engine
    assert eng.ring == 0  # no own ring: every layer reads the StreamingLLM cache
    ids = np.random.RandomState(4).randint(0, cfg["vocab_size"], 24).tolist()
    with torch.no_grad():
        ref = transformers_model(cfg, state)(torch.tensor([ids])).logits[0].numpy()
    eng.reset()
    got = [eng.prefill(ids[:16])] + [eng.decode(t) for t in ids[16:]]
    for g, w in zip(got, ref[15:]):
        assert np.abs(g - w).max() < TOL
