# SPDX-License-Identifier: Apache-2.0
"""A vLLM worker extension that writes an embedded benchmark pair into an engine
started with ``load_format="dummy"`` at the production shape, in place.

    LLM(model=<production config dir>, load_format="dummy",
        worker_extension_cls="bench.pairs.pair_worker.EmbeddedPairWorker", ...)
    llm.collective_rpc("load_embedded_pair", args=(pair_dir, pair_name))

(The checkout's root must be on the engine processes' PYTHONPATH; importing
bench.common puts it there for the processes a bench tool starts.) The tensors
come from embed.py one at a time and go through the models' own
``load_weights``, as a checkpoint's would: vLLM's fused projections and tensor
parallel shards are handled by vLLM. Parameters keep their addresses, so CUDA
graphs captured at startup stay valid.
"""

from __future__ import annotations

import os
import time

import torch

from bench.pairs import embed
from bench.pairs import pair_configs as pc


def _load_small(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _finish_load(model: torch.nn.Module, device: torch.device) -> None:
    """Rebuild what the model derives from its weights after loading, from the
    weights just written. vLLM 0.34 derives some tensors in the post-load hooks
    (DFlash's fused context K/V projection), in place; 0.26's ``load_weights``
    derives them itself and has no such pass."""
    try:
        from vllm.model_executor.model_loader.weight_utils import (
            finalize_model_weights,
        )
    except ImportError:
        return
    finalize_model_weights(model, device)


def _drafter_model(runner):
    # V2 model runner: runner.speculator.model; V1: runner.drafter.model
    for owner in ("speculator", "drafter"):
        obj = getattr(runner, owner, None)
        model = getattr(obj, "model", None)
        if model is not None:
            return model
    return None


class EmbeddedPairWorker:
    def load_embedded_pair(
        self, pair_dir: str, pair_name: str, with_drafter: bool = True
    ) -> dict:
        t0 = time.time()
        spec = pc.load_pair(os.path.dirname(pair_dir.rstrip("/")), pair_name)
        runner = self.model_runner
        target = runner.model
        dtype = self.vllm_config.model_config.dtype
        device = next(target.parameters()).device
        small_t = _load_small(os.path.join(pair_dir, "target"))
        n_bytes = n_tensors = 0

        def counted(it):
            nonlocal n_bytes, n_tensors
            for name, t in it:
                n_bytes += t.numel() * t.element_size()
                n_tensors += 1
                yield name, t

        kw = dict(device=device, dtype=dtype)
        target.load_weights(counted(embed.pair_weights(spec, "target", small_t, **kw)))
        _finish_load(target, device)
        out = {
            "pair": pair_name,
            "target_tensors": n_tensors,
            "target_gib": round(n_bytes / 2**30, 2),
        }
        drafter = _drafter_model(runner)
        if with_drafter and drafter is not None:
            n_bytes = n_tensors = 0
            # "mtp": the target's own MTP module (<pair_dir>/mtp), not a drafter
            mtp = self.vllm_config.speculative_config.method == "mtp"
            part = "mtp" if mtp else "drafter"
            small = _load_small(os.path.join(pair_dir, part))
            weights = embed.pair_weights(spec, part, small, **kw)
            drafter.load_weights(counted(weights))
            _finish_load(drafter, device)
            out.update(drafter_tensors=n_tensors, drafter_gib=round(n_bytes / 2**30, 2))
            # The drafter must read the target's embedding and lm_head (DFlash
            # and MTP share them at load time); a copy would still hold dummy
            # values.
            lm_t = getattr(getattr(target, "language_model", target), "lm_head", None)
            out["drafter_shares_lm_head"] = bool(
                lm_t is not None
                and getattr(drafter, "lm_head", None) is not None
                and drafter.lm_head.weight.data_ptr() == lm_t.weight.data_ptr()
            )
        torch.cuda.synchronize()
        out["seconds"] = round(time.time() - t0, 1)
        return out
