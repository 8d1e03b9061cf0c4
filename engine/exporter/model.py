"""A compact Llama-style transformer whose KV cache is a StreamingLLM window, written to be exported by
iree-turbine.

One file in the spirit of gpt-fast's model.py: a config (ModelConfig), a table of families (engine/arch.py: which
projections have biases, q/k norms, norm style, activation, tensor names) and the cache as buffers. Export-side
only (needs torch).

The cache is one buffer [layers, 2, kv_heads, sink slots + window, head_dim] (plus the sinks' original keys: see
Attention.write_cache). The host decides which slot each new token goes to (sinks first, then a ring over the
window after the last sink slot; how many sink slots hold sinks is the host's choice per conversation, the rest
stay empty) and tells the module, per call:
  * `slots`      the slot each new token is written to;
  * `rope`       [tables, 2, n, head_dim/2]: cos/sin at each new token's absolute position, per RoPE table
                 (one, or two for Gemma 3, whose local layers have their own base: ModelConfig.rope_table);
  * `shift`      [tables, 2, head_dim/2]: cos/sin of the number of tokens evicted so far;
  * `slot_pos`   the absolute position held by each of the cache's first `attended` slots after this write (a
                 huge value when empty), then, when local layers keep their own ring (ModelConfig.local_ring),
                 each ring slot's before it. Attention reads those first slots only: the host fills the cache
                 from slot 0 and passes as few as cover every used slot, so a call's attention costs what the
                 conversation holds, not what the build could hold (a window of 8188 costs a short chat what
                 one of 1020 does);
  * `token_pos`  each new token's absolute position.
Keys are stored rotated by their absolute position, so window keys never need re-rotation: their distance to
a query is the same in the conversation as in the cache. Only the sinks sit closer to the queries in the cache
than in the conversation: their keys are re-rotated forward by the evicted count, O(sinks) work per call. The
result is StreamingLLM's rule (each token attended at its position within the cache) with no copy of the
cache and no re-rotation on eviction.

A GPU build holds a program per call shape (engine/shapes.py), and the host pads a prefill to the next chunk size:
a padded token's slot is `settings.slots`, one past the slots any call reads (the cache has that one more, the own
ring one more past its `ring`), and StreamingLlama.padding picks them out, so no real token attends to them and the
logits returned are the last real token's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import Family, family
from ..config import ATTEND_STEP, BuildSettings, ModelConfig, auto_kv_dtype
from ..devices import TABLE, dot_form
from ..shapes import call_shapes
from .kernels import (attend_one_dispatch, attend_rows, attend_split_slots, first_blocks, first_slots, layer_of,
                      q4_linear_swiglu, query_keys, query_keys_rows, rms_norm_one_dispatch, softmax_over_slots,
                      weighted_values, weighted_values_rows)
from .kernels.attention_rows import attend_plan
from .linear import Linear, Piece

# The KV cache buffers' element type per --kv-dtype. bfloat16 is kept as its bits in int16: turbine 3.9 cannot make
# a bfloat16 global (it goes through numpy, which has no such type), so the graph bitcasts on every write and read.
KV_STORAGE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.int16}
# Models narrower than this read their layer of the cache in decode with the layer as a value (Attention.write_cache).
LAYER_VALUE_BELOW = 2048
EMPTY_SLOT = 2**62  # slot_pos of an empty slot: later than any token, so masked for every query


class RMSNorm(nn.Module):
    """Scales by (offset + weight): Gemma stores its norms as w with the 1 implied. `groups`: the squares are summed
    per group of that many first (the device's norm_groups, engine/devices.py; 0: in one reduction). `one_dispatch`:
    as one kernel (kernels.rms_norm_one_dispatch: a launch-bound device's fixed shapes), where IREE makes two."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, groups: int = 0, one_dispatch: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.groups = groups if groups and dim % groups == 0 else 0
        self.one_dispatch = one_dispatch and not self.groups
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, half: bool = False) -> torch.Tensor:
        """`half`: rounded to float16, for a product that takes x so (Linear.rounds_x)."""
        if self.one_dispatch:
            return rms_norm_one_dispatch(x, self.weight, self.eps, self.offset, half)
        scale = self.weight + self.offset if self.offset else self.weight
        if self.groups:
            squares = x.pow(2).unflatten(-1, (-1, self.groups)).sum(-1).sum(-1, keepdim=True) / x.shape[-1]
        else:
            squares = x.pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(squares + self.eps) * scale
        return y.half() if half else y


def one_dispatch_norms(cfg: ModelConfig, settings: BuildSettings) -> bool:
    """Whether a build's norms are one kernel each: on a launch-bound device, whose calls have fixed shapes."""
    return TABLE[settings.device].launch_bound and call_shapes(cfg, settings) is not None


def split_decode(cfg: ModelConfig, settings: BuildSettings) -> bool:
    """Whether decode's attention is split over the slots in blocks (kernels.attend_split_slots): where IREE's fused
    attention op serves a build of fixed shapes (cuda) over a float32 cache, which then holds a whole number of
    blocks. Gemma 2's soft cap keeps the matmuls."""
    return (TABLE[settings.device].attention == "fused" and cfg.attn_softcap is None
            and call_shapes(cfg, settings) is not None
            and auto_kv_dtype(settings.dtype, settings.kv_dtype, settings.device) == "f32")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Rotary embedding in the Hugging Face (rotate-half) layout. x [n, heads, D], cos/sin [n, D/2].

    x's halves as a dimension of 2, each half times cos plus the other half (flipped) times +-sin: one elementwise
    op, the same products and sums as rotate-half's x1 c - x2 s, x2 c + x1 s. As the two halves concatenated, IREE
    wrote each half in a transpose dispatch of its own. `scale` multiplies the result (a float, or one per head
    [1, heads, 1, 1]): q's attention scale, in the same op (after it, in a dispatch of its own)."""
    n, heads, d = x.shape
    halves = x.view(n, heads, 2, d // 2)
    c = cos.view(-1, 1, 1, d // 2)  # cos and sin may have one row for all of x's
    s = torch.stack([-sin, sin], dim=1).view(-1, 1, 2, d // 2)
    out = halves * c + halves.flip(2) * s
    return (out if isinstance(scale, float) and scale == 1.0 else out * scale).view(n, heads, d)


@dataclass
class Step:
    """What every layer reads in one call, built once per call in StreamingLlama.hidden."""
    cache: torch.Tensor  # the StreamingLLM cache of the layers that share it
    sink_keys: torch.Tensor | None
    ring: torch.Tensor | None  # the local layers' own ring, when they have one
    slots: torch.Tensor
    rope: torch.Tensor  # [tables, 2, n, D/2]
    shift: torch.Tensor  # [tables, 2, D/2]
    ring_slots: torch.Tensor | None  # where the new tokens go in the ring
    cache_pos: torch.Tensor  # the positions in the cache's slots attention reads: its first ones (model docstring)
    mask: torch.Tensor  # global layers: [n, attended]
    local_mask: torch.Tensor  # local layers: over the shared cache, or over what an own-ring layer sees
    mask_t: torch.Tensor  # the two transposed, [attended, n]: prefill's attention in one op (kernels.attend_rows)
    local_mask_t: torch.Tensor
    single: bool  # one query (decode)
    kept: torch.Tensor | None  # each new token's row of sink_keys: its sink slot, or the last row (nothing reads)
    ring_size: int  # the local ring's slots read (its buffer has one more in a padded build: engine/shapes.py)
    cache_rows: torch.Tensor | None = None  # launch-bound devices: where each layer writes (flat_rows)
    ring_rows: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, settings: BuildSettings, layer: int, index: int, own_ring: bool) -> None:
        super().__init__()
        self.cfg = cfg
        path = TABLE[settings.device].attention  # the device's way (engine/devices.py)
        # Decode reads the keys in blocks by the custom ops (kernels.first_blocks); IREE's GPU pipeline failed to
        # bufferize that scores op, and takes the plain slice.
        self.key_blocks = path == "ops"
        # Prefill's attention scores and output as custom ops (kernels.query_keys_rows, weighted_values_rows);
        # elsewhere torch matmuls, IREE's choice.
        self.rows_ops = path == "ops"
        # There, decode reads a narrow model's layer of the cache with the layer as a value (write_cache).
        self.layer_value = self.rows_ops and cfg.dim < LAYER_VALUE_BELOW
        # There, with no soft cap and a head size its stack fits, the whole attention as one op (kernels.attend_rows).
        self.one_op = (self.rows_ops and cfg.attn_softcap is None and attend_plan(cfg.head_dim) is not None
                       and not own_ring)
        # With no soft cap, IREE's own attention op: one fused op a layer (the softmax in flight) where the matmuls
        # and the softmax were four or more kernels.
        self.fused = path == "fused" and cfg.attn_softcap is None
        # Decode's one query row over the slots in blocks, each a batch of IREE's op, then joined: one row a head
        # was a workgroup a head, walking every slot (kernels/split_attention.py). Not a layer with its own ring.
        self.split = split_decode(cfg, settings) and not own_ring
        # Eddy's own kernel, one dispatch a layer (kernels.attend_one_dispatch), reading the layer's cache in place,
        # for calls of fixed shapes: not a layer with a ring of its own (it attends to the ring and the new tokens
        # joined), nor a bfloat16 cache (stored as int16 bits), which keep the matmuls.
        self.own_kernel = (path == "own" and not own_ring and call_shapes(cfg, settings) is not None
                           and auto_kv_dtype(settings.dtype, settings.kv_dtype, settings.device) in ("f16", "f32"))
        self.index = index  # this layer's place in the buffer it writes (the shared cache or the ring)
        self.local = layer in cfg.local_layers  # attends to the last local_window tokens only (Gemma)
        self.own_ring = own_ring
        self.table = cfg.rope_table(layer)
        self.scale = (cfg.query_scalar or cfg.head_dim) ** -0.5
        # q leaves its rotation scaled for attention (in that op: a multiply of its own was a dispatch a layer), but
        # for IREE's fused op, which takes the scale itself.
        self.q_scale = 1.0 if self.fused else self.scale
        self.softcap = cfg.attn_softcap
        fam = family(cfg.arch)
        # q's and k's heads rotated as one tensor (one dispatch, where there were two), as they come from wqkv.
        self.joint_rope = TABLE[settings.device].launch_bound and not fam.qk_norm
        # Softmax as torch's where the slot count is fixed: in blocks (softmax_in_blocks, for a dynamic count) it was
        # six dispatches a layer on vulkan.
        self.plain_softmax = call_shapes(cfg, settings) is not None
        # q, k and v as one matrix: one matmul reads x once.
        units = TABLE[settings.device].matrix_units
        self.wqkv = Linear((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.dim, settings.dtype, fam.qkv_bias,
                           matrix_units=units)
        self.wo = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, settings.dtype, matrix_units=units)
        # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
        one = one_dispatch_norms(cfg, settings)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, fam.norm_offset, one_dispatch=one) if fam.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, fam.norm_offset, one_dispatch=one) if fam.qk_norm else None

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        kvh, rep, d = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        # Grouped-query attention through views and broadcasting: a reshape mixing the dynamic length with
        # head counts breaks torch.export's shape constraints.
        cos, sin = step.rope[self.table, 0], step.rope[self.table, 1]
        if self.joint_rope and (step.single or self.wqkv.dtype != "q4"):  # q4's prefill product has three outputs
            y = self.wqkv(x)
            # q's heads scaled, k's not; made by ops: as a tensor constant, IREE lost its data ("resource data
            # missing in input IR").
            scale = self.q_scale if self.q_scale == 1.0 else torch.cat(
                [torch.full((1, cfg.n_heads, 1, 1), self.q_scale), torch.ones(1, kvh, 1, 1)], dim=1)
            qk = rotate(y[:, :(cfg.n_heads + kvh) * d].reshape(n, cfg.n_heads + kvh, d), cos, sin, scale)
            q, k = qk[:, :cfg.n_heads].reshape(n, kvh, rep, d), qk[:, cfg.n_heads:]
            v = y[:, (cfg.n_heads + kvh) * d:].reshape(n, kvh, d)
        else:
            q, k, v = self.wqkv.parts(x, cfg.n_heads * d, kvh * d, many=not step.single)
            q, k, v = q.reshape(n, cfg.n_heads, d), k.reshape(n, kvh, d), v.reshape(n, kvh, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q, cos, sin, self.q_scale).view(n, kvh, rep, d), rotate(k, cos, sin)
        if self.own_ring:
            keys, values = self.ring_kv(step, k, v)
            mask = step.local_mask
        else:
            keys, values = self.write_cache(step, k, v)
            mask = step.local_mask if self.local else step.mask
        if self.split and step.single:  # keys and values in blocks (write_cache)
            out = attend_split_slots(q.view(kvh, rep, d), keys, values, mask.view(-1), self.scale)
            return self.wo(out.reshape(1, cfg.n_heads * d))
        if self.fused:
            return self.wo(self.fused_attention(q, keys, values, mask))
        if self.own_kernel:
            out = attend_one_dispatch(q, keys, values, mask.reshape(n, -1), self.softcap)  # [n, kvh, rep, d]
            return self.wo(out.reshape(n, cfg.n_heads * d))
        if step.single:
            # One query: custom ops read the cache in place (matmuls would re-pack it every step: kernels).
            q1, mask1 = q.view(kvh, rep, d), mask.view(-1)
            if self.softcap is None:
                scores = query_keys(q1, keys, mask1)  # [kvh, rep, C]
            else:  # the cap comes before the mask
                scores = self.capped(query_keys(q1, keys, torch.zeros_like(mask1))) + mask1
            probs = self.softmax(scores)
            out = weighted_values(probs, values)  # [kvh, rep, d]
            return self.wo(out.reshape(1, cfg.n_heads * d))
        if self.one_op:
            mask_t = step.local_mask_t if self.local else step.mask_t
            out = attend_rows(q.permute(1, 2, 3, 0), keys, values, mask_t)  # [n, kvh, rep, d]
            return self.wo(out.reshape(n, cfg.n_heads * d))
        if self.rows_ops:  # q scaled first, as decode's: a scale after the op was a dispatch of its own
            scores = query_keys_rows(q.permute(1, 2, 0, 3), keys)  # [kvh, rep, n, C]
        else:
            scores = torch.matmul(q.permute(1, 2, 0, 3), keys.transpose(1, 2).unsqueeze(1))
        probs = self.softmax(self.capped(scores), mask)
        if self.rows_ops:
            out = weighted_values_rows(probs, values)  # [n, kvh, rep, d]
        else:
            out = torch.matmul(probs, values.unsqueeze(1)).permute(2, 0, 1, 3)
        return self.wo(out.reshape(n, cfg.n_heads * d))

    def fused_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        """q [n, kvh, rep, d] over keys and values [kvh, C, d] under mask [n, C] as one scaled_dot_product_attention
        (IREE: iree_linalg_ext.attention); a KV head's rep query heads are its rows, so keys are not repeated."""
        n, kvh, rep, d = q.shape
        rows = q.permute(1, 2, 0, 3).reshape(1, kvh, rep * n, d)
        # The mask as the scores' full shape: IREE's conversion of a 2-d one failed (a collapse to a lower rank).
        slots = mask.shape[-1]
        over = mask.unsqueeze(0).expand(rep, n, slots).reshape(1, 1, rep * n, slots).expand(1, kvh, rep * n, slots)
        out = F.scaled_dot_product_attention(rows, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=over,
                                             scale=self.scale)
        return out.view(kvh, rep, n, d).permute(2, 0, 1, 3).reshape(n, kvh * rep * d)

    def softmax(self, scores: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # A local ring's slots (and a prefill's new tokens after them) are not in blocks: the others are for the
        # cache's attended slots.
        if self.own_ring or self.plain_softmax:
            return torch.softmax(scores if mask is None else scores + mask, dim=-1)
        if self.rows_ops:
            return softmax_over_slots(scores, mask)
        return softmax_in_blocks(scores if mask is None else scores + mask)

    def capped(self, scores: torch.Tensor) -> torch.Tensor:
        """Gemma 2's soft cap on attention scores, before the mask."""
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def _put(self, buffer: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor | None) -> None:
        # Keys and values in one write (one scatter dispatch; two index_put_ calls were two), stacked in the order
        # they come ([2, n, kvh, d], the buffer's type): transposed to the cache's, IREE fused the transpose into the
        # scatter with a tile of it on the stack, 64 kB at a head_dim of 128 (the limit is 32 kB).
        if rows is not None:  # each key's and value's row of the buffer seen flat (flat_rows): no index built here
            buffer.view(-1, buffer.shape[-1]).index_put_((rows[self.index],), kv)
            return
        layer = torch.full((1, 1, 1), self.index, dtype=torch.int64)
        which = torch.arange(2).view(-1, 1, 1)
        heads = torch.arange(self.cfg.n_kv_heads).view(1, 1, -1)
        buffer.index_put_((layer, which, heads, slots.view(1, -1, 1)), kv)

    def ring_kv(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A local layer's own ring of local_window slots: the keys and values its queries see, [kvh, *, d].

        Decode writes first: the ring then holds exactly the last local_window tokens. A prefill attends to the
        ring as it was plus the new tokens, and writes them after: writing first would overwrite tokens its
        earliest queries still see. Keys are rotated by absolute position, so nothing is re-rotated.
        """
        ring, i, size = step.ring, self.index, step.ring_size
        k, v = to_kv(k, ring), to_kv(v, ring)
        if step.single:
            self._put(ring, step.ring_slots, torch.stack([k, v]), step.ring_rows)
            return from_kv(ring[i, 0].narrow(1, 0, size)), from_kv(ring[i, 1].narrow(1, 0, size))
        keys = torch.cat([from_kv(ring[i, 0].narrow(1, 0, size)), from_kv(k).transpose(0, 1)], dim=1)
        values = torch.cat([from_kv(ring[i, 1].narrow(1, 0, size)), from_kv(v).transpose(0, 1)], dim=1)
        self._put(ring, step.ring_slots, torch.stack([k, v]), step.ring_rows)
        return keys, values

    def write_cache(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new keys/values at their slots; returns this layer's keys and values in the attended slots
        [kvh, attended, d] (prefill's on a cpu: the keys as stored, and the whole layer's values as stored:
        kernels.query_keys_rows and weighted_values_rows widen them as they read).

        The cache is laid out [layers, 2, kv_heads, slots, head_dim] so attention reads it without a
        transpose. With sinks, `sink_keys` [layers, S + 1, kvh, d] keeps each sink key as first stored (rotated
        by its own position; its last row takes the writes of every other token), and slots 0..S-1 of the cache
        hold those originals rotated forward by the evicted count: the sinks' in-cache distance at O(sinks) cost,
        with no drift from rotating a rotated key again and again. The earlier calls' sinks are rotated for every
        layer at once, before the first (StreamingLlama.shift_sinks): done here, with the keys kept in the cache's
        order, that was five dispatches a layer where the keeping is now one. A key this call writes to a sink
        slot goes in as it is: such a call evicts nothing (the host's chunks are never longer than the window, so
        a call that starts among the sinks ends before the cache is full), and the shift is the identity. Decode
        keeps no sink key: a token bound for a sink slot goes through prefill (StreamingEngine.decode), which
        saves decode that write, a dispatch a layer.
        """
        cache, slots, i = step.cache, step.slots, self.index
        # Rounded to the cache's type once, stacked (converted one at a time, a 16-bit cache's keys and values were a
        # dispatch each on vulkan).
        kv = to_kv(torch.stack([k, v]), cache)
        if step.sink_keys is not None and not step.single:  # decode writes no sink: the host prefills those
            # The keys as converted (a float32 cache's are k itself: read from the stack, cuda's prefill took a
            # dispatch more a layer; converted again, vulkan's did).
            sink = k if cache.dtype == k.dtype else kv[0]
            step.sink_keys.index_put_((torch.full((1, 1), i, dtype=torch.int64), step.kept.view(1, -1)), sink)
        self._put(cache, slots, kv, step.cache_rows)
        if self.one_op and not step.single or self.own_kernel:  # the layer's keys and values as stored, read in
            return cache[i, 0], cache[i, 1]  # place (attend_rows, attend_one_dispatch)
        if self.split and step.single:  # float32 as stored, in blocks read in place (attend_split_slots)
            return first_blocks(cache[i, 0], step.cache_pos), first_blocks(cache[i, 1], step.cache_pos)
        # A narrow model's decode on a CPU reads its layer with the layer as a value (kernels.layer_of): one executable
        # for every layer's attention, where the constant offset made two a layer. The default model's decode (576
        # wide, bound by its dispatches) ran 1.14-1.29x as fast so, a 1B's (2048) and an 8B's 0.95-0.98x
        # (bench/decode_ab.py, Zen 5, 2026-12-07), so wider models keep the constant.
        layer = ((lambda which: layer_of(cache, i)[which]) if step.single and self.layer_value
                 else (lambda which: cache[i, which]))
        # One query reads the keys as blocks (kernels.first_blocks), where the device takes them.
        keys = (first_blocks if step.single and self.key_blocks else first_slots)(layer(0), step.cache_pos)
        if self.rows_ops and not step.single:  # prefill's ops widen what they read: the keys' slice as stored, and
            return keys, cache[i, 1]  # the layer's values read in place
        return from_kv(keys), from_kv(first_slots(layer(1), step.cache_pos))


def flat_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each layer's new keys' and values' rows of `buffer` [layers, 2, kvh, size, d] seen as [-1, d]: [layers, 2, n,
    kvh], for every layer at once. Per layer, the index the cache's write needs was built in a dispatch of its own
    (a copy of the slots into it with the layer's number); sliced from this, IREE reads it in the write's."""
    layers, _, kvh, size, _ = buffer.shape
    rows = (torch.arange(layers * 2).view(layers, 2, 1, 1) * kvh + torch.arange(kvh).view(1, 1, 1, -1)) * size
    return rows + slots.view(1, 1, -1, 1)


def softmax_in_blocks(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the slots (the last dimension), taken per block of ATTEND_STEP slots, then over the blocks. The
    slot count is a dynamic dimension (model docstring), and IREE vectorises none of a softmax over a dynamic
    innermost dimension (as linalg.softmax or spelled out: 3-4 ms a layer for 30 queries over 1024 slots, against
    0.2 ms when that count was static); with a static block it vectorises along the block again."""
    x = scores.unflatten(-1, (-1, ATTEND_STEP))
    e = torch.exp(x - x.amax(dim=-1, keepdim=True).amax(dim=-2, keepdim=True))
    return (e * torch.reciprocal(e.sum(dim=-1, keepdim=True).sum(dim=-2, keepdim=True))).flatten(-2)


def to_kv(t: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Keys or values as `buffer` stores them (rounded to its type; bfloat16 as int16 bits: KV_STORAGE)."""
    return t.to(torch.bfloat16).view(torch.int16) if buffer.dtype == torch.int16 else t.to(buffer.dtype)


def from_kv(t: torch.Tensor) -> torch.Tensor:
    """Stored keys or values back as float32."""
    return (t.view(torch.bfloat16) if t.dtype == torch.int16 else t).float()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation spelled out: IREE's lowering of F.gelu(approximate="tanh") is off by up to 5e-5
    (at x near 1.3), which took a Gemma model's logits 1.2e-4 from transformers'; through math.tanh it is 8e-7."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class FeedForward(nn.Module):
    """The gated MLP: down(act(gate) * up), SwiGLU or GeGLU. `by_hand`: the products are written by hand (an x86
    CPU's dot form), where a q4 SwiGLU's decode makes silu(gate) * up inside the down product's dispatch
    (kernels.q4_linear_swiglu): one dispatch a layer fewer, of a step's ~15 a layer (the default model's decode is
    bound by its dispatches, not its bytes: docs/BENCHMARKS.md)."""

    def __init__(self, cfg: ModelConfig, fam: Family, dtype: str, matrix_units: bool = False,
                 by_hand: bool = False) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate
        self.act = ACTIVATIONS[fam.activation]
        self.w_gate_up = Linear(2 * cfg.intermediate, cfg.dim, dtype, matrix_units=matrix_units)
        self.w_down = Linear(cfg.dim, cfg.intermediate, dtype, matrix_units=matrix_units)
        self.swiglu_by_hand = by_hand and fam.activation == "silu" and self.w_down.dtype == "q4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)
        if self.swiglu_by_hand and isinstance(x.shape[0], int) and x.shape[0] == 1:
            return q4_linear_swiglu(gate_up, *self.w_down.q4_tensors())
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return self.w_down(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, settings: BuildSettings, layer: int, index: int, own_ring: bool,
                 by_hand: bool = False) -> None:
        """`by_hand`: the build's products are written by hand (devices.dot_form: an x86 CPU's), FeedForward's."""
        super().__init__()
        fam = family(cfg.arch)

        # Only the first layer's norms of x read the embedding lookup, which norm_groups is for (engine/devices.py).
        # Gemma's post norms read the attention's and the FFN's outputs: grouped, vulkan's fused the sums' last step
        # with the residual add into a dispatch that held 32 rows of 2304 in workgroup memory (295 kB; limit 101 kB).
        groups = TABLE[settings.device].norm_groups if layer == 0 else 0

        def norm(role: str) -> RMSNorm | None:
            return (RMSNorm(cfg.dim, cfg.norm_eps, fam.norm_offset, groups if role in ("attn", "ffn") else 0,
                            one_dispatch_norms(cfg, settings))
                    if role in fam.norms else None)

        self.attention_norm, self.post_attention_norm = norm("attn"), norm("post_attn")
        self.attention = Attention(cfg, settings, layer, index, own_ring)
        self.ffn_norm, self.post_ffn_norm = norm("ffn"), norm("post_ffn")
        self.feed_forward = FeedForward(cfg, fam, settings.dtype, TABLE[settings.device].matrix_units, by_hand)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        h = self.attention(self.attention_norm(x, self.attention.wqkv.rounds_x(x)), step)
        x = x + (h if self.post_attention_norm is None else self.post_attention_norm(h))
        h = self.feed_forward(self.ffn_norm(x, self.feed_forward.w_gate_up.rounds_x(x)))
        return x + (h if self.post_ffn_norm is None else self.post_ffn_norm(h))


class StreamingLlama(nn.Module):
    """The whole model (any family in engine/arch.py; the name is the one it started with)."""

    def __init__(self, cfg: ModelConfig, settings: BuildSettings) -> None:
        super().__init__()
        self.cfg, self.settings = cfg, settings
        self.family = fam = family(cfg.arch)
        self.embed_scale = cfg.dim ** 0.5 if fam.embed_scale else None
        # Like llama.cpp's 4-bit types, q4 keeps the LM head in 8 bits: every logit goes through it.
        head = "q8" if settings.dtype == "q4" else settings.dtype
        units = TABLE[settings.device].matrix_units
        self.tok_embeddings = (Linear(cfg.vocab_size, cfg.dim, head, matrix_units=units) if cfg.tie_embeddings
                               else Linear(cfg.vocab_size, cfg.dim, settings.dtype, lookup=True))
        # Local layers with their own ring leave the shared cache to the others; each layer writes its own
        # row (`index`) of the buffer it uses.
        self.ring = ring = cfg.local_ring(settings)
        own = [bool(ring) and i in cfg.local_layers for i in range(cfg.n_layers)]
        shared = [i for i in range(cfg.n_layers) if not own[i]]
        local = [i for i in range(cfg.n_layers) if own[i]]
        by_hand = dot_form(settings.device, settings.target_cpu) is not None  # read from the CPU once, not a layer
        self.layers = nn.ModuleList(
            Block(cfg, settings, i, (local if own[i] else shared).index(i), own[i], by_hand)
            for i in range(cfg.n_layers))
        self.sink_tables = [cfg.rope_table(i) for i in shared]  # each shared layer's RoPE table (shift_sinks)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, fam.norm_offset, one_dispatch=one_dispatch_norms(cfg, settings))
        self.output = None if cfg.tie_embeddings else Linear(cfg.vocab_size, cfg.dim, head, matrix_units=units)
        # Decode's logits from a 4-bit copy of the head (the 8-bit head was a third of a 1B decode step's bytes); the
        # host has the likeliest made again from the 8-bit head's rows (refine), so sampling sees 8-bit logits.
        self.coarse_head = Linear(cfg.vocab_size, cfg.dim, "q4") if cfg.coarse_head(settings) else None
        # One cache global for all shared layers (and one ring for the local ones): with many per-layer globals a
        # zero-splat initialiser gave wrong logits in IREE. Their type is the build's kv_dtype (values are written
        # rounded to it and read back widened to float32), the sinks' original keys' too: they hold the keys as the
        # cache does, so nothing is lost, and their write reads the rounded keys as they are (widened to float32
        # inside the write's dispatch, a head_dim-128 model's tile of them took 32 kB of stack: over the limit).
        kv = KV_STORAGE[auto_kv_dtype(settings.dtype, settings.kv_dtype, settings.device)]
        kvh, d = cfg.n_kv_heads, cfg.head_dim
        # A build of fixed call shapes pads its calls: padded tokens go to one more slot of the cache and of the
        # ring, which no call reads (engine/shapes.py).
        self.shapes = call_shapes(cfg, settings)
        trash = 1 if self.shapes else 0
        size = settings.slots + trash
        if split_decode(cfg, settings):  # a whole number of blocks (Attention.write_cache)
            size = -(-size // ATTEND_STEP) * ATTEND_STEP
        self.register_buffer("cache", torch.zeros(len(shared), 2, kvh, size, d, dtype=kv), persistent=False)
        sinks = torch.zeros(len(shared), settings.sink_slots + 1, kvh, d, dtype=kv) if settings.sink_slots else None
        self.register_buffer("sink_keys", sinks, persistent=False)
        self.register_buffer("ring_cache", torch.zeros(len(local), 2, kvh, ring + trash, d, dtype=kv) if ring else None,
                             persistent=False)
        # The last prefill call's final hidden rows, which `score` turns into log-probabilities: scoring is then a
        # small program over them, not a third copy of the whole model in the module (tracing and compiling that
        # copy was a third of a new model's build). A decode with a coarse head leaves its row first, for refine.
        self.register_buffer("scored", torch.zeros(cfg.prefill_bound(settings), cfg.dim), persistent=False)

    @classmethod
    def skeleton(cls, cfg: ModelConfig, settings: BuildSettings) -> "StreamingLlama":
        """The model with its weights allocated and never written: what the export traces (the weights are
        external parameters, so the graph is the one a loaded model gives) while engine/exporter/weights_file.py writes
        the weights from the checkpoint one tensor at a time.

        Linear's parameters come from torch.empty, whose pages the kernel maps only when first written: an 8B
        skeleton takes address space, not memory. The meta device would take neither, but torch.export refuses
        to mix meta weights with the CPU inputs and cache buffers (whose initial value turbine reads).
        """
        return cls(cfg, settings).eval()

    def hidden(self, tokens, slots, rope, shift, slot_pos, token_pos, single: bool) -> torch.Tensor:
        """slot_pos holds the cache's attended slots after this call's writes, then (own ring) the ring's before
        them."""
        x = self.tok_embeddings.rows(tokens)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        window, ring = self.cfg.local_window, self.ring
        n_slots = slot_pos.shape[0] - ring
        cache_pos, now = slot_pos.narrow(0, 0, n_slots), token_pos.unsqueeze(1)
        neg = torch.full((), float("-inf"))
        mask = torch.where(cache_pos.unsqueeze(0) <= now, torch.zeros(()), neg)  # [n, C]
        local, ring_slots = mask, None
        if ring:
            ring_slots = torch.remainder(token_pos, ring)
            if self.shapes and not single:  # padded tokens: the ring's spare slot
                ring_slots = torch.where(self.padding(slots), torch.full_like(slots, ring), ring_slots)
            ring_pos = slot_pos.narrow(0, n_slots, ring)
            if single:  # what the ring holds once this token is written
                seen = torch.where(torch.arange(ring) == ring_slots, token_pos, ring_pos)
            else:  # the ring as it was, then the new tokens (padded ones never seen)
                new = token_pos
                if self.shapes:
                    new = torch.where(self.padding(slots), torch.full_like(token_pos, EMPTY_SLOT), token_pos)
                seen = torch.cat([ring_pos, new])
            seen = seen.unsqueeze(0)
            # Nested rather than `&`: the IREE torch frontend cannot lower a boolean and.
            local = torch.where(seen <= now, torch.where(seen > now - window, torch.zeros(()), neg), neg)
        elif self.cfg.local_layers:
            # Local layers read the shared cache and also drop slots local_window or more tokens back (sinks
            # included, once that far).
            local = torch.where(cache_pos.unsqueeze(0) > now - window, mask, neg)
        sinks = self.settings.sink_slots
        kept = (torch.where(slots < sinks, slots, torch.full_like(slots, sinks))
                if self.sink_keys is not None and not single else None)
        flat = TABLE[self.settings.device].launch_bound
        step = Step(self.cache, self.sink_keys, self.ring_cache, slots, rope, shift, ring_slots, cache_pos, mask, local,
                    mask.transpose(0, 1), local.transpose(0, 1), single, kept, ring,
                    flat_rows(self.cache, slots) if flat else None,
                    flat_rows(self.ring_cache, ring_slots) if flat and ring else None)
        self.shift_sinks(shift)
        for block in self.layers:  # all, or a trace's few (engine/exporter/layers.py)
            x = block(x, step)
        return self.norm(x)

    def padding(self, slots: torch.Tensor) -> torch.Tensor:
        """Which of a padded call's tokens are padding: those written to the trash slot (engine/shapes.py)."""
        return slots >= self.shapes.trash

    def shift_sinks(self, shift: torch.Tensor) -> None:
        """Slots 0..S-1 of every shared layer's keys: the sinks' original keys (sink_keys, from earlier calls)
        rotated forward by the evicted count, `shift` [tables, 2, D/2]; one op for all layers
        (Attention.write_cache)."""
        if self.sink_keys is None:
            return
        sinks, (layers, _, heads, d) = self.settings.sink_slots, self.sink_keys.shape
        tables = self.sink_tables
        # Each layer's table [layers or 1 for all, 2, D/2], by slices: a tensor of the indices was a constant that
        # IREE lost in compiling (Gemma 3, "resource does not exist").
        rot = shift[tables[0]].unsqueeze(0) if len(set(tables)) == 1 else torch.stack([shift[t] for t in tables])
        # rotate()'s products for [layers, sinks, heads, 2 halves, D/2], as a sum over the halves of each times its
        # factor (cos and +-sin, [layers, 2, 2, D/2]). IREE fuses an elementwise producer into the scatter and holds
        # its tile on the stack: with the halves swapped by flip() (a gather) that passed the 32 kB limit for a
        # float32 cache of head_dim 128 (an 8B's 32 layers, or many sink slots); the sum is not fused that way.
        # Scattered in the cache's order: in the keys' own order the cache's other scatters changed shape in IREE
        # and decode took 4 % longer.
        cos, sin = rot[:, 0], rot[:, 1]
        factors = torch.stack([torch.stack([cos, -sin], dim=1), torch.stack([sin, cos], dim=1)], dim=1)
        halves = from_kv(self.sink_keys[:, :sinks]).view(layers, sinks, heads, 1, 2, d // 2)
        shifted = (halves * factors.view(-1, 1, 1, 2, 2, d // 2)).sum(4).view(layers, sinks, heads, d)
        self.cache.index_put_((torch.arange(layers).view(-1, 1, 1), torch.zeros((1, 1, 1), dtype=torch.int64),
                               torch.arange(heads).view(1, -1, 1), torch.arange(sinks).view(1, 1, -1)),
                              to_kv(shifted.transpose(1, 2), self.cache))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.capped((self.tok_embeddings if self.output is None else self.output)(x))

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prefill(self, tokens, slots, rope, shift, slot_pos, token_pos) -> torch.Tensor:
        """Appends n tokens to the cache; returns the logits after the last one [1, vocab]."""
        x = self.hidden(tokens, slots, rope, shift, slot_pos, token_pos, single=False)
        self.scored.narrow(0, 0, x.shape[0]).copy_(x)
        # A gather by a data-dependent index rather than x[-1:]: IREE would otherwise narrow the last layer to
        # one row and emit a reduction dispatch whose stack frame exceeds the CPU limit.
        # Padded tokens repeat the last position: they are taken out of the running.
        pos = torch.where(self.padding(slots), torch.full_like(token_pos, -1), token_pos) if self.shapes else token_pos
        last = torch.argmax(pos).unsqueeze(0)
        return self.head(x.index_select(0, last))

    def decode(self, tokens, slots, rope, shift, slot_pos, token_pos) -> torch.Tensor:
        """prefill for exactly one token, with single-query attention."""
        x = self.hidden(tokens, slots, rope, shift, slot_pos, token_pos, single=True)
        if self.coarse_head is None:
            return self.head(x)
        self.scored.narrow(0, 0, 1).copy_(x)  # what refine multiplies
        return self.capped(self.coarse_head(x))

    def refine(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits of tokens `ids` [REFINED_ROWS] after the last decode, from the 8-bit head's rows: the head's
        own numbers for them, where decode's came from its 4-bit copy (coarse_head)."""
        rows = (self.tok_embeddings if self.output is None else self.output).rows(ids)
        return self.capped((rows * self.scored.narrow(0, 0, 1)).sum(-1))

    def score(self, targets) -> torch.Tensor:
        """log p(targets[i] | the last prefill call's tokens up to i) for each of its n tokens [n] (perplexity)."""
        logits = self.head(self.scored.narrow(0, 0, targets.shape[0]))
        # The target's logit less the log of the sum, spelled out: IREE's vulkan code for gather(log_softmax) over
        # 4 rows of a 49152 vocabulary came out wrong by up to 2.9 on lavapipe (16 rows: right), and this is right
        # at both (tests/test_vulkan.py).
        top = logits.amax(-1, keepdim=True)
        total = torch.log(torch.exp(logits - top).sum(-1, keepdim=True)) + top
        return (torch.gather(logits, 1, targets.unsqueeze(1)) - total).squeeze(1)

    def state(self) -> list[torch.Tensor]:
        """The buffers that hold a conversation's cache, in the order snapshot returns and restore takes them."""
        return [b for b in (self.cache, self.sink_keys, self.ring_cache) if b is not None]

    def reset(self) -> torch.Tensor:
        for buffer in self.state():
            buffer.zero_()
        # A tensor that is not the cache (the export must return one): a slice of the zeroed cache was a constant
        # that IREE computed at load time by filling a whole cache in one workgroup's stack, where one of its
        # dimensions was 1 (Gemma 3's single KV head: 4 MB, refused).
        return torch.zeros(1)

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        """A copy of the whole cache state: switching conversations restores it instead of prefilling again."""
        return tuple(b.clone() for b in self.state())

    def restore(self, *saved: torch.Tensor) -> torch.Tensor:
        for buffer, value in zip(self.state(), saved):
            # `+ 0`: turbine drops a buffer mutation whose new value is an argument as it stands (no global
            # store is emitted and restore silently does nothing).
            buffer.copy_(value + 0)
        return self.cache[0, 0, 0, 0, :1] + 0.0

    def pieces(self) -> list[Piece]:
        """Every parameter of the model, grouped by module, with the checkpoint tensors each is made from (names
        from engine/arch.py)."""
        fam = self.family
        out = [Piece("tok_embeddings", ("model.embed_tokens.weight",), "matrix")]
        if self.output is not None:
            out.append(Piece("output", ("lm_head.weight",), "matrix"))
        if self.coarse_head is not None:  # from the head's own checkpoint tensor, the last piece
            out.append(Piece("coarse_head", out[-1].sources, "matrix"))
        out.append(Piece("norm", ("model.norm.weight",), "norm"))
        for i, block in enumerate(self.layers):
            p, m = f"model.layers.{i}.", f"layers.{i}."
            out.append(Piece(m + "attention.wqkv", tuple(f"{p}{name}.weight" for name in fam.qkv), "matrix"))
            if fam.qkv_bias:
                out.append(Piece(m + "attention.wqkv", tuple(f"{p}{name}.bias" for name in fam.qkv), "bias"))
            if fam.qk_norm:
                out.append(Piece(m + "attention.q_norm", (f"{p}self_attn.q_norm.weight",), "norm"))
                out.append(Piece(m + "attention.k_norm", (f"{p}self_attn.k_norm.weight",), "norm"))
            out.append(Piece(m + "attention.wo", (f"{p}self_attn.o_proj.weight",), "matrix"))
            out.append(Piece(m + "feed_forward.w_gate_up", tuple(f"{p}{name}.weight" for name in fam.gate_up),
                             "matrix"))
            out.append(Piece(m + "feed_forward.w_down", (f"{p}mlp.down_proj.weight",), "matrix"))
            roles = {"attn": "attention_norm", "post_attn": "post_attention_norm", "ffn": "ffn_norm",
                     "post_ffn": "post_ffn_norm"}
            for role, name in fam.norms.items():
                out.append(Piece(m + roles[role], (p + name,), "norm"))
        matrix = lambda piece: self.get_submodule(piece.module)  # noqa: E731
        return [replace(piece, dtype=matrix(piece).dtype, tiled=matrix(piece).tiled) if piece.kind == "matrix"
                else piece for piece in out]

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        """Copies a Hugging Face state dict of this family in, casting matrices to the build's weight dtype: the
        whole model in memory (the streamed build writes the same tensors without it)."""
        loaded: set[str] = set()
        with torch.no_grad():
            for piece in self.pieces():
                for name, t in piece.convert([state[s] for s in piece.sources]).items():
                    self.get_parameter(name).copy_(t)
                    loaded.add(name)
        # Parameters start uninitialised (torch.empty): one that no piece fills would be silently random.
        missed = [name for name, _ in self.named_parameters() if name not in loaded]
        assert not missed, f"no checkpoint tensor fills {missed}"
