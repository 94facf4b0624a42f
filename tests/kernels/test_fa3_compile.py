"""Every kernel of ``specmeta.kernels`` compiles for a real GPU (sm_90), checked on any machine.

The CPU tier runs kernels under Triton's interpreter, which accepts things the compiler
rejects (plain Python globals, loop-carried type changes, mixed 32/64-bit values).
``triton.compile`` needs no GPU to lower a kernel to PTX, so each kernel is compiled in a
subprocess with the interpreter off. One list, :data:`KERNELS`, drives the check; a test makes
sure it names every ``@triton.jit`` kernel of the package.

Each entry compiles with 32-bit scalar arguments (what a launch with small sizes passes) and, as
a second variant, with every scalar 64-bit (what Triton passes for a stride or size at or above
2**31): both must lower.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import subprocess
import sys
import textwrap

import specmeta.kernels as kernels_pkg
from specmeta.kernels._page_tables import NO_EXPAND, NO_NORMAL

# (module, kernel, {constexpr, or argument passed None: value}, {pointer argument: element type
# other than i32})
_PAGED = dict(PAGED=True, PAGE_SIZE=16)
_FLAT = dict(PAGED=False, PAGE_SIZE=1)
# The page-table kernel's arguments that draft_decode_page_tables passes None.
_CASCADE = dict(extra_tokens=None, fill_value=None, num_rows=None, stride_cs=None, stride_cu=None)
# Target verify without and with per-request verify lengths (ragged verify, design §3.2-§3.3):
# the uniform launch passes verify_lens_ptr None, so its signature is the one before them.
_UNIFORM = dict(verify_lens_ptr=None, HAS_VERIFY_LENS=False)
_RAGGED = dict(HAS_VERIFY_LENS=True)
# The id spaces of design §2.10 in the FA3 page-table kernels: a plain row passes no map (its
# arguments None); rows of page ids read through a virtual -> physical map.
_PLAIN_ROWS = dict(v2p_ptr=None, num_pages=None, ENTRY_PAGE_SIZE=1, TRANSLATE=False)
_PAGE_ROWS = dict(ENTRY_PAGE_SIZE=16, TRANSLATE=True)
_PLAIN_SLOTS = dict(page_size=None, **_PLAIN_ROWS)
# Accept compaction over uniform windows passes qo_indptr_ptr and n_slots None (design §2.4).
_UNIFORM_ACCEPT = dict(qo_indptr_ptr=None, n_slots=None, RAGGED=False)
# Sliding-window layers (design §2.10): a full layer passes no full -> window pool map (its
# arguments None) and, in the verify lists and the mask, no rail.
_NO_MAP = dict(full_to_swa_ptr=None, full_size=None, TO_WINDOW=False)
_FULL_LAYER = dict(rail=None, WINDOW_LAYER=False, **_NO_MAP)
_NO_RAIL = dict(rail=None, RAIL=False)
KERNELS = [
    ("host_lengths", "_check_host_lengths_kernel", dict(BLOCK=1024), dict(slot_ptr="i64")),
    ("host_list_lengths", "_check_host_list_lengths_kernel", dict(BLOCK=4096),
     dict(slot_ptr="i64")),
    ("tree_ancestor_kv_indices", "_tree_ancestor_counts_kernel", dict(BLOCK_N=16),
     dict(tree_mask_ptr="u8")),
    ("tree_ancestor_kv_indices", "_tree_ancestor_kv_indices_kernel",
     dict(BLOCK_N=16, BLOCK_S=1024, **_PLAIN_SLOTS), dict(tree_mask_ptr="u8")),
    ("tree_ancestor_kv_indices", "_tree_ancestor_kv_indices_kernel",
     dict(BLOCK_N=16, BLOCK_S=1024, **_PAGE_ROWS), dict(tree_mask_ptr="u8", v2p_ptr="i64")),
    ("verify_lens", "_pad_verify_lens_to_bucket_kernel", dict(BLOCK=256),
     dict(verify_lens_ptr="i64")),
    ("draft_cache_locs", "_assign_draft_cache_locs_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, ENTRY_PAGE_SIZE=1, TRANSLATE=False, BLOCK=16,
          WRITE_POSITIONS=True, HAS_STATUS=True, **_NO_MAP),
     dict(out_cache_loc_ptr="i64")),
    ("draft_cache_locs", "_assign_draft_cache_locs_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, ENTRY_PAGE_SIZE=16, TRANSLATE=True, BLOCK=16,
          WRITE_POSITIONS=False, HAS_STATUS=True, **_NO_MAP),
     dict(out_cache_loc_ptr="i64", v2p_ptr="i64")),
    ("draft_cache_locs", "_assign_draft_cache_locs_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, ENTRY_PAGE_SIZE=16, TRANSLATE=True, BLOCK=16,
          WRITE_POSITIONS=False, HAS_STATUS=True, TO_WINDOW=True),
     dict(out_cache_loc_ptr="i64", v2p_ptr="i64", full_to_swa_ptr="i64")),
    ("draft_decode_kv_ids", "_draft_decode_kv_ids_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, ENTRY_PAGE_SIZE=1, TRANSLATE=False, BLOCK=1024,
          BLOCK_B=1024, BLOCK_S=4, **_NO_MAP), {}),
    ("draft_decode_kv_ids", "_draft_decode_kv_ids_kernel",
     dict(TOPK=1, NUM_STEPS=3, LAYOUT_B=False, ENTRY_PAGE_SIZE=64, TRANSLATE=True, BLOCK=1024,
          BLOCK_B=1024, BLOCK_S=4, **_NO_MAP), dict(v2p_ptr="i64", req_to_token_ptr="i64")),
    ("draft_decode_kv_ids", "_draft_decode_kv_ids_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, ENTRY_PAGE_SIZE=1, TRANSLATE=True, BLOCK=1024,
          BLOCK_B=1024, BLOCK_S=4, TO_WINDOW=True), dict(v2p_ptr="i64", full_to_swa_ptr="i64")),
    ("draft_cache_locs", "_prefix_tail_copy_pairs_kernel",
     dict(TOPK=4, NUM_STEPS=3, ENTRY_PAGE_SIZE=1, TRANSLATE=False, BLOCK=64, HAS_STATUS=True),
     {}),
    ("draft_cache_locs", "_prefix_tail_copy_pairs_kernel",
     dict(TOPK=4, NUM_STEPS=3, ENTRY_PAGE_SIZE=16, TRANSLATE=True, BLOCK=64, HAS_STATUS=True),
     dict(v2p_ptr="i64")),
    ("draft_decode_kv_indices", "_draft_decode_kv_indices_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=False, BLOCK=1024, BLOCK_B=1024, BLOCK_LISTS=8,
          BLOCK_EDGE=16, VEC=4, HAS_STATUS=True), {}),
    ("verify_kv_indices", "_verify_kv_indices_kernel",
     dict(BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, ENTRY_PAGE_SIZE=1, TRANSLATE=False,
          **_UNIFORM, **_FULL_LAYER), {}),
    ("verify_kv_indices", "_verify_kv_indices_kernel",
     dict(BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, ENTRY_PAGE_SIZE=1, TRANSLATE=False,
          **_RAGGED, **_FULL_LAYER), dict(verify_lens_ptr="i64")),
    ("verify_kv_indices", "_verify_kv_indices_kernel",
     dict(BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, ENTRY_PAGE_SIZE=16, TRANSLATE=True,
          **_UNIFORM, **_FULL_LAYER), dict(v2p_ptr="i64")),
    ("verify_kv_indices", "_verify_kv_indices_kernel",
     dict(BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, ENTRY_PAGE_SIZE=16, TRANSLATE=True,
          WINDOW_LAYER=True, TO_WINDOW=True, **_UNIFORM),
     dict(v2p_ptr="i64", full_to_swa_ptr="i64")),
    ("shared_prefix_kv_indices", "_shared_prefix_kv_indices_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, BLOCK=1024, BLOCK_B=1024, BLOCK_CHAIN=64,
          BLOCK_PTR=16, BLOCK_ROWS=4, ENTRY_PAGE_SIZE=1, TRANSLATE=False, HAS_STATUS=True,
          v2p_ptr=None), {}),
    ("shared_prefix_kv_indices", "_shared_prefix_kv_indices_kernel",
     dict(TOPK=4, NUM_STEPS=3, LAYOUT_B=True, BLOCK=1024, BLOCK_B=1024, BLOCK_CHAIN=64,
          BLOCK_PTR=16, BLOCK_ROWS=4, ENTRY_PAGE_SIZE=16, TRANSLATE=True, HAS_STATUS=True),
     dict(v2p_ptr="i64")),
    ("branch_page_table", "_branch_page_table_kernel",
     dict(TOPK=4, NUM_STEPS=3, BLOCK=256, BLOCK_PTR=16, HAS_STATUS=True, **_PLAIN_ROWS), {}),
    ("branch_page_table", "_branch_page_table_kernel",
     dict(TOPK=4, NUM_STEPS=3, BLOCK=256, BLOCK_PTR=16, HAS_STATUS=True, **_PAGE_ROWS),
     dict(v2p_ptr="i64", req_to_token_ptr="i64")),
    ("branch_kv_indices", "_branch_kv_indices_kernel",
     dict(TOPK=4, NUM_STEPS=3, BLOCK=256, BLOCK_B=256, BLOCK_ROWS=4, BLOCK_K=4, HAS_STATUS=True,
          v2p_ptr=None, ENTRY_PAGE_SIZE=1, TRANSLATE=False), {}),
    ("branch_kv_indices", "_branch_kv_indices_kernel",
     dict(TOPK=4, NUM_STEPS=3, BLOCK=256, BLOCK_B=256, BLOCK_ROWS=4, BLOCK_K=4, HAS_STATUS=True,
          ENTRY_PAGE_SIZE=16, TRANSLATE=True), dict(v2p_ptr="i64", req_to_token_ptr="i64")),
    ("tree_custom_mask", "_tree_custom_mask_kernel",
     dict(PACKED=True, BLOCK=256, BLOCK_B=1024, HAS_STATUS=True, **_UNIFORM, **_NO_RAIL),
     dict(tree_mask_ptr="u8", custom_mask_ptr="u8", seq_lens_ptr="i64")),
    ("tree_custom_mask", "_tree_custom_mask_kernel",
     dict(PACKED=False, BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, **_UNIFORM, **_NO_RAIL),
     dict(tree_mask_ptr="u8", custom_mask_ptr="u8")),
    ("tree_custom_mask", "_tree_custom_mask_kernel",
     dict(PACKED=True, BLOCK=256, BLOCK_B=1024, HAS_STATUS=True, **_RAGGED, **_NO_RAIL),
     dict(tree_mask_ptr="u8", custom_mask_ptr="u8", seq_lens_ptr="i64", verify_lens_ptr="i64")),
    ("tree_custom_mask", "_tree_custom_mask_kernel",
     dict(PACKED=False, BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, **_RAGGED, **_NO_RAIL),
     dict(tree_mask_ptr="u8", custom_mask_ptr="u8")),
    ("tree_custom_mask", "_tree_custom_mask_kernel",
     dict(PACKED=True, BLOCK=256, BLOCK_B=1024, HAS_STATUS=True, RAIL=True, **_UNIFORM),
     dict(tree_mask_ptr="u8", custom_mask_ptr="u8", seq_lens_ptr="i64")),
    ("tree_custom_mask", "_tree_custom_mask_kernel",
     dict(PACKED=False, BLOCK=1024, BLOCK_B=1024, HAS_STATUS=True, RAIL=True, **_UNIFORM),
     dict(tree_mask_ptr="u8", custom_mask_ptr="u8")),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXCLUDE_LAST_PARTIAL=True, **_PAGED, BLOCK=1024, BLOCK_B=1024, VEC_IN=1,
          VEC_OUT=4, WRITE_CU=True, HAS_STATUS=True, **_PLAIN_ROWS, **_FULL_LAYER, **NO_EXPAND), {}),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXCLUDE_LAST_PARTIAL=True, **_FLAT, BLOCK=1024, BLOCK_B=1024, VEC_IN=4,
          VEC_OUT=4, WRITE_CU=True, HAS_STATUS=True, **_PLAIN_ROWS, **_FULL_LAYER, **NO_EXPAND), {}),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXCLUDE_LAST_PARTIAL=False, **_PAGED, BLOCK=1024, BLOCK_B=1024, VEC_IN=1,
          VEC_OUT=4, WRITE_CU=True, HAS_STATUS=True, **_PAGE_ROWS, **_FULL_LAYER, **NO_EXPAND),
     dict(v2p_ptr="i64", req_to_token_ptr="i64")),
    ("_page_tables", "page_tables_kernel",
     dict(EXPAND=True, TOPK=4, NUM_STEPS=5, **_PAGED, BLOCK_K=4, BLOCK_S=8, BLOCK_W=8,
          BLOCK_B=1024, WRITE_EXPAND_CU=True, HAS_STATUS=True, **NO_NORMAL), {}),
    ("_page_tables", "page_tables_kernel",
     dict(EXPAND=True, TOPK=4, NUM_STEPS=5, **_FLAT, BLOCK_K=4, BLOCK_S=8, BLOCK_W=8,
          BLOCK_B=1024, WRITE_EXPAND_CU=True, HAS_STATUS=True, **NO_NORMAL), {}),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXPAND=True, EXCLUDE_LAST_PARTIAL=True, **_PAGED, BLOCK=1024,
          BLOCK_B=1024, TOPK=8, NUM_STEPS=5, BLOCK_K=8, BLOCK_S=8, BLOCK_W=8, VEC_IN=1,
          VEC_OUT=4, WRITE_CU=True, WRITE_EXPAND_CU=True, HAS_STATUS=True, **_CASCADE,
          **_PLAIN_ROWS, **_FULL_LAYER), {}),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXPAND=True, EXCLUDE_LAST_PARTIAL=True, **_FLAT, BLOCK=1024,
          BLOCK_B=1024, TOPK=8, NUM_STEPS=5, BLOCK_K=8, BLOCK_S=8, BLOCK_W=8, VEC_IN=4,
          VEC_OUT=4, WRITE_CU=True, WRITE_EXPAND_CU=True, HAS_STATUS=True, **_CASCADE,
          **_PLAIN_ROWS, **_FULL_LAYER), {}),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXPAND=True, EXCLUDE_LAST_PARTIAL=True, **_PAGED, BLOCK=1024,
          BLOCK_B=1024, TOPK=8, NUM_STEPS=5, BLOCK_K=8, BLOCK_S=8, BLOCK_W=8, VEC_IN=1,
          VEC_OUT=4, WRITE_CU=True, WRITE_EXPAND_CU=True, HAS_STATUS=True, **_CASCADE,
          **_PAGE_ROWS, **_FULL_LAYER), dict(v2p_ptr="i64")),
    # A window layer's tables (design §2.10): the rail and the map, plain rows and virtual ones.
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXCLUDE_LAST_PARTIAL=False, **_PAGED, BLOCK=1024, BLOCK_B=1024, VEC_IN=1,
          VEC_OUT=4, WRITE_CU=True, HAS_STATUS=True, **_PLAIN_ROWS, WINDOW_LAYER=True,
          TO_WINDOW=True, **NO_EXPAND), dict(full_to_swa_ptr="i64")),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXCLUDE_LAST_PARTIAL=False, **_FLAT, BLOCK=1024, BLOCK_B=1024, VEC_IN=4,
          VEC_OUT=4, WRITE_CU=True, HAS_STATUS=True, **_PAGE_ROWS, WINDOW_LAYER=True,
          TO_WINDOW=True, **NO_EXPAND), dict(v2p_ptr="i64", full_to_swa_ptr="i64")),
    ("_page_tables", "page_tables_kernel",
     dict(NORMAL=True, EXPAND=True, EXCLUDE_LAST_PARTIAL=True, **_PAGED, BLOCK=1024,
          BLOCK_B=1024, TOPK=8, NUM_STEPS=5, BLOCK_K=8, BLOCK_S=8, BLOCK_W=8, VEC_IN=1,
          VEC_OUT=4, WRITE_CU=True, WRITE_EXPAND_CU=True, HAS_STATUS=True, **_CASCADE,
          **_PLAIN_ROWS, WINDOW_LAYER=True, TO_WINDOW=True), dict(full_to_swa_ptr="i64")),
    ("verify_expand_page_table", "_verify_expand_page_table_kernel",
     dict(BLOCK_N=8, BLOCK_T=4, WRITE_CU0=True, HAS_STATUS=True, **_UNIFORM, **_PLAIN_SLOTS),
     dict(tree_mask_ptr="u8")),
    ("verify_expand_page_table", "_verify_expand_page_table_kernel",
     dict(BLOCK_N=8, BLOCK_T=4, WRITE_CU0=True, HAS_STATUS=True, **_RAGGED, **_PLAIN_SLOTS),
     dict(tree_mask_ptr="u8", verify_lens_ptr="i64")),
    ("verify_expand_page_table", "_verify_expand_page_table_kernel",
     dict(BLOCK_N=8, BLOCK_T=4, WRITE_CU0=True, HAS_STATUS=True, **_RAGGED, **_PAGE_ROWS),
     dict(tree_mask_ptr="u8", verify_lens_ptr="i64", v2p_ptr="i64")),
    ("accept_cache_locs", "_accept_cache_locs_kernel",
     dict(BLOCK_B=128, BLOCK_C=8, BLOCK_TAIL=1024, TRANSLATE=False, HAS_STATUS=True,
          **_UNIFORM_ACCEPT), {}),
    ("accept_cache_locs", "_accept_cache_locs_kernel",
     dict(BLOCK_B=128, BLOCK_C=8, BLOCK_TAIL=1024, TRANSLATE=True, HAS_STATUS=True,
          **_UNIFORM_ACCEPT),
     dict(v2p_ptr="i64", out_cache_loc_ptr="i64", tgt_ptr="i64", src_ptr="i64")),
    ("accept_cache_locs", "_accept_cache_locs_kernel",
     dict(BLOCK_B=128, BLOCK_C=8, BLOCK_TAIL=1024, TRANSLATE=True, HAS_STATUS=True,
          RAGGED=True),
     dict(v2p_ptr="i64", qo_indptr_ptr="i64", tgt_ptr="i64", src_ptr="i64")),
    ("cache_loc_move", "_move_kv_cache_kernel",
     dict(BLOCK_N=64, COLS=64, TABLE=True, WORD_BYTES=8, VEC=2, HAS_STATUS=True),
     dict(table_ptr="i64", buf_ptr="i64", tgt_ptr="i64", src_ptr="i64")),
    ("cache_loc_move", "_move_kv_cache_kernel",
     dict(BLOCK_N=64, COLS=64, TABLE=False, WORD_BYTES=4, VEC=4, HAS_STATUS=True),
     dict(table_ptr="i32", buf_ptr="i32")),
    ("merge_state", "_merge_state_kernel",
     dict(BLOCK_H=4, BLOCK_D=128, HAS_LSE_OUT=True),
     dict(o1_ptr="fp16", o2_ptr="fp16", out_ptr="fp16", lse1_ptr="fp32", lse2_ptr="fp32",
          out_lse_ptr="fp32")),
    ("runners.padding", "_copy_pad_kernel", dict(BLOCK=1024), dict(src_ptr="i64", dst_ptr="i64")),
    ("runners.padding", "_copy_pad_many_kernel", dict(NBUF=3, BLOCK=1024),
     dict(src0="i64", dst0="i64", src1="i32", dst1="i32", src2="u8", dst2="u8", src3="i64",
          dst3="i64")),
    ("verify_expand_page_table", "inclusive_sums_kernel", dict(BLOCK=1024), {}),
    ("verify_expand_ragged", "_verify_expand_ragged_kernel",
     dict(BLOCK_N=8, BLOCK_W=8, BLOCK_F=16, CHAIN=False, WRITE_CU0=True, **_PLAIN_SLOTS),
     dict(tree_mask_ptr="u8", qo_indptr_ptr="i32")),
    ("verify_expand_ragged", "_verify_expand_ragged_kernel",
     dict(BLOCK_N=8, BLOCK_W=8, BLOCK_F=16, CHAIN=True, WRITE_CU0=True, **_PLAIN_SLOTS),
     dict(tree_mask_ptr="i32", qo_indptr_ptr="i32")),
    ("verify_expand_ragged", "_verify_expand_ragged_kernel",
     dict(BLOCK_N=8, BLOCK_W=8, BLOCK_F=16, CHAIN=False, WRITE_CU0=True, **_PAGE_ROWS),
     dict(tree_mask_ptr="u8", qo_indptr_ptr="i32", v2p_ptr="i64")),
]  # fmt: skip

#: Compiles every kernel of ``KERNELS`` (argv[1], JSON) for sm_90, from the package under
#: argv[2] (default: the installed one), and prints ``{"<kernel> <consts> <scalars>": PTX or
#: "COMPILE ERROR ..."}`` as JSON. ``scripts/ptx_compare.py`` runs it too.
COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    if len(sys.argv) > 2:
        sys.path.insert(0, sys.argv[2])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from importlib import import_module  # the package re-exports functions of the same names

    out = {}
    for module, name, consts, ptr_types in json.loads(sys.argv[1]):
        path = "specmeta." + (module if "." in module else "kernels." + module)
        fn = getattr(import_module(path), name, None)
        for scalar in ("i32", "i64"):
            key = f"{module}.{name} {json.dumps(consts, sort_keys=True)} {scalar}"
            if fn is None:
                out[key] = "MISSING"
                continue
            sig = {}
            for p in fn.params:
                if p.is_constexpr or p.name in consts:  # an argument passed None is one too
                    sig[p.name] = "constexpr"
                elif p.name in ptr_types or (p.name.endswith("_ptr") and not p.name.startswith("stride")):
                    sig[p.name] = "*" + ptr_types.get(p.name, "i32")
                else:
                    sig[p.name] = scalar
            names = list(sig)
            constexprs = {(names.index(c),): v for c, v in consts.items()}
            try:  # report every kernel that fails, not only the first
                kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                        target=GPUTarget("cuda", 90, 32))
                out[key] = kernel.asm.get("ptx") or "COMPILE ERROR: no PTX"
            except Exception as exc:
                out[key] = f"COMPILE ERROR: {exc}"
    print(json.dumps(out))
    """
)


def _jit_kernels() -> set[tuple[str, str]]:
    """``(module, name)`` of every ``*_kernel`` JIT function defined in specmeta/kernels/ (as
    ``"<op>"``) and specmeta/runners/ (as ``"runners.<module>"``)."""
    found = set()
    root = pathlib.Path(kernels_pkg.__file__).parent.parent
    for package, prefix in (("kernels", ""), ("runners", "runners.")):
        for path in (root / package).glob("*.py"):
            module = importlib.import_module(f"specmeta.{package}.{path.stem}")
            for name, value in vars(module).items():
                fn = getattr(value, "fn", None)  # a JITFunction, or the interpreter's stand-in
                if name.endswith("_kernel") and getattr(fn, "__module__", None) == module.__name__:
                    found.add((prefix + path.stem, name))
    return found


def test_the_list_names_every_kernel():
    listed = {(module, name) for module, name, _c, _p in KERNELS}
    found = _jit_kernels()
    assert listed == found, f"missing {found - listed}, stale {listed - found}"


def test_kernels_compile_for_sm90(device):
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(KERNELS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(ptx) == 2 * len(KERNELS)
    failures = [f"{key}: {text[:300]}" for key, text in ptx.items() if not text.startswith("//")]
    assert not failures, " | ".join(failures)
