#!/usr/bin/env python3
"""Mutation check: plant known bugs one at a time and see that the tests catch each (issue 17).

Every entry of :data:`MUTATIONS` is a bug of the kind this library exists to prevent, planted
by an exact text replacement (its ``old`` snippet must occur exactly once in its file, so a
mutation cannot go stale silently), with the small test selection that must catch it. For each
mutation the script copies the repository's tracked files into a fresh temporary directory,
applies the mutation there and runs ``python3 -m pytest -q -x -p no:cacheprovider <selection>``
from that directory with ``PYTHONPATH`` pointing at the copy (so the mutated package is the one
imported). Pytest's exit code decides: 1 is *caught*, and so is a test process killed by a
segmentation fault, an abort or a bus error (a planted out-of-bounds write that corrupts the
process's memory); 0 is *missed*; anything else (or a stale snippet) is an *error*.

    python3 scripts/mutations.py              # every CPU mutation, two at a time
    python3 scripts/mutations.py --list       # the mutations, without running them
    python3 scripts/mutations.py --only ID... # some of them
    python3 scripts/mutations.py --gpu        # also the gpu=True ones (on a CUDA machine)
    python3 scripts/mutations.py --gpu-only   # only the gpu=True ones (scripts/gpu_visit.sh
                                              # stage mutations-gpu)

Exit status 1 when a mutation that ran is missed or errors (a stale snippet included).

A race (the move kernel without its barrier) cannot show under Triton's interpreter, which
runs a program's lanes in lock step: such mutations are marked ``gpu=True`` and run only with
``--gpu`` or ``--gpu-only``, which refuse to start without a CUDA device (their tests would be
skipped and every mutation would read as missed).

The copy is of the work tree less what ``.gitignore`` names.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The layers a mutation can sit in; tests/test_mutations.py checks each has one at least.
LAYERS = {
    "kernel": "a @triton.jit kernel (or device helper) alone",
    "reference": "a pure-torch reference <op>_ref alone",
    "shared": "one rule planted in a kernel helper and its torch twin at once",
    "host_mirror": (
        "FlashInfer's host part: a mirror writer (metadata/host_ops.c, .py), the ring's turn "
        "(host_mirrors.py), the set it writes and returns (flashinfer.py)"
    ),
    "host_ops": "the compiled host ops' one build a process (metadata/host_ops.py: warmup)",
    "host_check": "a builder's host check (metadata/inputs.py, the host ops' length check)",
    "host_scalar": "FA3's host part: max_seqlen_k rewritten from seq_lens_cpu (metadata/fa3.py)",
    "validate": "a launcher's host argument check (validate.py)",
    "config": "the capacity plan (config.py)",
    "runner": "the CUDA-graph runner: its padding and its captured-tensor check (runners/)",
    "stage": (
        "a bound stage: its host part before its launches (stage.py), what a bind makes once "
        "(a builder's views), an eager call that binds anew"
    ),
    "launch": "the bound launch path (launch.py: Launcher.bind, Launch)",
    "e2e": "caught end to end by the lossless speculative-decoding loop",
}

LOSSLESS = "tests/testing/test_lossless.py"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One planted bug: replace ``old`` (exactly once in ``file``) by ``new``; ``also`` holds
    further ``(file, old, new)`` edits applied with it (a rule planted in two places)."""

    id: str
    layer: str
    description: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    gpu: bool = False
    also: tuple[tuple[str, str, str], ...] = ()

    def edits(self) -> list[tuple[str, str, str]]:
        return [(self.file, self.old, self.new), *self.also]


def _m(id, layer, description, file, old, new, tests, **kw) -> Mutation:  # noqa: A002
    return Mutation(id, layer, description, file, old, new, tuple(tests), **kw)


K = "specmeta/kernels/"
# fmt: off
MUTATIONS: list[Mutation] = [
    # ---------------------------------------------------------------- device kernels
    _m("k-verify-kv-length", "kernel", "verify KV list one entry short (L + n - 1)",
       K + "verify_kv_indices.py",
       "n = tl.where(b < B, L + extra_tokens, 0)",
       "n = tl.where(b < B, L + extra_tokens - 1, 0)",
       ["tests/kernels/test_verify_kv_indices.py", "-k", "spec_example"]),
    _m("k-verify-kv-row-bit", "kernel", "verify_kv_indices drops the ROW_OOB status bit",
       K + "verify_kv_indices.py",
       "tl.where(row_ok, 0, ROW_OOB)",
       "tl.where(row_ok, 0, 0)",
       ["tests/kernels/test_single_faults.py", "-k", "verify_kv_indices"]),
    _m("k-tree-mask-capacity-bit", "kernel", "tree_custom_mask drops OUT_OF_CAPACITY",
       K + "tree_custom_mask.py",
       "tl.where(start + n > W_mask, OUT_OF_CAPACITY, 0)",
       "tl.where(start + n > W_mask, 0, 0)",
       ["tests/kernels/test_tree_custom_mask.py", "-k", "too_small"]),
    _m("k-tree-mask-row-wrap", "kernel",
       "tree_custom_mask: a row's end element read as the next row's start column",
       K + "tree_custom_mask.py",
       "        wrap = col >= cols",
       "        wrap = col > cols",
       ["tests/kernels/test_tree_custom_mask.py", "-k", "wider_than_a_chunk"]),
    _m("k-tree-mask-row-estimate", "kernel",
       "tree_custom_mask: the float64 row estimate used without its correction",
       K + "tree_custom_mask.py",
       "        j += (bit - j * cols >= cols).to(tl.int64)\n",
       "",
       ["tests/kernels/test_tree_custom_mask.py", "-k", "falls_short"]),
    _m("k-copy-prefix-capacity-mask", "kernel",
       "copy_row_prefix stores without the dst < W_dst mask (last chunk runs past the buffer)",
       K + "_common.py",
       "        m = (k < n) & (dst < W_dst)\n",
       "        m = k < n\n",
       ["tests/kernels/test_verify_kv_indices.py", "-k", "too_small"]),
    _m("k-branch-kv-page-count", "kernel",
       "branch_kv_indices: ceil((L + rows) / ps) computed as floor + 1 (one page too many)",
       K + "branch_kv_indices.py",
       "n_last = tl.where(valid, (L + num_rows - 1 + page_size) // page_size, 0)",
       "n_last = tl.where(valid, (L + num_rows + page_size) // page_size, 0)",
       ["tests/kernels/test_branch_kv_indices.py", "-k", "matches_reference"]),
    _m("k-branch-kv-step-pages", "kernel",
       "branch_kv_indices: a step's pages per branch one short at page boundaries",
       K + "branch_kv_indices.py",
       "n_s = (L + s + page_size) // page_size",
       "n_s = (L + s + page_size - 1) // page_size",
       ["tests/kernels/test_branch_kv_indices.py", "-k", "matches_reference"]),
    _m("k-branch-page-capacity-bit", "kernel", "branch_page_table drops OUT_OF_CAPACITY",
       K + "branch_page_table.py",
       "| tl.where(over, OUT_OF_CAPACITY, 0)",
       "| tl.where(over, 0, 0)",
       ["tests/kernels/test_branch_page_table.py", "-k", "narrow_table"]),
    _m("k-merge-state-weight", "kernel", "merge_state weights pass 2 by pass 1's LSE",
       K + "merge_state.py",
       'w2 = tl.where(lse2 == float("-inf"), 0.0, tl.exp(lse2 - safe))',
       'w2 = tl.where(lse2 == float("-inf"), 0.0, tl.exp(lse1 - safe))',
       ["tests/kernels/test_merge_state.py", "-k", "union"]),
    _m("k-draft-positions", "kernel", "draft_cache_locs: positions L + 1 instead of L",
       K + "draft_cache_locs.py",
       "tl.zeros_like(k).to(tl.int64) + L, mask=k < TOPK)",
       "tl.zeros_like(k).to(tl.int64) + L + 1, mask=k < TOPK)",
       ["tests/kernels/test_draft_cache_locs.py", "-k", "matches_reference"]),
    _m("k-verify-expand-rank", "kernel", "verify_expand_page_table: ancestor rank off by one",
       K + "_common.py",
       "return tl.where(m, incl - 1, cnt[:, None] + cc - incl), cnt",
       "return tl.where(m, incl, cnt[:, None] + cc - incl), cnt",
       ["tests/kernels/test_verify_expand_page_table.py", "-k", "spec_example"]),
    _m("k-shared-chain-dst", "kernel", "shared_prefix_kv_indices: chain stride s instead of s + 1",
       K + "shared_prefix_kv_indices.py",
       "dst = (b * TOPK + t) * (s + 1) + j",
       "dst = (b * TOPK + t) * s + j",
       ["tests/kernels/test_shared_prefix_kv_indices.py", "-k", "spec_example"]),
    _m("k-prefix-page-seqlens", "kernel", "prefix_page_table: cu_seqlens counts one token more",
       K + "_page_tables.py",
       "own = tl.where(offs < B, tl.minimum(len_head + r, cap), 0)",
       "own = tl.where(offs < B, tl.minimum(len_head + r + 1, cap), 0)",
       ["tests/kernels/test_prefix_page_table.py::test_matches_reference_over_workloads"]),
    _m("k-expand-slot", "kernel", "expand_page_table reads the next step's draft slot",
       K + "_page_tables.py",
       "(first + t) * NUM_STEPS + j, mask=live, other=0)",
       "(first + t) * NUM_STEPS + j + 1, mask=live, other=0)",
       ["tests/kernels/test_expand_page_table.py", "-k", "spec_example"]),
    _m("k-draft-kv-indptr-end", "kernel",
       "draft_decode_kv_indices: closing kv_indptr entry without step s's own slot",
       K + "draft_decode_kv_indices.py",
       "end = TOPK * (cum + L) + B * TOPK * (s_d + 1)",
       "end = TOPK * (cum + L) + B * TOPK * s_d",
       ["tests/kernels/test_draft_decode_kv_indices.py", "-k", "spec_example"]),
    _m("k-draft-kv-chain-capacity-mask", "kernel",
       "draft_decode_kv_indices: chain stores lose their capacity mask",
       K + "draft_decode_kv_indices.py",
       "(j <= s_d[:, None]) & (L + j < room[:, None])",
       "(j <= s_d[:, None])",
       ["tests/kernels/test_draft_decode_kv_indices.py", "-k", "too_small"]),
    _m("k-verify-sums-carry", "kernel",
       "verify expand cu_seqlens_k drops the running total between blocks",
       K + "verify_expand_page_table.py",
       "        carry += tl.sum(v, 0)",
       "        carry += tl.sum(v, 0) * 0",
       ["tests/kernels/test_verify_expand_page_table.py"]),
    _m("k-move-no-barrier", "kernel",
       "move_kv_cache: no barrier between a block's loads and its stores (a race)",
       K + "cache_loc_move.py",
       "                tl.debug_barrier()\n",
       "",
       # The moves alone: graph, sync, recompile and memcheck tests cannot see a race.
       ["tests/kernels/test_cache_loc_move.py", "-k", "overlapping or ordered or pointer_table"],
       gpu=True),
    # ---------------------------------------------------------------- torch references
    _m("r-accept-window", "reference",
       "accept_cache_locs_ref accepts a node past the request's own window",
       K + "accept_cache_locs.py",
       "ok = want & (idx >= lo) & (idx < lo + N) & (k < N)",
       "ok = want & (idx >= lo) & (k < N)",
       ["tests/kernels/test_cache_loc_move.py", "-k",
        "accept_matches or accept_property or past_its_window"]),
    _m("r-move-src-range", "reference", "move_kv_cache_ref forgets the source's upper bound",
       K + "cache_loc_move.py",
       "in_pool = (t >= 0) & (t < rows.shape[0]) & (s >= 0) & (s < rows.shape[0])",
       "in_pool = (t >= 0) & (t < rows.shape[0]) & (s >= 0)",
       ["tests/kernels/test_cache_loc_move.py", "-k", "move_out_of_range"]),
    _m("r-draft-kv-start", "reference",
       "draft_decode_kv_indptr (the reference's and the mirror's): lists miss their last slot",
       K + "draft_decode_kv_indices.py",
       "steps = torch.arange(1, max_rows + 1, dtype=dtype, device=device).view(-1, 1)",
       "steps = torch.arange(0, max_rows, dtype=dtype, device=device).view(-1, 1)",
       ["tests/kernels/test_draft_decode_kv_indices.py", "-k", "matches_reference"]),
    _m("r-tree-mask-transposed", "reference", "tree_custom_mask_ref reads the tree transposed",
       K + "tree_custom_mask.py",
       "tree = tree_mask[req_b, j.clamp_max(N - 1), (col - prefix_len).clamp(0, N - 1)]",
       "tree = tree_mask[req_b, (col - prefix_len).clamp(0, N - 1), j.clamp_max(N - 1)]",
       ["tests/kernels/test_tree_custom_mask.py", "-k", "matches_reference"]),
    _m("r-verify-kv-length", "reference", "verify_kv_indices_ref: lists one entry short",
       K + "verify_kv_indices.py",
       "n = seq_lens.to(torch.int64).clamp_min(0) + extra_tokens",
       "n = seq_lens.to(torch.int64).clamp_min(0) + extra_tokens - 1",
       ["tests/kernels/test_verify_kv_indices.py", "-k", "matches_reference"]),
    _m("r-merge-state-lse", "reference", "merge_state_ref: log(total + 1) in the merged LSE",
       K + "merge_state.py",
       "safe + torch.log(total)",
       "safe + torch.log(total + 1)",
       ["tests/kernels/test_merge_state.py", "-k", "union"]),
    # ---------------------------------------------------------------- one rule, both sides
    _m("s-draft-slot-position", "shared",
       "draft slot position (layout A) strides branches by S + 1, in the kernel helper and "
       "its torch twin alike",
       K + "_common.py",
       "return L + t * NUM_STEPS + j",
       "return L + t * (NUM_STEPS + 1) + j",
       ["tests/kernels/test_draft_cache_locs.py", "-k", "spec_example"],
       also=((K + "_common.py", "return L + t * num_steps + j",
              "return L + t * (num_steps + 1) + j"),)),
    # ---------------------------------------------------------------- FlashInfer host mirrors
    _m("h-decode-indptr", "host_mirror", "draft_decode kv_indptr_host misses step s's own slot",
       "specmeta/metadata/host_ops.c",
       "for (Py_ssize_t i = 0; i < n; ++i, ramp += step) dst[i] = src[i] + ramp;",
       "for (Py_ssize_t i = 0; i < n; ++i, ramp += step) dst[i] = src[i] + ramp - (uint32_t)i;",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write"]),
    _m("h-torch-decode-indptr", "host_mirror",
       "the torch writer of draft_decode kv_indptr_host counts L + 1 tokens a branch",
       "specmeta/metadata/host_ops.py",
       "DraftDecodeIndptr.write(views, table.gather(seq_lens_cpu), out)",
       "DraftDecodeIndptr.write(views, table.gather(seq_lens_cpu) + 1, out)",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write"]),
    _m("h-window-cap-compiled", "host_mirror",
       "the compiled draft_decode mirror ignores a draft window: kv_indptr_host from full L",
       "specmeta/metadata/host_ops.c",
       "uint32_t L = (uint32_t)(full < cap ? full : cap), start = acc + (uint32_t)z;",
       "uint32_t L = (uint32_t)full, start = acc + (uint32_t)z;                  ",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write and draft_window"]),
    _m("h-window-cap-torch", "host_mirror",
       "the torch length table of a draft window does not cap the lengths",
       "specmeta/metadata/host_ops.py",
       "            self.values = self.values.clamp_max(self.cap + shift)",
       "            self.values = self.values.clamp_max(self.max_len + shift)",
       ["tests/metadata/test_id_spaces.py", "-k", "attends_to_the_window and torch"]),
    _m("h-paged-last-page-len", "host_mirror",
       "draft_decode_paged kv_last_page_len_host off by one (0 on a full page)",
       "specmeta/metadata/host_ops.c",
       "in_last = (uint32_t)(IN_PAGE) + 1;",
       "in_last = (uint32_t)(IN_PAGE);",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write"]),
    _m("h-paged-shift-mask", "host_mirror",
       "paged mirrors: a power-of-two page size masked one bit short (last-page lengths wrap)",
       "specmeta/metadata/host_ops.c",
       "PAGED_ROW(tokens >> shift, tokens & mask)",
       "PAGED_ROW(tokens >> shift, tokens & (mask >> 1))",
       ["tests/metadata/test_host_ops.py", "-k", "every_width"]),
    _m("h-draft-row0-width", "host_mirror",
       "draft decode mirrors: the unrolled K = 8 row 0 written as K = 4",
       "specmeta/metadata/host_ops.c",
       "case 8: ROW0(8); break;",
       "case 8: ROW0(4); break;",
       ["tests/metadata/test_host_ops.py", "-k", "every_width"]),
    _m("r-paged-pages", "reference",
       "branch_kv_indptr (reference and mirror): ceil((L + s + 1) / ps) one page short",
       K + "branch_kv_indices.py",
       "list_offsets((L.view(1, -1) + steps + page_size) // page_size, topk, kv_indptr)",
       "list_offsets((L.view(1, -1) + steps + page_size - 1) // page_size, topk, kv_indptr)",
       ["tests/kernels/test_branch_kv_indices.py", "-k", "matches_reference"]),
    _m("h-prefill-indptr", "host_mirror", "verify/extend kv_indptr_host without the N new tokens",
       "specmeta/metadata/flashinfer.py",
       "tables = {n: LengthTable(cfg.max_context_len, bs, n)}",
       "tables = {n: LengthTable(cfg.max_context_len, bs)}",
       ["tests/metadata/test_flashinfer.py", "-k", "target_verify_tree or draft_extend"]),
    _m("h-shared-prefix-indptr", "host_mirror", "cascade prefix_kv_indptr_host counts L + 1",
       "specmeta/metadata/host_ops.c",
       "acc += (uint32_t)(full < cap ? full : cap) + shift;",
       "acc += (uint32_t)(full < cap ? full : cap) + shift + 1;",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write"]),
    _m("h-lengths-view-strided", "host_mirror",
       "the compiled read of seq_lens_cpu takes a strided or expanded view as contiguous: the "
       "writers read lengths that are not the request's, or past the tensor's storage",
       "specmeta/metadata/host_ops.c",
       "int contiguous = cpu == 1 ? is_true(tensor, is_contiguous_name, 1) : 0;",
       "int contiguous = cpu;",
       ["tests/metadata/test_host_ops.py", "-k", "reads_only_a_tensor_of_its_batch"]),
    _m("h-ragged-cols-compiled", "host_mirror",
       "the compiled ragged verify mirrors count L + v columns a filler request, not L + min(v, N)",
       "specmeta/metadata/host_ops.c",
       "(uint32_t)(rows < n ? rows : n);",
       "(uint32_t)rows;",
       ["tests/metadata/test_host_ops.py", "-k", "ragged"]),
    _m("h-writer-stats", "host_mirror",
       "the compiled draft-decode writer returns ΣL as max L: the host part publishes a wrong "
       "maximum for the device's stale check",
       "specmeta/metadata/host_ops.c",
       "  PyBuffer_Release(&out.buffer);\n  return sum < 0 ? NULL : Py_BuildValue(\"(LL)\", high, sum);\n}\n\n/* prefix(",
       "  PyBuffer_Release(&out.buffer);\n  return sum < 0 ? NULL : Py_BuildValue(\"(LL)\", sum, sum);\n}\n\n/* prefix(",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write"]),
    _m("h-ragged-stats", "host_mirror",
       "the compiled ragged writer returns the verify lengths' sum as their maximum",
       "specmeta/metadata/host_ops.c",
       'Py_BuildValue("(LLLL)", top, sum, high, total)',
       'Py_BuildValue("(LLLL)", top, sum, total, total)',
       ["tests/metadata/test_host_ops.py", "tests/metadata/test_ragged_verify_builders.py",
        "-k", "ragged_writers or stale"]),
    _m("b-refusal-takes-a-turn", "host_mirror",
       "a FlashInfer host part ends its ring turn at the claim (a refused write takes a turn, "
       "a build two)",
       "specmeta/metadata/flashinfer.py",
       "            slot = claim()\n",
       "            slot = claim()\n            advance()\n",
       ["tests/metadata/test_host_mirrors.py", "-k", "round_the_ring"]),
    _m("h-ragged-spare-torch", "host_mirror",
       "the torch ragged verify mirrors give every pad one more token (leftover not conserved)",
       "specmeta/kernels/verify_lens.py",
       "        lengths[count : count + spare] += 1",
       "        lengths[count:] += 1",
       ["tests/metadata/test_host_ops.py", "-k", "ragged"]),
    _m("h-ragged-mask-torch", "host_mirror",
       "the torch ragged verify mirrors write mask_indptr_host as kv_indptr_host",
       "specmeta/metadata/host_ops.py",
       "    torch.cumsum(cols.mul_(verify_out), 0, out=mask_tail)",
       "    torch.cumsum(cols, 0, out=mask_tail)",
       ["tests/metadata/test_host_ops.py", "-k", "ragged"]),
    _m("h-ragged-lens-unread", "host_mirror",
       "FlashInfer's ragged verify lists and mask read the uniform layout, not the padded lengths",
       "specmeta/metadata/flashinfer.py",
       "                status=self.status_word(status), verify_lens=padded,",
       "                status=self.status_word(status), verify_lens=None,",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "reads_as_the_rule"]),
    _m("k-shared-chain-untranslated", "kernel",
       "the shared-prefix cascade's chain level leaves its ids virtual (v2p not applied)",
       K + "shared_prefix_kv_indices.py",
       "            req_to_token_ptr + row_base, p, tl.where(row_ok, live, False), W_row, v2p_ptr,\n"
       "            num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE,",
       "            req_to_token_ptr + row_base, p, tl.where(row_ok, live, False), W_row, v2p_ptr,\n"
       "            num_pages, page_size, ENTRY_PAGE_SIZE, False,",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "shared_prefix"]),
    _m("c-page-rows-width", "host_check",
       "the builders' host check counts a row of page ids as token positions (a valid page row "
       "is refused as too narrow)",
       "specmeta/metadata/inputs.py",
       "    need = -(-cfg.row_width_need // entry_page_size)",
       "    need = cfg.row_width_need",
       ["tests/metadata/test_id_spaces.py", "-k", "page_rows"]),
    _m("st-page-rows-unread", "stage",
       "FlashInfer's verify and extend lists read rows of page ids as token ids",
       "specmeta/metadata/flashinfer.py",
       "            page_size=self.cfg.page_size, verify_lens=verify_lens,\n"
       "            entry_page_size=entry_page_size,",
       "            page_size=self.cfg.page_size, verify_lens=verify_lens,\n"
       "            entry_page_size=1,",
       ["tests/metadata/test_id_spaces.py", "-k", "page_rows"]),
    _m("c-ragged-verify-stale-unchecked", "host_check",
       "a ragged verify's verify_lens_cpu is never published for the device's stale check",
       "specmeta/metadata/contract.py",
       "            publish_host_lengths(self._verify_published, count, found[1], found[0])",
       "            pass",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "stale"]),
    _m("c-ragged-verify-over-n", "host_check",
       "the host check of verify_lens_cpu lets a length past N through",
       "specmeta/metadata/inputs.py",
       "    bad = values and not 0 <= min(values) <= max(values) <= n",
       "    bad = values and not 0 <= min(values)",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "refused"]),
    _m("c-plan-bucket-tokens", "config",
       "specmeta plan --verify-buckets lets a bucket of more than Bp·N tokens through",
       "specmeta/cli.py",
       "        if T > bp * n:",
       "        if T > bp * n + 1:",
       ["tests/test_cli.py", "-k", "ragged_verify_bucket"]),
    _m("rn-ragged-host-pad", "runner",
       "the ragged runner pads the host inputs with 0, not their inputs' pads: the host mirrors "
       "of the pad requests disagree with what the device reads",
       "specmeta/runners/ragged_runner.py",
       "        copy[n:m] = spec.pad",
       "        copy[n:m] = 0",
       ["tests/runners/test_ragged_runner.py", "-k", "every_split"]),
    _m("rn-ragged-bucket-tokens", "runner",
       "the ragged runner picks a bucket by requests only: too few tokens for the batch",
       "specmeta/runners/ragged_runner.py",
       "            if T >= t and bp >= B:",
       "            if bp >= B:",
       ["tests/runners/test_ragged_runner.py", "-k", "bucket_choice"]),
    # ---------------------------------------------------------------- FlashInfer's host part
    _m("h-mirror-set-stale", "host_mirror",
       "FlashInfer's results are all made over the ring's first set: build i + 1 rewrites the "
       "mirrors build i handed to plan()",
       "specmeta/metadata/flashinfer.py",
       "entry = results[slot] = make(B, *key, sets[slot], compiled)",
       "entry = results[slot] = make(B, *key, sets[0], compiled)",
       ["tests/metadata/test_host_mirrors.py", "-k", "round_the_ring"]),
    _m("h-mirror-result-other-set", "host_mirror",
       "FlashInfer's host part writes this turn's set but returns the previous set's result, "
       "whose mirrors hold the previous build's lengths",
       "specmeta/metadata/flashinfer.py",
       "            return entry[0]",
       "            return (results[slot - 1] or entry)[0]",
       ["tests/metadata/test_host_mirrors.py", "-k", "round_the_ring"]),
    _m("h-ring-no-wait", "host_mirror",
       "the ring's turn never waits: it hands out a set whose plan() copy is still queued "
       "behind the stream",
       "specmeta/metadata/host_mirrors.py",
       "            if j >= self._depth and (j - self._depth) % every == 0:",
       "            if False:",
       ["tests/metadata/test_host_mirrors.py", "-k", "reuses_a_set_only_after_its_copy_ran"]),
    _m("h-ring-wrong-event", "host_mirror",
       "the ring's turn waits for the event recorded before the one that covers the set's "
       "last build (its copy may still be queued)",
       "specmeta/metadata/host_mirrors.py",
       "events[((j - self._depth) // every + 1) % len(events)]",
       "events[((j - self._depth) // every) % len(events)]",
       ["tests/metadata/test_host_mirrors.py", "-k", "covers_the_sets_last_build"]),
    # ---------------------------------------------------------------- the compiled host ops
    _m("h-warmup-no-lock", "host_ops",
       "warmup() without its lock: two threads that call it at once build the module twice",
       "specmeta/metadata/host_ops.py",
       "    with _LOCK:\n        if _module is not None:",
       "    if True:\n        if _module is not None:",
       ["tests/metadata/test_host_ops.py", "-k", "two_threads"]),
    # ---------------------------------------------------------------- FA3's host scalar
    _m("m-fa3-stale-max", "host_scalar",
       "FA3's host part writes max_seqlen_k on a result's first call only: later calls of the "
       "batch size keep the first call's max L",
       "specmeta/metadata/fa3.py",
       "                _set_max(meta, top + extra)",
       "                meta.max_seqlen_k or _set_max(meta, top + extra)",
       ["tests/metadata/test_fa3.py", "-k", "follows_seq_lens_cpu"]),
    _m("m-fa3-max-first-pass", "host_scalar",
       "FA3's host part rewrites the first normal pass's max_seqlen_k only (a K = 1 draft "
       "decode's later steps keep theirs)",
       "specmeta/metadata/fa3.py",
       "            for meta, extra in maxima:",
       "            for meta, extra in maxima[:1]:",
       ["tests/metadata/test_fa3.py", "-k", "follows_seq_lens_cpu"]),
    # ---------------------------------------------------------------- ragged verify buckets
    _m("k-pad-lens-capacity-bit", "kernel",
       "pad_verify_lens_to_bucket drops OUT_OF_CAPACITY when the lengths overflow the bucket",
       K + "verify_lens.py",
       "| tl.where(total > T64, OUT_OF_CAPACITY, 0)",
       "| tl.where(total > T64, 0, 0)",
       ["tests/kernels/test_verify_lens.py", "-k", "overflow_sets_capacity"]),
    _m("k-pad-lens-past-bucket", "kernel",
       "pad_verify_lens_to_bucket stores qo_indptr one entry past the bucket",
       K + "verify_lens.py",
       "mask=i <= B_pad)",
       "mask=i <= B_pad + 1)",
       ["tests/kernels/test_verify_lens.py", "-k", "valid_splits"]),
    _m("k-pad-lens-spare", "kernel",
       "pad_verify_lens_to_bucket gives one pad too many the extra token",
       K + "verify_lens.py",
       "pad_len = share + (j < spare).to(tl.int64)",
       "pad_len = share + (j <= spare).to(tl.int64)",
       ["tests/kernels/test_verify_lens.py", "-k", "hand_worked"]),
    _m("k-pad-lens-unclamped-sum", "kernel",
       "pad_verify_lens_to_bucket sums unclamped lengths (a garbage int64 length wraps the total)",
       K + "verify_lens.py",
       "total += tl.sum(tl.minimum(tl.maximum(v, 0), top), axis=0)",
       "total += tl.sum(tl.maximum(v, 0), axis=0)",
       ["tests/kernels/test_verify_lens.py", "-k", "overflow_sets_capacity"]),
    _m("k-pad-lens-cap", "kernel",
       "pad_verify_lens_to_bucket ignores cap (a dense consumer's rows overflow its N columns)",
       K + "verify_lens.py",
       "length = tl.where(CAP > 0, tl.minimum(length, CAP), length)",
       "length = length",
       ["tests/kernels/test_verify_lens.py", "-k", "capped"]),
    _m("r-pad-lens-cap", "reference",
       "pad_verify_lens_to_bucket_ref does not clamp the padded lengths to cap",
       K + "verify_lens.py",
       "        lengths.clamp_(max=cap)\n    out[:Bp]",
       "        pass\n    out[:Bp]",
       ["tests/kernels/test_verify_lens.py", "-k", "hand_worked_capped"]),
    _m("r-pad-lens-absorb", "reference",
       "pad_verify_lens_to_bucket_ref: with no pad request the last request does not take the "
       "leftover",
       K + "verify_lens.py",
       "        lengths[count - 1] += leftover",
       "        lengths[count - 1] += 0",
       ["tests/kernels/test_verify_lens.py", "-k", "hand_worked"]),
    # ---------------------------------------------------------------- ragged verify lists
    _m("k-ragged-kv-length", "kernel", "ragged verify_kv_indices: a list one entry longer than L + v",
       K + "verify_kv_indices.py",
       "n = tl.where(b < B, L + v, 0)",
       "n = tl.where(b < B, L + v + 1, 0)",
       ["tests/kernels/test_ragged_verify.py", "-k", "hand_worked_kv"]),
    _m("k-ragged-kv-offsets", "kernel",
       "ragged verify_kv_indices: list starts summed with the uniform stride L + N, not L + v",
       K + "verify_kv_indices.py",
       "        cum += tl.sum(tl.where(before, tl.maximum(L, 0) + v, 0), axis=0)",
       "        cum += tl.sum(tl.where(before, tl.maximum(L, 0) + N, 0), axis=0)",
       ["tests/kernels/test_ragged_verify.py", "-k", "hand_worked_kv"]),
    _m("k-ragged-kv-bit", "kernel",
       "ragged verify_kv_indices: a v_b < 0 read as 0 but not reported",
       K + "verify_kv_indices.py",
       "        L_ok = L_ok & v_ok\n",
       "",
       ["tests/kernels/test_ragged_verify.py", "-k", "negative and kv"]),
    _m("k-ragged-mask-block", "kernel",
       "ragged tree_custom_mask: a segment of v·(L + N) elements instead of v·(L + v)",
       K + "tree_custom_mask.py",
       "n_bits = tl.where(valid, rows * (L + Nb), 0)",
       "n_bits = tl.where(valid, rows * (L + N), 0)",
       ["tests/kernels/test_ragged_verify.py", "-k", "hand_worked_mask"]),
    _m("k-ragged-mask-start", "kernel", "ragged tree_custom_mask: segment starts summed as v·(L + N)",
       K + "tree_custom_mask.py",
       "        cum += tl.sum(tl.where(before, rows * (L + tl.minimum(rows, N)), 0), axis=0)",
       "        cum += tl.sum(tl.where(before, rows * (L + N), 0), axis=0)",
       ["tests/kernels/test_ragged_verify.py", "-k", "hand_worked_mask"]),
    _m("k-ragged-mask-packed-compact", "kernel",
       "ragged packed tree_custom_mask: segment i at byte ceil(offset / 8) (a byte-compact "
       "layout) instead of at its element offset, the byte FlashInfer's plan() reads",
       K + "tree_custom_mask.py",
       "        start = _ragged_segment_start(seq_lens_ptr, verify_lens_ptr, b, N, BLOCK_B)\n",
       "        start = _ragged_segment_start(seq_lens_ptr, verify_lens_ptr, b, N, BLOCK_B)\n"
       "        if PACKED:\n            start = (start + 7) // 8\n",
       ["tests/kernels/test_ragged_verify.py", "-k", "hand_worked_mask"]),
    _m("k-ragged-mask-bit", "kernel",
       "ragged tree_custom_mask: a v_b < 0 read as 0 but not reported",
       K + "tree_custom_mask.py",
       "        L_ok = L_ok & v_ok\n",
       "",
       ["tests/kernels/test_ragged_verify.py", "-k", "negative and mask"]),
    _m("k-ragged-expand-rows", "kernel",
       "ragged verify_expand_page_table: nodes j >= v_b keep their ancestor lists",
       K + "verify_expand_page_table.py",
       "in_tile = tl.where(live, (jj < V) & (cc < V), False)",
       "in_tile = tl.where(live, (jj < N) & (cc < V), False)",
       ["tests/kernels/test_ragged_verify.py", "-k", "hand_worked_expand"]),
    _m("k-ragged-expand-columns", "kernel",
       "ragged verify_expand_page_table: mask columns c >= v_b counted as ancestors",
       K + "verify_expand_page_table.py",
       "in_tile = tl.where(live, (jj < V) & (cc < V), False)",
       "in_tile = tl.where(live, (jj < V) & (cc < N), False)",
       ["tests/kernels/test_ragged_verify.py", "-k", "any_mask_bits and expand"]),
    _m("k-ragged-expand-zero-fill", "kernel",
       "ragged verify_expand_page_table: columns [v_b, N) of the verified nodes left unwritten",
       K + "verify_expand_page_table.py",
       "mask=row_live & (cc < N) & ~in_tile)",
       "mask=row_live & (cc < V) & ~in_tile)",
       ["tests/kernels/test_ragged_verify.py", "-k", "random_splits and expand"]),
    _m("k-ragged-expand-reads", "kernel",
       "ragged verify_expand_page_table: the whole N-slot window read, slots past L + v_b "
       "included (POS_OOB for a window that fits to L + v_b)",
       K + "verify_expand_page_table.py",
       "want = tl.where(live, c < V, False)",
       "want = tl.where(live, c < N, False)",
       ["tests/kernels/test_ragged_verify.py", "-k", "window_reads and expand"]),
    _m("k-ragged-expand-bit", "kernel",
       "ragged verify_expand_page_table: a v_b outside [0, N] read clamped but not reported",
       K + "verify_expand_page_table.py",
       "        L_ok = L_ok & v_ok\n",
       "",
       ["tests/kernels/test_ragged_verify.py", "-k", "(negative or past_n) and expand"]),
    _m("r-ragged-kv-length", "reference",
       "verify_kv_indices_ref: ragged lists of L + N entries (v_b ignored)",
       K + "verify_kv_indices.py",
       "        n = n - extra_tokens + v\n",
       "",
       ["tests/kernels/test_ragged_verify.py", "-k", "random_splits and kv"]),
    _m("r-ragged-mask-columns", "reference", "tree_custom_mask_ref: ragged rows L + N columns wide",
       K + "tree_custom_mask.py",
       "        cols = (L + V)[req_b]",
       "        cols = (L + N)[req_b]",
       ["tests/kernels/test_ragged_verify.py", "-k", "random_splits and mask"]),
    _m("r-ragged-expand-empty-rows", "reference",
       "verify_expand_page_table_ref: nodes j >= v_b keep the window slots in their rows",
       K + "verify_expand_page_table.py",
       "    table = torch.where(node, table, 0).reshape(BN, N)",
       "    table = table.reshape(BN, N)",
       ["tests/kernels/test_ragged_verify.py", "-k", "random_splits and expand"]),
    _m("s-window-recent-start", "shared",
       "a draft window's recent tokens start one position early (they overlap the sink's last), "
       "in the device helper and its torch twin alike",
       K + "_common.py",
       "    return tl.where(k < tl.minimum(sink, L), k, L - Lw + k)",
       "    return tl.where(k < tl.minimum(sink, L), k, L - Lw + k - 1)",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "window_edges"],
       also=((K + "_common.py", "return torch.where(k < L.clamp_max(sink), k, L - Lw + k)",
              "return torch.where(k < L.clamp_max(sink), k, L - Lw + k - 1)"),)),
    _m("s-window-length-no-sink", "shared",
       "a draft window keeps window tokens, not window + sink, in the helper and its twin",
       K + "_common.py",
       "return tl.where(window > 0, tl.minimum(L, window + sink), L)",
       "return tl.where(window > 0, tl.minimum(L, window), L)",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "window_edges"],
       also=((K + "_common.py", "return L.clamp_max(window + sink) if window > 0 else L",
              "return L.clamp_max(window) if window > 0 else L"),)),
    _m("k-window-offsets-full-length", "kernel",
       "the windowed draft lists are placed by the full prefix lengths of earlier requests",
       K + "draft_decode_kv_ids.py",
       "kept, _ = rail_draft_lengths(windowed_length(tl.maximum(before, 0), window, sink), s,",
       "kept, _ = rail_draft_lengths(tl.maximum(before, 0), s,",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "follow_the_rules and window"]),
    _m("k-page-row-offset", "kernel",
       "a page-granular row gives every token of a page the page's first slot",
       K + "_common.py",
       "        ids = page * ENTRY_PAGE_SIZE + pos % ENTRY_PAGE_SIZE\n",
       "        ids = page * ENTRY_PAGE_SIZE\n",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "page_rows"]),
    _m("k-v2p-offset", "kernel", "a translated id loses its offset within the page",
       K + "_common.py",
       "return tl.where(read & ~bad, phys.to(tl.int64) * page_size + ids % page_size, 0), bad",
       "return tl.where(read & ~bad, phys.to(tl.int64) * page_size, 0), bad",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "virtual"]),
    _m("k-v2p-past-map", "kernel",
       "an id whose page lies past the v2p map is read from past the map, not refused",
       K + "_common.py",
       "mask=read & (ids >= 0) & (vpage < num_pages), other=-1)",
       "mask=read & (ids >= 0), other=-1)",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "page_past_map"]),
    _m("k-bad-kv-id-bit", "kernel", "the draft lists drop BAD_KV_ID",
       K + "draft_decode_kv_ids.py",
       "    bad_bit = tl.where(bad != 0, BAD_KV_ID, 0)",
       "    bad_bit = tl.where(bad != 0, 0, 0)",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "does_not_map"]),
    _m("k-accept-half-pair", "kernel",
       "accept_cache_locs keeps the mapped end of a pair whose other slot is unmapped (a move "
       "from or to the sink slot into a real one)",
       K + "accept_cache_locs.py",
       "            tgt = tl.where(lost, 0, tgt)\n",
       "",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "accept"]),
    # ---------------------------------------------------------------- FA3's ragged verify
    _m("k-expand-ragged-start", "kernel",
       "verify_expand_ragged writes a request's node rows at i·N, not at its query offset",
       K + "verify_expand_ragged.py",
       "    r = start + jj  # the node rows",
       "    r = i * N + jj  # the node rows",
       ["tests/kernels/test_verify_expand_ragged.py", "-k", "match_reference"]),
    _m("k-expand-ragged-filler", "kernel",
       "verify_expand_ragged: a filler row lists one node fewer than the request verifies",
       K + "verify_expand_ragged.py",
       "        tl.store(cache_seqlens_ptr + rf, V + 0 * rf, mask=okf)",
       "        tl.store(cache_seqlens_ptr + rf, V - 1 + 0 * rf, mask=okf)",
       ["tests/kernels/test_verify_expand_ragged.py", "-k", "match_reference"]),
    _m("k-expand-ragged-no-request", "kernel",
       "verify_expand_ragged leaves the bucket's rows of no request unwritten",
       K + "verify_expand_ragged.py",
       "_empty_rows(page_table_ptr, cache_seqlens_ptr, tl.maximum(start, 0), T, T, W, stride_pt,",
       "_empty_rows(page_table_ptr, cache_seqlens_ptr, T + 0 * start, T, T, W, stride_pt,",
       ["tests/kernels/test_verify_expand_ragged.py", "-k", "no_request"]),
    _m("r-expand-ragged-filler", "reference",
       "verify_expand_ragged_ref: a filler row counts one node fewer",
       K + "verify_expand_ragged.py",
       "                counts[r] = V\n",
       "                counts[r] = V - 1\n",
       ["tests/kernels/test_verify_expand_ragged.py", "-k", "match_reference"]),
    _m("b-fa3-ragged-normal-causal", "stage",
       "FA3's ragged verify marks its prefix pass causal: rows see a bottom-right cut of it",
       "specmeta/metadata/fa3.py",
       "cu_seqlens_k_new=cu[: B + 1], max_seqlen_q=T, causal=False, return_softmax_lse=True,",
       "cu_seqlens_k_new=cu[: B + 1], max_seqlen_q=T, causal=True, return_softmax_lse=True,",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "fa3_ragged_verify_cascade"]),
    _m("b-fa3-ragged-prefix-window", "stage",
       "FA3's ragged verify lists the N window slots in its prefix pass too (read twice)",
       "specmeta/metadata/fa3.py",
       "                         extra_tokens=0, status=status, **out[\"normal\"]),",
       "                         extra_tokens=N, status=status, **out[\"normal\"]),",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "fa3_ragged_verify_cascade"]),
    _m("b-trtllm-ragged-uncapped", "stage",
       "TRT-LLM MLA's ragged verify pads its lengths without the cap: a request's rows overflow "
       "the dense kernel's N",
       "specmeta/metadata/trtllm_mla.py",
       "cap=cfg.num_draft_tokens)",
       "cap=None)",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "trtllm_mla_ragged_verify_keeps"]),
    _m("b-trtllm-ragged-unchecked-copy", "stage",
       "TRT-LLM MLA's ragged verify leaves out the device check of verify_lens_cpu",
       "specmeta/metadata/trtllm_mla.py",
       "return self._stage(mode, B, [pad, launch, check], result, seq_lens, status, verify)",
       "return self._stage(mode, B, [pad, launch], result, seq_lens, status, verify)",
       ["tests/metadata/test_ragged_verify_builders.py", "-k", "trtllm_mla_ragged_verify_checks"]),
    _m("k-ragged-accept-start", "kernel",
       "ragged accept_cache_locs reads request i's window at i·N, not at qo_indptr[i]",
       K + "accept_cache_locs.py",
       "lo = tl.load(qo_indptr_ptr + i, mask=row_live, other=0).to(tl.int64)[:, None]",
       "lo = i[:, None] * N",
       ["tests/kernels/test_ragged_accept.py", "-k", "splits or planted"]),
    _m("k-ragged-accept-width", "kernel",
       "ragged accept_cache_locs takes a window's filler rows (past N) for tree nodes",
       K + "accept_cache_locs.py",
       "w = tl.minimum(hi - lo, N)",
       "w = hi - lo",
       ["tests/kernels/test_ragged_accept.py", "-k", "filler_row"]),
    _m("k-ragged-accept-k-width", "kernel",
       "ragged accept_cache_locs accepts an entry k past the window's width (its target is the "
       "next request's row)",
       K + "accept_cache_locs.py",
       "ok = want & (idx >= lo) & (idx < lo + w) & (k[None, :] < w)",
       "ok = want & (idx >= lo) & (idx < lo + w)",
       ["tests/kernels/test_ragged_accept.py", "-k", "k_past_width"]),
    _m("k-ragged-accept-rows", "kernel",
       "ragged accept_cache_locs reads rows past the end of out_cache_loc",
       K + "accept_cache_locs.py",
       "ok = ok & (row >= 0) & (row < n_slots) & (idx >= 0) & (idx < n_slots)",
       "ok = ok & (row >= 0) & (idx >= 0)",
       ["tests/kernels/test_ragged_accept.py", "-k", "past_out_cache_loc"]),
    _m("k-ragged-accept-filler-bit", "kernel",
       "accept_cache_locs skips an entry past its window's first N rows (a filler row) without "
       "reporting BAD_ACCEPT",
       K + "accept_cache_locs.py",
       "wrong = (want & ~ok) | (live & ~want & (idx != -1))",
       "wrong = (want & ~ok & (idx < lo + N)) | (live & ~want & (idx != -1))",
       ["tests/kernels/test_ragged_accept.py", "-k", "filler_row"]),
    _m("r-ragged-accept-start", "reference",
       "accept_cache_locs_ref reads ragged windows at i·N, not at qo_indptr[i]",
       K + "accept_cache_locs.py",
       "lo, w = q[:-1].view(-1, 1), (q[1:] - q[:-1]).clamp_max(N).view(-1, 1)",
       "lo, w = torch.arange(B, device=device).view(-1, 1) * N, (q[1:] - q[:-1]).clamp_max(N)"
       ".view(-1, 1)",
       ["tests/kernels/test_ragged_accept.py", "-k", "splits or planted"]),
    _m("r-ragged-accept-width", "reference",
       "accept_cache_locs_ref takes a ragged window's filler rows (past N) for tree nodes",
       K + "accept_cache_locs.py",
       "(q[1:] - q[:-1]).clamp_max(N).view(-1, 1)",
       "(q[1:] - q[:-1]).view(-1, 1)",
       ["tests/kernels/test_ragged_accept.py", "-k", "filler_row"]),
    _m("k-tail-pair-half", "kernel",
       "prefix_tail_copy_pairs keeps the mapped end of a pair whose other slot is unmapped",
       K + "draft_cache_locs.py",
       "    tl.store(tgt_ptr + b * width + e, tl.where(lost, 0, tgt), mask=live)",
       "    tl.store(tgt_ptr + b * width + e, tgt, mask=live)",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "prefix_tail"]),
    _m("k-verify-bad-kv-id-bit", "kernel", "verify_kv_indices drops BAD_KV_ID",
       K + "verify_kv_indices.py",
       "        bits = tl.where(bad != 0, BAD_KV_ID, 0)",
       "        bits = tl.where(bad != 0, 0, 0)",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "verify_lists"]),
    _m("s-copy-row-page-rows", "shared",
       "the ragged list copy reads a page-granular row as token ids (entry_page_size ignored), "
       "in the device helper and its torch twin",
       K + "_common.py",
       "                                  W_row, v2p_ptr, num_pages, page_size, ENTRY_PAGE_SIZE,\n"
       "                                  TRANSLATE)  # fmt: skip",
       "                                  W_row, v2p_ptr, num_pages, page_size, 1,\n"
       "                                  TRANSLATE)  # fmt: skip",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "verify_lists and page_rows"],
       also=((K + "_common.py", "                                   entry_page_size=entry_page_size, v2p=v2p,\n",
              "                                   entry_page_size=1, v2p=v2p,\n"),)),
    _m("s-verify-filler-rows", "shared",
       "a ragged request's rows past N read the tree mask past its N rows instead of being "
       "filler rows (every column), in the kernel helper and its torch twin",
       K + "tree_custom_mask.py",
       "    in_tree = (col >= L) & (j < Nt)\n",
       "    in_tree = col >= L\n",
       ["tests/kernels/test_ragged_verify.py", "-k", "leftover or past_n"],
       also=((K + "tree_custom_mask.py", "filler = j >= V[req_b]", "filler = j < 0"),)),
    _m("k-pad-real-past-n", "kernel",
       "pad_verify_lens_to_bucket lets a real length past num_draft_tokens through unreported",
       K + "verify_lens.py",
       "negative |= tl.max(((v < 0) | ((N > 0) & (v > N))).to(tl.int32), axis=0)",
       "negative |= tl.max((v < 0).to(tl.int32), axis=0)",
       ["tests/kernels/test_verify_lens.py", "-k", "past_n"]),
    _m("r-bad-kv-id-unread", "reference",
       "the draft-lists reference reports BAD_KV_ID for ids dropped for capacity (never read)",
       K + "draft_decode_kv_ids.py",
       "        bad |= bool(prefix_bad[bz][keep].any())",
       "        bad |= bool(prefix_bad.any())",
       ["tests/kernels/test_kv_id_spaces.py", "-k", "short_buffer"]),
    _m("s-verify-len-over-n", "shared",
       "load_verify_len and verify_lens_ref (the FA3 expand pass): a v_b over N read clamped but not reported",
       K + "_common.py",
       "    v_ok = (raw >= 0) & (raw <= N)\n",
       "    v_ok = raw >= 0\n",
       ["tests/kernels/test_ragged_verify.py", "-k", "past_n and expand"],
       also=((K + "_common.py", "bad = bool(((raw < 0) | (raw > N)).any())",
              "bad = bool((raw < 0).any())"),)),
    # ---------------------------------------------------------------- seq_lens_cpu on the device
    _m("k-stale-total", "kernel",
       "the seq_lens_cpu check compares the maximum only (a stale copy with the same maximum "
       "passes)",
       K + "host_lengths.py",
       "((n > B) | (total != want_sum) | (top != want_max))",
       "((n > B) | (top != want_max))",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "worked_examples"]),
    _m("k-stale-pads", "kernel",
       "the seq_lens_cpu check reads the whole padded batch, pads included",
       K + "host_lengths.py",
       "mask=offs < count, other=0)",
       "mask=offs < B, other=0)",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "worked_examples"]),
    _m("k-stale-not-consumed", "kernel",
       "the seq_lens_cpu check leaves the slot armed: a later build without seq_lens_cpu "
       "checks an old copy",
       K + "host_lengths.py",
       "    tl.store(seen_ptr, seq)",
       "    tl.store(seen_ptr, seq - 1)",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "worked_examples"]),
    _m("k-stale-never-consumed", "kernel",
       "the seq_lens_cpu check never marks the host slot consumed: the host never publishes "
       "again and every later copy goes unchecked",
       K + "host_lengths.py",
       "    tl.store(slot_ptr + 4, seq)  # consumed: the host may publish again\n",
       "",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "every_mode"]),
    _m("s-stale-publish-over-unread", "stage",
       "a host part publishes over values the device has not read: a host ahead of the device "
       "has the earlier build checked against its own copy",
       K + "host_lengths.py",
       "    if slot[CONSUMED] != seq:\n",
       "    if False:\n",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "publishes_only or every_mode"]),
    _m("s-stale-opt-out-ignored", "stage",
       "a builder made with check_host_lengths=False still launches the check in every stage",
       "specmeta/metadata/contract.py",
       "        if not self.check_host_lengths:\n            return None\n        return self._launch(bind_check_host_lengths, check_host_lengths_ref, seq_lens,",
       "        return self._launch(bind_check_host_lengths, check_host_lengths_ref, seq_lens,",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "without_the_check"]),
    _m("r-stale-total", "reference",
       "check_host_lengths_ref compares the maximum only",
       K + "host_lengths.py",
       "        if n >= 0 and (n > B or total != want_sum or top != want_max):",
       "        if n >= 0 and (n > B or top != want_max):",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "worked_examples"]),
    _m("s-stale-not-sent", "stage",
       "a builder's host part reads seq_lens_cpu but sends nothing to the device check",
       "specmeta/metadata/contract.py",
       "            publish_host_lengths(self._host_published[mode], B, found[1], found[0])",
       "            pass",
       ["tests/metadata/test_stale_host_lengths.py", "-k", "every_mode"]),
    # ---------------------------------------------------------------- builders' host checks
    _m("i-max-bs", "host_check", "builders accept a batch one over max_bs",
       "specmeta/metadata/inputs.py",
       "if B > cfg.max_bs:",
       "if B > cfg.max_bs + 1:",
       ["tests/metadata/test_builder_messages.py", "-k", "max_bs"]),
    _m("i-row-width", "host_check", "builders accept req_to_token one column narrow",
       "specmeta/metadata/inputs.py",
       "if table.shape[1] < need:",
       "if table.shape[1] < need - 1:",
       ["tests/metadata/test_builder_messages.py", "-k", "narrow_req_to_token or exact_limits"]),
    _m("i-out-cache-loc", "host_check", "out_cache_loc checked without the topk factor",
       "specmeta/metadata/inputs.py",
       "need_slots = B * cfg.topk * cfg.num_steps",
       "need_slots = B * cfg.num_steps",
       ["tests/metadata/test_builder_messages.py", "-k", "fa3_draft_slots"]),
    _m("i-negative-len", "host_check", "builders accept seq_lens_cpu of -1",
       "specmeta/metadata/inputs.py",
       "if low < 0:",
       "if low < -1:",
       ["tests/metadata/test_builder_messages.py", "-k", "negative_seq_lens_cpu or exact_limits"]),
    _m("i-max-context", "host_check", "builders accept a length one past max_context_len",
       "specmeta/metadata/inputs.py",
       "if high > cfg.max_context_len:",
       "if high > cfg.max_context_len + 1:",
       ["tests/metadata/test_builder_messages.py", "-k", "seq_lens_over_the_plan or exact_limits"]),
    _m("i-length-table", "host_check",
       "the length table (FlashInfer's check of seq_lens_cpu) holds one length past max_context_len",
       "specmeta/metadata/host_ops.py",
       "self.values = _positions(max_len + shift + 1)[shift:]",
       "self.values = _positions(max_len + shift + 2)[shift:]",
       ["tests/metadata/test_host_ops.py", "-k", "out_of_range"]),
    _m("h-compiled-length-check", "host_check",
       "the compiled host-mirror writers accept a length one past max_context_len",
       "specmeta/metadata/host_ops.c",
       "bad |= (unsigned long long)x > (unsigned long long)max_len;",
       "bad |= (unsigned long long)x > (unsigned long long)max_len + 1;",
       ["tests/metadata/test_builder_messages.py", "-k", "seq_lens_over_the_plan or exact_limits"]),
    # ---------------------------------------------------------------- launchers' host checks
    _m("v-at-least", "validate", "capacity check lets a buffer one element short through",
       "specmeta/validate.py",
       "if need > have:",
       "if need > have + 1:",
       ["tests/kernels/test_verify_kv_indices.py", "tests/kernels/test_tree_custom_mask.py",
        "-k", "bad_input"]),
    _m("v-tensor-fast-dtype", "validate",
       "validate.tensor's one-test fast path takes a tensor of a wrong dtype as a good one",
       "specmeta/validate.py",
       "            t.dtype in dtypes\n            and (ndim is None or t.dim() == ndim)",
       "            t.dtype not in dtypes\n            and (ndim is None or t.dim() == ndim)",
       ["tests/kernels/test_draft_cache_locs.py", "-k", "bad_input"]),
    _m("v-positive", "validate", "positive() accepts minimum - 1",
       "specmeta/validate.py",
       "if value < minimum:",
       "if value < minimum - 1:",
       ["tests/runners/test_graph_runner.py", "tests/kernels/test_cache_loc_move.py",
        "-k", "seq_lens_fill or accept_bad_input"]),
    _m("v-length", "validate", "length() accepts a longer tensor",
       "specmeta/validate.py",
       "if t.shape[0] != expected:",
       "if t.shape[0] < expected:",
       ["tests/kernels/test_verify_kv_indices.py", "tests/kernels/test_cache_loc_move.py",
        "-k", "bad_input"]),
    _m("v-status-length", "validate", "a status word of any length is accepted",
       "specmeta/validate.py",
       '    length("status", t, 1)\n',
       "",
       ["tests/kernels/test_verify_kv_indices.py", "tests/kernels/test_cache_loc_move.py",
        "tests/kernels/test_tree_custom_mask.py", "tests/metadata/test_builder_messages.py",
        "-k", "bad_input or status_word_of_the_wrong_shape"]),
    # ---------------------------------------------------------------- the capacity plan
    _m("c-window-cap", "config", "draft-decode lists sized for the window alone, not + sink",
       "specmeta/config.py",
       "return min(self.max_context_len, self.draft_window_size + self.draft_sink_size)",
       "return min(self.max_context_len, self.draft_window_size)",
       ["tests/metadata/test_id_spaces.py", "-k", "plan_sizes"]),
    _m("c-window-served-anyway", "config",
       "a builder mode that builds no draft window is served for a config with one (its lists "
       "would ignore the window)",
       "specmeta/metadata/capabilities.py",
       "        if windowed and mode not in self.draft_window:",
       "        if windowed and mode not in self.draft_window and False:",
       ["tests/metadata/test_id_spaces.py", "-k", "refuses_a_config"]),
    _m("c-kv-indices-topk", "config", "draft-decode kv_indices sized without the topk factor",
       "specmeta/config.py",
       "return topk * seq_lens_sum + batch * topk * num_rows",
       "return seq_lens_sum + batch * topk * num_rows",
       ["tests/test_config.py", "-k", "topk_factor"]),
    _m("c-row-need-topk", "config", "req_to_token row need without the topk factor",
       "specmeta/config.py",
       "return prefix_len + topk * num_steps",
       "return prefix_len + num_steps",
       ["tests/test_config.py", "tests/metadata/test_builder_messages.py",
        "-k", "row_width or narrow_req_to_token or row_need_by_hand"]),
    _m("c-tail-pairs-topk", "config", "prefix-tail pair buffers sized without the topk factor",
       "specmeta/config.py",
       "tail_pairs = bs * (k - 1) * (ps - 1) if cfg.layout_b else 0",
       "tail_pairs = bs * (ps - 1) if cfg.layout_b else 0",
       ["tests/test_config.py", "-k", "prefix_tail"]),
    # ---------------------------------------------------------------- the runner's padding
    _m("p-copy-pad-value", "runner", "copy_pad kernel pads with 0 whatever the pad value",
       "specmeta/runners/padding.py",
       "v = tl.where(from_src, v, pad)",
       "v = tl.where(from_src, v, 0)",
       ["tests/runners/test_graph_runner.py", "-k", "copy_pad_matches"]),
    _m("p-seq-lens-fill", "runner", "seq_lens pad covers only the first query width",
       "specmeta/runners/padding.py",
       "return max(1, *query_widths)",
       "return max(1, query_widths[0])",
       ["tests/runners/test_graph_runner.py", "-k", "seq_lens_fill"]),
    _m("p-device-pad-dropped", "runner", "runner copies [:B] but leaves the [B:Bp] tail stale",
       "specmeta/runners/graph_runner.py",
       "pairs.append((src, rows, spec.pad))",
       "pairs.append((src, rows[: src.shape[0]], spec.pad))",
       ["tests/runners/test_graph_runner.py", "-k", "poisoned_tails"]),
    _m("p-many-skips-last", "runner", "copy_pad_many launches one buffer fewer than it was given",
       "specmeta/runners/padding.py",
       "_copy_pad_many_launch.bind((blocks, len(group)), **args",
       "_copy_pad_many_launch.bind((blocks, len(group) - 1), **args",
       ["tests/runners/test_graph_runner.py", "-k", "copy_pad_many"]),
    _m("p-host-part-bucket", "runner",
       "the runner binds B's host part on the bucket's views: the results describe Bp requests",
       "specmeta/runners/graph_runner.py",
       "stage = self._stage_fn(types.MappingProxyType(self._views_of(B)))",
       "stage = self._stage_fn(types.MappingProxyType(self._views_of(bp)))",
       ["tests/runners/test_graph_runner.py", "-k", "poisoned_tails"]),
    _m("p-persistent-forgets-rows", "runner",
       "a persistent batch's replay forgets the rows it wrote (a shrunk batch keeps stale rows)",
       "specmeta/runners/graph_runner.py",
       "        self._dirty = batch_size\n",
       "        self._dirty = 0\n",
       ["tests/runners/test_graph_runner.py", "-k", "persistent"]),
    # ---------------------------------------------------------------- the runner's held tensors
    _m("p-held-no-shapes", "runner",
       "the runner's captured-tensor check ignores shapes: a stage is replayed after a static "
       "input or a guarded tensor was resized in place",
       "specmeta/runners/graph_runner.py",
       "held = [(t.data_ptr(), t.shape, t.stride()) for t in self._buffers]",
       "held = [(t.data_ptr(), t.stride()) for t in self._buffers]",
       ["tests/test_stage.py", "-k", "held_tensor_changed and shape"],
       also=(("specmeta/runners/graph_runner.py",
              "held.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))",
              "held.append((t.data_ptr(), t.stride(), t.dtype, t.device))"),)),
    _m("p-held-no-strides", "runner",
       "the runner's captured-tensor check ignores strides: a stage is replayed after a static "
       "input or a guarded tensor was transposed in place",
       "specmeta/runners/graph_runner.py",
       "held = [(t.data_ptr(), t.shape, t.stride()) for t in self._buffers]",
       "held = [(t.data_ptr(), t.shape) for t in self._buffers]",
       ["tests/test_stage.py", "-k", "held_tensor_changed and strides"],
       also=(("specmeta/runners/graph_runner.py",
              "held.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device))",
              "held.append((t.data_ptr(), t.shape, t.dtype, t.device))"),)),
    _m("p-replay-skips-held", "runner",
       "a persistent replay of a batch size replayed before no longer checks the captured "
       "tensors",
       "specmeta/runners/graph_runner.py",
       "        if self._held() != self._layout:\n            self._check_held()  # raises, naming what changed\n",
       "",
       ["tests/test_stage.py", "-k", "held_tensor_changed"]),
    _m("p-capture-collector-on", "runner",
       "capture() leaves the cyclic collector on: a dead graph destroyed mid-capture fails it",
       "specmeta/runners/graph_runner.py",
       "        with collector_off():\n",
       "        with contextlib.nullcontext():\n",
       ["tests/runners/test_graph_runner.py", "-k", "dead_graph"],
       gpu=True),
    # ---------------------------------------------------------------- bound stages
    _m("st-host-after-launch", "stage",
       "calling a stage launches before its host part: a refused seq_lens_cpu raises after the "
       "outputs were written",
       "specmeta/stage.py",
       "        result = self.host(seq_lens_cpu, **host_inputs)\n        for launch in self.launches:\n"
       "            launch()\n        return result\n",
       "        for launch in self.launches:\n            launch()\n"
       "        return self.host(seq_lens_cpu, **host_inputs)\n",
       ["tests/test_stage.py", "tests/metadata/test_builder_messages.py", "-k",
        "refused_length or host_part_before or bound_stage_refuses"]),
    _m("st-views-keyed-by-mode", "stage",
       "a builder's views made once per mode, not per (mode, B, rows): a stage bound for one "
       "batch size launches into, and returns, the views of another",
       "specmeta/metadata/contract.py",
       "        found = self._views.get(key)\n        if found is None:\n"
       "            found = self._views[key] = make(*args)",
       "        found = self._views.get(key[0])\n        if found is None:\n"
       "            found = self._views[key[0]] = make(*args)",
       ["tests/test_stage.py", "-k", "own_views"]),
    _m("st-fa3-views-without-rows", "stage",
       "FA3's draft-decode views keyed without rows: a stage of fewer rows returns the steps "
       "of the rows bound first",
       "specmeta/metadata/fa3.py",
       'self.views(("draft_decode", B, rows), self._draft_views, B, rows)',
       'self.views(("draft_decode", B), self._draft_views, B, rows)',
       ["tests/test_stage.py", "-k", "own_views"]),
    _m("st-eager-memoizes", "stage",
       "bind_draft_extend hands back the stage it bound first for the batch size, whatever "
       "tensors it is given: an eager call launches on an earlier call's tensors",
       "specmeta/metadata/fa3.py",
       'return self._stage("draft_extend", B, [launch, check], result, [(result, N)])',
       'return self.views(("draft_extend.stage", B), self._stage, "draft_extend", B, [launch, '
       "check], result, [(result, N)])",
       ["tests/metadata/test_fa3.py", "-k", "eager_call_reads"]),
    # ---------------------------------------------------------------- bound launches
    _m("l-bind-grid-first-dim", "launch",
       "a bound launch keeps only its grid's first dimension",
       "specmeta/launch.py",
       "functools.partial(self.kernel[grid], **args, **options)",
       "functools.partial(self.kernel[grid[:1]], **args, **options)",
       ["tests/kernels/test_draft_decode_kv_indices.py", "-k", "spec_example"],
       also=(("specmeta/launch.py",
              "full = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)",
              "full = (grid[0], 1, 1)"),)),
    _m("l-bind-unchecked-arguments", "launch",
       "Launcher.bind no longer checks the kernel's arguments by name: a missing or misspelt "
       "one is found at the first launch, not named at the bind",
       "specmeta/launch.py",
       "if args.keys() != self._name_set:",
       "if False:",
       ["tests/kernels/test_launch.py", "-k", "bind_names"]),
    _m("l-launch-keeps-addresses", "launch",
       "a Launch keeps its tensors' addresses (data_ptr() ints), not the tensors: a launch "
       "outlives what it points at and writes freed memory",
       "specmeta/launch.py",
       "return Launch(compiled, full, tuple(map(args.__getitem__, self.names)), device)",
       "return Launch(compiled, full, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a "
       "for a in map(args.__getitem__, self.names)), device)",
       ["tests/kernels/test_launch.py", "-k", "keeps_the_tensors"],
       gpu=True),
    # ---------------------------------------------------------------- end to end (lossless)
    _m("e-ragged-chain-ancestors", "e2e",
       "FA3's ragged expand pass (kernel and reference alike) reads a chain node's ancestors "
       "without the node itself: lossless decoding breaks with a ragged verify",
       K + "verify_expand_ragged.py",
       "        m = in_tile & (cc <= jj)",
       "        m = in_tile & (cc < jj)",
       [LOSSLESS, "-k", "ragged and self"],
       also=((K + "verify_expand_ragged.py",
              "chain = torch.ones(N, N, dtype=torch.bool, device=device).tril()",
              "chain = torch.ones(N, N, dtype=torch.bool, device=device).tril(-1)"),)),
    _m("e-verify-mask-transposed", "e2e", "verify mask reads the tree columns transposed",
       K + "tree_custom_mask.py",
       "m = tl.load(tree_ptr + j * stride_mj + (col - L), mask=live & in_tree, other=0)",
       "m = tl.load(tree_ptr + (col - L) * stride_mj + j, mask=live & in_tree, other=0)",
       [LOSSLESS, "-k", "test_lossless_cpu and flashinfer and perturbed"]),
    _m("e-accept-not-compacted", "e2e",
       "accept pairs of request i stored at i·C, not compacted (the zeroed tail eats them)",
       K + "accept_cache_locs.py",
       "dst = first[:, None] + k[None, :]  # < Σacc ≤ B·C ≤ n_out",
       "dst = i[:, None] * C + k[None, :]",
       # Trees of both backends (FA3 topk 4, FlashInfer topk 2): a request past the first
       # whose accepted path needs a move shows it; one backend alone misses it on some seeds.
       [LOSSLESS, "-k", "test_lossless_cpu and perturbed"]),
    _m("e-move-only-k", "e2e",
       "move_kv_cache moves the first half of the pool's buffers only (K, not V)",
       K + "cache_loc_move.py",
       # The interpreter launches once per buffer (TABLE=False): drop the V half there.
       "    for words in pool.words:\n",
       "    for words in pool.words[: (len(pool.words) + 1) // 2]:\n",
       [LOSSLESS, "-k", "test_lossless_cpu and perturbed"]),
    _m("e-draft-list-shifted", "e2e", "draft decode lists read each chain one step ahead",
       K + "draft_decode_kv_indices.py",
       "chain_pos = draft_slot_position(L, t_d[:, None], j, page_size, NUM_STEPS, LAYOUT_B)",
       "chain_pos = draft_slot_position(L, t_d[:, None], j + 1, page_size, NUM_STEPS, LAYOUT_B)",
       # The CPU tier's lossless cases run FlashInfer's paged form; `specmeta check`'s loop
       # runs its token lists (draft_decode), against the same loop on the references.
       [LOSSLESS, "-k", "check_prints_tokens_per_iteration"]),
    # ------------------------------------------- FlashInfer's cascade and paged draft forms
    _m("k-branch-kv-page-rows-as-tokens", "kernel",
       "branch_kv_indices reads rows of page ids as rows of token ids",
       K + "branch_kv_indices.py",
       "                num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE,\n            )  # fmt: skip\n"
       "            page = slot // page_size",
       "                num_pages, page_size, 1, TRANSLATE,\n            )  # fmt: skip\n"
       "            page = slot // page_size",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "paged_lists_follow and page_rows"]),
    _m("k-branch-kv-untranslated", "kernel",
       "branch_kv_indices lists the virtual pages: its ids skip the page map",
       K + "branch_kv_indices.py",
       "                num_pages, page_size, ENTRY_PAGE_SIZE, TRANSLATE,\n            )  # fmt: skip\n"
       "            page = slot // page_size",
       "                num_pages, page_size, ENTRY_PAGE_SIZE, False,\n            )  # fmt: skip\n"
       "            page = slot // page_size",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "paged_lists_follow and virtual"]),
    _m("k-branch-kv-unmapped-unstored", "kernel",
       "branch_kv_indices reports BAD_KV_ID for an unmapped page it never stored (capacity)",
       K + "branch_kv_indices.py",
       "unmapped |= tl.max((wrong & stored).to(tl.int32), axis=0)",
       "unmapped |= tl.max(wrong.to(tl.int32), axis=0)",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "dropped_for_capacity"]),
    _m("r-branch-kv-untranslated", "reference",
       "branch_kv_indices_ref reads the rows without their page map",
       K + "branch_kv_indices.py",
       "                                            entry_page_size=E, v2p=v2p, page_size=ps)",
       "                                            entry_page_size=E, v2p=None, page_size=ps)",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "paged_lists_follow and virtual"]),
    _m("k-shared-window-first-tokens", "kernel",
       "the shared-prefix level lists the first Lw tokens, not the sink and the recent ones",
       K + "shared_prefix_kv_indices.py",
       "req_to_token_ptr + row_base, window_position(k, L, Lw, sink),",
       "req_to_token_ptr + row_base, k,",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "cascade_window_follows"]),
    _m("k-shared-window-offsets", "kernel",
       "the shared-prefix level places each list after the full lengths before it, not the Lw",
       K + "shared_prefix_kv_indices.py",
       "start += tl.sum(windowed_length(tl.maximum(before, 0), window, sink), axis=0)",
       "start += tl.sum(tl.maximum(before, 0), axis=0)",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "cascade_window_edges"]),
    _m("r-shared-window-ignored", "reference",
       "shared_prefix_kv_indices_ref builds no window",
       K + "shared_prefix_kv_indices.py",
       "Lw = windowed_length_ref(seq_lens, window, sink)",
       "Lw = windowed_length_ref(seq_lens, 0, sink)",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "cascade_window_follows"]),
    _m("v-shared-window-bound", "validate",
       "the shared-prefix host bound ignores the window: a buffer sized for it is refused",
       K + "shared_prefix_kv_indices.py",
       "return min(total, batch * (window + sink)) if window else total",
       "return total",
       ["tests/kernels/test_cascade_and_paged_id_spaces.py", "-k", "seq_lens_sum_bounds"]),
    _m("h-shared-window-cap-compiled", "host_mirror",
       "the compiled cascade mirror ignores a draft window: prefix offsets from full L",
       "specmeta/metadata/host_ops.c",
       "acc += (uint32_t)(full < cap ? full : cap) + shift;",
       "acc += (uint32_t)full + shift;",
       ["tests/metadata/test_host_ops.py", "-k", "write_what_the_rules_write and cascade_window"]),
    _m("h-shared-window-table", "host_mirror",
       "the builder's shared-prefix mirrors read uncapped lengths under a draft window",
       "specmeta/metadata/flashinfer.py",
       'for mode in ("draft_decode", "draft_decode_shared_prefix"):',
       'for mode in ("draft_decode",):',
       ["tests/metadata/test_id_spaces.py", "-k", "shared_prefix_attends_to_the_window"]),
    _m("st-paged-v2p-unread", "stage",
       "draft_decode_paged drops v2p= before the launch: its pages stay virtual",
       "specmeta/metadata/flashinfer.py",
       '("kv_indices", "kv_indptr", "kv_last_page_len"), self._paged_result, v2p=v2p,',
       '("kv_indices", "kv_indptr", "kv_last_page_len"), self._paged_result, v2p=None,',
       ["tests/metadata/test_id_spaces.py", "-k", "paged_draft_lists_physical"]),
    # ---------------------------------------------------------------- FA3 page tables' id spaces
    _m("k-fa3-page-of-id", "kernel",
       "the FA3 normal pass over a row in another id space stores the id read, not its page",
       K + "_page_tables.py",
       "tl.store(out_ptr + col, tl.where(col < filled, ids // PAGE_SIZE, fill_value),",
       "tl.store(out_ptr + col, tl.where(col < filled, ids, fill_value),",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "physical_rows and prefix"]),
    _m("k-fa3-page-first-position", "kernel",
       "the FA3 normal pass over page or virtual rows reads each page's last position, not its "
       "first",
       K + "_page_tables.py",
       "ids, _, bad = load_kv_ids(row_ptr, col.to(tl.int64) * PAGE_SIZE,",
       "ids, _, bad = load_kv_ids(row_ptr, col.to(tl.int64) * PAGE_SIZE + PAGE_SIZE - 1,",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "physical_rows and prefix and virtual"]),
    _m("k-fa3-page-bad-kv-id", "kernel",
       "the FA3 normal pass gives an unmapped id the sink page but drops BAD_KV_ID",
       K + "_page_tables.py",
       "tl.atomic_or(status_ptr, BAD_KV_ID, mask=bad_any != 0, sem=\"relaxed\")",
       "tl.atomic_or(status_ptr, 0, mask=bad_any != 0, sem=\"relaxed\")",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "does_not_map and prefix"]),
    _m("k-fa3-page-row-width", "kernel",
       "the FA3 normal pass counts a page row's width in entries, not positions: a page start "
       "inside the row reported past it (POS_OOB)",
       K + "_page_tables.py",
       "pos_bad = ((pages > 0) & (last_pos >= W_row * ENTRY_PAGE_SIZE)) | ~L_ok",
       "pos_bad = ((pages > 0) & (last_pos >= W_row)) | ~L_ok",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "just_wide_enough"]),
    _m("k-fa3-verify-bad-kv-id", "kernel",
       "FA3's verify expand pass lists an unmapped slot as the sink but drops BAD_KV_ID",
       K + "verify_expand_page_table.py",
       "| tl.where(tl.max(bad.to(tl.int32), axis=0) != 0, BAD_KV_ID, 0)",
       "| tl.where(tl.max(bad.to(tl.int32), axis=0) != 0, 0, 0)",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "does_not_map and verify"]),
    _m("k-fa3-ragged-bad-kv-id", "kernel",
       "FA3's ragged expand pass lists an unmapped slot as the sink but drops BAD_KV_ID",
       K + "verify_expand_ragged.py",
       "| tl.where(bad_id & emitted, BAD_KV_ID, 0)",
       "| tl.where(bad_id & emitted, 0, 0)",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "does_not_map and ragged"]),
    _m("r-fa3-prefix-ref-bad-kv-id", "reference",
       "prefix_page_table_ref gives an unmapped id the sink page but drops BAD_KV_ID",
       K + "prefix_page_table.py",
       "    if bool(bad.any()):\n        bits |= int(Status.BAD_KV_ID)\n",
       "",
       ["tests/kernels/test_fa3_id_spaces.py", "-k", "does_not_map and prefix"]),
    _m("st-fa3-verify-expand-spaces", "stage",
       "FA3's target verify binds its expand pass without the id space: the tree nodes' slots "
       "stay page ids or virtual ids",
       "specmeta/metadata/fa3.py",
       'kw = dict(status=status, page_size=ps, **spaces, **out["expand"])',
       'kw = dict(status=status, page_size=ps, **out["expand"])',
       ["tests/metadata/test_fa3_id_spaces.py", "-k", "target_verify and build_what"]),
    _m("h-fa3-extend-width-in-tokens", "host_check",
       "FA3's draft extend checks a page row's width in tokens: a row wide enough in pages is "
       "refused",
       "specmeta/metadata/fa3.py",
       'B = self.check("draft_extend", req_pool_indices, req_to_token, seq_lens, status=status,\n'
       "                       entry_page_size=entry_page_size)  # fmt: skip",
       'B = self.check("draft_extend", req_pool_indices, req_to_token, seq_lens, status=status)'
       "  # fmt: skip",
       ["tests/metadata/test_fa3_id_spaces.py", "-k", "draft_extend and page_rows"]),
    # ---------------------------------------------- TRT-LLM MLA's block tables' id spaces
    _m("k-branch-pt-page-rows-as-tokens", "kernel",
       "branch_page_table reads rows of page ids as rows of token ids",
       K + "branch_page_table.py",
       "num_pages, NUM_STEPS, ENTRY_PAGE_SIZE, TRANSLATE,",
       "num_pages, NUM_STEPS, 1, TRANSLATE,",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "physical_rows and page_rows"]),
    _m("k-branch-pt-untranslated", "kernel",
       "branch_page_table lists the virtual pages: its ids skip the page map",
       K + "branch_page_table.py",
       "num_pages, NUM_STEPS, ENTRY_PAGE_SIZE, TRANSLATE,",
       "num_pages, NUM_STEPS, ENTRY_PAGE_SIZE, False,",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "physical_rows and virtual"]),
    _m("k-branch-pt-bad-kv-id", "kernel",
       "branch_page_table gives an unmapped id page 0 but drops BAD_KV_ID",
       K + "branch_page_table.py",
       "| tl.where(unmapped != 0, BAD_KV_ID, 0)",
       "| tl.where(unmapped != 0, 0, 0)",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "does_not_map"]),
    _m("k-branch-pt-unmapped-unstored", "kernel",
       "branch_page_table reports BAD_KV_ID for an unmapped page it never stored (capacity)",
       K + "branch_page_table.py",
       "unmapped |= tl.max((wrong & in_w).to(tl.int32), axis=0)",
       "unmapped |= tl.max(wrong.to(tl.int32), axis=0)",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "dropped_for_capacity"]),
    _m("s-branch-page-first-position", "shared",
       "a branch page over page or virtual rows is read one position past the column's first, "
       "in the kernel helper and the reference",
       K + "_common.py",
       "        slot, in_row, bad = load_kv_ids(req_to_token_ptr + row_base, pos,\n",
       "        slot, in_row, bad = load_kv_ids(req_to_token_ptr + row_base, pos + 1,\n",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "physical_rows and virtual"],
       also=((K + "_common.py",
              "    slots, bad, bits = load_kv_ids_ref(req_to_token, req_pool_indices, pos, used, v2p",
              "    slots, bad, bits = load_kv_ids_ref(req_to_token, req_pool_indices, pos + 1, used, v2p"),)),
    _m("r-branch-pt-row-width", "reference",
       "branch_pages_ref counts a page row's width in entries, not positions: a page inside "
       "the row reported past it (POS_OOB)",
       K + "_common.py",
       "past = used & (pos >= req_to_token.shape[1] * entry_page_size)",
       "past = used & (pos >= req_to_token.shape[1])",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "just_wide_enough"]),
    _m("r-branch-pt-untranslated", "reference",
       "branch_page_table_ref reads the rows without their page map",
       K + "branch_page_table.py",
       "        entry_page_size=E, v2p=v2p,\n    )  # fmt: skip\n    if bool(bad[",
       "        entry_page_size=E, v2p=None,\n    )  # fmt: skip\n    if bool(bad[",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "physical_rows and virtual"]),
    _m("r-branch-pt-bad-kv-id", "reference",
       "branch_page_table_ref gives an unmapped id page 0 but drops BAD_KV_ID",
       K + "branch_page_table.py",
       "    if bool(unmapped[:, :, :W].any()):  # only the pages stored count\n"
       "        bits |= int(Status.BAD_KV_ID)\n",
       "",
       ["tests/kernels/test_branch_page_table_id_spaces.py", "-k", "does_not_map"]),
    _m("st-mla-draft-spaces", "stage",
       "TRT-LLM MLA's draft decode binds its block tables without the id space: the pages stay "
       "page ids' or virtual",
       "specmeta/metadata/trtllm_mla.py",
       'seq_lens_k=buf[f"{mode}.seq_lens_k"], status=self.status_word(status), **spaces,',
       'seq_lens_k=buf[f"{mode}.seq_lens_k"], status=self.status_word(status),',
       ["tests/metadata/test_trtllm_mla_id_spaces.py", "-k", "draft_decode and virtual"]),
    _m("st-mla-prefill-spaces", "stage",
       "TRT-LLM MLA's verify and extend bind their block tables without the id space",
       "specmeta/metadata/trtllm_mla.py",
       'cache_seqlens=buf[f"{mode}.seq_lens_k"], status=self.status_word(status), **spaces,',
       'cache_seqlens=buf[f"{mode}.seq_lens_k"], status=self.status_word(status),',
       ["tests/metadata/test_trtllm_mla_id_spaces.py", "-k", "verify and page_rows"]),
    _m("h-mla-width-in-tokens", "host_check",
       "TRT-LLM MLA's host check counts a page row's width in tokens: a row wide enough in "
       "pages is refused",
       "specmeta/metadata/trtllm_mla.py",
       "B = self.check(mode, req_pool_indices, req_to_token, seq_lens, status=status,\n"
       "                       entry_page_size=entry_page_size)  # fmt: skip",
       "B = self.check(mode, req_pool_indices, req_to_token, seq_lens, status=status)"
       "  # fmt: skip",
       ["tests/metadata/test_trtllm_mla_id_spaces.py", "-k", "draft_extend and page_rows"]),
    _m("h-mla-v2p-unchecked", "host_check",
       "TRT-LLM MLA's builder leaves a bad v2p to the kernels' check: the message names the "
       "kernel, not the builder's call",
       "specmeta/metadata/trtllm_mla.py",
       "        check_id_spaces(self.require(mode), 0, 0, entry_page_size, v2p, self.device)\n",
       "",
       ["tests/metadata/test_trtllm_mla_id_spaces.py", "-k", "refused and draft_decode"]),
    _m("st-fim-prefix-causal", "stage",
       "FlashInfer MLA's cascade plans its prefix pass causal: a request's K rows see only the "
       "last keys of its prefix",
       "specmeta/metadata/flashinfer_mla.py",
       "prefix_host[: B + 1], prefix_len[:B], 1, False,",
       "prefix_host[: B + 1], prefix_len[:B], 1, True,",
       ["tests/metadata/test_flashinfer_mla.py", "-k", "draft_decode and 2-3-16"]),
    _m("st-fim-ancestors-read-prefix", "stage",
       "FlashInfer MLA's ancestor pass reads the prefix list again in place of each branch's "
       "chain",
       "specmeta/metadata/flashinfer_mla.py",
       'buf[f"{mode}.ancestor_kv_indices"][s],',
       'buf[f"{mode}.prefix_kv_indices"],',
       ["tests/metadata/test_flashinfer_mla.py", "-k", "draft_decode and 2-3-16"]),
    _m("hm-fim-kv-len-off-by-one", "host_mirror",
       "FlashInfer MLA's chain draft decode writes kv_len_arr_host one short (L + s, not "
       "L + s + 1)",
       "specmeta/metadata/flashinfer_mla.py",
       "steps_col = numpy.arange(1, rows + 1, dtype=numpy.int32).reshape(-1, 1)",
       "steps_col = numpy.arange(0, rows, dtype=numpy.int32).reshape(-1, 1)",
       ["tests/metadata/test_flashinfer_mla.py", "-k", "draft_decode and 1-3-16"]),
    _m("c-fim-chains-without-topk", "config",
       "FlashInfer MLA's ancestor lists planned without the topk factor (B·S a step, not "
       "B·K·S): stores dropped for capacity",
       "specmeta/metadata/flashinfer_mla_plan.py",
       'add(f"{mode}.ancestor_kv_indices", (s, shared_prefix_chain_need(bs, k, s)), i32,',
       'add(f"{mode}.ancestor_kv_indices", (s, shared_prefix_chain_need(bs, 1, s)), i32,',
       ["tests/metadata/test_flashinfer_mla.py", "-k", "draft_decode and 4-2-1"]),
    _m("h-fim-lengths-unpublished", "host_check",
       "FlashInfer MLA's torch host part leaves seq_lens_cpu to its writers' checks and never "
       "publishes it: a stale copy goes unreported",
       "specmeta/metadata/flashinfer_mla.py",
       "            if not compiled:\n"
       "                self.lengths(mode, B, seq_lens_cpu)  # every check, before anything is "
       "written\n",
       "            if not compiled:\n                pass\n",
       ["tests/metadata/test_flashinfer_mla.py", "-k", "stale"]),
    _m("st-fim-v2p-dropped", "stage",
       "FlashInfer MLA's builder binds its lists without the page map: the lists hold virtual "
       "ids",
       "specmeta/metadata/flashinfer_mla.py",
       "return dict(entry_page_size=entry_page_size, v2p=v2p)",
       "return dict(entry_page_size=entry_page_size, v2p=None)",
       ["tests/metadata/test_flashinfer_mla.py", "-k", "id_spaces"]),
    # ------------------------------------------- sliding-window layers (design §2.10)
    _m("k-swa-map-skipped", "kernel",
       "a window layer's kernels emit full-pool ids: the full -> window pool map is read but "
       "its entry not emitted",
       K + "_window.py",
       "        return tl.where(read & ~bad, swa, 0), bad",
       "        return tl.where(read & ~bad, ids, 0), bad",
       ["tests/kernels/test_window_layers.py", "-k", "verify_lists and tokens"]),
    _m("r-swa-map-skipped", "reference",
       "the window pool map's torch twin returns the full-pool ids",
       K + "_window.py",
       "    return torch.where(read & ~bad, swa, 0), bad",
       "    return torch.where(read & ~bad, ids, 0), bad",
       ["tests/kernels/test_window_layers.py", "-k", "verify_lists and tokens"]),
    _m("k-swa-hole-unreported", "kernel",
       "an evicted (-1) window-pool entry the rail reads is emitted as -1, unreported",
       K + "_window.py",
       "        bad = read & (swa < 0)\n",
       "        bad = read & False\n",
       ["tests/kernels/test_window_layers.py", "-k", "hole_the_rail_reads"]),
    _m("r-swa-hole-unreported", "reference",
       "the window pool map's torch twin passes an evicted (-1) entry, unreported",
       K + "_window.py",
       "    bad = read & (swa < 0)\n    return torch.where",
       "    bad = read & False\n    return torch.where",
       ["tests/kernels/test_window_layers.py", "-k", "hole_the_rail_reads"]),
    _m("k-rail-draft-chain-unclipped", "kernel",
       "draft decode under the rail lists every chain step, past the window",
       K + "_window.py",
       "    chain = tl.where(rail > 0, tl.minimum(s + 1, rail), s + 1)",
       "    chain = s + 1 + rail * 0",
       ["tests/kernels/test_window_layers.py", "-k", "draft_lists and tokens"]),
    _m("r-rail-draft-prefix", "reference",
       "the draft rail's torch twin keeps w - 1 prefix positions at every step (not w - chain)",
       K + "_window.py",
       "    return L.clamp_max(max(rail - chain, 0)), chain",
       "    return L.clamp_max(rail - 1), chain",
       ["tests/kernels/test_window_layers.py", "-k", "draft_lists and tokens"]),
    _m("k-rail-verify-list-start", "kernel",
       "a window layer's verify list starts at position 0, not at L - min(L, w - 1)",
       K + "verify_kv_indices.py",
       "        first = L - rail_verify_prefix(L, rail)\n",
       "        first = L * 0\n",
       ["tests/kernels/test_window_layers.py", "-k", "verify_lists and tokens"]),
    _m("k-rail-verify-offsets-full", "kernel",
       "a window layer's verify lists are placed by the full lengths of earlier requests",
       K + "_window.py",
       "        cum += tl.sum(tl.where(before, rail_verify_prefix(prev, rail) + extra, 0), axis=0)",
       "        cum += tl.sum(tl.where(before, prev + extra, 0), axis=0)",
       ["tests/kernels/test_window_layers.py", "-k", "verify_lists and tokens"]),
    _m("r-rail-verify-prefix-one-long", "reference",
       "the verify rail's torch twin keeps w prefix positions (the first query row reads w - 1)",
       K + "_window.py",
       "    return L.clamp_max(rail - 1) if rail else L",
       "    return L.clamp_max(rail) if rail else L",
       ["tests/kernels/test_window_layers.py", "-k", "verify_lists and tokens"]),
    _m("k-rail-mask-ancestor-off-by-one", "kernel",
       "the window layer's tree mask drops the ancestor exactly w - 1 levels up",
       K + "tree_custom_mask.py",
       "m & (after <= rail)",
       "m & (after < rail)",
       ["tests/kernels/test_window_layers.py", "-k", "tree_mask and False"]),
    _m("k-rail-mask-prefix-edge", "kernel",
       "the window layer's tree mask hides the oldest prefix position a node reads",
       K + "tree_custom_mask.py",
       "col >= L + count - rail)",
       "col > L + count - rail)",
       ["tests/kernels/test_window_layers.py", "-k", "tree_mask and False"]),
    _m("k-rail-mask-segments-full", "kernel",
       "the window layer's mask segments start at the full blocks' offsets",
       K + "tree_custom_mask.py",
       "        if RAIL:\n            L = rail_verify_prefix(L, rail)\n        cum +=",
       "        cum +=",
       ["tests/kernels/test_window_layers.py", "-k", "tree_mask and True"]),
    _m("r-rail-mask-depth", "reference",
       "the tree mask's reference takes a node's ancestor count as its depth (one too deep)",
       K + "tree_custom_mask.py",
       "            depth = anc.sum(2)[req_b, rows_j] - 1\n",
       "            depth = anc.sum(2)[req_b, rows_j]\n",
       ["tests/kernels/test_window_layers.py", "-k", "tree_mask and False"]),
    _m("v-rail-beside-draft-window", "validate",
       "a draft window and a window layer's rail are taken together (the rail silently wins)",
       K + "_window.py",
       "    if rail and window_size:\n",
       "    if False:\n",
       ["tests/kernels/test_window_layers.py", "-k", "host_refusals"]),
    _m("c-rail-draft-need-without-topk", "config",
       "the draft lists under the rail bounded by B*w, without the topk factor",
       "specmeta/metadata/window_plan.py",
       "    return min(plain, batch * topk * rail) if rail else plain",
       "    return min(plain, batch * rail) if rail else plain",
       ["tests/kernels/test_window_layers.py", "-k", "capacity"]),
]
# fmt: on


# --------------------------------------------------------------------------------------------
def stale(m: Mutation, root: Path = ROOT) -> str | None:
    """Why ``m`` cannot be applied to the tree at ``root`` (None when every snippet occurs
    exactly once)."""
    for file, old, _ in m.edits():
        path = root / file
        if not path.is_file():
            return f"{file}: no such file"
        count = path.read_text().count(old)
        if count != 1:
            return f"{file}: snippet occurs {count} times, not once: {old.strip()[:60]!r}"
    return None


# What ``.gitignore`` names, plus the repository itself.
_UNTRACKED = ("__pycache__", "*.egg-info", ".pytest_cache", ".benchmarks", ".hypothesis", "build",
              "dist", ".whl", ".device-out", ".before", ".git")  # fmt: skip


def _copy_tracked(root: Path, dst: Path) -> None:
    """The work tree less what ``.gitignore`` names. Not ``git ls-files``: a machine's copy of
    the tree may carry a ``.git`` whose index is not that of the files it holds."""
    shutil.copytree(root, dst, ignore=shutil.ignore_patterns(*_UNTRACKED), dirs_exist_ok=True)


@dataclasses.dataclass
class Result:
    mutation: Mutation
    outcome: str  # caught | missed | error | skipped
    seconds: float = 0.0
    detail: str = ""


def run_one(m: Mutation, root: Path = ROOT, timeout: float = 900) -> Result:
    """Copy the tracked tree, plant ``m``, run its tests there; pytest exit 1 is a catch."""
    start = time.monotonic()
    why = stale(m, root)
    if why:
        return Result(m, "error", 0.0, f"stale: {why}")
    with tempfile.TemporaryDirectory(prefix=f"specmeta-mut-{m.id}-") as tmp:
        copy = Path(tmp)
        _copy_tracked(root, copy)
        for file, old, new in m.edits():
            path = copy / file
            path.write_text(path.read_text().replace(old, new, 1))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return Result(m, "error", time.monotonic() - start, f"timed out after {timeout} s")
    seconds = time.monotonic() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    crashed = -proc.returncode in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
    outcome = "caught" if crashed else {1: "caught", 0: "missed"}.get(proc.returncode, "error")
    detail = tail[0] if outcome != "error" else f"pytest exit {proc.returncode}: {tail[0]}"
    if crashed:
        detail = f"the tests crashed ({signal.Signals(-proc.returncode).name})"
    return Result(m, outcome, seconds, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutations")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at a time (2)")
    parser.add_argument("--gpu", action="store_true", help="also run the gpu=True mutations")
    parser.add_argument("--gpu-only", action="store_true",
                        help="run only the gpu=True mutations (on a CUDA machine)")  # fmt: skip
    args = parser.parse_args(argv)
    gpu = args.gpu or args.gpu_only

    chosen = MUTATIONS
    if args.only:
        known = {m.id for m in MUTATIONS}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            parser.error(f"unknown mutation id(s): {', '.join(unknown)}")
        chosen = [m for m in MUTATIONS if m.id in args.only]

    if args.gpu_only:
        chosen = [m for m in chosen if m.gpu]

    if args.list:
        for m in chosen:
            flag = " [gpu]" if m.gpu else ""
            print(f"{m.id:32} {m.layer:12} {m.description}{flag}")
            print(f"{'':32} {m.file}  ::  {' '.join(m.tests)}")
        print(f"{len(chosen)} mutations ({sum(not m.gpu for m in chosen)} CPU)")
        return 0

    if gpu and any(m.gpu for m in chosen) and not _has_cuda():
        parser.error("--gpu and --gpu-only need a CUDA device: without one the gpu=True "
                     "mutations' tests are skipped and every mutation would read as missed")  # fmt: skip
    to_run = [m for m in chosen if gpu or not m.gpu]
    skipped = [Result(m, "skipped", detail="gpu=True: run with --gpu on a CUDA machine")
               for m in chosen if m.gpu and not gpu]  # fmt: skip
    t0 = time.monotonic()
    results: dict[str, Result] = {r.mutation.id: r for r in skipped}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_one, m): m for m in to_run}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results[r.mutation.id] = r
            print(f"  {r.outcome:7} {r.mutation.id} ({r.seconds:.0f} s)", flush=True)
    total = time.monotonic() - t0

    print(f"\n{'id':32} {'layer':12} {'result':8} {'seconds':>7}")
    for m in chosen:
        r = results[m.id]
        print(f"{m.id:32} {m.layer:12} {r.outcome:8} {r.seconds:7.1f}")
        if r.outcome in ("missed", "error", "skipped"):
            print(f"{'':32} -> {r.detail}")
    counts = {k: sum(r.outcome == k for r in results.values())
              for k in ("caught", "missed", "error", "skipped")}  # fmt: skip
    print(
        f"\n{counts['caught']} caught, {counts['missed']} missed, {counts['error']} errors, "
        f"{counts['skipped']} skipped (gpu) of {len(chosen)} mutations in {total:.0f} s"
    )
    bad = [r for r in results.values() if r.outcome in ("missed", "error")]
    return 1 if bad else 0


def _has_cuda() -> bool:
    """Whether the tests' own torch sees a CUDA device (asked in a child, so that a plain
    ``--list`` or CPU run never imports torch here)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
