# SPDX-License-Identifier: Apache-2.0
"""A DFlash drafter in plain torch, laid out as vLLM's ``DFlashDraftModel``
(vllm/model_executor/models/qwen3_dflash.py) loads it, for training the benchmark
pairs and as the reference forward of the embedding tests.

The math follows vLLM's DFlash: context K/V come from
``hidden_norm(fc(concat(target hidden states at target_layer_ids)))`` through each
layer's k/v projection (+ k_norm, RoPE at the context positions); the queries are
the embeddings of ``[bonus, mask, ..., mask]``; each block attends to its context
and bidirectionally within itself; the target's embedding and lm_head are shared.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (
        xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    ).to(x.dtype)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, neox style (Qwen3): x [B, T, H, D], pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (
        theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    )
    f = pos.float()[..., None] * inv
    cos, sin = f.cos()[..., None, :], f.sin()[..., None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def _norm(n: int) -> nn.Module:
    """A holder of an RMSNorm weight (``rms_norm`` applies it)."""
    return nn.RMSNorm(n)


def _layer(cfg: dict) -> nn.Module:
    """One decoder layer's weights under a DFlash checkpoint's names."""
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
    attn.q_proj, attn.k_proj = _linear(h, nq * hd), _linear(h, nkv * hd)
    attn.v_proj, attn.o_proj = _linear(h, nkv * hd), _linear(nq * hd, h)
    attn.q_norm, attn.k_norm = _norm(hd), _norm(hd)
    mlp.gate_proj, mlp.up_proj = _linear(h, inter), _linear(h, inter)
    mlp.down_proj = _linear(inter, h)
    layer.self_attn, layer.mlp = attn, mlp
    layer.input_layernorm, layer.post_attention_layernorm = _norm(h), _norm(h)
    return layer


class DFlashDrafter(nn.Module):
    """State-dict names are those of a DFlash checkpoint (no embedding, no lm_head)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        n_aux = len(cfg["dflash_config"]["target_layer_ids"])
        self.cfg = cfg
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd, self.theta, self.eps = (
            cfg["head_dim"],
            cfg["rope_theta"],
            cfg["rms_norm_eps"],
        )
        self.fc = _linear(h * n_aux, h)
        self.hidden_norm, self.norm = _norm(h), _norm(h)
        self.layers = nn.ModuleList(
            _layer(cfg) for _ in range(cfg["num_hidden_layers"])
        )

    def forward(
        self,
        feats: torch.Tensor,
        ctx_pos: torch.Tensor,
        q_emb: torch.Tensor,
        q_pos: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Inputs: feats [B, T, n_aux * H] target states; q_emb [B, Q, H];
        positions [B, T] and [B, Q]; mask [B, Q, T + Q] bool (True = attend).
        Returns the final-normed hidden states of the queries [B, Q, H] (apply
        the target's lm_head)."""
        b, t, _ = feats.shape
        q_len = q_emb.shape[1]
        ctx = rms_norm(self.fc(feats), self.hidden_norm.weight, self.eps)
        h = q_emb
        rep = self.nh // self.nkv
        for layer in self.layers:
            a = layer.self_attn
            x = rms_norm(h, layer.input_layernorm.weight, self.eps)
            q = rms_norm(
                a.q_proj(x).view(b, q_len, self.nh, self.hd), a.q_norm.weight, self.eps
            )
            kq = rms_norm(
                a.k_proj(x).view(b, q_len, self.nkv, self.hd), a.k_norm.weight, self.eps
            )
            vq = a.v_proj(x).view(b, q_len, self.nkv, self.hd)
            kc = rms_norm(
                a.k_proj(ctx).view(b, t, self.nkv, self.hd), a.k_norm.weight, self.eps
            )
            vc = a.v_proj(ctx).view(b, t, self.nkv, self.hd)
            q = rope_neox(q, q_pos, self.theta)
            k = torch.cat(
                [rope_neox(kc, ctx_pos, self.theta), rope_neox(kq, q_pos, self.theta)],
                1,
            )
            v = torch.cat([vc, vq], 1)
            k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask[:, None],
            )
            h = h + a.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))
            x = rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
            h = h + layer.mlp.down_proj(
                F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)
            )
        return rms_norm(h, self.norm.weight, self.eps)


def block_inputs(
    tokens: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For sequences ``tokens`` [B, S] and sorted ``anchors`` [B, A] (the position of
    each block's bonus token): the query ids [B, A*block] (bonus, then masks), their
    positions, and the attention mask [B, A*block, S + A*block]: a block sees the
    context strictly before its anchor and every slot of its own block."""
    b, s = tokens.shape
    a = anchors.shape[1]
    offs = torch.arange(block, device=tokens.device)
    q_pos = (anchors[:, :, None] + offs).reshape(b, a * block)
    q_ids = torch.full((b, a, block), mask_id, device=tokens.device, dtype=tokens.dtype)
    q_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    ctx_pos = torch.arange(s, device=tokens.device).expand(b, s)
    blk = torch.arange(a, device=tokens.device).repeat_interleave(block)
    m_ctx = ctx_pos[:, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
    m_blk = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return q_ids.view(b, a * block), q_pos, torch.cat([m_ctx, m_blk], -1)


def draft_logits(
    drafter: DFlashDrafter,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> torch.Tensor:
    """Drafter logits [B, A, block - 1, V] for depths 1..block-1 after each anchor."""
    block = drafter.cfg["block_size"]
    mask_id = drafter.cfg["dflash_config"]["mask_token_id"]
    b, s = tokens.shape
    q_ids, q_pos, mask = block_inputs(tokens, anchors, block, mask_id)
    ctx_pos = torch.arange(s, device=tokens.device).expand(b, s)
    hid = drafter(feats, ctx_pos, F.embedding(q_ids, embed), q_pos, mask)
    hid = hid.view(b, anchors.shape[1], block, -1)[:, :, 1:]
    return hid @ lm_head.t().to(hid.dtype)


def target_forward(
    model, input_ids: torch.Tensor, target_layer_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face target's logits and the concatenated features vLLM's DFlash
    reads: the residual stream after each listed layer, before any final norm
    (Hugging Face's last ``hidden_states`` entry is normed, so hooks are used)."""
    layers = model.model.layers
    outs: dict[int, torch.Tensor] = {}
    hooks = [
        layers[i].register_forward_hook(
            lambda _module, _args, out, i=i: outs.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i in target_layer_ids
    ]
    try:
        logits = model(input_ids=input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.cat([outs[i] for i in target_layer_ids], -1)
