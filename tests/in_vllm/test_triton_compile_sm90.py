# SPDX-License-Identifier: Apache-2.0
"""Compile DDTree's Triton kernels (the split tree attention's among them),
and the patched unified attention kernel with a per-sequence tree bias, for
Hopper (sm_90) without a GPU.

The Triton interpreter, which runs the kernels on CPU in the other tests,
accepts code the GPU compiler refuses (a plain Python global read inside a
kernel passed the interpreter and failed to compile on the H200). Compiling
for a GPUTarget needs no device, so these front-end and PTX errors are caught
here. Runs in a subprocess: the interpreter flag set by conftest.py would
otherwise turn the kernels into interpreted functions.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget

    import vllm.v1.spec_decode.ddtree.tree_conv as tc
    import vllm.v1.spec_decode.ddtree.tree_gdn as tg
    import vllm.v1.spec_decode.ddtree.tree_triton as tt
    import vllm.v1.attention.ops.triton_unified_attention as tua
    import vllm.v1.worker.gpu.spec_decode.ddtree.kernels as kk

    target = GPUTarget("cuda", 90, 32)
    failures = []

    def compile_kernel(fn, signature, constexprs):
        src = triton.compiler.ASTSource(
            fn=fn, signature=signature, constexprs=constexprs
        )
        try:
            triton.compile(src, target=target)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{fn.__name__} {constexprs}: {e}")

    C = "constexpr"
    for key16 in (True, False):
        compile_kernel(
            tt._vocab_chunk_kernel,
            {"logits_ptr": "*bf16", "part_max_ptr": "*fp32",
             "part_sum_ptr": "*fp32", "cand_ptr": "*i64", "V": "i32",
             "stride": "i32", "NC": "i32", "K": C, "CHUNK": C,
             "IS_LOGPROBS": C, "COMPUTE_LSE": C, "KEY16": C},
            {"K": 64, "CHUNK": 1024, "IS_LOGPROBS": False,
             "COMPUTE_LSE": True, "KEY16": key16},
        )
    compile_kernel(
        tt._topk_merge_kernel,
        {"cand_ptr": "*i64", "out_ptr": "*i64", "NCAND": "i32",
         "NUM_GROUPS": "i32", "K": C, "GROUP": C, "BLOCK": C},
        {"K": 64, "GROUP": 1024, "BLOCK": 1024},
    )
    # The threshold filter (`_vocab_threshold_plan` at V = 151936, K = 64:
    # 1024-token sub-blocks, 149 of them, 8 keys kept of each from its
    # groups of 16 tokens, room for 1024 keys) and the tournament's kernels
    # for the rows that overflow it.
    compile_kernel(
        tt._vocab_stats_kernel,
        {"logits_ptr": "*bf16", "part_max_ptr": "*fp32",
         "part_sum_ptr": "*fp32", "cand_ptr": "*i64", "submax_ptr": "*i64",
         "V": "i32", "stride": "i32", "NC": "i32", "NSUB": "i32",
         "no_store": "i32", "K": C, "CHUNK": C, "SUB": C, "KEEP": C,
         "GROUP": C, "IS_LOGPROBS": C, "COMPUTE_LSE": C},
        {"K": 64, "CHUNK": 1024, "SUB": 1024, "KEEP": 8, "GROUP": 16,
         "IS_LOGPROBS": False, "COMPUTE_LSE": True},
    )
    compile_kernel(
        tt._vocab_threshold_kernel,
        {"submax_ptr": "*i64", "thresh_ptr": "*i64", "blocks_ptr": "*i32",
         "count_ptr": "*i32", "num_over_ptr": "*i32", "NSUB": "i32",
         "K": C, "KEEP": C, "MP": C, "MB": C, "TOP": C},
        {"K": 64, "KEEP": 8, "MP": 2048, "MB": 256,
         "TOP": 64 if tt.HAS_TOPK else 2048},
    )
    compile_kernel(
        tt._vocab_filter_kernel,
        {"logits_ptr": "*bf16", "thresh_ptr": "*i64", "blocks_ptr": "*i32",
         "count_ptr": "*i32", "small_ptr": "*i64", "num_over_ptr": "*i32",
         "over_rows_ptr": "*i32", "V": "i32", "stride": "i32", "K": C,
         "SUB": C, "G": C, "CAP": C, "IS_LOGPROBS": C},
        {"K": 64, "SUB": 1024, "G": 2, "CAP": 1024, "IS_LOGPROBS": False},
    )
    compile_kernel(
        tt._fallback_chunk_kernel,
        {"logits_ptr": "*bf16", "cand_ptr": "*i64", "num_over_ptr": "*i32",
         "over_rows_ptr": "*i32", "V": "i32", "stride": "i32", "NC": "i32",
         "K": C, "CHUNK": C, "IS_LOGPROBS": C, "KEY16": C},
        {"K": 64, "CHUNK": 1024, "IS_LOGPROBS": False, "KEY16": True},
    )
    compile_kernel(
        tt._fallback_merge_kernel,
        {"cand_ptr": "*i64", "out_ptr": "*i64", "num_over_ptr": "*i32",
         "over_rows_ptr": "*i32", "NCAND": "i32", "NUM_GROUPS": "i32",
         "K": C, "GROUP": C, "BLOCK": C},
        {"K": 64, "GROUP": 1024, "BLOCK": 1024},
    )
    # Every parameter in the signature (Triton 3.8 refuses a kernel whose
    # signature leaves parameters out), with the pointers `_triton_vocab`
    # passes: without the filter, the candidates stand in for its buffers.
    for threshold in (False, True):
        compile_kernel(
            tt._vocab_merge_kernel,
            {"part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
             "cand_ptr": "*i64", "token_lp_ptr": "*fp32",
             "token_ids_ptr": "*i64", "lse_ptr": "*fp32", "small_ptr": "*i64",
             "count_ptr": "*i32" if threshold else "*i64", "NC": "i32",
             "NCAND": "i32", "K": C, "NC_BLOCK": C, "CAND_BLOCK": C,
             "IS_LOGPROBS": C, "HAS_LSE": C, "THRESHOLD": C, "CAP": C,
             "CAP_TOP": C},
            {"K": 64, "NC_BLOCK": 256, "CAND_BLOCK": 1024,
             "IS_LOGPROBS": False, "HAS_LSE": False, "THRESHOLD": threshold,
             "CAP": 1024 if threshold else 1,
             "CAP_TOP": (64 if tt.HAS_TOPK else 1024) if threshold else 1},
        )
    tree_sig = {name: "*i64" for name in (
        "top_tokens_ptr", "col_depth_ptr", "col_cand_offset_ptr",
        "cand_token_slot_ptr", "cand_parent_col_ptr", "col_position_ptr",
        "out_tokens_ptr", "out_parent_ptr", "out_depth_ptr")}
    tree_sig.update({name: "*i32" for name in (
        "cand_a_ptr", "cand_b_ptr", "cand_count_ptr", "col_start_ptr",
        "prefix_count_ptr", "all_cands_ptr")})
    tree_sig.update({"token_lp_ptr": "*fp32", "all_scores_ptr": "*fp32",
                     "out_score_ptr": "*fp32", "out_valid_ptr": "*i8",
                     "N": "i32", "NUM_SEL": "i32", "D": C, "K": C, "B": C,
                     "CP": C, "KP": C, "NB": C})
    # TN / TB: the top-k sizes of the tree kernel where it has them.
    has_topk = "TN" in tt._tree_kernel.arg_names
    if has_topk:
        tree_sig.update({"TN": C, "TB": C})
    for budget, cp, nb in ((16, 64, 1024), (64, 512, 4096)):
        consts = {"D": 15, "K": budget, "B": budget, "CP": cp, "KP": budget, "NB": nb}
        if has_topk:
            consts.update(TN=budget, TB=budget)
        compile_kernel(tt._tree_kernel, tree_sig, consts)
    walk_sig = {"target_ptr": "*i64", "cu_num_logits_ptr": "*i32",
                "idx_mapping_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "node_tokens_ptr": "*i64", "node_tokens_stride": "i32",
                "parent_ptr": "*i64", "parent_stride": "i32",
                "depth_ptr": "*i64", "depth_stride": "i32",
                "valid_ptr": "*i1", "valid_stride": "i32", "scratch_ptr": "*i32",
                "out_tokens_ptr": "*i64", "out_tokens_stride": "i32",
                "num_accepted_ptr": "*i32", "num_sampled_ptr": "*i32",
                "num_rejected_ptr": "*i32", "seq_lens_ptr": "*i32",
                "prefill_len_ptr": "*i32", "positions_ptr": "*i64",
                "logits_indices_ptr": "*i32", "shift_ptr": "*i64",
                "src_row_ptr": "*i64",
                "dst_row_ptr": "*i64", "DRAFT_DEPTH": C, "NUM_JUMPS": C,
                "BLOCK": C, "PATH_BLOCK": C, "COUNTS": C, "RESTORE": C}
    for fused in (False, True):
        compile_kernel(kk._ddtree_walk_kernel, walk_sig,
                       {"DRAFT_DEPTH": 15, "NUM_JUMPS": 4, "BLOCK": 128,
                        "PATH_BLOCK": 16, "COUNTS": fused, "RESTORE": fused})
    for restore in (False, True):
        compile_kernel(
            kk._ddtree_tree_positions_kernel,
            {"positions_ptr": "*i64", "logits_indices_ptr": "*i32",
             "expanded_idx_mapping_ptr": "*i32",
             "expanded_local_pos_ptr": "*i32", "depth_ptr": "*i64",
             "depth_stride": "i32", "input_ids_ptr": "*i32", "shift_ptr": "*i64",
             "logits_pos_ptr": "*i64", "logits_input_ids_ptr": "*i32",
             "num_logits": "i32", "RESTORE": C, "BLOCK": C},
            {"RESTORE": restore, "BLOCK": 1024},
        )
    from vllm.v1.spec_decode.ddtree import gdn_verify as gv
    compile_kernel(
        gv._save_verify_inputs_kernel,
        {"x": "*bf16", "stride_x_row": "i32", "stride_x_col": "i32",
         "a": "*bf16", "stride_a_row": "i32", "stride_a_col": "i32",
         "b": "*bf16", "stride_b_row": "i32", "stride_b_col": "i32",
         "x_buf": "*bf16", "a_buf": "*bf16", "b_buf": "*bf16",
         "conv_dim": "i32", "num_heads": "i32", "BLOCK": C, "HEADS_BLOCK": C},
        {"BLOCK": 1024, "HEADS_BLOCK": 64},
    )
    for num_dims, sign in ((3, 1), (3, -1), (4, 1)):
        compile_kernel(
            kk._ddtree_shift_model_positions_kernel,
            {"positions_ptr": "*i64", "dim_stride": "i32", "token_stride": "i32",
             "logits_indices_ptr": "*i32", "shift_ptr": "*i64",
             "num_logits": "i32", "NUM_DIMS": C, "SIGN": C, "BLOCK": C},
            {"NUM_DIMS": num_dims, "SIGN": sign, "BLOCK": 1024},
        )
    compile_kernel(
        kk._ddtree_store_trees_kernel,
        {"idx_mapping_ptr": "*i32", "tree_parent_ptr": "*i64",
         "tree_depth_ptr": "*i64", "tree_valid_ptr": "*i1",
         "tree_tokens_ptr": "*i64", "tree_stride": "i32",
         "req_parent_ptr": "*i64", "req_depth_ptr": "*i64",
         "req_valid_ptr": "*i1", "req_stride": "i32", "req_depth_stride": "i32",
         "req_tokens_ptr": "*i32", "req_tokens_stride": "i32",
         "BUDGET": C, "BLOCK": C},
        {"BUDGET": 64, "BLOCK": 64},
    )
    for packed, num_nodes, out_cols, rows, cols in (
        (False, 65, 65, 32, 128),
        (True, 65, 3, 64, 4),
        (True, 257, 9, 64, 16),
        (True, 17, 1, 32, 1),
    ):
        compile_kernel(
            kk._ddtree_tree_bias_kernel,
            {"parent_ptr": "*i64", "parent_stride": "i32",
             "idx_mapping_ptr": "*i32", "cu_num_logits_ptr": "*i32",
             "out_ptr": "*i32" if packed else "*fp32", "NUM_NODES": C,
             "DRAFT_DEPTH": C, "ROWS": C, "COLS": C, "PACKED": C, "OUT_COLS": C},
            {"NUM_NODES": num_nodes, "DRAFT_DEPTH": 15, "ROWS": rows,
             "COLS": cols, "PACKED": packed, "OUT_COLS": out_cols},
        )
    # The patched unified attention kernel with a per-sequence bias, float
    # and packed bits (`load_qq_bias_tile`), at a Qwen3-8B-like shape.
    ua = tua.kernel_unified_attention
    ua_ptrs = {"output_ptr": "*bf16", "query_ptr": "*bf16",
               "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16",
               "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
               "query_start_len_ptr": "*i32"}
    ua_consts = dict(
        num_query_heads=32, num_queries_per_kv=4, BLOCK_SIZE=16, TILE_SIZE=32,
        HEAD_SIZE=128, HEAD_SIZE_PADDED=128, USE_ALIBI_SLOPES=False,
        USE_ALIBI_SQRT=False, USE_QQ_BIAS=True, USE_SOFTCAP=False,
        USE_SINKS=False, SLIDING_WINDOW=0, USE_CAUSAL=True,
        USE_PER_SEQ_CAUSAL=False, USE_MM_PREFIX=False, MAX_MM_RANGES=0,
        R_SWA_WINDOW=0, USE_R_SWA=False, stride_k_cache_3=1, stride_v_cache_3=1,
        BLOCK_Q=4, BLOCK_M=16, NUM_SEGMENTS_PER_SEQ=1, USE_FP8=False,
        IS_3D=False)
    for packed in (False, True):
        sig, consts = {}, dict(ua_consts, QQ_BIAS_PACKED=packed)
        for p in ua.params:
            name = p.name
            if name in consts:
                sig[name] = C
            elif name in ua_ptrs:
                sig[name] = ua_ptrs[name]
            elif name == "qq_bias_ptr":
                sig[name] = "*i32" if packed else "*fp32"
            elif p.is_constexpr or p.default is None:
                # constexpr defaults, and the optional pointers / strides
                # the wrapper passes as None when their branch is dead.
                sig[name] = C
                consts[name] = p.default
            elif name in ("scale", "softcap"):
                sig[name] = "fp32"
            elif name in ("num_seqs", "qq_bias_len"):
                sig[name] = "i32"
            elif name in ("q_scale", "k_scale", "v_scale", "out_scale"):
                sig[name] = C
                consts[name] = None
            else:
                sig[name] = "i64"
        compile_kernel(ua, sig, consts)
    # The split tree attention's kernel over the step's own keys, at the
    # Qwen3-8B (4 queries per KV head, 128) and Qwen3.6-27B (6, 256) shapes,
    # with the tiles `tree_attention` picks.
    import vllm.v1.spec_decode.ddtree.tree_attention as ta

    sta = ta._tree_attention_kernel
    for qpk, heads, head_size, tile, merge, softcap in (
        (4, 32, 128, 16, True, False),
        (4, 32, 128, 32, True, True),
        (6, 24, 256, 16, True, False),
        (6, 24, 256, 16, False, True),
    ):
        consts = dict(
            NUM_QUERY_HEADS=heads, NUM_QUERIES_PER_KV=qpk, BLOCK_SIZE=16,
            TILE_SIZE=tile, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=head_size,
            BLOCK_Q=16 // qpk, BLOCK_M=16, USE_SOFTCAP=softcap,
            MERGE_PREFIX=merge, OUTPUT_LSE=not merge, stride_k_cache_3=1,
            stride_v_cache_3=1)
        sig = {}
        for p in sta.params:
            name = p.name
            if name in consts:
                sig[name] = C
            elif name in ("out_ptr", "query_ptr", "key_cache_ptr",
                          "value_cache_ptr"):
                sig[name] = "*bf16"
            elif name in ("out_lse_ptr", "prefix_lse_ptr"):
                used = merge if name == "prefix_lse_ptr" else not merge
                sig[name] = "*fp32" if used else C
                if not used:
                    consts[name] = None
            elif name.endswith("_ptr"):
                sig[name] = "*i32"
            elif name in ("scale", "softcap"):
                sig[name] = "fp32"
            elif name in ("num_seqs", "mask_len"):
                sig[name] = "i32"
            else:
                sig[name] = "i64"
        compile_kernel(sta, sig, consts)
    gdn_sig = {name: "*bf16" for name in ("a", "b", "q", "k", "v", "o")}
    gdn_sig.update({"A_log": "*fp32", "dt_bias": "*fp32", "state": "*fp32",
                    "state_stride": "i64", "state_idx_ptr": "*i32",
                    "final_state_idx_ptr": "*i32", "query_start_ptr": "*i32",
                    "parent_ptr": "*i64", "parent_stride": "i32",
                    "idx_mapping_ptr": "*i32", "target_ptr": "*i64",
                    "softplus_beta": "fp32", "softplus_threshold": "fp32",
                    "scale": "fp32"})
    for store_final in (False, True):
        compile_kernel(
            tg._tree_gdn_kernel, dict(gdn_sig, **{n: C for n in (
                "NUM_TARGETS", "HAS_TARGETS", "H", "HV", "K", "V", "BK", "BV",
                "MAX_PATH",
                "PATH_BLOCK", "USE_QK_L2NORM_IN_KERNEL", "STORE_OUTPUT",
                "STORE_FINAL")}),
            {"NUM_TARGETS": 1 if store_final else 65, "HAS_TARGETS": store_final,
             "H": 16, "HV": 48, "K": 128, "V": 128, "BK": 128,
             "BV": 32, "MAX_PATH": 16, "PATH_BLOCK": 16,
             "USE_QK_L2NORM_IN_KERNEL": True, "STORE_OUTPUT": not store_final,
             "STORE_FINAL": store_final},
        )
    chunk_sig = {n: t for n, t in gdn_sig.items()
                 if n not in ("final_state_idx_ptr", "target_ptr")}
    for num_nodes, products, apart, inverse, bv in (
        (16, False, 0, "ieee", 64), (16, True, 0, "ieee", 64),
        (16, True, 1, "ieee", 64), (32, True, 1, "ieee", 64),
        (64, True, 1, "ieee", 64), (16, True, 0, "tf32x3", 64),
        (32, True, 0, "ieee", tg.CHUNK_BLOCK_V_BATCHED),
    ):
        compile_kernel(
            tg._tree_gdn_chunk_kernel, dict(chunk_sig, **{n: C for n in (
                "H", "HV", "K", "V", "BK", "BV", "BN", "MAX_PATH", "ROOT_APART",
                "PRODUCTS", "PATH_SQUARINGS", "INVERSE_FACTORS",
                "USE_QK_L2NORM_IN_KERNEL", "DOT_PRECISION", "INVERSE_PRECISION")}),
            {"H": 16, "HV": 48, "K": 128, "V": 128, "BK": 128,
             "BV": bv, "BN": num_nodes, "MAX_PATH": 16,
             "ROOT_APART": apart, "PRODUCTS": products, "PATH_SQUARINGS": 4,
             "INVERSE_FACTORS": 3,
             "USE_QK_L2NORM_IN_KERNEL": True,
             "DOT_PRECISION": "tf32" if products else "ieee",
             "INVERSE_PRECISION": inverse},
        )
    blocked_sig = dict(chunk_sig, u_ws="*fp32", g_ws="*fp32")
    blocked_sig["anc_ws"] = "*i8"
    for block, products, apart, first, inverse in (
        (16, False, 1, False, "ieee"), (32, True, 1, False, "ieee"),
        (32, True, 0, False, "ieee"), (32, True, 1, True, "ieee"),
        (16, False, 0, True, "ieee"), (32, True, 1, True, "tf32x3"),
        (16, True, 1, True, "ieee"),
    ):
        compile_kernel(
            tg._tree_gdn_blocked_kernel, dict(blocked_sig, **{n: C for n in (
                "H", "HV", "K", "V", "BK", "BV", "BC", "MAX_PATH", "PATH_BLOCK",
                "ROOT_APART", "ANCESTORS_FIRST", "BN_ALL", "PATH_SQUARINGS",
                "PRODUCTS", "INVERSE_FACTORS", "USE_QK_L2NORM_IN_KERNEL",
                "DOT_PRECISION", "INVERSE_PRECISION")}),
            {"H": 16, "HV": 48, "K": 128, "V": 128, "BK": 128,
             "BV": tg.CHUNK_BLOCK_V, "BC": block, "MAX_PATH": 16,
             "PATH_BLOCK": 16, "ROOT_APART": apart, "ANCESTORS_FIRST": first,
             "BN_ALL": 64 if first else 1, "PATH_SQUARINGS": 4,
             "PRODUCTS": products,
             "INVERSE_FACTORS": 3,
             "USE_QK_L2NORM_IN_KERNEL": True,
             "DOT_PRECISION": "tf32" if products else "ieee",
             "INVERSE_PRECISION": inverse},
        )
    strides = {n: "i64" for n in (
        "stride_x_tok", "stride_x_dim", "stride_s_seq", "stride_s_dim", "stride_s_tok")}
    conv_sig = dict(strides, x="*bf16", w="*bf16", stride_w_dim="i64",
                    stride_w_width="i64", bias="*bf16", conv_state="*bf16", o="*bf16",
                    state_idx_ptr="*i32", query_start_ptr="*i32", parent_ptr="*i64",
                    parent_stride="i32", idx_mapping_ptr="*i32", dim="i32")
    CONV_CONSTEXPRS = (
        "NUM_TARGETS",
        "KERNEL_WIDTH",
        "WIDTH_BLOCK",
        "HAS_BIAS",
        "SILU_ACTIVATION",
        "BLOCK_N",
    )
    for has_bias in (False, True):
        compile_kernel(
            tc._tree_conv1d_kernel,
            dict(conv_sig, **{n: C for n in CONV_CONSTEXPRS}),
            {"NUM_TARGETS": 65, "KERNEL_WIDTH": 4, "WIDTH_BLOCK": 4,
             "HAS_BIAS": has_bias, "SILU_ACTIVATION": True, "BLOCK_N": 256},
        )
    update_sig = dict(strides, x="*bf16", conv_state="*bf16", state_idx_ptr="*i32",
                      final_state_idx_ptr="*i32", query_start_ptr="*i32",
                      accepted_ptr="*i64", accepted_stride="i32",
                      num_accepted_ptr="*i32", dim="i32")
    compile_kernel(
        tc._tree_conv_state_update_kernel,
        dict(update_sig, **{n: C for n in ("KERNEL_WIDTH", "STATE_BLOCK", "BLOCK_N")}),
        {"KERNEL_WIDTH": 4, "STATE_BLOCK": 4, "BLOCK_N": 256},
    )
    # The one-launch KV compaction (one KV-cache group, bf16 rows moved as
    # 16-bit words), the aux-hidden-state rows and the GDN commit after the
    # walk, the acceptance counters of the measured budget policy.
    import triton.language as tl
    import vllm.v1.spec_decode.ddtree.acceptance as acc
    import vllm.v1.spec_decode.ddtree.gdn_commit as gc
    compile_kernel(
        kk._ddtree_compact_kv_kernel,
        {"layer_base_ptr": "*i64", "slot_mapping_ptr": "*i64",
         "src_row_ptr": "*i64", "dst_row_ptr": "*i64", "num_accepted_ptr": "*i32",
         "stride_block": "i64", "stride_head": "i64", "stride_slot": "i64",
         "stride_elem": "i64", "block_size": "i32", "NUM_HEADS": C,
         "ROW_SIZE": C, "HEAD_BLOCK": C, "ROW_BLOCK": C, "DRAFT_DEPTH": C,
         "ELEM_TYPE": C},
        {"NUM_HEADS": 8, "ROW_SIZE": 128, "HEAD_BLOCK": 8, "ROW_BLOCK": 128,
         "DRAFT_DEPTH": 15, "ELEM_TYPE": tl.int16},
    )
    compile_kernel(
        kk._ddtree_compact_rows_kernel,
        dict({f"t{i}": "*bf16" for i in range(8)}, row_stride="i64",
             num_cols="i32", src_row_ptr="*i64", dst_row_ptr="*i64",
             num_accepted_ptr="*i32", NUM_TENSORS=C, DRAFT_DEPTH=C, BLOCK=C),
        {"NUM_TENSORS": 3, "DRAFT_DEPTH": 15, "BLOCK": 1024},
    )
    commit_common = {"slot_ptr": "*i32", "slot_group_stride": "i32",
                     "slot_stride": "i32", "layer_group_ptr": "*i32",
                     "spec_batch_rows_ptr": "*i32", "spec_query_start_ptr": "*i32",
                     "num_accepted_ptr": "*i32", "src_row_ptr": "*i64",
                     "src_row_stride": "i32", "query_start_loc_ptr": "*i32"}
    for has_bias in (False, True):
        compile_kernel(
            gc._commit_conv_kernel,
            dict(commit_common, x_buf="*bf16", stride_x_layer="i64",
                 stride_x_tok="i64", conv_ptrs="*i64", stride_s_seq="i64",
                 stride_s_dim="i64", stride_s_tok="i64", w_ptrs="*i64",
                 stride_w_dim="i64", stride_w_width="i64", bias_ptrs="*i64",
                 dim="i32", **{n: C for n in (
                     "MAX_PATH", "PATH_BLOCK", "KERNEL_WIDTH", "STATE_BLOCK",
                     "HAS_BIAS", "SILU_ACTIVATION", "CONV_TYPE", "W_TYPE",
                     "BIAS_TYPE", "BLOCK_N")}),
            {"MAX_PATH": 16, "PATH_BLOCK": 16, "KERNEL_WIDTH": 4,
             "STATE_BLOCK": 4, "HAS_BIAS": has_bias, "SILU_ACTIVATION": True,
             "CONV_TYPE": tl.bfloat16, "W_TYPE": tl.bfloat16,
             "BIAS_TYPE": tl.bfloat16, "BLOCK_N": 256},
        )
    compile_kernel(
        gc._commit_gdn_kernel,
        dict(commit_common, x_buf="*bf16", stride_x_layer="i64",
             stride_x_tok="i64", a_buf="*bf16", b_buf="*bf16",
             stride_ab_layer="i64", stride_ab_tok="i64", ssm_ptrs="*i64",
             stride_h_seq="i64", a_log_ptrs="*i64", dt_bias_ptrs="*i64",
             softplus_beta="fp32", softplus_threshold="fp32", **{n: C for n in (
                 "MAX_PATH", "H", "HV", "K", "V", "BK", "BV",
                 "USE_QK_L2NORM_IN_KERNEL", "SSM_TYPE", "A_TYPE", "DT_TYPE")}),
        {"MAX_PATH": 16, "H": 16, "HV": 48, "K": 128, "V": 128, "BK": 128,
         "BV": 32, "USE_QK_L2NORM_IN_KERNEL": True, "SSM_TYPE": tl.float32,
         "A_TYPE": tl.float32, "DT_TYPE": tl.float32},
    )
    for budget in (16, 64, 256):
        compile_kernel(
            acc._count_accepted_ranks_kernel,
            {"counts_ptr": "*i64", "num_accepted_ptr": "*i32",
             "src_row_ptr": "*i64", "src_row_stride": "i32",
             "query_start_loc_ptr": "*i32", "cu_num_logits_ptr": "*i32",
             "BUDGET": C, "PATH_LEN": C, "PATH_BLOCK": C, "BLOCK": C},
            {"BUDGET": budget, "PATH_LEN": 16, "PATH_BLOCK": 16,
             "BLOCK": budget},
        )
    print("\\n".join(failures) or "all compiled")
    sys.exit(1 if failures else 0)
    """
)


def test_ddtree_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
