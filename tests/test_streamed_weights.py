"""The streamed weights file equals the in-memory one.

The build writes weights.irpa from the checkpoint one tensor at a time (engine/exporter/weights_file.py) instead
of loading the whole model and handing it to turbine's save_module_parameters. These tests hold it to that
old path: for every weight type, the file it writes is, tensor for tensor and byte for byte, what
save_module_parameters writes for the model loaded in memory (export.build_model). No export or compile is
needed for that; the one real build checked is the session's `tiny` fixture.
"""
from __future__ import annotations

import filecmp
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import TINY_SETTINGS
from engine.config import DTYPES


def archive_tensors(path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    from iree.turbine.aot import ParameterArchive

    return {name: (t.dtype, tuple(t.shape), t.numpy().tobytes() if t.dtype != torch.bfloat16
                   else t.view(torch.int16).numpy().tobytes())
            for name, t in ((name, entry.as_tensor()) for name, entry in ParameterArchive(path).items())}


def in_memory_archive(source, settings, path) -> None:
    """What the build wrote before it streamed: the model loaded whole, saved by turbine."""
    import iree.turbine.aot as aot

    from engine.checkpoint import load_state_dict, read_config
    from engine.exporter.export import build_model
    from engine.config import ModelConfig

    cfg = ModelConfig.from_hf(read_config(source))
    aot.save_module_parameters(str(path), build_model(cfg, settings, load_state_dict(source)))


def streamed_archive(source, settings, path) -> None:
    from engine.checkpoint import open_tensors, read_config
    from engine.exporter.model import StreamingLlama
    from engine.exporter.weights_file import write_weights
    from engine.config import ModelConfig

    cfg = ModelConfig.from_hf(read_config(source))
    steps: list[tuple[int, int]] = []
    write_weights(StreamingLlama.skeleton(cfg, settings), open_tensors(source), path,
                  lambda done, total: steps.append((done, total)))
    assert steps[-1][0] == steps[-1][1] and [d for d, _ in steps] == list(range(1, len(steps) + 1))


def assert_same_archives(got, want) -> None:
    a, b = archive_tensors(got), archive_tensors(want)
    assert list(a) == list(b)  # same names, in the same order
    for name in b:
        assert a[name][:2] == b[name][:2], name  # dtype, shape
        assert a[name][2] == b[name][2], name  # bytes
    assert filecmp.cmp(got, want, shallow=False)  # and the same layout: the very same file


@pytest.mark.parametrize("name,dtypes", [
    ("tiny-random", DTYPES),
    # q|k|v biases, q/k norms and sandwich norms, Phi-3's fused matrices, in the types with the most to get wrong.
    ("tiny-random-qwen2", ("q8", "q4")), ("tiny-random-gemma3", ("bf16", "q8")), ("tiny-random-phi3", ("f16",)),
])
def test_streamed_weights_equal_the_in_memory_build(tmp_path, name, dtypes):
    from engine.checkpoint import resolve_model

    source = resolve_model(name)
    for dtype in dtypes:
        settings = replace(TINY_SETTINGS, dtype=dtype)
        streamed_archive(source, settings, tmp_path / f"{dtype}-streamed.irpa")
        in_memory_archive(source, settings, tmp_path / f"{dtype}-memory.irpa")
        assert_same_archives(tmp_path / f"{dtype}-streamed.irpa", tmp_path / f"{dtype}-memory.irpa")


def test_the_built_module_carries_the_in_memory_weights(tiny, tmp_path):
    """The real build (child process, export, compile) wrote the same weights file."""
    in_memory_archive(tiny.source, TINY_SETTINGS, tmp_path / "memory.irpa")
    assert_same_archives(tiny.folder / "weights.irpa", tmp_path / "memory.irpa")


def test_q8_by_row_blocks_equals_the_whole_matrix_at_once():
    """stored_matrix quantises a block of rows at a time; rows are independent, so that is exact."""
    from engine.exporter.linear import CONVERT_ROWS, stored_matrix

    w = torch.from_numpy(np.random.RandomState(0).standard_normal((2 * CONVERT_ROWS + 5, 24)).astype(np.float32))
    w[3] = 0.0  # an all-zero row keeps its floor scale
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    got = stored_matrix(w, "q8")
    assert torch.equal(got["weight"], q) and torch.equal(got["scale"], scale)
    # A 16-bit matrix is widened a block at a time: the bytes of widening it whole first.
    half = w.to(torch.bfloat16)
    for dtype in ("q8", "f16", "f32"):
        got, want = stored_matrix(half, dtype), stored_matrix(half.float(), dtype)
        assert all(torch.equal(got[k], want[k]) for k in want), dtype


def test_a_bf16_folder_streams_what_its_float32_widening_builds(tmp_path):
    """A bf16 Hugging Face folder is read as bf16 and converted a block of rows at a time (never widened whole):
    the file is the in-memory build's, which loads the folder as float32."""
    import json

    from safetensors.torch import save_file

    from engine.checkpoint import load_state_dict, read_config, resolve_model, save_tokenizer

    tiny, folder = resolve_model("tiny-random"), tmp_path / "bf16"
    save_tokenizer(resolve_model(None), folder)
    chat = json.loads((folder / "chat.json").read_text())
    (folder / "chat.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": chat["bos_token"], "eos_token": chat["eos_token"], "chat_template": chat["chat_template"]}))
    (folder / "config.json").write_text(json.dumps({**read_config(tiny), "architectures": ["LlamaForCausalLM"]}))
    save_file({k: v.to(torch.bfloat16) for k, v in load_state_dict(tiny).items()}, str(folder / "model.safetensors"))
    source = resolve_model(str(folder))
    for dtype in ("f16", "q8"):
        settings = replace(TINY_SETTINGS, dtype=dtype)
        streamed_archive(source, settings, tmp_path / f"{dtype}-streamed.irpa")
        in_memory_archive(source, settings, tmp_path / f"{dtype}-memory.irpa")
        assert_same_archives(tmp_path / f"{dtype}-streamed.irpa", tmp_path / f"{dtype}-memory.irpa")


def test_a_gguf_streams_its_single_matrices_a_block_of_rows_at_a_time(tmp_path):
    """A GGUF matrix that takes the float path and is a piece of its own (the LM head, down projections) is read a
    block of rows at a time (gguf.GGUFRows), never whole in float32; the file is still the in-memory build's.
    Q8_0 here: the gguf package quantises it (Q6_K's own dequantiser is held to gguf-py's in test_gguf_q4)."""
    from gguf_writer import write_gguf

    from engine.checkpoint import load_state_dict, open_tensors, read_config, resolve_model
    from engine.checkpoint.gguf import GGUFRows
    from engine.exporter.linear import CONVERT_ROWS

    tiny = resolve_model("tiny-random")
    cfg = read_config(tiny)
    source = resolve_model(str(write_gguf(tmp_path / "tiny-q8_0.gguf", "llama", cfg,
                                          {k: v.numpy() for k, v in load_state_dict(tiny).items()}, quant="Q8_0")))
    tensors = open_tensors(source)
    down = tensors.read_rows("model.layers.0.mlp.down_proj.weight")
    assert isinstance(down, GGUFRows) and down.shape == tensors.shapes["model.layers.0.mlp.down_proj.weight"]
    whole = tensors.read_stored("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(down[3:7], whole[3:7]) and torch.equal(down.contiguous(), whole)
    assert tensors.read_rows("model.layers.0.self_attn.q_proj.weight") is None  # rows permuted by llama.cpp
    assert cfg["vocab_size"] > CONVERT_ROWS  # the embedding (the tied head) is read in blocks below
    for dtype in ("q8", "q4"):
        settings = replace(TINY_SETTINGS, dtype=dtype)
        streamed_archive(source, settings, tmp_path / f"{dtype}-streamed.irpa")
        in_memory_archive(source, settings, tmp_path / f"{dtype}-memory.irpa")
        assert_same_archives(tmp_path / f"{dtype}-streamed.irpa", tmp_path / f"{dtype}-memory.irpa")


def test_archive_writer_refuses_a_wrong_length_and_a_missing_tensor(tmp_path):
    from engine.exporter.irpa import ArchiveWriter, Entry

    writer = ArchiveWriter(tmp_path / "w.irpa", [Entry("a", 8), Entry("b", 4)])
    with pytest.raises(ValueError, match="a: 4 bytes, but its entry holds 8"):
        writer.write("a", bytes(4))
    writer.write("a", bytes(8))
    with pytest.raises(ValueError, match="never written, e.g. b"):
        writer.close()


def test_archive_writer_raises_a_failed_write_from_its_thread(tmp_path):
    """The writer's bytes go out from a thread of its own; a write the OS refuses (here a file-size limit:
    EFBIG, as a full disk gives ENOSPC) is raised in the caller's thread, by close; a closed writer takes
    nothing more."""
    import resource
    import signal

    from engine.exporter.irpa import ArchiveWriter, Entry

    writer = ArchiveWriter(tmp_path / "w.irpa", [Entry("a", 1 << 16), Entry("b", 1 << 16)])
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from pwrite instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1]))
    try:
        writer.write("a", bytes(1 << 16))
        with pytest.raises(OSError, match="cannot write .*w.irpa"):
            writer.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    with pytest.raises(ValueError, match="closed"):
        writer.write("b", bytes(1 << 16))
