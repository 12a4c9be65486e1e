# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-rank acceptance of DDTree's trees, counted on the device.

The "measured" budget policy (`policy`) needs, for every tree rank ``r``
(node ``r + 1`` of the verify layout), how many request-steps verified it
and how many accepted it. The walk's outputs hold both: a request verified
the nodes ``1 .. num_logits - 1`` (``cu_num_logits``), and its accepted path
is ``src_row[:, 1:num_accepted]`` (rows of the flattened verify batch; node
= row - ``query_start_loc``). `AcceptanceCounters.count` adds them into two
``[tree_budget]`` int64 device buffers in one launch, every step, with fixed
shapes and no host synchronisation.

Reading them is off the step's critical path: `snapshot` queues a
non-blocking copy into a pinned host buffer allocated once, and a later step
finds it complete (`snapshot_ready`, an event query) and reads the host
copy. Torch only (plus Triton for the launch on CUDA), like ``tree.py``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path still counts
    triton = None


def count_accepted_ranks_torch(
    counts: torch.Tensor,
    num_accepted: torch.Tensor,
    src_row: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
) -> None:
    """Reference of the counter update (and the CPU path).

    ``counts``: ``[2, B]`` int64, row 0 accepted, row 1 verified, per rank.
    ``num_accepted``: ``[R]`` path length including the root; ``src_row``:
    ``[R, D + 1]`` verify-batch rows of the path (entry 0 the root, entries
    past the path the root again); ``query_start_loc``, ``cu_num_logits``:
    ``[>= R + 1]``."""
    num_reqs, path_len = src_row.shape
    budget = counts.shape[1]
    device = counts.device
    rows = query_start_loc[:num_reqs, None].to(torch.int64)
    rank = src_row.to(torch.int64) - rows - 1
    col = torch.arange(path_len, device=device)
    on_path = (col[None, :] >= 1) & (col[None, :] < num_accepted[:, None].long())
    counts[0].index_add_(
        0, rank.clamp(0, budget - 1).reshape(-1), on_path.reshape(-1).to(torch.int64)
    )
    num_nodes = (cu_num_logits[1 : num_reqs + 1] - cu_num_logits[:num_reqs]).long() - 1
    ranks = torch.arange(budget, device=device)
    counts[1] += (ranks[None, :] < num_nodes[:, None]).sum(0)


if triton is not None:

    @triton.jit
    def _count_accepted_ranks_kernel(
        counts_ptr,  # [2, B] int64: accepted, verified
        num_accepted_ptr,  # [R]
        src_row_ptr,  # [R, D + 1]
        src_row_stride,
        query_start_loc_ptr,  # [R + 1]
        cu_num_logits_ptr,  # [R + 1]
        BUDGET: tl.constexpr,
        PATH_LEN: tl.constexpr,
        PATH_BLOCK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0)
        row0 = tl.load(query_start_loc_ptr + r).to(tl.int64)
        num_acc = tl.load(num_accepted_ptr + r)
        k = tl.arange(0, PATH_BLOCK)
        on_path = (k >= 1) & (k < num_acc) & (k < PATH_LEN)
        src = tl.load(src_row_ptr + r * src_row_stride + k, mask=on_path, other=0)
        rank = tl.where(on_path, src.to(tl.int64) - row0 - 1, 0)
        ones_path = tl.full((PATH_BLOCK,), 1, tl.int64)
        tl.atomic_add(counts_ptr + rank, ones_path, mask=on_path)

        num_nodes = (
            tl.load(cu_num_logits_ptr + r + 1) - tl.load(cu_num_logits_ptr + r) - 1
        )
        j = tl.arange(0, BLOCK)
        verified = (j < num_nodes) & (j < BUDGET)
        ones = tl.full((BLOCK,), 1, tl.int64)
        tl.atomic_add(counts_ptr + BUDGET + j, ones, mask=verified)


def count_accepted_ranks(
    counts: torch.Tensor,
    num_accepted: torch.Tensor,
    src_row: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    use_triton: bool | None = None,
) -> None:
    """`count_accepted_ranks_torch` in one launch (Triton on CUDA; the torch
    reference elsewhere, or when ``use_triton`` is False)."""
    if use_triton is None:
        use_triton = triton is not None and counts.device.type == "cuda"
    if not use_triton:
        count_accepted_ranks_torch(
            counts, num_accepted, src_row, query_start_loc, cu_num_logits
        )
        return
    num_reqs, path_len = src_row.shape
    if num_reqs == 0:
        return
    budget = counts.shape[1]
    assert counts.is_contiguous() and src_row.stride(1) == 1
    _count_accepted_ranks_kernel[(num_reqs,)](
        counts,
        num_accepted,
        src_row,
        src_row.stride(0),
        query_start_loc,
        cu_num_logits,
        BUDGET=budget,
        PATH_LEN=path_len,
        PATH_BLOCK=triton.next_power_of_2(path_len),
        BLOCK=triton.next_power_of_2(budget),
        num_warps=1 if budget <= 256 else 4,
    )


class AcceptanceCounters:
    """Per-rank accepted / verified request-step counts on the device, and
    their host copy for the budget policy.

    ``counts[0, r]``: request-steps whose accepted path contains rank ``r``;
    ``counts[1, r]``: request-steps that verified rank ``r``. Both only grow
    (int64 will not wrap: 2^63 request-steps). ``host`` (``[2, B]``, pinned
    on CUDA) receives them through `snapshot`; ``host_np`` views it."""

    def __init__(self, tree_budget: int, device: torch.device):
        self.tree_budget = tree_budget
        self.device = torch.device(device)
        self.counts = torch.zeros(2, tree_budget, dtype=torch.int64, device=device)
        on_cuda = self.device.type == "cuda"
        self.host = torch.zeros(2, tree_budget, dtype=torch.int64, pin_memory=on_cuda)
        self.host_np = self.host.numpy()
        self._event = torch.cuda.Event() if on_cuda else None
        self._pending = False

    def count(
        self,
        num_accepted: torch.Tensor,
        src_row: torch.Tensor,
        query_start_loc: torch.Tensor,
        cu_num_logits: torch.Tensor,
    ) -> None:
        """Add one step's walk (`ddtree_walk`'s outputs) to the counters."""
        count_accepted_ranks(
            self.counts, num_accepted, src_row, query_start_loc, cu_num_logits
        )

    def snapshot(self) -> None:
        """Queue the copy of the counters into ``host`` (non-blocking on
        CUDA: it runs after the work already queued on the stream)."""
        assert not self._pending, "the previous snapshot was not read"
        self.host.copy_(self.counts, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._pending = True

    @property
    def pending(self) -> bool:
        return self._pending

    def snapshot_ready(self) -> bool:
        """True once the queued copy has landed in ``host`` (an event query:
        does not wait). Marks the snapshot read."""
        if not self._pending:
            return False
        if self._event is not None and not self._event.query():
            return False
        self._pending = False
        return True
