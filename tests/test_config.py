"""SpecConfig validation and the capacity plan (design §5)."""

from __future__ import annotations

import math

import pytest
import torch

from specmeta import SpecConfig, plan_buffers
from specmeta.config import ROW_ALIGN, draft_row_need


def test_rejects_invalid_values():
    with pytest.raises(ValueError, match="topk must be >= 1"):
        SpecConfig(topk=0, num_steps=3, num_draft_tokens=4)
    with pytest.raises(TypeError, match="num_steps must be an int"):
        SpecConfig(topk=1, num_steps=2.0, num_draft_tokens=3)
    # N − 1 ≤ K + (S−1)·K²: K=2, S=2 allows N ≤ 7.
    SpecConfig(topk=2, num_steps=2, num_draft_tokens=7)
    with pytest.raises(ValueError, match="num_draft_tokens=8 is too large"):
        SpecConfig(topk=2, num_steps=2, num_draft_tokens=8)
    with pytest.raises(ValueError, match="req_to_token_width=100 is too small"):
        SpecConfig(
            topk=4, num_steps=3, num_draft_tokens=8, max_context_len=100, req_to_token_width=100
        )
    with pytest.raises(ValueError, match="pool_size"):
        SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, page_size=16, pool_size=100)


@pytest.mark.parametrize("k,s,n,ps", [(1, 3, 4, 1), (4, 3, 8, 1), (8, 5, 32, 16), (2, 2, 4, 64)])
def test_row_width_covers_every_prefix(k, s, n, ps):
    cfg = SpecConfig(
        topk=k, num_steps=s, num_draft_tokens=n, page_size=ps, max_bs=4, max_context_len=300
    )
    for length in range(0, 301):
        assert draft_row_need(length, k, s, ps) <= cfg.req_to_token_width
        assert length + n <= cfg.req_to_token_width


def test_draft_row_need_by_hand():
    """The row positions of design §1, worked out by hand: layout A needs ``L + K·S``;
    layout B ``base + K·nnp·ps`` with ``nnp = ceil((lpl + S) / ps)``."""
    assert draft_row_need(10, 4, 3, 1) == 10 + 4 * 3  # layout A (ps = 1)
    assert draft_row_need(10, 1, 3, 16) == 10 + 3  # layout A (K = 1)
    # L = 30, ps = 16: base 16, lpl 14, nnp = ceil(17 / 16) = 2 pages a branch, 4 branches.
    assert draft_row_need(30, 4, 3, 16) == 16 + 4 * 2 * 16
    # L = 32, ps = 16: base 32, lpl 0, nnp = 1.
    assert draft_row_need(32, 4, 3, 16) == 32 + 4 * 1 * 16
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=6, page_size=4, max_bs=4,
                     max_context_len=32)  # fmt: skip
    assert cfg.row_width_need == 44  # L = 30: base 28 + 2 branches · 2 pages · 4


def test_draft_kv_indices_carry_the_topk_factor():
    """Seed 002: the graph path sized the draft kv_indices without K."""
    cfg = SpecConfig(topk=8, num_steps=5, num_draft_tokens=16, max_bs=256, max_context_len=32768)
    spec = plan_buffers(cfg)["draft_decode.kv_indices"]
    assert spec.shape == (5, 256 * 8 * 32768 + 256 * 8 * 5)
    assert spec.dtype == torch.int32
    assert plan_buffers(cfg)["draft_decode.kv_indptr"].shape == (5, 256 * 8 + 1)
    assert plan_buffers(cfg)["draft.out_cache_loc"].shape == (256 * 8 * 5,)


def test_prefix_tail_pairs_only_in_layout_b():
    a = plan_buffers(SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=1))
    b = plan_buffers(SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=2))
    assert a["draft.prefix_tail_tgt"].shape == (0,)
    assert b["draft.prefix_tail_tgt"].shape == (2 * 3 * 15,)


@pytest.mark.parametrize("ps", [1, 3, 16, 64])
def test_default_row_width_is_whole_pages_and_lines(ps):
    cfg = SpecConfig(topk=1, num_steps=5, num_draft_tokens=6, page_size=ps, max_context_len=1000)
    assert cfg.req_to_token_width % ps == 0
    assert cfg.req_to_token_width % ROW_ALIGN == 0, "int32 rows start 16-byte aligned"
    assert cfg.req_to_token_width >= 1000 + 6
    unit = ps * ROW_ALIGN // math.gcd(ps, ROW_ALIGN)
    assert cfg.req_to_token_width - unit < cfg.row_width_need, "the smallest such width"


# --------------------------------------------------------------------------------------------
# check_fits: a plan that cannot be allocated is refused before anything is allocated.
# --------------------------------------------------------------------------------------------
_FIX = (
    "shrink SpecConfig's max_bs or max_context_len, or allocate fewer buffers (a builder's "
    "modes=, allocate_buffers' names=)"
)
# The configuration of the report: a 10-million-token context for 256 requests.
HUGE = SpecConfig(topk=8, num_steps=5, num_draft_tokens=64, page_size=16, max_bs=256,
                  max_context_len=10**7)  # fmt: skip


def _no_allocation(monkeypatch):
    """Make any allocation through a BufferSpec fail the test."""
    from specmeta.config import BufferSpec

    def refuse(self, device, fill=0):
        raise AssertionError(f"allocated {self.shape} before the check")

    monkeypatch.setattr(BufferSpec, "allocate", refuse)


def test_allocate_buffers_refuses_rows_past_int32_offsets_before_allocating(monkeypatch):
    from specmeta import allocate_buffers

    _no_allocation(monkeypatch)
    total = sum(spec.nbytes for spec in plan_buffers(HUGE).values())
    with pytest.raises(ValueError) as info:
        allocate_buffers(HUGE, "cpu")
    # One row is K·ΣL + B·K·S = 8·256·10^7 + 256·8·5 = 20,480,010,240 entries; five rows of
    # int32 are 409,600,204,800 bytes = 381.47 GiB (the request torch's allocator saw). The 9
    # others: FlashInfer's six, FlashInfer MLA's prefix list and its verify and extend lists.
    assert str(info.value) == (
        "allocate_buffers: draft_decode.kv_indices of shape [5, 20480010240] has rows of "
        "20,480,010,240 elements, more than the 2,147,483,647 (2**31 - 1) its int32 kv_indptr "
        f"can address; it alone is 409,600,204,800 bytes (381.5 GiB) of {total:,} bytes "
        f"(1.2 TiB) planned; 9 other buffers have such rows; {_FIX}"
    )
    # + 72 bytes of the ragged verify's host_lengths slot, and its buffers at max_bs 256:
    # FlashInfer's verify_lens and its mirror 2·256·4, ragged_qo_indptr and its mirror 2·257·4,
    # the runner's verify_lens 256·4, FA3's and TRT-LLM MLA's verify_lens 256·4 and
    # ragged_qo_indptr 257·4 each.
    ragged = 72 + 2 * 256 * 4 + 2 * 257 * 4 + 256 * 4 + 2 * (256 * 4 + 257 * 4)
    # FlashInfer MLA: its two prefix lists (draft decode's, tree verify's) ΣL and its extend
    # list ΣL + B·N, int32, then 5,078,200 bytes of ancestor lists (B·K·S a step, B·N·N),
    # offsets and mirrors.
    mla = 4 * (3 * 256 * 10**7 + 256 * 64) + 5_078_200
    # TRT-LLM MLA's tree verify (design §3.4), B·N = 16384 rows: the prefix pass's block table
    # of ceil((10^7 + 64) / 16) = 625004 pages rounded up to 625008 (a multiple of 128 / 16)
    # and its lengths; the ancestor lists B·N·N, four offsets of B·N + 1 (two on the host),
    # two counts of B·N (one on the host), the counts' host slot 8 + B·N int64 and its word.
    bn = 256 * 64
    tree = (4 * bn * 625008 + 4 * bn + 4 * bn * 64 + 4 * 4 * (bn + 1) + 2 * 4 * bn
            + 8 * (8 + bn) + 8)  # fmt: skip
    assert total == 1_211_529_947_264 + ragged + mla + tree


def test_allocate_buffers_checks_only_the_names_it_allocates(monkeypatch):
    from specmeta import allocate_buffers

    _no_allocation(monkeypatch)
    with pytest.raises(ValueError) as info:
        allocate_buffers(HUGE, "cpu", ["fa3.target_verify.page_table",
                                       "flashinfer.draft_decode_shared.prefix_kv_indices"])  # fmt: skip
    # ΣL = 256·10^7 = 2,560,000,000 prefix entries in one CSR row.
    assert str(info.value) == (
        "allocate_buffers: flashinfer.draft_decode_shared.prefix_kv_indices of shape "
        "[2560000000] has rows of 2,560,000,000 elements, more than the 2,147,483,647 "
        "(2**31 - 1) its int32 prefix_kv_indptr can address; it alone is 10,240,000,000 bytes "
        "(9.5 GiB) of 10,880,015,360 bytes (10.1 GiB) planned; " + _FIX
    )
    # The page table: W_row = 10^7 - 15 + 8 branches · 2 pages · 16 = 10,000,240 positions (the
    # prefix 10^7 - 1, design §1 layout B), 625,015 pages of 16; 256 rows of int32 = 640,015,360
    # bytes, which fit: only the prefix list is refused.


@pytest.mark.parametrize("field,offsets", [
    ("kv_indices", "kv_indptr"), ("prefix_kv_indices", "prefix_kv_indptr"),
    ("chain_kv_indices", "chain_kv_indptr"), ("custom_mask", "mask_indptr"),
    ("packed_custom_mask", "packed_mask_indptr")])  # fmt: skip
def test_check_fits_limits_each_int32_indexed_row(field, offsets):
    """A row of 2**31 - 1 elements is addressable (its end offset fits an int32), one more is
    not; a [S, W] list is limited per row, not in all. Nothing is allocated on ``meta``, where
    no memory limit applies, so only the offsets decide."""
    from specmeta.config import BufferSize, check_fits

    top = 2**31 - 1
    check_fits({f"x.{field}": BufferSize((top,), "int32", "")}, "meta", "t")
    check_fits({f"x.{field}": BufferSize((5, top), "int32", "")}, "meta", "t")
    with pytest.raises(ValueError) as info:
        check_fits({"x.small": BufferSize((3,), "int32", ""),
                    f"x.{field}": BufferSize((2, top + 1), "uint8", "")}, "meta", "Caller")  # fmt: skip
    assert str(info.value) == (
        f"Caller: x.{field} of shape [2, 2147483648] has rows of 2,147,483,648 elements, more "
        f"than the 2,147,483,647 (2**31 - 1) its int32 {offsets} can address; it alone is "
        f"4,294,967,296 bytes (4.0 GiB) of 4,294,967,308 bytes (4.0 GiB) planned; {_FIX}"
    )


def test_check_fits_leaves_dense_tables_to_64_bit_offsets():
    """Page tables and block tables are dense: the kernels address them in 64 bits, so only
    the memory check applies to them."""
    from specmeta.config import BufferSize, check_fits

    wide = (2, 2**31)
    check_fits({"fa3.draft_decode.page_table": BufferSize(wide, "int32", ""),
                "trtllm_mla.draft_decode.block_kv_indices": BufferSize(wide, "int32", ""),
                "draft.out_cache_loc": BufferSize((2**32,), "int64", "")}, "meta", "t")  # fmt: skip


def test_check_fits_refuses_more_than_the_cpu_has(monkeypatch):
    from specmeta.config import BufferSpec, check_fits

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 4}  # a 16 KiB machine
    monkeypatch.setattr("specmeta.config.os.sysconf", lambda name: pages[name])
    specs = {"a": BufferSpec((1000,), torch.int32, "a"), "b": BufferSpec((3000,), torch.int64, "b")}
    with pytest.raises(ValueError) as info:
        check_fits(specs, "cpu", "FA3MetadataBuilder")
    assert str(info.value) == (
        "FA3MetadataBuilder: the 2 planned buffers need 28,000 bytes (27.3 KiB) on cpu, more "
        "than its 16,384 bytes (16.0 KiB) of physical memory; the largest is b of shape [3000], "
        f"24,000 bytes (23.4 KiB); {_FIX}"
    )
    check_fits({"a": specs["a"]}, "cpu", "FA3MetadataBuilder")  # 4,000 bytes fit
    check_fits({"a": specs["a"]}, torch.device("cpu"), "FA3MetadataBuilder")


def test_check_fits_refuses_more_than_the_gpu_has(monkeypatch):
    from specmeta.config import BufferSpec, check_fits

    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 10 * 2**30, 80 * 2**30  # free, total: the total decides

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    big = {"x.page_table": BufferSpec((2**20, 2**13, 3), torch.int32, "")}  # 96 GiB
    with pytest.raises(ValueError) as info:
        check_fits(big, "cuda:1", "TrtllmMlaBuilder")
    assert str(info.value) == (
        "TrtllmMlaBuilder: the 1 planned buffer needs 103,079,215,104 bytes (96.0 GiB) on "
        "cuda:1, more than its 85,899,345,920 bytes (80.0 GiB) of memory "
        "(torch.cuda.mem_get_info); the largest is x.page_table of shape [1048576, 8192, 3], "
        f"103,079,215,104 bytes (96.0 GiB); {_FIX}"
    )
    assert asked == [torch.device("cuda:1")]
    check_fits({"x.page_table": BufferSpec((2**20, 2**13, 2), torch.int32, "")}, "cuda:1", "t")


def test_allocate_buffers_names_an_unknown_buffer_with_close_matches():
    from specmeta import allocate_buffers

    cfg = SpecConfig(topk=2, num_steps=2, num_draft_tokens=4)
    with pytest.raises(ValueError) as info:
        allocate_buffers(cfg, "cpu", ["draft.positions", "draft.out_cache_locs"])
    assert str(info.value) == (
        "allocate_buffers: names has 'draft.out_cache_locs' (did you mean "
        "'draft.out_cache_loc', 'verify.tgt_cache_loc' or 'verify.src_cache_loc'?), not a key "
        "of the plan; every name is a key of specmeta.plan_buffers(cfg), and `specmeta plan` "
        "lists them (the engine groups with --with)"
    )
    with pytest.raises(ValueError) as info:
        allocate_buffers(cfg, "cpu", ["fa3.draft_decode.page_tabel", "zzz"])
    assert str(info.value) == (
        "allocate_buffers: names has 'fa3.draft_decode.page_tabel' (did you mean "
        "'fa3.draft_decode.page_table', 'fa3.draft_decode.expand_page_table' or "
        "'fa3.draft_extend.page_table'?), 'zzz' (no close name), not keys of the plan; every "
        "name is a key of specmeta.plan_buffers(cfg), and `specmeta plan` lists them (the "
        "engine groups with --with)"
    )
    with pytest.raises(TypeError) as info:
        allocate_buffers(cfg, "cpu", "draft.positions")
    assert str(info.value) == (
        "allocate_buffers: names must be a list of plan keys, got the str 'draft.positions'; "
        "pass ['draft.positions']"
    )
    bufs = allocate_buffers(cfg, "cpu", ("draft.positions",))  # any iterable of names
    assert list(bufs) == ["draft.positions"] and bufs["draft.positions"].shape == (2,)


def test_plan_sizes_is_plan_buffers_without_torch():
    from specmeta.config import plan_sizes

    for cfg in (CFG_A, CFG_B, HUGE):
        sizes, specs = plan_sizes(cfg), plan_buffers(cfg)
        assert list(sizes) == list(specs)
        for name, spec in specs.items():
            size = sizes[name]
            assert (size.shape, size.doc, size.nbytes) == (spec.shape, spec.doc, spec.nbytes)
            assert getattr(torch, size.dtype) == spec.dtype, name
    assert {s.dtype for s in plan_sizes(CFG_B).values()} == {"int32", "int64", "bool", "uint8"}


CFG_A = SpecConfig(topk=1, num_steps=3, num_draft_tokens=4, max_bs=3, max_context_len=50)
CFG_B = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, page_size=16, max_bs=8,
                   max_context_len=1024)  # fmt: skip


def test_human_bytes():
    from specmeta.config import human_bytes

    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 2**30, 409_600_204_800, 3 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "1.0 GiB", "381.5 GiB", "3.0 TiB"]  # fmt: skip


def test_the_plan_imports_no_torch():
    """``specmeta plan`` sizes a configuration without torch (seconds to import)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from specmeta.config import SpecConfig, plan_sizes\n"
        "cfg = SpecConfig(topk=4, num_steps=3, num_draft_tokens=8, max_bs=8, max_context_len=64)\n"
        "assert plan_sizes(cfg)['draft_decode.kv_indices'].nbytes == 3 * (4 * 512 + 8 * 4 * 3) * 4\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert (run.returncode, run.stdout, run.stderr) == (0, "[]\n", "")


def test_builders_check_their_buffers_before_allocating(monkeypatch):
    """Each builder's constructor runs check_fits over what it allocates (its plan keys and its
    status word and its seq_lens_cpu check's slots), with its own name first in the message."""
    from specmeta import FA3MetadataBuilder, FlashInferBuilder

    _no_allocation(monkeypatch)
    plan = plan_buffers(HUGE)
    names = ["status", "host_lengths_host", "host_lengths_seen",
             *FlashInferBuilder.plan_keys(HUGE)]  # fmt: skip
    total = sum(plan[name].nbytes for name in names)
    # + the ragged verify's four buffers (max_bs 256: 2·256·4 + 2·257·4 bytes) and its slot
    assert (len(names), total) == (49, 793_603_089_452 + 2 * 256 * 4 + 2 * 257 * 4 + 72)
    with pytest.raises(ValueError) as info:
        FlashInferBuilder(HUGE, "cpu")
    assert str(info.value) == (
        "FlashInferBuilder: flashinfer.draft_decode.kv_indices of shape [5, 20480010240] has "
        "rows of 20,480,010,240 elements, more than the 2,147,483,647 (2**31 - 1) its int32 "
        f"kv_indptr can address; it alone is 409,600,204,800 bytes (381.5 GiB) of {total:,} "
        f"bytes (739.1 GiB) planned; 5 other buffers have such rows; {_FIX}"
    )
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1}  # a 4 KiB machine
    monkeypatch.setattr("specmeta.config.os.sysconf", lambda name: pages[name])
    names = ["status", "host_lengths_host", "host_lengths_seen",
             *FA3MetadataBuilder.plan_keys(CFG_B)]  # fmt: skip
    total = sum(plan_buffers(CFG_B)[name].nbytes for name in names)
    # + the ragged verify's host slot (72 bytes), verify_lens (8·4) and ragged_qo_indptr (9·4)
    assert (len(names), total) == (25, 12_380 + 72 + 8 * 4 + 9 * 4)
    with pytest.raises(ValueError) as info:
        FA3MetadataBuilder(CFG_B, "cpu")
    assert str(info.value) == (
        f"FA3MetadataBuilder: the {len(names)} planned buffers need {total:,} bytes (12.2 KiB) "
        "on cpu, more than its 4,096 bytes (4.0 KiB) of physical memory; the largest is "
        "fa3.draft_decode.page_table of shape [8, 71], 2,272 bytes (2.2 KiB); " + _FIX
    )


# ----------------------------------------------------------------------------------------------
# Window layers (design §2.10): their builders' buffers, sized from the rail's formulas by hand.


def _shapes(cfg: SpecConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    from specmeta.config import plan_sizes

    return {k[len(prefix) :]: v.shape for k, v in plan_sizes(cfg).items() if k.startswith(prefix)}


def test_window_lists_are_sized_by_the_rail_by_hand():
    """K = 2, S = 3, N = 5, B = 4, L = 100, w = 30, ps = 1 (design §2.10), every window key:
    FlashInfer's draft row lists ``min(L + S, w)`` = 30 entries a branch, B·K·30 = 240; a
    verify or extend list ``min(L, w − 1) + N`` = 34 a request, 136; the mask ``N × 34`` a
    request, 680 elements (as many bytes packed); the shared-prefix cascade (w = 30 > S) a
    prefix row a step of ``min(ΣL, B·(w − 1))`` = 116 and chain rows of B·K·S = 24; the paged
    form a full layer's K·ΣL + B·K·S = 824 pages (ps = 1). FA3's tree tables keep the row's
    112 pages (W_row = L + K·S = 106 rounded up to 16); its draft expand row is S + ⌊(w − G +
    ps − 2) / ps⌋ wide, G = ⌊(w − (S − 1) − ps) / ps⌋·ps = 27, so 3 + 2 = 5; its verify expand
    rows B·N = 20 of N + 2·ps − 2 = 5. The ragged verify's buffers bound what the full layers'
    do (Bp ≤ B = 4 lengths, T ≤ B·N = 20 expand rows), so one bucket rule serves both."""
    cfg = SpecConfig(topk=2, num_steps=3, num_draft_tokens=5, max_bs=4, max_context_len=100,
                     sliding_window_size=30)  # fmt: skip
    both = {}
    for name, shape in {"qo_indptr": (5,), "kv_indptr": (5,), "kv_indices": (136,),
                        "kv_last_page_len": (4,)}.items():  # fmt: skip
        both[name] = shape
        if name != "kv_indices":
            both[f"{name}_host"] = shape
    with_host = {
        "draft_decode.kv_indices": (3, 240), "draft_decode.kv_indptr": (3, 9),
        "draft_decode.kv_last_page_len": (8,),
        "draft_decode_shared.prefix_kv_indices": (3, 116),
        "draft_decode_shared.prefix_kv_indptr": (3, 5),
        "draft_decode_shared.prefix_qo_indptr": (5,),
        "draft_decode_shared.chain_kv_indices": (3, 24),
        "draft_decode_shared.chain_kv_indptr": (3, 9),
        "draft_decode_shared.chain_qo_indptr": (9,),
        "draft_decode_shared.kv_last_page_len": (8,),
        "draft_decode_paged.kv_indices": (3, 824), "draft_decode_paged.kv_indptr": (3, 9),
        "draft_decode_paged.kv_last_page_len": (3, 8),
        "target_verify.custom_mask": (680,), "target_verify.mask_indptr": (5,),
        "target_verify.packed_custom_mask": (680,), "target_verify.packed_mask_indptr": (5,),
        "target_verify.verify_lens": (4,), "target_verify.ragged_qo_indptr": (5,),
    }  # fmt: skip
    want = {f"{mode}.{name}": shape for mode in ("target_verify", "draft_extend")
            for name, shape in both.items()}  # fmt: skip
    for name, shape in with_host.items():
        want[name] = shape
        if not name.endswith(("kv_indices", "custom_mask")):  # the device lists: no mirror
            want[f"{name}_host"] = shape
    assert _shapes(cfg, "flashinfer_swa.") == want
    table = {"page_table": (4, 112), "cache_seqlens": (4,), "cu_seqlens_k": (5,),
             "cu_seqlens_q": (5,)}  # fmt: skip
    assert _shapes(cfg, "fa3_swa.") == {
        "draft_decode.page_table": (4, 112), "draft_decode.cache_seqlens": (1, 4),
        "draft_decode.cu_seqlens_k": (1, 5), "draft_decode.cu_seqlens_q": (5,),
        "draft_decode.expand_page_table": (3, 8, 5), "draft_decode.expand_cache_seqlens": (3, 8),
        "draft_decode.expand_cu_seqlens_k": (3, 9), "draft_decode.expand_cu_seqlens_q": (9,),
        **{f"target_verify.{name}": shape for name, shape in table.items()},
        "target_verify.expand_page_table": (20, 5), "target_verify.expand_cache_seqlens": (20,),
        "target_verify.expand_cu_seqlens_k": (21,), "target_verify.expand_cu_seqlens_q": (21,),
        "target_verify.verify_lens": (4,), "target_verify.ragged_qo_indptr": (5,),
        **{f"draft_extend.{name}": shape for name, shape in table.items()},
    }  # fmt: skip


def test_a_window_past_every_position_clips_nothing_and_a_window_of_one_keeps_the_new_tokens():
    """A chain, S = 3, N = 4, ps = 16, B = 2, L = 64. With w = 67 = L + S nothing is clipped:
    the lists are K·ΣL + B·K·S = 134 a draft row and ΣL + B·N = 136 a verify list, the
    shared-prefix cascade's prefix rows ΣL = 128 (B·(w − 1) = 132 is more). With w = 1 a draft
    row holds one entry a branch (2) and a verify list its N new tokens (8), and no step keeps a
    prefix position: no shared-prefix keys (w ≤ S). The paged form keeps a full layer's lists
    whatever w, ⌈(L + S) / ps⌉ = 5 pages a branch, 10 a row. FA3's window tables keep the full
    row: W_row = L + N = 68 rounded up to 80, 5 pages; a ragged verify's expand rows (B·N = 8)
    hold N + 2·ps − 2 = 34 slots."""
    base = dict(topk=1, num_steps=3, num_draft_tokens=4, page_size=16, max_bs=2,
                max_context_len=64)  # fmt: skip
    wide = _shapes(SpecConfig(**base, sliding_window_size=67), "flashinfer_swa.")
    assert wide["draft_decode.kv_indices"] == (3, 134)
    assert wide["target_verify.kv_indices"] == wide["draft_extend.kv_indices"] == (136,)
    assert wide["target_verify.custom_mask"] == (4 * 128 + 2 * 16,)
    assert wide["draft_decode_shared.prefix_kv_indices"] == (3, 128)
    assert wide["draft_decode_shared.chain_kv_indices"] == (3, 6)
    assert wide["draft_decode_paged.kv_indices"] == (3, 10)
    one = SpecConfig(**base, sliding_window_size=1)
    narrow = _shapes(one, "flashinfer_swa.")
    assert narrow["draft_decode.kv_indices"] == (3, 2)
    assert narrow["target_verify.kv_indices"] == narrow["draft_extend.kv_indices"] == (8,)
    assert narrow["target_verify.custom_mask"] == (2 * 16,)
    assert not [key for key in narrow if key.startswith("draft_decode_shared.")]
    assert narrow["draft_decode_paged.kv_indices"] == (3, 10)
    assert narrow["target_verify.verify_lens"] == (2,)
    assert _shapes(one, "fa3_swa.") == {
        "draft_decode.page_table": (2, 5), "draft_decode.cache_seqlens": (3, 2),
        "draft_decode.cu_seqlens_k": (3, 3), "draft_decode.cu_seqlens_q": (3,),
        "target_verify.page_table": (2, 5), "target_verify.cache_seqlens": (2,),
        "target_verify.cu_seqlens_k": (3,), "target_verify.cu_seqlens_q": (3,),
        "target_verify.expand_page_table": (8, 34), "target_verify.expand_cache_seqlens": (8,),
        "target_verify.expand_cu_seqlens_k": (9,), "target_verify.expand_cu_seqlens_q": (9,),
        "target_verify.verify_lens": (2,), "target_verify.ragged_qo_indptr": (3,),
        "draft_extend.page_table": (2, 5), "draft_extend.cache_seqlens": (2,),
        "draft_extend.cu_seqlens_k": (3,), "draft_extend.cu_seqlens_q": (3,),
    }  # fmt: skip


@pytest.mark.parametrize("k,ps", [(1, 1), (4, 16)])
def test_window_layers_add_their_own_buffers_and_change_none_of_the_full_layers(k, ps):
    """``sliding_window_size`` appends the window builders' keys to the plan: every key of the
    plan without it keeps its place, shape and dtype (the full layers' id space is unchanged)."""
    import dataclasses

    from specmeta.config import plan_sizes

    cfg = SpecConfig(topk=k, num_steps=3, num_draft_tokens=4, page_size=ps, max_bs=4,
                     max_context_len=200)  # fmt: skip
    full = plan_sizes(cfg)
    hybrid = plan_sizes(dataclasses.replace(cfg, sliding_window_size=50))
    assert list(hybrid)[: len(full)] == list(full)
    assert all(hybrid[key] == size for key, size in full.items())
    prefixes = {key.split(".")[0] for key in list(hybrid)[len(full) :]}
    assert prefixes == {"flashinfer_swa", "fa3_swa"}  # FA3's window builder serves trees too
