# SPDX-License-Identifier: Apache-2.0
"""Copy a Qwen3 checkpoint (a target or a DFlash drafter) with its key/value
heads repeated, so that it computes the same function with more of them.

Why: tensor parallelism splits the key/value heads across ranks, and the
tinypair (../shared/models/tinypair) has 3 of them, so it cannot run at
TP = 2. A model with dummy weights can, but its logits are nearly flat
(vLLM's dummy weights are uniform in +-1e-3: top-2 gaps of ~1e-6 nats at
every token, seen on the H200), so no greedy comparison between TP = 1 and
TP = 2 means anything there. Repeating each key/value head keeps the
trained pair's outputs and acceptance: with grouped-query attention, query
head ``i`` reads key/value head ``i // (num_heads // num_kv_heads)``, so the
copy's key/value head ``j`` is the original head ``j // repeat``.

    python3 bench/expand_kv_heads.py SRC DST --kv-heads 6

Only ``k_proj`` / ``v_proj`` (weight, and bias where present) and the
config's ``num_key_value_heads`` change; every other file is copied. The
weights keep their dtype.
"""

import argparse
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KV_PROJ_SUFFIXES = (
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
)


def repeat_kv_heads(
    tensor: torch.Tensor, num_kv_heads: int, repeat: int
) -> torch.Tensor:
    """Rows of a k/v projection (``[num_kv_heads * head_dim, ...]``) with
    each head's block of rows repeated ``repeat`` times in place (head ``j``
    of the result is head ``j // repeat`` of the input)."""
    heads = tensor.reshape(num_kv_heads, -1, *tensor.shape[1:])
    return (
        heads.repeat_interleave(repeat, dim=0)
        .reshape(-1, *tensor.shape[1:])
        .contiguous()
    )


def expand_kv_heads(src: str, dst: str, kv_heads: int) -> dict:
    """Write the expanded copy of ``src`` to ``dst``; returns its config."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads", num_heads)
    if kv_heads % num_kv_heads or num_heads % kv_heads:
        raise ValueError(
            f"--kv-heads {kv_heads} must be a multiple of the model's "
            f"{num_kv_heads} key/value heads and divide its {num_heads} query heads"
        )
    repeat = kv_heads // num_kv_heads
    os.makedirs(dst, exist_ok=True)
    changed = 0
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name == "config.json" or os.path.isdir(path):
            continue
        if not name.endswith(".safetensors"):
            shutil.copyfile(path, os.path.join(dst, name))
            continue
        tensors = {}
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                tensor = f.get_tensor(key)
                if key.endswith(KV_PROJ_SUFFIXES):
                    tensor = repeat_kv_heads(tensor, num_kv_heads, repeat)
                    changed += 1
                tensors[key] = tensor
        save_file(tensors, os.path.join(dst, name), metadata=metadata)
    if changed == 0:
        raise ValueError(f"{src}: no k_proj / v_proj weights found")
    config["num_key_value_heads"] = kv_heads
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--kv-heads", type=int, required=True)
    a = ap.parse_args()
    config = expand_kv_heads(a.src, a.dst, a.kv_heads)
    print(
        f"{a.dst}: {config['num_attention_heads']} query heads, "
        f"{config['num_key_value_heads']} key/value heads"
    )


if __name__ == "__main__":
    main()
