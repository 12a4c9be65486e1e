# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DDTree tree speculative decoding (arXiv 2604.12989).

A DFlash drafter predicts ``draft_depth`` positions in one pass; DDTree turns
the per-depth distributions into the optimal draft tree of ``tree_budget``
nodes and verifies the whole tree in one target forward.

- `config`: the ``method: "ddtree"`` settings and their validation (hooks in
  ``SpeculativeConfig`` / ``VllmConfig``);
- `tree`, `tree_triton`: the batched tree build (torch and Triton backends);
- `sampling`: per-node penalty context and logprob order at T > 0;
- `gdn_verify`, `tree_gdn`, `tree_conv`: Gated DeltaNet layers of hybrid
  targets verified over trees;
- `metrics`, `startup`: Prometheus series, log line, one-line CLI errors.

The V2 model runner's side lives in ``vllm.v1.worker.gpu.spec_decode.ddtree``.
The package imports nothing itself: ``config`` is loaded with the config
classes at startup, the rest only when DDTree runs.
"""
