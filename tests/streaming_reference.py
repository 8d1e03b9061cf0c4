"""A plain torch StreamingLLM reference, written independently of engine/build/model.py.

It keeps an explicit ordered list of cached entries per layer, stores keys *before* RoPE and rotates every
key by its index in the cache at each step (the textbook formulation), on Hugging Face Llama weights.
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
        self.inv_freq = 1.0 / (hf_cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.double()[:, None] * self.inv_freq[None]
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
        h = x.shape[-1] // 2
        return torch.cat([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * w

    @torch.no_grad()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Feeds a chunk; returns logits for each of its tokens [n, vocab]."""
        c, w = self.c, self.w
        n, H, KVH, D = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        abs_pos = list(range(self.position, self.position + n))
        self.position += n
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        for li, entries in enumerate(self.layers):
            p = f"model.layers.{li}."
            h = self.norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, H, D)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, KVH, D)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, KVH, D)
            entries.extend((a, k[i], v[i]) for i, a in enumerate(abs_pos))
            while len(entries) > self.capacity:
                del entries[self.sinks]
            cache_pos = torch.arange(len(entries))
            keys = self.rope(torch.stack([e[1] for e in entries]), cache_pos)  # [C, KVH, D]
            vals = torch.stack([e[2] for e in entries])
            where = {a: i for i, (a, _, _) in enumerate(entries)}
            outs = []
            for i, a in enumerate(abs_pos):
                qi = self.rope(q[i : i + 1], torch.tensor([where[a]]))[0]  # [H, D]
                visible = torch.tensor([e[0] <= a for e in entries])
                kk = keys.repeat_interleave(H // KVH, dim=1)  # [C, H, D]
                vv = vals.repeat_interleave(H // KVH, dim=1)
                s = torch.einsum("hd,chd->hc", qi, kk) / D**0.5
                s = s.masked_fill(~visible[None], float("-inf")).softmax(-1)
                outs.append(torch.einsum("hc,chd->hd", s, vv).reshape(H * D))
            x = x + torch.stack(outs) @ w[p + "self_attn.o_proj.weight"].T
            h = self.norm(x, w[p + "post_attention_layernorm.weight"])
            g = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + g @ w[p + "mlp.down_proj.weight"].T
        x = self.norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return x @ head.T
