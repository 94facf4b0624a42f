"""specmeta: speculative-decoding attention metadata for paged KV caches and CUDA graphs.

Every index is built on the device in one sync-free launch, every store is bounds-masked, every
buffer is sized by :func:`plan_buffers`, and the eager and graphed paths share one layout.

``import specmeta`` has no side effects and imports neither torch nor Triton: every public name
is imported from its module on first use (PEP 562). In particular it does not switch on
Triton's interpreter: to run the kernels on CPU tensors, set ``TRITON_INTERPRET=1`` before the
first kernel is imported (Triton reads it when a kernel is decorated), e.g. on the command line
or with ``os.environ.setdefault("TRITON_INTERPRET", "1")`` at the top of a script.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

# Read statically by setup.cfg (`attr: specmeta.__version__`): keep it a plain literal.
__version__ = "0.1.0"

# Each module (relative to this package) and the public names that come from it; ``probes`` is
# the module itself.
_MODULES: dict[str, tuple[str, ...]] = {
    ".config": ("SpecConfig", "BufferSpec", "plan_buffers", "allocate_buffers", "check_fits"),
    ".status": ("Status", "SpecmetaStatusError", "check_status", "new_status", "default_status"),
    ".kernels": ("assign_draft_cache_locs", "assign_draft_cache_locs_ref",
                 "prefix_tail_copy_pairs", "prefix_tail_copy_pairs_ref",
                 "draft_decode_kv_indices", "draft_decode_kv_indices_ref"),
    ".kernels.accept_cache_locs": ("accept_cache_locs", "accept_cache_locs_ref"),
    ".kernels.cache_loc_move": ("move_kv_cache", "move_kv_cache_ref", "KVPool"),
    ".kernels.merge_state": ("merge_state", "merge_state_ref"),
    ".kernels.verify_lens": ("pad_verify_lens_to_bucket", "pad_verify_lens_to_bucket_ref"),
    ".metadata.fa3": ("FA3MetadataBuilder", "FA3Metadata", "FA3Cascade"),
    ".metadata.flashinfer": ("FlashInferBuilder",),
    ".metadata.trtllm_mla": ("TrtllmMlaBuilder",),
    ".metadata.flashinfer_mla": ("FlashInferMLABuilder",),
    ".metadata.host_ops": ("warmup",),
    ".probes": ("probes",),
    ".runners": ("GraphRunner", "RaggedGraphRunner", "RunResult"),
    ".stage": ("Stage",),
}  # fmt: skip
_SOURCES = {name: module for module, names in _MODULES.items() for name in names}

# Written out (not list(_SOURCES)) so that linters and readers see it; a test checks that it
# names exactly the keys of _SOURCES.
__all__ = [
    "SpecConfig", "BufferSpec", "plan_buffers", "allocate_buffers", "check_fits",
    "Status", "SpecmetaStatusError", "check_status", "new_status", "default_status",
    "assign_draft_cache_locs", "assign_draft_cache_locs_ref", "prefix_tail_copy_pairs",
    "prefix_tail_copy_pairs_ref", "draft_decode_kv_indices", "draft_decode_kv_indices_ref",
    "accept_cache_locs", "accept_cache_locs_ref", "move_kv_cache", "move_kv_cache_ref", "KVPool",
    "merge_state", "merge_state_ref", "pad_verify_lens_to_bucket",
    "pad_verify_lens_to_bucket_ref", "FA3MetadataBuilder", "FA3Metadata", "FA3Cascade",
    "FlashInferBuilder", "TrtllmMlaBuilder", "FlashInferMLABuilder", "warmup", "probes", "GraphRunner",
    "RaggedGraphRunner", "RunResult", "Stage",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use, then keep it here (PEP 562).

    A submodule (``specmeta.kernels``, ``specmeta.metadata``, ...) is imported on first use
    too, as the eager imports of earlier versions made them attributes of the package."""
    source = _SOURCES.get(name)
    if source is None:
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'specmeta' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")  # sets the attribute itself
    module = importlib.import_module(source, __name__)
    value = module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports each name
    from . import probes
    from .config import BufferSpec, SpecConfig, allocate_buffers, check_fits, plan_buffers
    from .kernels import (
        assign_draft_cache_locs,
        assign_draft_cache_locs_ref,
        draft_decode_kv_indices,
        draft_decode_kv_indices_ref,
        prefix_tail_copy_pairs,
        prefix_tail_copy_pairs_ref,
    )
    from .kernels.accept_cache_locs import accept_cache_locs, accept_cache_locs_ref
    from .kernels.cache_loc_move import KVPool, move_kv_cache, move_kv_cache_ref
    from .kernels.merge_state import merge_state, merge_state_ref
    from .kernels.verify_lens import pad_verify_lens_to_bucket, pad_verify_lens_to_bucket_ref
    from .metadata.fa3 import FA3Cascade, FA3Metadata, FA3MetadataBuilder
    from .metadata.flashinfer import FlashInferBuilder
    from .metadata.flashinfer_mla import FlashInferMLABuilder
    from .metadata.host_ops import warmup
    from .metadata.trtllm_mla import TrtllmMlaBuilder
    from .runners import GraphRunner, RaggedGraphRunner, RunResult
    from .stage import Stage
    from .status import SpecmetaStatusError, Status, check_status, default_status, new_status
