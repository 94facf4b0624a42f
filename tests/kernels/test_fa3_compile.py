"""The FA3 page-table kernels compile for a real GPU (sm_90), checked on any machine.

The CPU tier runs kernels under Triton's interpreter, which accepts things the compiler
rejects (plain Python globals, loop-carried type changes). ``triton.compile`` needs no GPU to
lower a kernel to PTX, so each kernel is compiled in a subprocess with the interpreter off.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from importlib import import_module  # the package re-exports functions of the same names
    prefix_page_table = import_module("specmeta.kernels.prefix_page_table")
    expand_page_table = import_module("specmeta.kernels.expand_page_table")
    verify_expand_page_table = import_module("specmeta.kernels.verify_expand_page_table")
    draft_decode_page_tables = import_module("specmeta.kernels.draft_decode_page_tables")

    def compile_one(which, variant):
        sizes = dict(
            prefix=["B", "R", "W_row", "stride_row", "extra_tokens", "fill_value",
                    "num_rows", "W", "stride_pt", "stride_cs", "stride_cu", "chunk_programs"],
            expand=["B", "num_rows", "W", "stride_pt_s", "stride_pt_r", "stride_cs",
                    "stride_cu"],
            verify=["B", "R", "W_row", "stride_row", "N", "W", "stride_pt", "stride_mb", "stride_mj"],
            fused=["B", "R", "W_row", "stride_row", "W", "stride_pt", "chunk_programs", "num_rows",
                   "W_expand", "stride_ept_s", "stride_ept_r", "stride_ecs", "stride_ecu"],
        )[which]
        fn, ptrs, consts = dict(
            prefix=(prefix_page_table._prefix_page_table_kernel,
                    ["req_pool_indices_ptr", "req_to_token_ptr", "seq_lens_ptr", "page_table_ptr",
                     "cache_seqlens_ptr", "cu_seqlens_k_ptr", "status_ptr"],
                    dict(EXCLUDE_LAST_PARTIAL=True, PAGED=variant == "paged",
                         PAGE_SIZE=16 if variant == "paged" else 1, BLOCK=1024,
                         BLOCK_B=1024, VEC_IN=1 if variant == "paged" else 4, VEC_OUT=4,
                         WRITE_CU=True, HAS_STATUS=True)),
            expand=(expand_page_table._expand_page_table_kernel,
                    ["out_cache_loc_ptr", "seq_lens_ptr", "page_table_ptr", "cache_seqlens_ptr",
                     "cu_seqlens_k_ptr", "status_ptr"],
                    dict(TOPK=4, NUM_STEPS=5, PAGED=variant == "paged",
                         PAGE_SIZE=16 if variant == "paged" else 1, BLOCK_K=4, BLOCK_S=8, BLOCK_W=8,
                         BLOCK_B=1024, WRITE_CU=True, HAS_STATUS=True)),
            verify=(verify_expand_page_table._verify_expand_page_table_kernel,
                    ["req_pool_indices_ptr", "req_to_token_ptr", "seq_lens_ptr", "tree_mask_ptr",
                     "page_table_ptr", "cache_seqlens_ptr", "cu_seqlens_k_ptr", "status_ptr"],
                    dict(BLOCK_N=8, BLOCK_T=4, WRITE_CU0=True, HAS_STATUS=True)),
            fused=(draft_decode_page_tables._draft_decode_page_tables_kernel,
                   ["req_pool_indices_ptr", "req_to_token_ptr", "seq_lens_ptr", "out_cache_loc_ptr",
                    "page_table_ptr", "cache_seqlens_ptr", "cu_seqlens_k_ptr",
                    "expand_page_table_ptr", "expand_cache_seqlens_ptr", "expand_cu_seqlens_k_ptr",
                    "status_ptr"],
                   dict(EXCLUDE_LAST_PARTIAL=True, PAGED=variant == "paged",
                        PAGE_SIZE=16 if variant == "paged" else 1, BLOCK=1024, BLOCK_B=1024,
                        TOPK=8, NUM_STEPS=5, BLOCK_K=8, BLOCK_S=8, BLOCK_W=8,
                        VEC_IN=1 if variant == "paged" else 4, VEC_OUT=4, WRITE_CU=True,
                        WRITE_EXPAND_CU=True, HAS_STATUS=True)),
        )[which]
        sig = {p: ("*u8" if p == "tree_mask_ptr" else "*i32") for p in ptrs}
        sig.update({n: "i32" for n in sizes})
        sig.update({c: "constexpr" for c in consts})
        names = list(sig)
        constexprs = {(names.index(c),): v for c, v in consts.items()}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32))
        assert "ptx" in kernel.asm

    failures = []
    for which, variant in [("prefix", "paged"), ("prefix", "flat"), ("expand", "paged"),
                           ("expand", "flat"), ("verify", "-"), ("fused", "paged"),
                           ("fused", "flat")]:
        try:
            compile_one(which, variant)
        except Exception as exc:  # report every kernel that fails, not only the first
            failures.append(f"{which}/{variant}: {exc}")
    assert not failures, " | ".join(failures)
    """
)


def test_kernels_compile_for_sm90(device):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
