# SPDX-License-Identifier: Apache-2.0
"""Embed a small trained pair exactly into a production shape.

The production-shaped weights are produced one Hugging Face tensor at a time
(``target_weights``, ``drafter_weights``), so that they can be fed straight into
a model's ``load_weights`` (vLLM's own loader: fused projections, tensor
parallel shards) after a ``load_format="dummy"`` start: nothing is stored.

How the function is kept (h = small hidden size, H = production hidden size):

- the small model's units are the first h of the residual stream; every write
  into the residual stream (embedding, attention/GDN output projections, MLP
  down projections, the drafter's fc) is zero outside them, so the other units
  stay exactly zero;
- the residual stream is the small one times c = sqrt(H / h): then the mean of
  squares over H units equals the small model's over h units and every RMSNorm
  sees the same statistic with the same epsilon; norm weights are divided by c
  (``(1 + w) / c - 1`` for Qwen3.5's one-plus norms) and are zero on the padded
  units, so each sublayer reads exactly the small model's normalised input;
- heads keep their head_dim (RoPE and q/k norms unchanged); small query head j
  of KV group k sits at production head ``k * G + j % g`` (G, g: production and
  small group sizes) so that GQA groups line up; a small Gated DeltaNet head keeps
  its index (same value/key head ratio); weights that only feed padded heads or
  read padded units are random (as vLLM's dummy loader), so the arithmetic costs
  what the production model costs;
- production layers that are not a small layer are exact identities (zero output
  and down projections); the small layers sit at ``placement``;
- a production vocabulary larger than the small one: one padded residual unit
  carries a small constant from the embedding; only the final norm passes it,
  and the lm_head rows of the padded tokens read it with a large negative
  weight, so those tokens get logits far below every real one (no probability
  mass at any temperature).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from bench.pairs.pair_configs import text_config

INIT_RANGE = 1e-3  # vLLM's dummy loader draws weights from U(-1e-3, 1e-3)
CONST_VALUE = 1e-4  # the padded-vocabulary unit: its square (over H) is far below eps
PAD_LOGIT_WEIGHT = -1e8  # lm_head weight of padded tokens on that unit


class Geometry:
    """Sizes of one small model and the production model it is embedded in."""

    def __init__(self, small: dict, big: dict, *, with_const_unit: bool):
        self.h, self.H = small["hidden_size"], big["hidden_size"]
        if self.h > self.H or (with_const_unit and self.h >= self.H):
            raise ValueError(f"hidden {self.h} does not fit in {self.H}")
        self.c = math.sqrt(self.H / self.h)
        self.const_unit = self.H - 1 if with_const_unit else None

    def norm(
        self, w: torch.Tensor | None, *, one_plus: bool, final: bool
    ) -> torch.Tensor:
        """An RMSNorm weight over H for the small weight ``w`` over h."""
        pad = -1.0 if one_plus else 0.0
        out = torch.full((self.H,), pad, dtype=torch.float32, device=w.device)
        if one_plus:
            out[: self.h] = (1.0 + w.float()) / self.c - 1.0
        else:
            out[: self.h] = w.float() / self.c
        if final and self.const_unit is not None:
            out[self.const_unit] = 0.0 if one_plus else 1.0
        return out


def _q_head_index(
    j: int, small_heads: int, small_kv: int, big_heads: int, big_kv: int
) -> int:
    g_small, g_big = small_heads // small_kv, big_heads // big_kv
    k, r = divmod(j, g_small)
    return k * g_big + r


def _head_rows(heads: list[int], per_head: int, device) -> torch.Tensor:
    return torch.cat(
        [torch.arange(b * per_head, (b + 1) * per_head, device=device) for b in heads]
    )


def check_compatible(small: dict, big: dict) -> None:
    """Raise ValueError if the small text config cannot be embedded in the big one."""
    same = ["head_dim", "rms_norm_eps"]
    at_most = ["num_key_value_heads", "intermediate_size", "vocab_size"]
    if "linear_num_key_heads" in small:
        same += ["linear_key_head_dim", "linear_value_head_dim"]
        same += ["linear_conv_kernel_dim", "rope_parameters"]
        at_most.append("linear_num_key_heads")
        ratio = [
            c["linear_num_value_heads"] // c["linear_num_key_heads"]
            for c in (small, big)
        ]
        if ratio[0] != ratio[1]:
            raise ValueError(
                f"cannot embed: GDN value/key head ratio {ratio[0]} != {ratio[1]}"
            )
    else:
        same.append("rope_theta")
    groups = [
        c["num_attention_heads"] // c["num_key_value_heads"] for c in (small, big)
    ]
    for bad, what in (
        *((small.get(k) != big.get(k), f"{k} differs") for k in same),
        *((small[k] > big[k], f"{k} larger than the target's") for k in at_most),
        (groups[0] > groups[1], f"query group {groups[0]} larger than {groups[1]}"),
    ):
        if bad:
            raise ValueError(f"cannot embed: {what}")


class _Writer:
    def __init__(self, geo: Geometry, device, dtype, seed: int):
        self.geo, self.device, self.dtype = geo, device, dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device).uniform_(
            -INIT_RANGE, INIT_RANGE, generator=self.gen
        )

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def put(
        self, big: torch.Tensor, rows, cols, small: torch.Tensor, scale: float = 1.0
    ) -> torch.Tensor:
        small = small.to(device=self.device, dtype=torch.float32) * scale
        if cols is None:
            big[rows] = small.to(self.dtype)
        else:
            big[rows[:, None], cols[None, :]] = small.to(self.dtype)
        return big

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)

    def norm(self, w: torch.Tensor, *, one_plus: bool, final: bool = False):
        """``Geometry.norm`` in this writer's device and dtype."""
        return self.cast(self.geo.norm(w, one_plus=one_plus, final=final))


def _attention(w: _Writer, small: dict, big: dict, s: dict | None, gated: bool):
    """(name suffix, tensor) of one attention block; ``s`` holds the small layer's
    tensors by suffix, or None for an identity layer."""
    geo, dev = w.geo, w.device
    hd, H = big["head_dim"], geo.H
    nq_b, nkv_b = big["num_attention_heads"], big["num_key_value_heads"]
    q_per_head = 2 * hd if gated else hd
    q = w.rand(nq_b * q_per_head, H)
    k, v = w.rand(nkv_b * hd, H), w.rand(nkv_b * hd, H)
    o = w.zeros(H, nq_b * hd)
    if s is None:
        q_norm, k_norm = w.rand(hd), w.rand(hd)
    else:
        nq_s, nkv_s = small["num_attention_heads"], small["num_key_value_heads"]
        heads = [_q_head_index(j, nq_s, nkv_s, nq_b, nkv_b) for j in range(nq_s)]
        hs = torch.arange(geo.h, device=dev)
        w.put(q, _head_rows(heads, q_per_head, dev), hs, s["q_proj.weight"])
        kv_rows = _head_rows(list(range(nkv_s)), hd, dev)
        w.put(k, kv_rows, hs, s["k_proj.weight"])
        w.put(v, kv_rows, hs, s["v_proj.weight"])
        w.put(o, hs, _head_rows(heads, hd, dev), s["o_proj.weight"], geo.c)
        q_norm, k_norm = w.cast(s["q_norm.weight"]), w.cast(s["k_norm.weight"])
    return _named(q_proj=q, k_proj=k, v_proj=v, o_proj=o, q_norm=q_norm, k_norm=k_norm)


def _named(**weights) -> list[tuple[str, torch.Tensor]]:
    """(``<name>.weight``, tensor) in order; ``dt_bias`` and ``A_log`` are
    parameters of their own."""
    return [
        (k if k in ("dt_bias", "A_log") else k + ".weight", t)
        for k, t in weights.items()
    ]


def _gated_delta_net(w: _Writer, small: dict, big: dict, s: dict | None):
    geo, dev, H = w.geo, w.device, w.geo.H
    dk, dv = big["linear_key_head_dim"], big["linear_value_head_dim"]
    kern = big["linear_conv_kernel_dim"]
    nk_b, nv_b = big["linear_num_key_heads"], big["linear_num_value_heads"]
    key_b, val_b = nk_b * dk, nv_b * dv
    conv_b = 2 * key_b + val_b
    qkv, z = w.rand(conv_b, H), w.rand(val_b, H)
    b_, a_ = w.rand(nv_b, H), w.rand(nv_b, H)
    conv = w.rand(conv_b, 1, kern)
    dt_bias, a_log = w.rand(nv_b), w.rand(nv_b)
    out = w.zeros(H, val_b)
    if s is None:
        norm = w.rand(dv)
    else:
        nk_s, nv_s = small["linear_num_key_heads"], small["linear_num_value_heads"]
        key_s, val_s = nk_s * dk, nv_s * dv
        # q, k and v: the small heads first in each of the three sections.
        sections = ((0, key_s), (key_b, key_s), (2 * key_b, val_s))
        rows = torch.cat([at + torch.arange(n, device=dev) for at, n in sections])
        hs = torch.arange(geo.h, device=dev)
        w.put(qkv, rows, hs, s["in_proj_qkv.weight"])
        w.put(conv, rows, None, s["conv1d.weight"])
        vs = torch.arange(val_s, device=dev)
        w.put(z, vs, hs, s["in_proj_z.weight"])
        heads = torch.arange(nv_s, device=dev)
        w.put(b_, heads, hs, s["in_proj_b.weight"])
        w.put(a_, heads, hs, s["in_proj_a.weight"])
        w.put(dt_bias, heads, None, s["dt_bias"])
        w.put(a_log, heads, None, s["A_log"])
        w.put(out, hs, vs, s["out_proj.weight"], geo.c)
        norm = w.cast(s["norm.weight"])
    return _named(
        in_proj_qkv=qkv,
        in_proj_z=z,
        in_proj_b=b_,
        in_proj_a=a_,
        conv1d=conv,
        dt_bias=dt_bias,
        A_log=a_log,
        norm=norm,
        out_proj=out,
    )


def _mlp(w: _Writer, small: dict, big: dict, s: dict | None):
    geo, dev, H = w.geo, w.device, w.geo.H
    inter = big["intermediate_size"]
    gate, up, down = w.rand(inter, H), w.rand(inter, H), w.zeros(H, inter)
    if s is not None:
        hs = torch.arange(geo.h, device=dev)
        cols = torch.arange(small["intermediate_size"], device=dev)
        w.put(gate, cols, hs, s["gate_proj.weight"])
        w.put(up, cols, hs, s["up_proj.weight"])
        w.put(down, hs, cols, s["down_proj.weight"], geo.c)
    return _named(gate_proj=gate, up_proj=up, down_proj=down)


def check_placement(small: dict, big: dict, placement: list[int]) -> None:
    """Raise ValueError unless ``placement`` puts each small layer, in order, on a
    production layer of the same type."""
    n_small, n_big = small["num_hidden_layers"], big["num_hidden_layers"]
    if len(placement) != n_small or sorted(set(placement)) != placement:
        raise ValueError(
            f"placement {placement} is not increasing over {n_small} layers"
        )
    if placement[-1] >= n_big:
        raise ValueError(f"placement {placement} beyond {n_big} layers")
    types_b = big.get("layer_types") or ["full_attention"] * big["num_hidden_layers"]
    types_s = (
        small.get("layer_types") or ["full_attention"] * small["num_hidden_layers"]
    )
    for i, li in enumerate(placement):
        if types_s[i] != types_b[li]:
            raise ValueError(
                f"small layer {i} ({types_s[i]}) placed on a {types_b[li]} layer {li}"
            )


def _layers(
    w: _Writer,
    small: dict,
    big: dict,
    small_sd: dict,
    prefix: str,
    placement: list[int],
    one_plus: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every production layer; layer ``placement[i]`` is small layer i."""
    check_placement(small, big, placement)
    types_b = big.get("layer_types") or ["full_attention"] * big["num_hidden_layers"]
    small_of = {b: i for i, b in enumerate(placement)}
    gated = bool(big.get("attn_output_gate", False))
    for li in range(big["num_hidden_layers"]):
        i = small_of.get(li)
        pre_s, pre_b = f"{prefix}layers.{i}.", f"{prefix}layers.{li}."

        def sub(block: str, i=i, pre_s=pre_s):
            if i is None:
                return None
            p = pre_s + block + "."
            return {k[len(p) :]: v for k, v in small_sd.items() if k.startswith(p)}

        if types_b[li] == "linear_attention":
            for n, t in _gated_delta_net(w, small, big, sub("linear_attn")):
                yield pre_b + "linear_attn." + n, t
        else:
            for n, t in _attention(w, small, big, sub("self_attn"), gated):
                yield pre_b + "self_attn." + n, t
        for n, t in _mlp(w, small, big, sub("mlp")):
            yield pre_b + "mlp." + n, t
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            if i is None:
                yield pre_b + norm, w.rand(w.geo.H)
            else:
                yield pre_b + norm, w.norm(small_sd[pre_s + norm], one_plus=one_plus)


def target_prefix(cfg: dict) -> str:
    """Where the language model's weights sit in a checkpoint of this config."""
    return "model.language_model." if "text_config" in cfg else "model."


def target_weights(
    small_cfg: dict,
    big_cfg: dict,
    placement: list[int],
    small_sd: dict[str, torch.Tensor],
    *,
    device="cpu",
    dtype=torch.float32,
    seed: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The production target's language-model weights (Hugging Face names)."""
    small, big = text_config(small_cfg), text_config(big_cfg)
    check_compatible(small, big)
    check_placement(small, big, placement)
    if big.get("tie_word_embeddings"):
        raise ValueError(
            "the production config must not tie embeddings (its lm_head differs)"
        )
    one_plus = "text_config" in big_cfg  # Qwen3.5 norms are (1 + w)
    geo = Geometry(small, big, with_const_unit=big["vocab_size"] > small["vocab_size"])
    w = _Writer(geo, device, dtype, seed)
    pre = target_prefix(small_cfg)
    pre_b = target_prefix(big_cfg)
    emb_s = small_sd[pre + "embed_tokens.weight"]
    v_s, v_b = small["vocab_size"], big["vocab_size"]
    hs, vocab = torch.arange(geo.h, device=device), torch.arange(v_s, device=device)
    emb = w.put(w.zeros(v_b, geo.H), vocab, hs, emb_s, geo.c)
    if geo.const_unit is not None:
        emb[:, geo.const_unit] = CONST_VALUE
    yield pre_b + "embed_tokens.weight", emb
    del emb
    for n, t in _layers(w, small, big, small_sd, pre, placement, one_plus):
        yield pre_b + n[len(pre) :], t
    final_norm = w.norm(small_sd[pre + "norm.weight"], one_plus=one_plus, final=True)
    yield pre_b + "norm.weight", final_norm
    lm = w.put(w.rand(v_b, geo.H), vocab, hs, small_sd.get("lm_head.weight", emb_s))
    if geo.const_unit is not None:
        lm[:v_s, geo.const_unit] = 0
        lm[v_s:, geo.const_unit] = PAD_LOGIT_WEIGHT
    yield "lm_head.weight", lm


def aux_slot_map(
    placement: list[int], n_big_layers: int, small_ids: list[int], big_ids: list[int]
) -> dict[int, int]:
    """Small drafter aux slot -> production aux slot reading the same hidden state
    (the output of production layer L equals small layer i's for
    placement[i] <= L < placement[i + 1])."""
    ends = placement[1:] + [n_big_layers]
    out, used = {}, set()
    for s_slot, i in enumerate(small_ids):
        match = [
            b
            for b, L in enumerate(big_ids)
            if placement[i] <= L < ends[i] and b not in used
        ]
        if not match:
            raise ValueError(
                f"no production target_layer_id reads small layer {i} (placed at "
                f"{placement[i]}..{ends[i] - 1}); production ids {big_ids}"
            )
        out[s_slot] = match[0]
        used.add(match[0])
    return out


def drafter_weights(
    small_dcfg: dict,
    big_dcfg: dict,
    small_target_cfg: dict,
    big_target_cfg: dict,
    placement: list[int],
    small_dsd: dict[str, torch.Tensor],
    *,
    device="cpu",
    dtype=torch.float32,
    seed: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The production DFlash drafter's weights (DFlash checkpoint names; the
    embedding and lm_head are the target's)."""
    check_compatible(small_dcfg, big_dcfg)
    if small_dcfg["hidden_size"] != text_config(small_target_cfg)["hidden_size"]:
        raise ValueError("the small drafter's width is not its target's")
    if big_dcfg["hidden_size"] != text_config(big_target_cfg)["hidden_size"]:
        raise ValueError("the production drafter's width is not its target's")
    big_t, small_t = text_config(big_target_cfg), text_config(small_target_cfg)
    const_unit = big_t["vocab_size"] > small_t["vocab_size"]
    geo = Geometry(small_dcfg, big_dcfg, with_const_unit=const_unit)
    w = _Writer(geo, device, dtype, seed)
    s_ids = small_dcfg["dflash_config"]["target_layer_ids"]
    b_ids = big_dcfg["dflash_config"]["target_layer_ids"]
    slots = aux_slot_map(placement, big_t["num_hidden_layers"], s_ids, b_ids)
    h, H = geo.h, geo.H
    fc = w.zeros(H, len(b_ids) * H)
    hs = torch.arange(h, device=device)
    for s_slot, b_slot in slots.items():
        small_fc = small_dsd["fc.weight"][:, s_slot * h : (s_slot + 1) * h]
        w.put(fc, hs, b_slot * H + hs, small_fc)
    yield "fc.weight", fc
    yield "hidden_norm.weight", w.norm(small_dsd["hidden_norm.weight"], one_plus=False)
    n_small = small_dcfg["num_hidden_layers"]
    yield from _layers(
        w, small_dcfg, big_dcfg, small_dsd, "", list(range(n_small)), one_plus=False
    )
    yield "norm.weight", w.norm(small_dsd["norm.weight"], one_plus=False, final=True)


def pair_weights(
    spec: dict, part: str, small_sd: dict[str, torch.Tensor], **kw
) -> Iterator[tuple[str, torch.Tensor]]:
    """The production weights of a pair's ``part`` ("target", "drafter" or
    "mtp"), ``spec`` as pair_configs.load_pair gives it, from the small
    ``part``'s weights; ``kw``: device, dtype."""
    small_t, big_t = spec["small_target"], spec["big_target"]
    placement = spec["placement"]
    if part == "target":
        return target_weights(small_t, big_t, placement, small_sd, **kw)
    if part == "mtp":
        return mtp_weights(small_t, big_t, small_sd, **kw)
    drafters = spec["small_drafter"], spec["big_drafter"]
    return drafter_weights(*drafters, small_t, big_t, placement, small_sd, **kw)


def mtp_weights(
    small_cfg: dict,
    big_cfg: dict,
    small_msd: dict[str, torch.Tensor],
    *,
    device="cpu",
    dtype=torch.float32,
    seed: int = 2,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The production MTP module's weights (``mtp.*``, as in Qwen3.5 / Qwen3.6
    checkpoints) for the small target's MTP head ``small_msd`` (mtp.py); the
    embedding and lm_head are the embedded target's, which vLLM shares.

    Its inputs are the production target's final hidden state (the small one
    on the first h units, the padded-vocabulary unit beside it) and the
    production embedding (c times the small one, the same unit): the pre-fc
    norms give the small normalised inputs on the first h units, as the
    target's norms do. ``fc`` writes c times the small result into the first
    h units of the head's residual stream and copies the padded-vocabulary
    unit of the normalised embedding into the same unit (the embedding norm
    passes it), so that the final norm passes it on to the shared lm_head and
    padded tokens stay far below every real one, as in the target."""
    small, big = text_config(small_cfg), text_config(big_cfg)
    if big.get("mtp_num_hidden_layers", 0) < 1:
        raise ValueError("the production config has no MTP layer")
    check_compatible(small, big)
    geo = Geometry(small, big, with_const_unit=big["vocab_size"] > small["vocab_size"])
    w = _Writer(geo, device, dtype, seed)
    h, H = geo.h, geo.H
    hs = torch.arange(h, device=device)
    fc = w.zeros(H, 2 * H)
    w.put(fc, hs, hs, small_msd["mtp.fc.weight"][:, :h], geo.c)
    w.put(fc, hs, H + hs, small_msd["mtp.fc.weight"][:, h:], geo.c)
    if geo.const_unit is not None:
        fc[geo.const_unit, geo.const_unit] = 1.0
    yield "mtp.fc.weight", fc
    for name, final in (("embedding", True), ("hidden", False)):
        norm = small_msd[f"mtp.pre_fc_norm_{name}.weight"]
        yield f"mtp.pre_fc_norm_{name}.weight", w.norm(norm, one_plus=True, final=final)
    one_layer = dict(num_hidden_layers=1, layer_types=["full_attention"])
    small_1, big_1 = dict(small, **one_layer), dict(big, **one_layer)
    yield from _layers(w, small_1, big_1, small_msd, "mtp.", [0], one_plus=True)
    final_norm = w.norm(small_msd["mtp.norm.weight"], one_plus=True, final=True)
    yield "mtp.norm.weight", final_norm
