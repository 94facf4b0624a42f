"""Triton kernels: one op per module, each with its typed launcher and its pure-torch reference."""

from .draft_cache_locs import (
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from .draft_decode_kv_indices import draft_decode_kv_indices, draft_decode_kv_indices_ref

__all__ = [
    "assign_draft_cache_locs",
    "assign_draft_cache_locs_ref",
    "prefix_tail_copy_pairs",
    "prefix_tail_copy_pairs_ref",
    "draft_decode_kv_indices",
    "draft_decode_kv_indices_ref",
]
