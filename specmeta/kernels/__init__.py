"""Triton kernels: one op per module, each with its typed launcher and its pure-torch reference.

Each launcher ``<op>(...)`` is ``bind_<op>(...)()``: ``bind_<op>`` takes the same arguments,
checks them (and allocates omitted outputs) once, and returns a :class:`specmeta.stage.Stage`
that makes the op's launches on every call.

Every launcher and reference reports each masked fault into the ``status`` word it is given or,
called without ``status=``, into :func:`specmeta.default_status` of its device (read both with
:func:`specmeta.check_status`). What the ops share lives in :mod:`specmeta.kernels._common`.
"""

from .accept_cache_locs import accept_cache_locs, accept_cache_locs_ref, bind_accept_cache_locs
from .branch_kv_indices import bind_branch_kv_indices, branch_kv_indices, branch_kv_indices_ref
from .branch_page_table import bind_branch_page_table, branch_page_table, branch_page_table_ref
from .cache_loc_move import KVPool, bind_move_kv_cache, move_kv_cache, move_kv_cache_ref
from .draft_cache_locs import (
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    bind_assign_draft_cache_locs,
    bind_prefix_tail_copy_pairs,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from .draft_decode_kv_indices import (
    bind_draft_decode_kv_indices,
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
)
from .draft_decode_page_tables import (
    bind_draft_decode_page_tables,
    draft_decode_page_tables,
    draft_decode_page_tables_ref,
)
from .expand_page_table import bind_expand_page_table, expand_page_table, expand_page_table_ref
from .host_lengths import bind_check_host_lengths, check_host_lengths, check_host_lengths_ref
from .prefix_page_table import bind_prefix_page_table, prefix_page_table, prefix_page_table_ref
from .shared_prefix_kv_indices import (
    bind_shared_prefix_kv_indices,
    shared_prefix_kv_indices,
    shared_prefix_kv_indices_ref,
)
from .tree_custom_mask import bind_tree_custom_mask, tree_custom_mask, tree_custom_mask_ref
from .verify_expand_page_table import (
    bind_verify_expand_page_table,
    verify_expand_page_table,
    verify_expand_page_table_ref,
)
from .verify_kv_indices import bind_verify_kv_indices, verify_kv_indices, verify_kv_indices_ref
from .verify_lens import (
    bind_pad_verify_lens_to_bucket,
    pad_verify_lens_to_bucket,
    pad_verify_lens_to_bucket_ref,
)

# Each op: its launcher, bind_<op> and its reference.
__all__ = [
    "assign_draft_cache_locs", "bind_assign_draft_cache_locs", "assign_draft_cache_locs_ref",
    "prefix_tail_copy_pairs", "bind_prefix_tail_copy_pairs", "prefix_tail_copy_pairs_ref",
    "draft_decode_kv_indices", "bind_draft_decode_kv_indices", "draft_decode_kv_indices_ref",
    "verify_kv_indices", "bind_verify_kv_indices", "verify_kv_indices_ref",
    "tree_custom_mask", "bind_tree_custom_mask", "tree_custom_mask_ref",
    "shared_prefix_kv_indices", "bind_shared_prefix_kv_indices", "shared_prefix_kv_indices_ref",
    "branch_page_table", "bind_branch_page_table", "branch_page_table_ref",
    "branch_kv_indices", "bind_branch_kv_indices", "branch_kv_indices_ref",
    "accept_cache_locs", "bind_accept_cache_locs", "accept_cache_locs_ref",
    "move_kv_cache", "bind_move_kv_cache", "move_kv_cache_ref",
    "KVPool",
    "prefix_page_table", "bind_prefix_page_table", "prefix_page_table_ref",
    "expand_page_table", "bind_expand_page_table", "expand_page_table_ref",
    "draft_decode_page_tables", "bind_draft_decode_page_tables", "draft_decode_page_tables_ref",
    "verify_expand_page_table", "bind_verify_expand_page_table", "verify_expand_page_table_ref",
    "pad_verify_lens_to_bucket", "bind_pad_verify_lens_to_bucket", "pad_verify_lens_to_bucket_ref",
    "check_host_lengths", "bind_check_host_lengths", "check_host_lengths_ref",
]  # fmt: skip
