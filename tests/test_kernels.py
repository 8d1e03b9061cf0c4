"""Each attention, norm and slice op of engine/exporter/kernels/ on its own, compiled and run, against its plain torch
meaning (the q4 and q8 products have theirs in test_q4.py): under the cpu's plan (the lowering attributes and the
hand-written prefill attention) and, for the ops a GPU build takes, under a GPU's plan (IREE's own choice; compiled
here for the CPU, whose numbers must be the same). Small shapes with what the model's calls have: several query heads
per kv head, slots a multiple of ATTEND_STEP but fewer than the cache holds, a 16-bit cache read as stored."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

KVH, REP, D, SLOTS, ATTENDED, QUERIES = 2, 3, 64, 96, 64, 5
TOL = 2e-5


def _inputs(kv_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mask = torch.zeros(ATTENDED)
    mask[7] = mask[40] = float("-inf")  # masked slots, as empty and future ones are
    rows_mask = torch.zeros(QUERIES, ATTENDED)
    rows_mask[:, 50:] = float("-inf")
    return {"q": r(KVH, REP, D), "keys": r(KVH, SLOTS, D).to(kv_dtype), "values": r(KVH, SLOTS, D).to(kv_dtype),
            "mask": mask, "probs": torch.softmax(r(KVH, REP, ATTENDED), -1),
            "q_rows": r(KVH, REP, QUERIES, D), "probs_rows": torch.softmax(r(KVH, REP, QUERIES, ATTENDED), -1),
            "scores": r(KVH, REP, ATTENDED), "scores_rows": r(KVH, REP, QUERIES, ATTENDED), "rows_mask": rows_mask,
            "like": torch.zeros(ATTENDED), "row": 4 * r(1, 576), "rows": r(QUERIES, 576), "heads": r(QUERIES, 4, D),
            "norm_w": r(576), "head_norm_w": r(D)}


def _expected(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each program means, in float32 torch."""
    k, v = x["keys"].float(), x["values"].float()
    kc, vc = k[:, :ATTENDED], v[:, :ATTENDED]
    scores_rows = x["q_rows"] @ kc.unsqueeze(1).transpose(2, 3)
    attend = torch.softmax(scores_rows + x["rows_mask"], -1) @ vc.unsqueeze(1)
    return {
        "slots": kc, "blocks": kc.unflatten(1, (-1, 16)), "layer_of": v,
        "query_keys": x["q"] @ kc.transpose(1, 2) + x["mask"],
        "query_blocks": x["q"] @ kc.transpose(1, 2) + x["mask"],
        "weighted_values": x["probs"] @ vc,
        "query_keys_rows": scores_rows,
        "weighted_values_rows": (x["probs_rows"] @ vc.unsqueeze(1)).permute(2, 0, 1, 3),
        "attend_rows": attend.permute(2, 0, 1, 3),
        "softmax": torch.softmax(x["scores"], -1),
        "norm_row": _rms(x["row"], x["norm_w"], 1e-5), "norm_rows": _rms(x["rows"], x["norm_w"], 1e-6),
        "norm_heads": _rms(x["heads"], 1.0 + x["head_norm_w"], 1e-6),
        "softmax_masked": torch.softmax(x["scores_rows"] + x["rows_mask"], -1),
    }


def _rms(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps).float() * scale


class _Ops(torch.nn.Module):
    """The programs: one op each, on the cache as stored (keys and values [kvh, slots, d])."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("keys", keys)
        self.register_buffer("values", values)


def _programs(gpu: bool) -> dict:
    from engine.exporter import kernels as k

    decode = {
        "slots": lambda m, x: k.first_slots(m.keys, x["like"]),
        "blocks": lambda m, x: k.first_blocks(m.keys, x["like"]),
        # A layer of a buffer of layers, the layer as a value (a narrow model's decode reads its cache so).
        "layer_of": lambda m, x: k.layer_of(torch.stack([m.keys, m.values]), 1),
        # Decode's ops take keys and values widened to float32, as the model gives them (model.from_kv).
        "query_keys": lambda m, x: k.query_keys(x["q"], k.first_slots(m.keys, x["like"]).float(), x["mask"]),
        "query_blocks": lambda m, x: k.query_keys(x["q"], k.first_blocks(m.keys, x["like"]).float(), x["mask"]),
        "weighted_values": lambda m, x: k.weighted_values(x["probs"], k.first_slots(m.values, x["like"]).float()),
        # A norm in one dispatch: decode's one row (whose unit dimension IREE drops), prefill's rows, q's heads
        # with Gemma's offset.
        "norm_row": lambda m, x: k.rms_norm_one_dispatch(x["row"], x["norm_w"], 1e-5, 0.0),
        "norm_rows": lambda m, x: k.rms_norm_one_dispatch(x["rows"], x["norm_w"], 1e-6, 0.0),
        "norm_heads": lambda m, x: k.rms_norm_one_dispatch(x["heads"], x["head_norm_w"], 1e-6, 1.0),
    }
    prefill = {
        "query_keys_rows": lambda m, x: k.query_keys_rows(x["q_rows"], k.first_slots(m.keys, x["like"])),
        "weighted_values_rows": lambda m, x: k.weighted_values_rows(x["probs_rows"], m.values),
        "attend_rows": lambda m, x: k.attend_rows(x["q_rows"].transpose(2, 3), m.keys, m.values, x["rows_mask"].T),
        "softmax": lambda m, x: k.softmax_over_slots(x["scores"]),
        "softmax_masked": lambda m, x: k.softmax_over_slots(x["scores_rows"], x["rows_mask"]),
    }
    return decode if gpu else {**decode, **prefill}


def _run_compiled(x: dict[str, torch.Tensor], device: str, work: Path) -> dict[str, np.ndarray]:
    """Every program of `device`'s plan exported, compiled for this CPU and run."""
    import iree.runtime as rt
    import iree.turbine.aot as aot

    from engine.devices import compile_flags
    from engine.exporter.kernels import KernelPlan, lowering

    m = _Ops(x["keys"], x["values"])
    fxb = aot.FxProgramsBuilder(m)
    names = list(_programs(device != "cpu"))
    inputs = {k: v for k, v in x.items() if k not in ("keys", "values")}
    for name in names:
        def program(module, args, _name=name):
            return _programs(device != "cpu")[_name](module, dict(zip(inputs, args)))

        fxb.export_program(name=name, args=(tuple(inputs.values()),), strict=False)(program)
    with lowering(KernelPlan.of(device)):
        mlir = str(aot.export(fxb).mlir_module)
    assert ("compilation_info" in mlir) == (device == "cpu")
    (work / "m.mlir").write_text(mlir)
    compiler = str(Path(sys.executable).with_name("iree-compile"))
    subprocess.run([compiler, str(work / "m.mlir"), *compile_flags("cpu", "host"), "-o", str(work / "m.vmfb")],
                   check=True, capture_output=True)
    module = rt.load_vm_flatbuffer_file(str(work / "m.vmfb"), driver="local-task")
    args = [t.numpy() for t in inputs.values()]
    return {name: np.asarray(module[name](*args).to_host()) for name in names}


@pytest.mark.parametrize(("device", "kv"), [("cpu", "f16"), ("cpu", "f32"), ("vulkan", "f32")])
def test_each_attention_op_computes_its_torch_meaning(device, kv, tmp_path):
    x = _inputs({"f16": torch.float16, "f32": torch.float32}[kv])
    expected = _expected(x)
    got = _run_compiled(x, device, tmp_path)
    assert set(got) == set(_programs(device != "cpu"))
    for name, out in got.items():
        want = expected[name].numpy()
        assert out.shape == want.shape, name
        finite = np.isfinite(want)
        assert (np.isfinite(out) == finite).all(), name
        assert np.abs(out[finite] - want[finite]).max() < TOL, (name, np.abs(out[finite] - want[finite]).max())


# (kv heads, query heads per kv head, head_dim, the cache's slots (a whole number of blocks), slots attended): the
# default model's at a bucket of 256, Phi-3 mini's (32 heads of 96) and Llama 3.1 8B's (8 x 4 of 128) at 1024.
SPLIT_CASES = [(3, 3, 64, 272, 256), (32, 1, 96, 528, 512), (8, 4, 128, 1040, 1024)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-c{c[4]}")
def test_decodes_attention_in_splits_computes_its_torch_meaning(case, tmp_path):
    """kernels.attend_split_slots (split_attention.py: cuda's decode, IREE's attention op a block of slots at a
    time, then joined), at real widths under cuda's plan, compiled here for the CPU: within 2e-5 of softmax attention
    over the attended slots, with a slot masked, a whole block masked (a split with nothing to attend) and the
    bucket's unused tail masked, keys and values read from the cache's blocks (first_blocks)."""
    import iree.runtime as rt
    import iree.turbine.aot as aot

    from engine.devices import compile_flags
    from engine.exporter import kernels as k
    from engine.exporter.kernels import KernelPlan, lowering

    kvh, rep, d, slots, c = case
    g = torch.Generator().manual_seed(5)
    q = torch.randn(kvh, rep, d, generator=g)
    keys, values = (torch.randn(kvh, slots, d, generator=g) for _ in range(2))
    mask = torch.zeros(c)
    mask[3] = float("-inf")
    mask[32:48] = float("-inf")
    mask[c - 100:] = float("-inf")
    scale = d ** -0.5

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("keys", keys)
            self.register_buffer("values", values)

        def forward(self, q, mask, like):
            blocks = k.first_blocks(self.keys, like), k.first_blocks(self.values, like)
            return k.attend_split_slots(q, *blocks, mask, scale)

    like = torch.zeros(c)
    with lowering(KernelPlan.of("cuda")):
        mlir = str(aot.export(Split(), args=(q, mask, like), strict_export=False).mlir_module)
    assert "iree_linalg_ext.online_attention" in mlir
    (tmp_path / "m.mlir").write_text(mlir)
    subprocess.run([str(Path(sys.executable).with_name("iree-compile")), str(tmp_path / "m.mlir"),
                    *compile_flags("cpu", "host"), "-o", str(tmp_path / "m.vmfb")], check=True, capture_output=True)
    module = rt.load_vm_flatbuffer_file(str(tmp_path / "m.vmfb"), driver="local-task")
    got = np.asarray(module.main(q.numpy(), mask.numpy(), like.numpy()).to_host())
    probs = torch.softmax(torch.einsum("hrd,hcd->hrc", q, keys[:, :c]) * scale + mask, -1)
    want = torch.einsum("hrc,hcd->hrd", probs, values[:, :c]).numpy()
    assert np.abs(got - want).max() < TOL, float(np.abs(got - want).max())
