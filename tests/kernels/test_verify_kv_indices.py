"""verify_kv_indices against its reference and against design §3.3 read directly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmeta import Status, new_status
from specmeta.config import verify_kv_indices_need
from specmeta.kernels.verify_kv_indices import verify_kv_indices, verify_kv_indices_ref
from specmeta.workloads import SHAPES, make_batch
from tests._support import row_width
from tests.guard_bands import Guarded, assert_equal

CONFIGS = [(1, 3, 1, 4), (4, 3, 1, 8), (2, 4, 4, 6), (3, 5, 16, 12)]  # (K, S, ps, N)


def _run(batch, device, extra, *, width=None, idx_dtype=torch.int32, with_sum=True):
    B = batch.batch_size
    need = verify_kv_indices_need(batch.seq_lens_sum, B, extra)
    width = need + 5 if width is None else width
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    kw = dict(extra_tokens=extra, seq_lens_sum=batch.seq_lens_sum if with_sum else None)
    idx = Guarded((width,), idx_dtype, device)
    ptr = Guarded((B + 1,), torch.int32, device)
    status = new_status(device)
    verify_kv_indices(*args, kv_indices=idx.view, kv_indptr=ptr.view, status=status, **kw)
    ref_idx, ref_ptr, ref_status = idx.view.clone().fill_(-3), ptr.view.clone(), new_status(device)
    verify_kv_indices_ref(*args, kv_indices=ref_idx, kv_indptr=ref_ptr, status=ref_status, **kw)
    idx.assert_intact("kv_indices")
    ptr.assert_intact("kv_indptr")
    assert_equal(ptr.view, ref_ptr, f"kv_indptr [{batch.describe()}]")
    used = min(need, width)
    assert_equal(idx.view[:used], ref_idx[:used], f"kv_indices [{batch.describe()}]")
    assert_equal(status, ref_status, "status")
    return idx.view, ptr.view, status


def _check_against_spec(batch, idx, ptr, extra):
    """kv_indptr = [0, cumsum(L + N)]; request b's list is row_b[0 : L_b + N] (design §3.3)."""
    idx, ptr, r2t = idx.cpu(), ptr.cpu(), batch.req_to_token.cpu()
    assert int(ptr[0]) == 0
    for b in range(batch.batch_size):
        L = int(batch.seq_lens_cpu[b])
        row = r2t[int(batch.req_pool_indices[b])].long()
        lo, hi = int(ptr[b]), int(ptr[b + 1])
        assert hi - lo == L + extra
        assert torch.equal(idx[lo:hi].long(), row[: L + extra]), f"request {b}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k,s,ps,n", CONFIGS)
def test_matches_reference_over_workloads(device, gen, shape, k, s, ps, n):
    batch = make_batch(shape, topk=k, num_steps=s, page_size=ps, row_width=row_width(k, s, ps, extra=n),
                       generator=gen, device=device, extra_tokens=n)  # fmt: skip
    idx, ptr, status = _run(batch, device, n)
    assert int(status) == 0
    _check_against_spec(batch, idx, ptr, n)


def test_spec_example(device):
    r2t = torch.zeros(3, 16, dtype=torch.int32, device=device)
    r2t[1] = torch.arange(100, 116)
    r2t[2] = torch.arange(200, 216)
    rpi, sl = torch.tensor([1, 2], device=device), torch.tensor([3, 1], device=device)
    idx, ptr = verify_kv_indices(rpi, r2t, sl, extra_tokens=2)
    assert ptr.tolist() == [0, 5, 8]
    assert idx[:8].tolist() == [100, 101, 102, 103, 104, 200, 201, 202]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    b=st.integers(0, 9),
    n=st.integers(0, 9),
    ps=st.sampled_from([1, 4, 64]),
    shape=st.sampled_from(["mod0", "modm1", "random", "near_row_end", "long_short"]),
    seed=st.integers(0, 2**31 - 1),
    idx64=st.booleans(),
)
def test_property(device, b, n, ps, shape, seed, idx64):
    batch = make_batch(shape, batch_size=b, topk=2, num_steps=2, page_size=ps,
                       row_width=row_width(2, 2, ps, extra=n, prefix=2 * ps + 8), extra_tokens=n,
                       generator=torch.Generator().manual_seed(seed), device=device)  # fmt: skip
    idx, ptr, status = _run(batch, device, n, idx_dtype=torch.int64 if idx64 else torch.int32)
    assert int(status) == 0
    _check_against_spec(batch, idx, ptr, n)


def test_empty_batch_writes_entry_zero(device, gen):
    batch = make_batch("empty", topk=2, num_steps=3, page_size=1, row_width=64, generator=gen,
                       device=device)  # fmt: skip
    _, ptr, status = _run(batch, device, 4)
    assert ptr.tolist() == [0] and int(status) == 0


def test_too_small_buffer_without_host_total_is_masked(device, gen):
    batch = make_batch("max", batch_size=3, topk=2, num_steps=3, page_size=4, extra_tokens=5,
                       row_width=row_width(2, 3, 4, extra=5), generator=gen, device=device)  # fmt: skip
    need = verify_kv_indices_need(batch.seq_lens_sum, 3, 5)
    _, _, status = _run(batch, device, 5, width=need // 2, with_sum=False)
    assert int(status) == int(Status.OUT_OF_CAPACITY)


def test_out_of_range_inputs_are_masked(device, gen):
    batch = make_batch("random", batch_size=5, topk=2, num_steps=3, page_size=16, extra_tokens=4,
                       row_width=row_width(2, 3, 16, extra=4), generator=gen, device=device)  # fmt: skip
    R, W = batch.req_to_token.shape
    batch.req_pool_indices[0] = R
    batch.seq_lens[2] = W - 2  # the verify window runs past the row
    batch.seq_lens_cpu[2] = W - 2
    idx, ptr, status = _run(batch, device, 4)
    assert int(status) == int(Status.ROW_OOB | Status.POS_OOB)
    # The bad row's list reads the sink; the window past the row reads the sink too.
    lo, hi = int(ptr[0]), int(ptr[1])
    assert idx[lo:hi].eq(0).all()
    assert idx[int(ptr[3]) - 2 : int(ptr[3])].eq(0).all()


def test_bad_input_raises_before_launch(device, gen):
    batch = make_batch("random", batch_size=4, topk=2, num_steps=3, page_size=1, row_width=64,
                       extra_tokens=4, generator=gen, device=device)  # fmt: skip
    args = (batch.req_pool_indices, batch.req_to_token, batch.seq_lens)
    need = verify_kv_indices_need(batch.seq_lens_sum, 4, 4)
    small = torch.zeros(need - 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=f"need {need} entries"):
        verify_kv_indices(*args, extra_tokens=4, kv_indices=small, seq_lens_sum=batch.seq_lens_sum)
    with pytest.raises(ValueError, match="kv_indptr is too small"):
        verify_kv_indices(
            *args, extra_tokens=4, kv_indptr=torch.zeros(4, dtype=torch.int32, device=device)
        )
    with pytest.raises(ValueError, match="extra_tokens"):
        verify_kv_indices(*args, extra_tokens=-1)
    with pytest.raises(TypeError, match="kv_indices"):
        verify_kv_indices(*args, extra_tokens=4, kv_indices=torch.zeros(512, device=device))
    with pytest.raises(ValueError, match="seq_lens"):
        verify_kv_indices(
            batch.req_pool_indices, batch.req_to_token, batch.seq_lens[:2], extra_tokens=4
        )


# The interpreter accepts what the compiler rejects (plain globals, loop-carried type changes):
# every kernel of this issue is lowered to sm_90 PTX with the interpreter off, in a subprocess
# (triton.compile needs no GPU). One subprocess for all five ops keeps the CPU tier quick.
_COMPILE_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from importlib import import_module

def compile_kernel(fn, ptrs, sizes, consts):
    types = {}
    for p in ptrs:
        name, ty = (p.split(":") + ["*i32"])[:2]
        types[name] = ty
    types.update({n: "i32" for n in sizes})
    types.update({c: "constexpr" for c in consts})  # an argument passed None is one too
    sig = {p.name: types[p.name] for p in fn.params}  # in the kernel's parameter order
    names = list(sig)
    constexprs = {(names.index(c),): v for c, v in consts.items()}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert "ptx" in k.asm

m = lambda n: import_module(f"specmeta.kernels.{n}")
U = dict(verify_lens_ptr=None, HAS_VERIFY_LENS=False)  # the uniform verify: no verify_lens
F = dict(full_to_swa_ptr=None, full_size=None, rail=None, TO_WINDOW=False, WINDOW_LAYER=False)  # a full layer
NR = dict(rail=None, RAIL=False)  # a full layer's mask
SF = dict(full_to_swa_ptr=None, full_size=None, rail=None, stride_prefix=None, stride_prefix_ptr=None,
          TO_WINDOW=False, RAIL=False)  # a full layer's cascade
BF = dict(full_to_swa_ptr=None, full_size=None, rail=None, TO_WINDOW=False, WINDOW_LAYER=False)  # a full layer's pages
jobs = {
 "verify": lambda: compile_kernel(m("verify_kv_indices")._verify_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","kv_indices_ptr","kv_indptr_ptr","v2p_ptr","status_ptr"],
    ["B","R","W_row","stride_row","extra_tokens","W_idx","chunk_programs","num_pages","page_size"], dict(BLOCK=1024,BLOCK_B=1024,HAS_STATUS=True,ENTRY_PAGE_SIZE=1,TRANSLATE=False,**U,**F)),
 "verify_ids": lambda: compile_kernel(m("verify_kv_indices")._verify_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","kv_indices_ptr","kv_indptr_ptr","v2p_ptr:*i64","status_ptr"],
    ["B","R","W_row","stride_row","extra_tokens","W_idx","chunk_programs","num_pages","page_size"], dict(BLOCK=1024,BLOCK_B=1024,HAS_STATUS=True,ENTRY_PAGE_SIZE=64,TRANSLATE=True,**U,**F)),
 "verify_ragged": lambda: compile_kernel(m("verify_kv_indices")._verify_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","verify_lens_ptr","kv_indices_ptr","kv_indptr_ptr","v2p_ptr","status_ptr"],
    ["B","R","W_row","stride_row","extra_tokens","W_idx","chunk_programs","num_pages","page_size"], dict(BLOCK=1024,BLOCK_B=1024,HAS_STATUS=True,HAS_VERIFY_LENS=True,ENTRY_PAGE_SIZE=1,TRANSLATE=False,**F)),
 "mask_bool": lambda: compile_kernel(m("tree_custom_mask")._tree_custom_mask_kernel,
    ["seq_lens_ptr:*i64","tree_mask_ptr:*u8","custom_mask_ptr:*u8","mask_indptr_ptr","status_ptr"],
    ["B","N","stride_mb","stride_mj","W_mask","chunk_programs"], dict(PACKED=False,BLOCK=1024,BLOCK_B=1024,HAS_STATUS=True,**U,**NR)),
 "mask_packed": lambda: compile_kernel(m("tree_custom_mask")._tree_custom_mask_kernel,
    ["seq_lens_ptr:*i64","tree_mask_ptr:*u8","custom_mask_ptr:*u8","mask_indptr_ptr","status_ptr"],
    ["B","N","stride_mb","stride_mj","W_mask","chunk_programs"], dict(PACKED=True,BLOCK=256,BLOCK_B=1024,HAS_STATUS=True,**U,**NR)),
 "mask_packed_ragged": lambda: compile_kernel(m("tree_custom_mask")._tree_custom_mask_kernel,
    ["seq_lens_ptr:*i64","verify_lens_ptr:*i64","tree_mask_ptr:*u8","custom_mask_ptr:*u8","mask_indptr_ptr","status_ptr"],
    ["B","N","stride_mb","stride_mj","W_mask","chunk_programs"], dict(PACKED=True,BLOCK=256,BLOCK_B=1024,HAS_STATUS=True,HAS_VERIFY_LENS=True,**NR)),
 "shared": lambda: compile_kernel(m("shared_prefix_kv_indices")._shared_prefix_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","prefix_kv_indices_ptr","prefix_kv_indptr_ptr","chain_kv_indices_ptr","chain_kv_indptr_ptr","v2p_ptr","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W_prefix","W_chain","stride_chain","stride_chain_ptr","chunk_programs","num_pages","window","sink"],
    dict(TOPK=4,NUM_STEPS=5,LAYOUT_B=True,BLOCK=1024,BLOCK_B=1024,BLOCK_CHAIN=128,BLOCK_PTR=32,BLOCK_ROWS=8,ENTRY_PAGE_SIZE=1,TRANSLATE=False,HAS_STATUS=True,**SF)),
 "shared_ids": lambda: compile_kernel(m("shared_prefix_kv_indices")._shared_prefix_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","prefix_kv_indices_ptr","prefix_kv_indptr_ptr","chain_kv_indices_ptr","chain_kv_indptr_ptr","v2p_ptr:*i64","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W_prefix","W_chain","stride_chain","stride_chain_ptr","chunk_programs","num_pages","window","sink"],
    dict(TOPK=4,NUM_STEPS=5,LAYOUT_B=True,BLOCK=1024,BLOCK_B=1024,BLOCK_CHAIN=128,BLOCK_PTR=32,BLOCK_ROWS=8,ENTRY_PAGE_SIZE=16,TRANSLATE=True,HAS_STATUS=True,**SF)),
 "shared_window": lambda: compile_kernel(m("shared_prefix_kv_indices")._shared_prefix_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","prefix_kv_indices_ptr","prefix_kv_indptr_ptr","chain_kv_indices_ptr","chain_kv_indptr_ptr","full_to_swa_ptr:*i64","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W_prefix","W_chain","stride_chain","stride_chain_ptr","chunk_programs","full_size","rail","stride_prefix","stride_prefix_ptr"],
    dict(TOPK=4,NUM_STEPS=5,LAYOUT_B=True,BLOCK=1024,BLOCK_B=1024,BLOCK_CHAIN=128,BLOCK_PTR=32,BLOCK_ROWS=8,ENTRY_PAGE_SIZE=1,TRANSLATE=False,HAS_STATUS=True,v2p_ptr=None,num_pages=None,window=None,sink=None,TO_WINDOW=True,RAIL=True)),
 "branch_pt": lambda: compile_kernel(m("branch_page_table")._branch_page_table_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","page_table_ptr","seq_lens_k_ptr","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W","stride_pt","stride_sl","fill_value","chunk_programs"],
    dict(TOPK=4,NUM_STEPS=5,BLOCK=256,BLOCK_PTR=32,v2p_ptr=None,num_pages=None,ENTRY_PAGE_SIZE=1,TRANSLATE=False,HAS_STATUS=True)),
 "branch_pt_ids": lambda: compile_kernel(m("branch_page_table")._branch_page_table_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr:*i64","seq_lens_ptr:*i64","page_table_ptr","seq_lens_k_ptr","v2p_ptr:*i64","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W","stride_pt","stride_sl","fill_value","chunk_programs","num_pages"],
    dict(TOPK=4,NUM_STEPS=5,BLOCK=256,BLOCK_PTR=32,ENTRY_PAGE_SIZE=16,TRANSLATE=True,HAS_STATUS=True)),
 "branch_kv": lambda: compile_kernel(m("branch_kv_indices")._branch_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","kv_indices_ptr","kv_indptr_ptr","kv_last_page_len_ptr","v2p_ptr","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W_idx","stride_idx","stride_ptr","stride_lpl","chunk_programs","num_pages"],
    dict(TOPK=4,NUM_STEPS=5,BLOCK=256,BLOCK_B=256,BLOCK_ROWS=8,BLOCK_K=4,ENTRY_PAGE_SIZE=1,TRANSLATE=False,HAS_STATUS=True,**BF)),
 "branch_kv_ids": lambda: compile_kernel(m("branch_kv_indices")._branch_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr:*i64","seq_lens_ptr:*i64","kv_indices_ptr","kv_indptr_ptr","kv_last_page_len_ptr","v2p_ptr:*i64","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W_idx","stride_idx","stride_ptr","stride_lpl","chunk_programs","num_pages"],
    dict(TOPK=4,NUM_STEPS=5,BLOCK=256,BLOCK_B=256,BLOCK_ROWS=8,BLOCK_K=4,ENTRY_PAGE_SIZE=16,TRANSLATE=True,HAS_STATUS=True,**BF)),
 "branch_kv_window": lambda: compile_kernel(m("branch_kv_indices")._branch_kv_indices_kernel,
    ["req_pool_indices_ptr:*i64","req_to_token_ptr","seq_lens_ptr:*i64","kv_indices_ptr","kv_indptr_ptr","kv_last_page_len_ptr","full_to_swa_ptr:*i64","status_ptr"],
    ["B","R","W_row","stride_row","page_size","num_rows","W_idx","stride_idx","stride_ptr","stride_lpl","chunk_programs","full_size","rail"],
    dict(TOPK=4,NUM_STEPS=5,BLOCK=256,BLOCK_B=256,BLOCK_ROWS=8,BLOCK_K=4,ENTRY_PAGE_SIZE=1,TRANSLATE=False,HAS_STATUS=True,v2p_ptr=None,num_pages=None,TO_WINDOW=True,WINDOW_LAYER=True)),
}
fails = []
for name, job in jobs.items():
    try:
        job(); print(name, "ok")
    except Exception as e:
        fails.append(name); print(name, "FAIL", type(e).__name__, str(e)[:1500])
assert not fails, fails
"""


def test_kernels_compile_for_sm90(device):
    """verify_kv_indices, tree_custom_mask (both forms; uniform and ragged verify),
    shared_prefix_kv_indices, branch_page_table and branch_kv_indices (a full layer's and a
    window layer's, design §2.10) compile for a real GPU."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
