"""specmeta: speculative-decoding attention metadata for paged KV caches and CUDA graphs.

Every index is built on the device in one sync-free launch, every store is bounds-masked, every
buffer is sized by :func:`plan_buffers`, and the eager and graphed paths share one layout.
"""

import os as _os

import torch as _torch

# Without CUDA the Triton kernels can only run under Triton's interpreter, on CPU tensors. The
# switch is read when a kernel is decorated, so it is set before the kernels are imported; a
# value the user set (either way) is kept.
if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from . import probes  # noqa: E402
from .config import BufferSpec, SpecConfig, allocate_buffers, plan_buffers  # noqa: E402
from .kernels import (  # noqa: E402
    assign_draft_cache_locs,
    assign_draft_cache_locs_ref,
    draft_decode_kv_indices,
    draft_decode_kv_indices_ref,
    prefix_tail_copy_pairs,
    prefix_tail_copy_pairs_ref,
)
from .kernels.cache_loc_move import (  # noqa: E402
    KVPool,
    accept_cache_locs,
    accept_cache_locs_ref,
    move_kv_cache,
    move_kv_cache_ref,
)
from .kernels.merge_state import merge_state, merge_state_ref  # noqa: E402
from .metadata.fa3 import FA3Cascade, FA3Metadata, FA3MetadataBuilder  # noqa: E402
from .metadata.flashinfer import FlashInferBuilder  # noqa: E402
from .metadata.trtllm_mla import TrtllmMlaBuilder  # noqa: E402
from .runners import GraphRunner, RunResult  # noqa: E402
from .status import (  # noqa: E402
    SpecmetaStatusError,
    Status,
    check_status,
    default_status,
    new_status,
)

__version__ = "0.1.0"

__all__ = [
    "SpecConfig",
    "BufferSpec",
    "plan_buffers",
    "allocate_buffers",
    "Status",
    "SpecmetaStatusError",
    "check_status",
    "new_status",
    "default_status",
    "assign_draft_cache_locs",
    "assign_draft_cache_locs_ref",
    "prefix_tail_copy_pairs",
    "prefix_tail_copy_pairs_ref",
    "draft_decode_kv_indices",
    "draft_decode_kv_indices_ref",
    "FlashInferBuilder",
    "TrtllmMlaBuilder",
    "accept_cache_locs",
    "accept_cache_locs_ref",
    "move_kv_cache",
    "move_kv_cache_ref",
    "KVPool",
    "merge_state",
    "merge_state_ref",
    "FA3MetadataBuilder",
    "FA3Metadata",
    "FA3Cascade",
    "probes",
    "GraphRunner",
    "RunResult",
]
