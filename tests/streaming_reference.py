"""A plain torch StreamingLLM reference, written independently of engine/exporter/model.py.

It keeps an explicit ordered list of cached entries per layer, stores keys *before* RoPE and rotates every
key by its index in the cache at each step (the textbook formulation), on Hugging Face weights of the
Llama-style families: Llama and Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm before RoPE) and Phi-3
(fused qkv_proj and gate_up_proj), Gemma 2 (embeddings scaled by sqrt(hidden), (1 + w) norms before and after
attention and MLP, GeGLU, soft-capped scores and logits, query_pre_attn_scalar, and local layers that see only
the last sliding_window tokens) and Gemma 3 (Gemma 2's layout with q/k norms, no soft caps, and local layers
rotated with their own unscaled base beside the linearly scaled global one). Which of these a model has is read off its tensor names and config, not
engine/arch.py.
A chunk of n tokens first makes room for itself (the oldest window entries leave), then each of its tokens
attends to every cached entry not later than itself.
"""
from __future__ import annotations

import torch


class StreamingReference:
    def __init__(self, state: dict[str, torch.Tensor], hf_cfg: dict, sinks: int, window: int) -> None:
        self.w = {k: v.float() for k, v in state.items()}
        self.c = hf_cfg
        self.sinks, self.capacity = sinks, sinks + window
        self.layers = [[] for _ in range(hf_cfg["num_hidden_layers"])]  # entries: (abs_pos, k_pre, v)
        self.position = 0
        d = hf_cfg["head_dim"]
        base = lambda theta: 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # noqa: E731
        scaling = hf_cfg.get("rope_scaling") or {}
        assert scaling.get("rope_type", "linear") == "linear", "the reference knows linear rope scaling only"
        global_freq = base(hf_cfg["rope_theta"]) / float(scaling.get("factor", 1.0))
        self.gemma = hf_cfg.get("model_type") in ("gemma2", "gemma3")
        self.local = [t == "sliding_attention" for t in hf_cfg.get("layer_types") or []] or [False] * len(self.layers)
        local_theta = hf_cfg.get("rope_local_base_freq")
        self.inv_freq = [base(local_theta) if local and local_theta else global_freq for local in self.local]
        self.scale = (hf_cfg.get("query_pre_attn_scalar") or d) ** -0.5

    def rope(self, x: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        ang = pos.double()[:, None] * self.inv_freq[layer][None]
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
        h = x.shape[-1] // 2
        return torch.cat([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * (1 + w if self.gemma else w)

    @staticmethod
    def cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
        return x if not cap else torch.tanh(x / cap) * cap

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    def qkv(self, h: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if p + "self_attn.qkv_proj.weight" in self.w:  # Phi-3: one matrix, rows q | k | v
            c = self.c
            q_rows, kv_rows = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
            return self.linear(h, p + "self_attn.qkv_proj").split([q_rows, kv_rows, kv_rows], dim=-1)
        return tuple(self.linear(h, f"{p}self_attn.{x}_proj") for x in "qkv")

    def mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        if p + "mlp.gate_up_proj.weight" in self.w:  # Phi-3: one matrix, rows gate | up
            gate, up = self.linear(h, p + "mlp.gate_up_proj").chunk(2, dim=-1)
        else:
            gate, up = self.linear(h, p + "mlp.gate_proj"), self.linear(h, p + "mlp.up_proj")
        act = torch.nn.functional.gelu(gate, approximate="tanh") if self.gemma else torch.nn.functional.silu(gate)
        return self.linear(act * up, p + "mlp.down_proj")

    @torch.no_grad()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Feeds a chunk; returns logits for each of its tokens [n, vocab]."""
        c, w = self.c, self.w
        n, H, KVH, D = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        abs_pos = list(range(self.position, self.position + n))
        self.position += n
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        if self.gemma:
            x = x * c["hidden_size"] ** 0.5
        for li, entries in enumerate(self.layers):
            p = f"model.layers.{li}."
            h = self.norm(x, w[p + "input_layernorm.weight"])
            q, k, v = self.qkv(h, p)
            q, k, v = q.reshape(n, H, D), k.reshape(n, KVH, D), v.reshape(n, KVH, D)
            if p + "self_attn.q_norm.weight" in w:  # Qwen3: each head normalised, before RoPE
                q, k = self.norm(q, w[p + "self_attn.q_norm.weight"]), self.norm(k, w[p + "self_attn.k_norm.weight"])
            entries.extend((a, k[i], v[i]) for i, a in enumerate(abs_pos))
            while len(entries) > self.capacity:
                del entries[self.sinks]
            cache_pos = torch.arange(len(entries))
            keys = self.rope(torch.stack([e[1] for e in entries]), cache_pos, li)  # [C, KVH, D]
            vals = torch.stack([e[2] for e in entries])
            where = {a: i for i, (a, _, _) in enumerate(entries)}
            outs = []
            for i, a in enumerate(abs_pos):
                qi = self.rope(q[i : i + 1], torch.tensor([where[a]]), li)[0]  # [H, D]
                window = c["sliding_window"] if self.local[li] else None
                visible = torch.tensor([e[0] <= a and (window is None or e[0] > a - window) for e in entries])
                kk = keys.repeat_interleave(H // KVH, dim=1)  # [C, H, D]
                vv = vals.repeat_interleave(H // KVH, dim=1)
                s = self.cap(torch.einsum("hd,chd->hc", qi, kk) * self.scale, c.get("attn_logit_softcapping"))
                s = s.masked_fill(~visible[None], float("-inf")).softmax(-1)
                outs.append(torch.einsum("hc,chd->hd", s, vv).reshape(H * D))
            out = self.linear(torch.stack(outs), p + "self_attn.o_proj")
            if self.gemma:  # sandwich norms: after attention, and before and after the MLP
                x = x + self.norm(out, w[p + "post_attention_layernorm.weight"])
                h = self.mlp(self.norm(x, w[p + "pre_feedforward_layernorm.weight"]), p)
                x = x + self.norm(h, w[p + "post_feedforward_layernorm.weight"])
            else:
                x = x + out
                x = x + self.mlp(self.norm(x, w[p + "post_attention_layernorm.weight"]), p)
        x = self.norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return self.cap(x @ head.T, c.get("final_logit_softcapping"))
