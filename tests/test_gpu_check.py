"""bench/gpu_check.py's pure parts: the random weights the device regenerates, the .irpa they are written to, and
the comparison that decides whether a GPU's logits pass. No builds, no GPU: a few seconds."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import (NOT_ON_DEVICE, compare, entry_spec, format_table, generate, meets,  # noqa: E402
                             weight_plan, write_irpa)


def _meta(dtype: str, shape: list[int]) -> bytes:
    # turbine's metadata for an entry, as engine/exporter/weights_file.py writes it (the fields gpu_check reads).
    return ("PYTORCH:" + json.dumps({"type": "Tensor", "dtype": dtype, "shape": shape})).encode()


ITEM = {"float32": 4, "float16": 2, "int8": 1}
# A q8 and an f16 model's kinds of entry: int8 codes with per-row scales, a norm, a 16-bit matrix, a bias.
ENTRIES = [("tok_embeddings.weight", "int8", [96, 32]), ("tok_embeddings.scale", "float32", [96]),
           ("layers.0.attention_norm.weight", "float32", [32]), ("layers.0.attention.wqkv.weight", "float16", [80, 32]),
           ("layers.0.attention.wqkv.bias", "float32", [80]), ("layers.0.attention.wo.weight", "float32", [32, 48])]


@pytest.fixture
def plan():
    specs = [entry_spec(n, int(np.prod(s)) * ITEM[d], _meta(d, s)) for n, d, s in ENTRIES]
    return weight_plan(specs)


def test_entry_spec_reads_turbines_metadata():
    e = entry_spec("w", 24, b'PYTORCH:{"type": "Tensor", "dtype": "float16", "shape": [3, 4], "dtype_desc": {}}')
    assert (e["dtype"], e["shape"], e["length"]) == ("float16", [3, 4], 24)
    assert e["metadata"].startswith("PYTORCH:")  # written back into the archive unchanged


def test_generated_weights_are_deterministic_and_as_the_manifest_says(plan):
    for spec in plan["entries"]:
        a, b = generate(spec), generate(json.loads(json.dumps(spec)))  # the device reads the plan back from JSON
        assert a.dtype == np.dtype(spec["dtype"]) and list(a.shape) == spec["shape"] and a.nbytes == spec["length"]
        assert a.tobytes() == b.tobytes()
        assert np.isfinite(a.astype(np.float64)).all()
    seeds = [s["seed"] for s in plan["entries"]]
    assert len(set(seeds)) == len(seeds)  # no two entries share numbers


def test_generated_values_have_the_intended_scale(plan):
    by = {s["name"]: generate(s) for s in plan["entries"]}
    codes = by["tok_embeddings.weight"]
    assert codes.min() >= -127 and codes.max() <= 127 and codes.std() > 50
    scale = by["tok_embeddings.scale"]
    assert (scale > 0).all() and 0.015 < float((codes * scale[:, None]).std()) < 0.025
    norm = by["layers.0.attention_norm.weight"]
    assert 0.89 < norm.min() and norm.max() < 1.11
    matrix = by["layers.0.attention.wo.weight"]
    assert 0.015 < float(matrix.std()) < 0.025 and abs(float(matrix.mean())) < 0.005


def test_a_wrong_length_is_refused(plan):
    spec = dict(plan["entries"][0], length=plan["entries"][0]["length"] + 1)
    with pytest.raises(ValueError, match="bytes generated"):
        generate(spec)


def test_the_irpa_written_from_a_plan_round_trips_through_iree(tmp_path, plan):
    import iree.runtime as rt

    path = tmp_path / "weights.irpa"
    digest = write_irpa(plan, path)
    assert digest == write_irpa(plan, tmp_path / "again.irpa")  # the same bytes every time
    index = rt.ParameterIndex()
    index.load(str(path))
    assert len(index) == len(plan["entries"])
    got = {index[i].key: index[i] for i in range(len(index))}
    assert list(got) == [s["name"] for s in plan["entries"]]
    for spec in plan["entries"]:
        entry = got[spec["name"]]
        assert entry.is_file and entry.length == spec["length"]
        assert bytes(entry.file_view) == generate(spec).tobytes()  # the entry's bytes, as IREE maps them
        assert entry.metadata == spec["metadata"].encode()


def _logits(rows: int = 3, vocab: int = 500, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (rows, vocab)).astype(np.float32)


def test_compare_passes_identical_and_nearby_logits():
    ref = _logits()
    assert compare(ref.copy(), ref, "f32")["passed"]
    assert compare(ref + 5e-5, ref, "f32")["passed"]
    assert compare(ref * (1 + 3e-3), ref, "f16")["passed"]


def test_compare_flags_a_nan_and_an_inf():
    ref = _logits()
    for bad in (np.nan, np.inf):
        dev = ref.copy()
        dev[1, 7] = bad
        r = compare(dev, ref, "f16")
        assert not r["passed"] and "non-finite" in r["why"]


def test_compare_flags_a_wrong_greedy_token():
    ref = _logits(vocab=5000)
    dev = ref.copy()
    top = int(ref[2].argmax())
    runner = int(np.argsort(ref[2])[-2])
    dev[2, runner] = ref[2, top] + 0.05  # the device picks the runner-up, which the reference ranks clearly lower
    r = compare(dev, ref, "q8")
    assert r["rel"] <= 1e-2  # the values alone would pass: the token is what fails it
    assert not r["passed"] and r["greedy_mismatch"] == [2] and "greedy token differs" in r["why"]


def test_compare_forgives_a_tie_the_reference_itself_has():
    ref = _logits()
    top = int(ref[0].argmax())
    runner = int(np.argsort(ref[0])[-2])
    ref[0, runner] = ref[0, top] - 2e-5  # the reference's own margin is under the f32 tolerance
    dev = ref.copy()
    dev[0, runner] += 4e-5
    r = compare(dev, ref, "f32")
    assert r["passed"] and r["near_ties"] == [0] and r["greedy_mismatch"] == []


def test_compare_flags_values_out_of_tolerance_and_wrong_shapes():
    ref = _logits()
    assert not compare(ref + 2e-4, ref, "f32")["passed"]
    assert not compare(ref * 1.05, ref, "f16")["passed"]
    assert not compare(ref[:2], ref, "f32")["passed"]


def test_generation_in_chunks_gives_one_draws_numbers(plan, monkeypatch):
    """Big entries (an 8B model's embedding) are drawn a chunk at a time: the bytes must not depend on the chunk."""
    import bench.gpu_check as gc

    whole = [generate(spec).tobytes() for spec in plan["entries"]]
    monkeypatch.setattr(gc, "GENERATE_CHUNK", 7)  # not a divisor of any entry's size
    assert [generate(spec).tobytes() for spec in plan["entries"]] == whole


def _timing(decode: float, prefill: float, turn: float) -> dict:
    return {"ok": True, "decode_128_tok_s": decode, "decode_1000_tok_s": decode, "turn_30_after_1000_ms": turn,
            "prefill_1024_tok_s": prefill}


def test_targets_and_table():
    from bench.gpu_check import DEFAULT_MODEL, LLAMA_8B

    assert meets(1200.0, ">=", 1000) and not meets(4.0, ">=", 1000) and meets(3.0, "<=", 5.0)
    assert meets(None, ">=", 1) is None
    check = {"ok": True, "passed": True, "max_abs": 0.0, "rel": 0.0, "greedy_equal": 9, "rows": 9}
    report = {"device_mode": "gpu", "elapsed_s": 3, "machine": {"info": {"iree_runtime": "3.13.0"}},
              "variants": {"a": {"model": DEFAULT_MODEL, "device": "cuda", "group": "smollm2-f16",
                                 "load": {"ok": True, "open_s": 0.2}, "check": check,
                                 "timing": {**_timing(1500.0, 30000.0, 4.0), "decode_1000_tok_s": 900.0}},
                           "a-vk": {"model": DEFAULT_MODEL, "device": "vulkan", "group": "smollm2-f16",
                                    "load": {"ok": True, "open_s": 0.3}, "check": check,
                                    "timing": {**_timing(1500.0, 10000.0, 5.0), "decode_1000_tok_s": 800.0}},
                           "big": {"model": LLAMA_8B, "device": "cuda", "group": "llama8b-q4",
                                   "load": {"ok": True, "open_s": 3.0}, "check": check,
                                   "timing": _timing(160.0, 3000.0, 40.0)},
                           "b": {"load": {"ok": False, "error": "DeviceError: no GPU"}}},
              "eddy_bench": {"skipped": "--no-bench"}}
    table = format_table(report)
    assert "decode_1000 MISSED" in table and "decode_128 met" in table and "NOLOAD" in table
    assert "DeviceError: no GPU" in table
    big = next(line for line in table.splitlines() if line.strip().startswith("big:"))
    assert big.count("met") == 1 and "(>=150)" in big  # the 8B is held to its own target only
    against = next(line for line in table.splitlines() if "a-vk against cuda" in line)
    # decode 900/800 = 1.12x, prefill 30000/10000 = 3x, turn 5/4 = 1.25x
    assert "decode_1000 1.12x met" in against and "prefill_1024 3.00x MISSED" in against
    assert "turn_30_after_1000 1.25x met" in against


def test_a_shaped_source_is_the_checkpoints_config_with_the_default_tokenizer(tmp_path):
    """The 1B and 8B variants build from a config and a tokenizer only (their weights come from the plan)."""
    from bench.gpu_check import LLAMA_8B, shaped_source
    from engine.checkpoint import read_config
    from engine.config import ModelConfig

    source = shaped_source(LLAMA_8B, tmp_path)
    cfg = ModelConfig.from_hf(read_config(source))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        4096, 32, 32, 8, 128, 128256)
    assert (source.path / "tokenizer.json").is_file() and (source.path / "tokenizer_config.json").is_file()
    assert shaped_source(LLAMA_8B, tmp_path).path == source.path  # written once
