# SPDX-License-Identifier: Apache-2.0
"""Run inside a venv with our vllm installed (CPU is fine).

Builds DFlashQwen3Attention layers from each qwen3_dflash.py given on the command
line (loaded as a module of the installed vllm package) and prints, as JSON, the
KV-cache spec each layer reports to the KV cache manager and the window its
attention impl applies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from typing import Any

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

import vllm.platforms as platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

platforms._current_platform = (
    CpuPlatform()
)  # no GPU here: use the CPU attention backend

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)


class ModelConfigStub:
    """The few model_config fields that layer construction reads."""

    dtype = torch.float32

    def __getattr__(self, name: str) -> Any:
        return None


def load(path: str, tag: str) -> Any:
    name = f"vllm.model_executor.models._ddtree_probe_{tag}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=16),
    )
    object.__setattr__(cfg, "model_config", ModelConfigStub())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results: dict[str, dict[str, Any]] = {}
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        initialize_model_parallel(1, 1)
        for i, path in enumerate(sys.argv[1:]):
            module = load(path, str(i))
            for window in (None, 32):
                layer = module.DFlashQwen3Attention(
                    hidden_size=64,
                    num_heads=4,
                    num_kv_heads=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    max_position=256,
                    head_dim=16,
                    sliding_window=window,
                    causal=True,
                    cache_config=cfg.cache_config,
                    prefix=f"probe{i}.layers.{window}.self_attn",
                )
                spec = layer.attn.get_kv_cache_spec(cfg)
                results[f"{i}:{window}"] = {
                    "spec": type(spec).__name__,
                    "spec_sliding_window": getattr(spec, "sliding_window", None),
                    "impl_sliding_window": layer.attn.impl.sliding_window,
                    "layer_sliding_window": layer.sliding_window,
                }
    print("PROBE " + json.dumps(results, default=str))


if __name__ == "__main__":
    main()
