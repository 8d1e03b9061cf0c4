"""Eddy's 4-bit weights (engine/exporter/q4.py) against GGUF's Q4_1, the layout the default model ships in: the
quantiser, the tiled layout, and each product form this CPU runs compiled on its own (the generic ones and the
hand-written ones of engine/exporter/kernels/dot_products.py and prefill_products.py). A whole model's q4 build is held to its dequantised weights in
test_engine.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.exporter.kernels.prefill_products import FEW_ROW_GROUPS, ROW_BLOCK, ROWS_PER_WORKGROUP, STEPS
from engine.exporter.q4 import Q4_GROUP, dequantise_q4, quantise_q4, unpack_q4, untile_q4


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, cols], scale, offset [rows, cols/32]) from raw Q4_1 rows: per block of 32, float16 d and m,
    then 16 bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, -1)
    return codes, d, m


def test_a_q4_1_gguf_tensor_comes_back_as_the_same_codes():
    """Requantising a Q4_1 tensor's dequantised weights gives back its very codes, and scales and offsets equal
    to its float16 ones within float32 rounding: a Q4_1 GGUF passes through q4 unchanged."""
    import gguf

    q41 = gguf.GGMLQuantizationType.Q4_1
    w = np.random.RandomState(0).standard_normal((48, 4 * Q4_GROUP)).astype(np.float32)
    raw = gguf.quants.quantize(w, q41)
    codes, d, m = q4_1_blocks(raw)
    ours = quantise_q4(torch.from_numpy(gguf.quants.dequantize(raw, q41).astype(np.float32)))
    assert np.array_equal(unpack_q4(ours["weight"]).numpy(), codes)
    np.testing.assert_allclose(ours["scale"].numpy(), d, rtol=1e-6)
    np.testing.assert_allclose(ours["offset"].numpy(), m, rtol=1e-6)
    # And the weights they make are the GGUF's own (up to float32 rounding of code * scale + offset).
    np.testing.assert_allclose(dequantise_q4(*ours.values()).numpy(), gguf.quants.dequantize(raw, q41),
                               rtol=0, atol=1e-6)


def test_every_weight_lands_within_half_a_step_and_the_extremes_exactly():
    w = torch.from_numpy(np.random.RandomState(1).standard_normal((16, 8 * Q4_GROUP)).astype(np.float32)) * 3
    q = quantise_q4(w)
    assert q["weight"].dtype == torch.int8 and q["weight"].shape == (16, 4 * Q4_GROUP)
    back = dequantise_q4(*q.values())
    step = q["scale"].repeat_interleave(Q4_GROUP, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-5).all()
    groups = w.reshape(16, -1, Q4_GROUP)
    codes = unpack_q4(q["weight"]).reshape(16, -1, Q4_GROUP)
    assert torch.equal(codes.gather(-1, groups.argmin(-1, keepdim=True)), torch.zeros_like(codes[..., :1]))
    assert torch.equal(codes.gather(-1, groups.argmax(-1, keepdim=True)), torch.full_like(codes[..., :1], 15))


def test_a_multiplied_matrix_is_tiled_with_the_same_codes_and_its_numbers_split():
    """tile_q4 puts each group of a 16-row tile in four 64-byte blocks, block h's byte 4r + j holding row r's codes at
    positions 4h + j (low nibble) and 4h + 16 + j (high nibble): the operands of the x86 integer dot products that
    decode's product takes (engine/exporter/kernels/dot_products.py). Its numbers are split_numbers' 8-bit factors and float16
    units, tiled the same way; untile_q4 gives back the codes exactly and the numbers as the products use them."""
    from engine.exporter.q4 import TILE, join_numbers, split_numbers, tile_q4, untile_q4

    rows_n, cols = 2 * TILE, 64 * Q4_GROUP  # 64 groups, 2048 wide: two super-blocks of 32
    w = torch.from_numpy(np.random.RandomState(2).standard_normal((rows_n, cols)).astype(np.float32))
    rows = quantise_q4(w)
    tiled = tile_q4(rows)
    assert tiled["weight"].shape == (2, cols // Q4_GROUP, TILE * Q4_GROUP // 2)
    assert tiled["scale"].shape == (2, cols // Q4_GROUP, TILE) and tiled["scale"].dtype == torch.int8
    assert tiled["units"].shape == (2, 2, 3, TILE) and tiled["units"].dtype == torch.float16
    split = split_numbers(rows["scale"], rows["offset"])
    codes, tiled_codes = unpack_q4(rows["weight"]), unpack_q4(tiled["weight"])  # [tile, group, nibble in group]
    for r, k in ((0, 0), (1, 5), (TILE + 3, cols - 1), (rows_n - 1, 77), (7, 16 + 6), (9, 32 + 15), (4, 800)):
        p, lane = k % Q4_GROUP, r % TILE
        byte = 64 * (p % 16 // 4) + 4 * lane + p % 4
        assert tiled_codes[r // TILE, k // Q4_GROUP, 2 * byte + p // 16] == codes[r, k]
        for name in ("scale", "offset"):
            assert tiled[name][r // TILE, k // Q4_GROUP, lane] == split[name][r, k // Q4_GROUP]
        assert torch.equal(tiled["units"][r // TILE, k // 1024, :, lane], split["units"][r, k // 1024])
    back = untile_q4(tiled)
    assert torch.equal(back["weight"], rows["weight"])
    scale, offset = join_numbers(split)
    assert torch.equal(back["scale"], scale) and torch.equal(back["offset"], offset)


def test_super_blocks_are_of_8_groups_in_narrow_rows_and_of_32_from_2048_wide():
    """The most groups that divide a row, up to 8 below 2048 wide (the default model's 576 and 1536: its build as it
    was), up to 32 from there (1B-8B, whose decode reads its bytes at the memory's speed)."""
    from engine.config import super_groups

    widths = {576: 6, 1536: 8, 896: 7, 2016: 7, 2048: 32, 4096: 32, 8192: 32, 14336: 32, 4864: 19, 11008: 8}
    assert {w: super_groups(w // Q4_GROUP) for w in widths} == widths


def test_split_numbers_round_each_group_number_to_a_factor_of_its_super_blocks_units():
    """A scale is a factor 0..255 of its super-block's unit (the largest scale / 255); an offset is the block's
    base plus a factor 0..255 of a unit (its least to its largest offset over 255 steps), after taking up 7.5 times
    its scale's rounding. So a weight of code c moves by at most half a scale unit times |c - 7.5|, plus half an
    offset unit; the largest scale is exactly 255 units, and each block's offsets use the factors' whole range. A
    negative scale (Q4_0's d may be) is flipped before tiling, with the same weights."""
    from engine.exporter.q4 import join_numbers, split_numbers, tile_q4, untile_q4

    rng = np.random.RandomState(4)
    scale = torch.from_numpy(rng.uniform(0.001, 0.05, (32, 64)).astype(np.float32)).to(torch.float16)
    offset = torch.from_numpy(rng.uniform(-0.4, 0.3, (32, 64)).astype(np.float32)).to(torch.float16)
    split = split_numbers(scale, offset)
    assert split["units"].shape == (32, 2, 3)  # 64 groups: two super-blocks of 32
    s, o = join_numbers(split)
    s_unit, o_unit = (split["units"][..., i].float().repeat_interleave(32, dim=1) for i in (0, 1))
    for code in (0.0, 7.0, 15.0):
        want, got = code * scale.float() + offset.float(), code * s + o
        assert ((got - want).abs() <= s_unit * 0.5 * abs(code - 7.5) + o_unit * 0.5 + 1e-6).all()
    factors = {n: split[n].view(torch.uint8).reshape(32, 2, 32) for n in ("scale", "offset")}
    assert (factors["scale"].amax(-1) == 255).all()
    assert (factors["offset"].amin(-1) <= 1).all() and (factors["offset"].amax(-1) >= 254).all()
    # A negative scale: the group's codes become 15 - code, and its weights stay.
    w = torch.from_numpy(rng.standard_normal((16, 8 * Q4_GROUP)).astype(np.float32))
    rows = quantise_q4(w)
    flipped = {**rows, "scale": rows["scale"].clone(), "offset": rows["offset"].clone()}
    flipped["scale"][3, 2] = -flipped["scale"][3, 2]
    want = dequantise_q4(*flipped.values())
    got = dequantise_q4(*untile_q4(tile_q4(flipped)).values())
    assert (got - want).abs().max() < 0.01 * w.abs().max()


def test_a_matrix_without_whole_tiles_or_groups_is_stored_in_q8():
    from engine.exporter.kernels import untile_q8
    from engine.config import TILE_ROWS
    from engine.exporter.linear import matrix_dtype, stored_matrix

    assert matrix_dtype("q4", 4 * Q4_GROUP, 64) == "q4"
    assert matrix_dtype("q4", 4 * Q4_GROUP, 40) == "q8"  # rows not in whole tiles: only if it is multiplied
    assert matrix_dtype("q4", 4 * Q4_GROUP) == "q4"  # an embedding, looked up by row
    assert matrix_dtype("q4", 100, 64) == "q8"
    fallback = stored_matrix(torch.ones(40, 4 * Q4_GROUP), "q4", tiled=True)
    assert set(fallback) == {"weight", "scale"} and fallback["weight"].shape == (40, 4 * Q4_GROUP)  # q8, in rows
    # q8 tiles a multiplied matrix whose rows make whole tiles, as q4 does: the same bytes moved (step p's byte
    # 4r + j is row r's weight at position 4p + j), the scales per row in row order.
    w = torch.from_numpy(np.random.RandomState(3).standard_normal((64, 4 * Q4_GROUP)).astype(np.float32))
    tiled, rows = stored_matrix(w, "q8", tiled=True), stored_matrix(w, "q8")
    assert tiled["weight"].shape == (2, Q4_GROUP, TILE_ROWS * 4) and torch.equal(tiled["scale"], rows["scale"])
    for r, k in [(0, 0), (1, 2), (31, 127), (33, 5), (63, 64), (40, 99)]:
        assert tiled["weight"][r // TILE_ROWS, k // 4, 4 * (r % TILE_ROWS) + k % 4] == rows["weight"][r, k]
    assert torch.equal(untile_q8(tiled["weight"]), rows["weight"])
    # Rows not in whole steps of 4 positions stay whole.
    assert stored_matrix(torch.ones(64, 30), "q8", tiled=True)["weight"].shape == (64, 30)


@pytest.mark.parametrize("dtype,op", [("q4", "q4"), ("q8", "i8")])
def test_decode_gets_the_vectorised_product_on_cpu_and_prefill_the_widening_one(dtype, op):
    """A quantised matrix's product, in one row, carries the llvm-cpu lowering that keeps a vector accumulator per
    lane (only in a cpu export: the attribute names llvm-cpu's pipeline), and any other row count the form that
    widens the tile for the data-tiled matmul. Their numbers are held to float32 parity by test_engine.py."""
    import iree.turbine.aot as aot

    from engine.exporter.kernels import lowering_for
    from engine.exporter.linear import Linear

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = Linear(64, 2 * Q4_GROUP, dtype)

        def forward(self, x):
            return self.lin(x)

    def exported(device: str, rows: int | None) -> str:
        fxb = aot.FxProgramsBuilder(Two())
        dyn = {"x": {0: torch.export.Dim("n", min=1, max=64)}} if rows is None else None

        @fxb.export_program(name="f", args=(torch.zeros(rows or 2, 2 * Q4_GROUP),), dynamic_shapes=dyn, strict=False)
        def f(m, x):
            return m(x)

        with lowering_for(device):
            return str(aot.export(fxb).mlir_module)

    assert Two().lin.in_tiles
    assert "compilation_info" in exported("cpu", 1) and f"@eddy_mv_{op}" in exported("cpu", 1)
    assert "compilation_info" not in exported("cuda", 1)
    prefill = exported("cpu", None)
    assert f"@eddy_mm_{op}" in prefill and "compilation_info" not in prefill


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] in groups of 32 rounded to int8 as the kernels do it, in float32: (q, dx) per group."""
    xg = x.reshape(len(x), -1, Q4_GROUP).float()
    amax = xg.abs().amax(-1)
    dx = amax * torch.tensor(1 / 127, dtype=torch.float32)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xg * inv.unsqueeze(-1)), dx


def _host_forms() -> list[str | None]:
    """The decode forms this machine can run: the generic one, and each hand-written one whose instructions it has."""
    from engine.devices import host_dot_forms

    return [None, *host_dot_forms()]


def _forms_and_steps() -> list[tuple[str, str | None, int, int]]:
    """(dtype, form, steps, groups): every form for q4 and q8 with prefill's two steps in rows of 12 groups (q4's
    numbers in two super-blocks of 6), and q4's with one step in rows of 64 (2048 wide, as a model that takes one
    step: two super-blocks of 32, config.super_groups)."""
    both = [(dtype, form, STEPS, 12) for dtype in ("q4", "q8") for form in _host_forms()]
    return both + [("q4", form, 1, 64) for form in _host_forms()]


@pytest.mark.parametrize(("dtype", "form", "steps", "groups"), _forms_and_steps())
def test_each_product_form_is_the_codes_times_x_quantised_per_group(dtype, form, steps, groups, tmp_path):
    """Each product form this CPU runs, compiled, for q4 and q8, in one row (decode) and many (prefill): the generic
    ones compute the dequantised weights times x (float32 parity); a hand-written one (engine/exporter/kernels/dot_products.py,
    prefill_products.py) x quantised to int8 per group of 32 (dx = max|x| / 127), exactly as llama.cpp's Q8_1
    activations, to float32 rounding: its only error against float32 is that rounding of x, about 0.5 % of the
    output here (prefill's in two steps also multiplies x's rounding error rounded in its turn, which leaves ~2e-5).
    The tiles' order and a workgroup's share of them are covered by rows of 9 tiles (WORKGROUPS = 16 workgroups of
    at least one tile), the blocks of rows and their workgroups by `n_rows` rows (a second workgroup of rows, ending
    in a block not full), a short turn's layout (few enough groups of rows to be split evenly and to take the
    tiles a few at a time, ending in a block not full) by `n_few`, and the product's columns as three outputs
    (q, k and v) by `prefill_parts`."""
    import subprocess
    import sys

    import iree.runtime as rt
    import iree.turbine.aot as aot

    from engine.exporter.kernels import lowering_for
    from engine.exporter.linear import Linear, stored_matrix
    from engine.devices import compile_flags

    out_f, in_f = 9 * (16 if dtype == "q4" else 32), groups * Q4_GROUP
    n_rows = ROWS_PER_WORKGROUP // steps + ROW_BLOCK // (2 * steps) + 1
    n_few = FEW_ROW_GROUPS * ROWS_PER_WORKGROUP // steps - ROW_BLOCK // steps - 1
    rng = np.random.RandomState(4)
    w = torch.from_numpy(rng.standard_normal((out_f, in_f)).astype(np.float32))
    lin = Linear(out_f, in_f, dtype)
    for name, t in stored_matrix(w, dtype, tiled=True).items():
        getattr(lin, name).data = t
    x1, xn, xf = (torch.from_numpy(rng.standard_normal((n, in_f)).astype(np.float32)) for n in (1, n_rows, n_few))

    fxb = aot.FxProgramsBuilder(lin)

    @fxb.export_program(name="decode", args=(x1,), strict=False)
    def decode(m, x):
        return m(x)

    @fxb.export_program(name="prefill", args=(xn,), strict=False)
    def prefill(m, x):
        return m(x)

    @fxb.export_program(name="prefill_few", args=(xf,), strict=False)
    def prefill_few(m, x):
        return m(x)

    # Its columns as three outputs (q, k and v: Linear.parts), in whole tiles of rows.
    first, second = 4 * 16, 2 * 16

    @fxb.export_program(name="prefill_parts", args=(xn,), strict=False)
    def prefill_parts(m, x):
        return m.parts(x, first, second, many=True)

    with lowering_for("cpu", form, steps):
        mlir = str(aot.export(fxb).mlir_module)
    marks = {None: "compilation_info", "vnni": "llvm.x86.avx512.vpdpbusd.512",
             "avx2": "llvm.x86.avx2.pmadd.ub.sw" if dtype == "q4" else "llvm.x86.avx2.psign.b"}
    assert marks[form] in mlir
    # The parts come from one hand-written product with three outputs where there is one (engine/exporter/kernels/q4_products.py).
    assert (f"eddy_q4_rows_{out_f}x{in_f}_{first}_{second}_" in mlir) == (form is not None and dtype == "q4")
    (tmp_path / "m.mlir").write_text(mlir)
    iree_compile = str(Path(sys.executable).with_name("iree-compile"))
    subprocess.run([iree_compile, str(tmp_path / "m.mlir"), *compile_flags("cpu", "host"), "-o", str(tmp_path / "m.vmfb")],
                   check=True, capture_output=True)
    module = rt.load_vm_flatbuffer_file(str(tmp_path / "m.vmfb"), driver="local-task")

    # q4's products multiply by the tiled numbers (split into factors and units), which untile_q4 joins.
    rows = untile_q4(stored_matrix(w, dtype, tiled=True)) if dtype == "q4" else stored_matrix(w, dtype)
    dense = dequantise_q4(*rows.values()) if dtype == "q4" else rows["weight"].float() * rows["scale"].unsqueeze(1)

    def times_codes(q: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        q, dx = q.double(), dx.double()
        if dtype == "q4":
            codes = unpack_q4(rows["weight"]).double().reshape(out_f, -1, Q4_GROUP)
            scale, offset = rows["scale"].double(), rows["offset"].double()
            per_group = torch.einsum("rgp,ngp->nrg", codes, q) * scale + offset * q.sum(-1).unsqueeze(1)
            return (per_group * dx.unsqueeze(1)).sum(-1)
        codes = rows["weight"].double().reshape(out_f, -1, Q4_GROUP)
        return (torch.einsum("rgp,ngp->nrg", codes, q) * dx.unsqueeze(1)).sum(-1).mul(rows["scale"].double())

    def quantised_x(x: torch.Tensor, twice: bool) -> np.ndarray:
        """x's rows times the codes, x rounded to int8 per group of 32 (llama.cpp's Q8_1 activations); `twice`:
        plus the rounding's error rounded in its turn (prefill's, engine/exporter/kernels/prefill_products.py)."""
        q, dx = rounded(x)
        out = times_codes(q, dx)
        if twice:
            error = x.reshape(q.shape).float() - q * dx.unsqueeze(-1)
            out = out + times_codes(*rounded(error.reshape(x.shape)))
        return out.numpy()

    for program, x in (("decode", x1), ("prefill", xn), ("prefill_few", xf), ("prefill_parts", xn)):
        got = getattr(module, program)(x.numpy())
        if program == "prefill_parts":
            parts = [np.asarray(t) for t in got]
            assert [p.shape[1] for p in parts] == [first, second, out_f - first - second]
            got = np.concatenate(parts, axis=1)
        got = np.asarray(got)
        exact = (x @ dense.T).numpy()
        # Only q4's many-row product has a hand-written form (engine/exporter/kernels/prefill_products.py) so far.
        by_hand = form is not None and (program == "decode" or dtype == "q4")
        twice = program != "decode" and steps == 2
        want = quantised_x(x, twice) if by_hand else exact
        if by_hand:
            rel = np.abs(got - exact).max() / np.abs(exact).max()
            # x's rounding shows, and is small; in two steps (prefill) float32's own rounding is what is left.
            assert (rel < 1e-4) if twice else (1e-4 < rel < 2e-2), rel
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), program


def test_prefill_rounds_x_once_from_1b_widths_and_twice_below():
    """The default model (576 wide) keeps x's rounding error as a second step; Llama 3.2 1B's width (2048) and
    wider round x once, as decode and llama.cpp do (engine/exporter/kernels/prefill_products.py: x_steps)."""
    from engine.checkpoint.shapes import config
    from engine.exporter.kernels.prefill_products import x_steps

    assert x_steps(576) == STEPS == 2
    assert [x_steps(config(name)["hidden_size"]) for name in ("llama-3.2-1b", "llama-3.1-8b")] == [1, 1]
    assert x_steps(config("qwen2.5-0.5b")["hidden_size"]) == 2


@pytest.mark.parametrize("dtype", ["q4", "q8"])
@pytest.mark.parametrize("device", ["cuda", "vulkan"])
def test_a_gpus_product_of_many_rows_is_float16_on_matrix_units_and_float32_elsewhere(device, dtype, tmp_path):
    """Prefill's q4 and q8 products on a GPU (_MM_Q4_ONE, and on cuda _MM_I8_ONE: widened inside their own dispatch,
    q8's rows' scale too), under the device's plan and compiled here for the CPU: on cuda (Device.matrix_units) the
    dequantised weights (q8: the codes, exact) and x each rounded to float16 and their products summed in float32,
    for the tensor cores; on vulkan float32 throughout. Each within 1e-5 (relative to the largest output) of that meaning in
    float64, one output and three parts."""
    import subprocess
    import sys

    import iree.runtime as rt
    import iree.turbine.aot as aot

    from engine.devices import TABLE, compile_flags
    from engine.exporter.kernels import lowering_for
    from engine.exporter.linear import Linear, stored_matrix

    out_f, in_f, rows = 9 * 32, 16 * Q4_GROUP, 17
    rng = np.random.RandomState(6)
    w = torch.from_numpy(rng.standard_normal((out_f, in_f)).astype(np.float32))
    lin = Linear(out_f, in_f, dtype)
    for name, t in stored_matrix(w, dtype, tiled=True).items():
        getattr(lin, name).data = t
    x = torch.from_numpy(rng.standard_normal((rows, in_f)).astype(np.float32))
    first, second = 4 * 16, 2 * 16
    fxb = aot.FxProgramsBuilder(lin)

    @fxb.export_program(name="prefill", args=(x,), strict=False)
    def prefill(m, x):
        return m(x)

    @fxb.export_program(name="prefill_parts", args=(x,), strict=False)
    def prefill_parts(m, x):
        return m.parts(x, first, second, many=True)

    with lowering_for(device):
        mlir = str(aot.export(fxb).mlir_module)
    half = TABLE[device].matrix_units
    # q8's formed dispatch is cuda's only (vulkan's SPIR-V lowering of it did not finish at Qwen3's widths).
    assert ("_one_h(" in mlir) == half and ("_one" in mlir) == (half or dtype == "q4")
    (tmp_path / "m.mlir").write_text(mlir)
    subprocess.run([str(Path(sys.executable).with_name("iree-compile")), str(tmp_path / "m.mlir"),
                    *compile_flags("cpu", "host"), "-o", str(tmp_path / "m.vmfb")], check=True, capture_output=True)
    module = rt.load_vm_flatbuffer_file(str(tmp_path / "m.vmfb"), driver="local-task")
    if dtype == "q4":
        dense = dequantise_q4(*untile_q4(stored_matrix(w, "q4", tiled=True)).values()).double()
        scale = torch.ones(out_f, dtype=torch.float64)
    else:
        rows8 = stored_matrix(w, "q8")
        dense, scale = rows8["weight"].double(), rows8["scale"].double()
    xs = x.half() if half else x
    # q4's float16 weights are its dequantised ones rounded; q8's codes are exact in float16, the scale after.
    want = ((xs.double() @ (dense.half() if half and dtype == "q4" else dense).double().T) * scale).numpy()
    exact = ((x.double() @ dense.T) * scale).numpy()
    for program in ("prefill", "prefill_parts"):
        got = getattr(module, program)(x.numpy())
        got = np.concatenate([np.asarray(t) for t in got], axis=1) if program == "prefill_parts" else np.asarray(got)
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), (program, np.abs(got - want).max())
        # float16's rounding shows where it is meant to, and is small.
        rel = np.abs(got - exact).max() / np.abs(exact).max()
        assert (1e-5 < rel < 1e-2) if half else rel < 1e-5, (program, rel)


@pytest.mark.parametrize("form", [f for f in _host_forms() if f is not None])
@pytest.mark.parametrize("tiles", [9, 36])
def test_the_swiglu_down_product_is_its_activation_then_the_product(form, tiles, tmp_path):
    """Decode's SwiGLU down product (kernels.q4_linear_swiglu: silu(gate) * up made inside the hand-written
    product as it rounds x) in each form this CPU runs: the codes times silu(gate) * up rounded to int8 per group of
    32, to float32 rounding, in one workgroup (9 tiles) and in two (36: dot_products.swiglu_tiles_per_workgroup)."""
    import subprocess
    import sys

    import iree.runtime as rt
    import iree.turbine.aot as aot

    from engine.devices import compile_flags
    from engine.exporter.kernels import lowering_for, q4_linear_swiglu
    from engine.exporter.kernels.dot_products import swiglu_tiles_per_workgroup
    from engine.exporter.linear import Linear, stored_matrix

    out_f, in_f = tiles * 16, 12 * Q4_GROUP
    assert -(-tiles // swiglu_tiles_per_workgroup(tiles)) == (1 if tiles == 9 else 2)
    rng = np.random.RandomState(6)
    w = torch.from_numpy(rng.standard_normal((out_f, in_f)).astype(np.float32))
    lin = Linear(out_f, in_f, "q4")
    for name, t in stored_matrix(w, "q4", tiled=True).items():
        getattr(lin, name).data = t
    gate_up = torch.from_numpy(3 * rng.standard_normal((1, 2 * in_f)).astype(np.float32))

    class Down(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, a):
            return q4_linear_swiglu(a, *self.lin.q4_tensors())

    fxb = aot.FxProgramsBuilder(Down())

    @fxb.export_program(name="decode", args=(gate_up,), strict=False)
    def decode(m, a):
        return m(a)

    with lowering_for("cpu", form):
        mlir = str(aot.export(fxb).mlir_module)
    assert f"eddy_q4_swiglu_{out_f}x{in_f}_{form}" in mlir and "math.exp" in mlir
    (tmp_path / "m.mlir").write_text(mlir)
    iree_compile = str(Path(sys.executable).with_name("iree-compile"))
    subprocess.run([iree_compile, str(tmp_path / "m.mlir"), *compile_flags("cpu", "host"), "-o",
                    str(tmp_path / "m.vmfb")], check=True, capture_output=True)
    got = np.asarray(rt.load_vm_flatbuffer_file(str(tmp_path / "m.vmfb"), driver="local-task").decode(gate_up.numpy()))

    rows = untile_q4(stored_matrix(w, "q4", tiled=True))
    dense = dequantise_q4(*rows.values()).double()
    x = torch.nn.functional.silu(gate_up[:, :in_f]) * gate_up[:, in_f:]
    q, dx = rounded(x)
    want = (dense @ (q * dx.unsqueeze(-1)).reshape(-1).double()).numpy()
    exact = (dense @ x.reshape(-1).double()).numpy()
    scale = np.abs(want).max()
    assert np.abs(got[0] - want).max() < 1e-5 * scale
    assert 1e-4 < np.abs(got[0] - exact).max() / scale < 2e-2
