"""q6, a q4 build's LM head on a CPU with hand-written products (engine/exporter/q6.py): a Q6_K tensor's codes
kept, the tiled layout, and the product compiled in each form this CPU runs, against its meaning."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint.gguf_q6 import Q6_K_BLOCK, q6_rows
from engine.exporter.q6 import (dequantise_q6, dequantise_tiled_q6, quantise_q6, tile_q6, tiled_rows_q6,
                                untile_q6)


def random_q6_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes] of random Q6_K blocks: any bits, factors of both signs, finite units."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, Q6_K_BLOCK), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_a_q6_k_tensor_comes_back_as_ggufs_own_dequantised_weights():
    """The codes, factors and units read from Q6_K blocks give gguf's own dequantisation exactly, and tiling them
    and back moves no bit."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_q6_k(32, 512)
    rows = {k: torch.from_numpy(v) for k, v in q6_rows(raw).items()}
    want = dequantize(raw, GGMLQuantizationType.Q6_K)
    assert rows["weight"].max() <= 63
    np.testing.assert_array_equal(dequantise_q6(*rows.values()).numpy(), want.astype(np.float32))
    back = untile_q6(*tile_q6(rows).values())
    for name in rows:
        assert torch.equal(back[name], rows[name].to(back[name].dtype)), name
    np.testing.assert_array_equal(dequantise_tiled_q6(*tile_q6(rows).values()).numpy(), want.astype(np.float32))


def test_q6_k_blocks_written_from_q6_read_back_as_the_same_codes():
    """The tests' Q6_K writer (gguf_writer.q6_k_blocks: what a llama.cpp 4-bit file's head is) is the reading's
    inverse, and gguf's own dequantisation agrees."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from gguf_writer import q6_k_blocks

    w = np.random.default_rng(5).standard_normal((32, 512)).astype(np.float32)
    raw = q6_k_blocks(w)
    rows = quantise_q6(torch.from_numpy(w))
    back = q6_rows(raw)
    for name in rows:
        np.testing.assert_array_equal(back[name], rows[name].numpy().astype(back[name].dtype), name)
    np.testing.assert_array_equal(dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float32),
                                  dequantise_q6(*rows.values()).numpy())


def test_quantising_floats_keeps_each_weight_within_half_a_step_and_looks_up_rows():
    rng = np.random.default_rng(1)
    w = torch.from_numpy(rng.standard_normal((48, 512)).astype(np.float32))
    w[3, 100] = 40.0  # an outlier takes its 16's scale, not its row's
    w[5, :16] = 0.0  # a constant 16 stays exact
    rows = quantise_q6(w)
    back = dequantise_q6(*rows.values())
    step = (rows["scale"].float().reshape(48, 2, 16) * rows["units"].float().unsqueeze(-1)).reshape(48, 32)
    err = (back - w).abs().reshape(48, 32, 16).amax(-1)
    assert bool((err <= step * 0.5 + 1e-6).all() | (step == 0).all())
    assert torch.equal(back[5, :16], torch.zeros(16))
    assert abs(back[3, 100].item() - 40.0) < 0.5 * step[3, 6].item() + 1e-6
    tiled = tile_q6(rows)
    ids = torch.tensor([0, 17, 47, 17])
    assert torch.equal(tiled_rows_q6(*tiled.values(), ids), back[ids])


def _forms() -> list[str]:
    from engine.devices import host_dot_forms

    return host_dot_forms()


@pytest.mark.parametrize("form", _forms())
def test_the_product_is_the_codes_times_x_quantised_per_group(form, tmp_path):
    """The hand-written product (dot_products.q6_executable), compiled for this CPU in each form it runs: the
    codes times x rounded to int8 per group of 32 (as the q4 and q8 products round it), to float32 rounding, in a
    row of 9 tiles and 3 super-blocks (a workgroup's share of tiles, the super-blocks' units), codes across
    their whole range (Q6_K blocks of any bits) and factors of both signs."""
    import iree.runtime as rt
    import iree.turbine.aot as aot

    from engine.devices import compile_flags
    from engine.exporter.kernels import lowering_for
    from engine.exporter.linear import Linear

    out_f, in_f = 9 * 16, 768
    rows = {k: torch.from_numpy(v) for k, v in q6_rows(random_q6_k(out_f, in_f, seed=2)).items()}
    lin = Linear(out_f, in_f, "q6")
    assert lin.dtype == "q6"
    for name, t in tile_q6(rows).items():
        getattr(lin, name).data = t
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((1, in_f)).astype(np.float32))
    fxb = aot.FxProgramsBuilder(lin)

    @fxb.export_program(name="decode", args=(x,), strict=False)
    def decode(m, x):
        return m(x)

    with lowering_for("cpu", form):
        mlir = str(aot.export(fxb).mlir_module)
    assert f"eddy_q6_{out_f}x{in_f}_{form}" in mlir
    (tmp_path / "m.mlir").write_text(mlir)
    iree_compile = str(Path(sys.executable).with_name("iree-compile"))
    subprocess.run([iree_compile, str(tmp_path / "m.mlir"), *compile_flags("cpu", "host"), "-o",
                    str(tmp_path / "m.vmfb")], check=True, capture_output=True)
    got = np.asarray(rt.load_vm_flatbuffer_file(str(tmp_path / "m.vmfb"), driver="local-task").decode(x.numpy()))

    dense = dequantise_q6(*rows.values()).double()
    xg = x.reshape(-1, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    dx = amax * torch.tensor(1 / 127, dtype=torch.float32)
    q = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    want = (dense @ (q * dx).reshape(-1).double()).numpy()
    exact = (dense @ x.reshape(-1).double()).numpy()
    scale = np.abs(want).max()
    assert np.abs(got[0] - want).max() < 1e-5 * scale
    assert 1e-4 < np.abs(got[0] - exact).max() / scale < 2e-2  # x's rounding shows, and is small


def test_a_q4_build_keeps_a_q6_k_heads_codes_and_reads_the_rest_as_before(tmp_path):
    """A 4-bit GGUF whose tied LM head is Q6_K (as llama.cpp's Q4_K_M files are), 256 wide: the streamed weights
    file holds the head as q6 with the file's very codes, factors and units (tiled), and its other matrices as q4
    from their Q4_1 blocks, on a CPU with hand-written products. Where there are none the head is q8."""
    from dataclasses import replace

    from iree.turbine.aot import ParameterArchive

    from conftest import TINY_SETTINGS
    from engine.checkpoint import open_tensors, read_config, resolve_model
    from engine.checkpoint.tiny import tiny_config, tiny_state_dict
    from engine.config import ModelConfig
    from engine.devices import host_dot_forms
    from engine.exporter.model import StreamingLlama
    from engine.exporter.weights_file import write_weights
    from gguf_writer import write_gguf

    cfg = {**tiny_config("tiny-random", 512), "hidden_size": 256, "tie_word_embeddings": True}
    sd = {k: v.numpy() for k, v in tiny_state_dict(cfg).items()}
    head = random_q6_k(512, 256, seed=4)
    path = write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, quant="Q4_1", tokenizer=True,
                      blocks={"model.embed_tokens.weight": (head, "Q6_K")})
    source = resolve_model(str(path))
    model_cfg = ModelConfig.from_hf(read_config(source))
    settings = replace(TINY_SETTINGS, dtype="q4")
    skeleton = StreamingLlama.skeleton(model_cfg, settings)
    assert skeleton.tok_embeddings.dtype == ("q6" if host_dot_forms() else "q8")
    assert skeleton.layers[0].feed_forward.w_down.dtype == "q4"
    write_weights(skeleton, open_tensors(source), tmp_path / "w.irpa")
    got = {name: entry.as_tensor() for name, entry in ParameterArchive(tmp_path / "w.irpa").items()}
    if skeleton.tok_embeddings.dtype == "q6":
        want = tile_q6({k: torch.from_numpy(v) for k, v in q6_rows(head).items()})
        for name, t in want.items():
            assert torch.equal(got[f"tok_embeddings.{name}"], t), name
