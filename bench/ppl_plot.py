#!/usr/bin/env python3
"""Turns `eddy ppl --json FILE` outputs into a perplexity-over-position plot and a Markdown table.

    python bench/ppl_plot.py docs/quality/*.json --out docs/quality/ppl.png [--bin 1024] [--table]

One column of panels per cache window (sinks + window of the streaming build); `dense` runs, which do not
depend on the window, appear in every column. Top: perplexity of consecutive bins of positions (streaming,
window, dense; not recompute, which scores every k-th position only: a few samples per bin). Bottom:
running perplexity over the recompute positions only, for every mode: the paired comparison with the
reference. `--table` prints two Markdown tables: per window and mode, perplexity over all scored tokens and
beyond the capacity (once eviction has started) with tokens/s; and perplexities of every mode over the same
positions (the recompute positions, and the range dense covers), the fair comparison.
Needs matplotlib (a dev/test extra, not a runtime dependency).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

COLORS = {"streaming": "tab:blue", "window": "tab:red", "recompute": "black", "dense": "tab:green"}
ORDER = {"streaming": 0, "window": 1, "recompute": 2, "dense": 3}


def load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        r["positions"], r["losses"] = np.asarray(r["positions"]), np.asarray(r["losses"], dtype=np.float64)
        r["file"] = p
        runs.append(r)
    dtypes = {r["dtype"] for r in runs}
    for r in runs:
        r["mixed_dtypes"] = len(dtypes) > 1
    return runs


def dtype_order(runs: list[dict]) -> list[str]:
    """Weight types, the most common first."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r["dtype"]] = counts.get(r["dtype"], 0) + 1
    return sorted(counts, key=lambda d: -counts[d])


def label(r: dict) -> str:
    weights = f", {r['dtype']}" if r.get("mixed_dtypes") else ""
    if r["mode"] == "recompute":
        return f"recompute (every {r['stride']}th{weights})"
    if r["mode"] == "dense":
        return f"dense (first {r['text_tokens']} tokens{weights})"
    return f"{r['mode']} (chunk {r['chunk']}{weights})"


def style(r: dict, dtypes: list[str]) -> str:
    """Solid for the first weight type and default chunk; dotted for other chunks; dashed for other types."""
    if r["dtype"] != dtypes[0]:
        return "--"
    return "-" if r["chunk"] == 16 or r["mode"] in ("dense", "recompute") else ":"


def windows(runs: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["sinks"], r["window"]) for r in runs if r["mode"] != "dense"}, key=lambda sw: sw[1])


def panel_runs(runs: list[dict], sw: tuple[int, int]) -> list[dict]:
    chosen = [r for r in runs if r["mode"] == "dense" or (r["sinks"], r["window"]) == sw]
    first = dtype_order(runs)[0]
    return sorted(chosen, key=lambda r: (r["dtype"] != first, r["dtype"], ORDER[r["mode"]], r["chunk"] != 16, r["chunk"]))


def binned(r: dict, bin_size: int) -> tuple[np.ndarray, np.ndarray]:
    edges = np.arange(0, int(r["positions"].max()) + bin_size, bin_size)
    idx = np.digitize(r["positions"], edges) - 1
    xs, ys = [], []
    for b in range(len(edges) - 1):
        sel = idx == b
        if sel.any():
            xs.append(r["positions"][sel].mean())
            ys.append(math.exp(r["losses"][sel].mean()))
    return np.array(xs), np.array(ys)


def at(r: dict, positions: np.ndarray) -> np.ndarray:
    """r's losses at the given positions (NaN where r did not score them)."""
    lookup = dict(zip(r["positions"].tolist(), r["losses"].tolist()))
    return np.array([lookup.get(int(p), np.nan) for p in positions])


def ppl(losses: np.ndarray) -> float:
    losses = losses[~np.isnan(losses)]
    return math.exp(losses.mean()) if len(losses) else float("nan")


def plot(runs: list[dict], out: Path, bin_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws, dtypes = windows(runs), dtype_order(runs)
    fig, axes = plt.subplots(2, len(ws), figsize=(7 * len(ws), 8.5), squeeze=False, sharex="col")
    model = runs[0]["model"]
    for col, sw in enumerate(ws):
        chosen = panel_runs(runs, sw)
        cap = sw[0] + sw[1]
        top, bottom = axes[0, col], axes[1, col]
        for r in chosen:
            if r["mode"] != "recompute":  # a few samples per bin: too noisy here, see the bottom panel
                xs, ys = binned(r, bin_size)
                top.plot(xs, ys, style(r, dtypes), color=COLORS[r["mode"]], lw=1.6, label=label(r))
        ref = next((r for r in chosen if r["mode"] == "recompute"), None)
        if ref is not None:
            pos = ref["positions"]
            for r in chosen:
                vals = at(r, pos)
                keep = ~np.isnan(vals)
                running = np.exp(np.cumsum(vals[keep]) / np.arange(1, keep.sum() + 1))
                bottom.plot(pos[keep], running, style(r, dtypes), color=COLORS[r["mode"]], lw=2 if r["mode"] == "recompute" else 1.4,
                            label=label(r))
        for ax in (top, bottom):
            ax.axvline(cap, color="gray", lw=0.8, ls="--")
            ax.grid(alpha=0.3)
        top.set_yscale("log")
        top.set_title(f"{model}: {sw[0]} sinks + {sw[1]} window (capacity {cap}; dashed line: first eviction)", fontsize=10)
        top.set_ylabel(f"perplexity of each {bin_size}-token bin")
        bottom.set_ylabel("running perplexity at the recompute positions")
        bottom.set_xlabel("position in the text (tokens)")
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(runs: list[dict]) -> str:
    lines = ["| window | mode | chunk / stride | tokens scored | ppl (all scored) | ppl beyond capacity | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for sw in windows(runs):
        cap = sw[0] + sw[1]
        for r in panel_runs(runs, sw):
            beyond = r["losses"][r["positions"] >= cap]
            how = f"stride {r['stride']}" if r["mode"] == "recompute" else f"chunk {r['chunk']}"
            mode = f"{r['mode']} ({r['dtype']})" if r["mixed_dtypes"] else r["mode"]
            lines.append(f"| {sw[0]}+{sw[1]} | {mode} | {how} | {r['tokens']} | {r['ppl']:.2f} | "
                         f"{ppl(beyond):.2f} | {r['tok_s']:.2f} |")
    return "\n".join(lines)


def paired_table(runs: list[dict]) -> str:
    """Every mode's perplexity over the same positions (— where a mode did not score all of them)."""
    out = []
    for sw in windows(runs):
        chosen = panel_runs(runs, sw)
        cap = sw[0] + sw[1]
        ref = next((r for r in chosen if r["mode"] == "recompute"), None)
        dense = next((r for r in chosen if r["mode"] == "dense"), None)
        sets = []
        if ref is not None:
            rp = ref["positions"][ref["positions"] >= cap]
            sets.append((f"recompute positions >= {cap}", rp))
            if dense is not None:
                sets.append((f"recompute positions in [{cap}, {dense['text_tokens']})", rp[rp < dense["text_tokens"]]))
        if dense is not None:
            sets.append((f"all positions in [{cap}, {dense['text_tokens']})", np.arange(cap, dense["text_tokens"])))
        out += [f"| {sw[0]}+{sw[1]}: positions | n | " + " | ".join(label(r) for r in chosen) + " |",
                "|---|---|" + "---|" * len(chosen)]
        for name, pos in sets:
            cells = []
            for r in chosen:
                vals = at(r, pos)
                cells.append("—" if np.isnan(vals).any() or not len(pos) else f"{ppl(vals):.2f}")
            out.append(f"| {name} | {len(pos)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON files written by `eddy ppl --json`")
    p.add_argument("--out", default="ppl.png", help="PNG to write")
    p.add_argument("--bin", type=int, default=1024, help="positions per bin in the top panels")
    p.add_argument("--table", action="store_true", help="also print a Markdown table")
    a = p.parse_args()
    runs = load(a.files)
    plot(runs, Path(a.out), a.bin)
    if a.table:
        print(table(runs))
        print()
        print(paired_table(runs))
