"""What each builder serves and which planned buffers it allocates, as plain data (design §3).

The builders (:mod:`.contract`, :mod:`.fa3`, :mod:`.flashinfer`, :mod:`.trtllm_mla`,
:mod:`.flashinfer_mla`, and the window layers' :mod:`.fa3_window`, :mod:`.flashinfer_window`)
read their capabilities, plan groups and FlashInfer's mask fields from here, and so does
``specmeta plan``, which sizes a configuration without importing torch or Triton (seconds): this
module imports neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .window_plan import FLASHINFER_WINDOW_MODES, WINDOW_MODES  # torch-free, like this module

if TYPE_CHECKING:
    from ..config import SpecConfig

__all__ = ["Capabilities", "BUILDERS", "MODES", "CAPABILITIES", "FA3_WINDOW_CAPABILITIES",
           "FLASHINFER_WINDOW_CAPABILITIES", "PLAN_GROUPS", "VERIFY_MASKS", "VERIFY_MASK_FIELDS",
           "verify_mask_keys", "plan_keys"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend's builder serves.

    Attributes
    ----------
    modes : tuple of str
        Every mode method of the builder.
    tree_draft : bool
        ``draft_decode`` with ``topk > 1``.
    tree_verify : bool
        ``target_verify`` with ``topk > 1`` (a tree mask or a cascade over ancestors).
    page_sizes : str
        The page sizes the metadata is built for (``"any"``: every positive size).
    graph_safe : frozenset of str
        Modes whose build may be captured in a CUDA graph (the host mirrors, if any, are
        refreshed outside it with ``launch=False``).
    draft_window : frozenset of str
        Draft-decode modes that build a config's draft window (design §2.10); the others are
        not served for a config with one.
    """

    modes: tuple[str, ...]
    tree_draft: bool
    tree_verify: bool
    page_sizes: str
    graph_safe: frozenset[str]
    draft_window: frozenset[str] = frozenset()

    def why_not(self, mode: str, cfg: SpecConfig) -> str | None:
        """Why ``mode`` (one of :attr:`modes`) cannot be built for ``cfg``, or ``None``."""
        if cfg.topk > 1 and mode == "target_verify" and not self.tree_verify:
            return f"{mode} with topk={cfg.topk} needs a tree, which this backend cannot build"
        if cfg.topk > 1 and mode.startswith("draft_decode") and not self.tree_draft:
            return f"{mode} with topk={cfg.topk} needs a tree, which this backend cannot build"
        windowed = cfg.draft_window_size and mode.startswith("draft_decode")
        if windowed and mode not in self.draft_window:
            return (f"{mode} does not build a draft window yet (draft_window_size="
                    f"{cfg.draft_window_size}); it is built by "
                    f"{', '.join(sorted(self.draft_window)) or 'none of its modes'}")  # fmt: skip
        return None

    def serves(self, mode: str, cfg: SpecConfig) -> bool:
        """Whether ``mode`` can be built for ``cfg``."""
        return mode in self.modes and self.why_not(mode, cfg) is None

    def served(self, cfg: SpecConfig) -> tuple[str, ...]:
        """Every mode that can be built for ``cfg``, in :attr:`modes` order."""
        return tuple(m for m in self.modes if self.serves(m, cfg))


#: The builder class of each backend, by the backend's plan prefix (``"<backend>.<group>.…"``).
BUILDERS = {"fa3": "FA3MetadataBuilder", "flashinfer": "FlashInferBuilder",
            "trtllm_mla": "TrtllmMlaBuilder", "flashinfer_mla": "FlashInferMLABuilder"}  # fmt: skip
#: Every mode of any builder, in the order the builders list them.
MODES = ("draft_decode", "draft_decode_shared_prefix", "draft_decode_paged", "target_verify",
         "draft_extend")  # fmt: skip
_DECODE_VERIFY_EXTEND = ("draft_decode", "target_verify", "draft_extend")

CAPABILITIES = {
    "fa3": Capabilities(
        modes=_DECODE_VERIFY_EXTEND,
        tree_draft=True,
        tree_verify=True,
        page_sizes="any",
        graph_safe=frozenset(_DECODE_VERIFY_EXTEND),
    ),
    "flashinfer": Capabilities(
        modes=MODES,
        tree_draft=True,
        tree_verify=True,
        page_sizes="any",
        graph_safe=frozenset(MODES),
        draft_window=frozenset({"draft_decode", "draft_decode_shared_prefix"}),
    ),
    "trtllm_mla": Capabilities(
        modes=_DECODE_VERIFY_EXTEND,
        tree_draft=True,  # per-branch block tables over slot layout B
        tree_verify=True,  # a cascade: its kernel for the prefix, FlashInfer MLA for the ancestors
        page_sizes="any",
        graph_safe=frozenset(_DECODE_VERIFY_EXTEND),
    ),
    "flashinfer_mla": Capabilities(
        modes=_DECODE_VERIFY_EXTEND,
        tree_draft=True,  # a cascade: each prefix once, then each branch's own chain
        tree_verify=True,  # a cascade too; the ancestor counts from the host's tree mask
        page_sizes="any",
        graph_safe=frozenset(_DECODE_VERIFY_EXTEND),
    ),
}
#: What FA3's window-layer builder serves (``FA3WindowBuilder``, design §2.10): chains and trees
#: in its three modes, a ragged verify too. A config's draft window bounds the draft model, not
#: a window layer: no window builder builds one (``draft_window`` empty).
FA3_WINDOW_CAPABILITIES = Capabilities(
    modes=WINDOW_MODES,
    tree_draft=True,
    tree_verify=True,
    page_sizes="any",
    graph_safe=frozenset(WINDOW_MODES),
)
#: What FlashInfer's window-layer builder serves (``FlashInferWindowBuilder``, design §2.10):
#: the page-size-1 draft lists, the shared-prefix cascade (its ``check_modes`` adds the one rule
#: these fields cannot say: only for a window wider than the draft steps,
#: :func:`.window_plan.shared_prefix_served`), the paged form, and the prefill lists.
FLASHINFER_WINDOW_CAPABILITIES = Capabilities(
    modes=FLASHINFER_WINDOW_MODES,
    tree_draft=True,
    tree_verify=True,
    page_sizes="any",
    graph_safe=frozenset(FLASHINFER_WINDOW_MODES),
)
#: The plan group (``"<backend>.<group>.<field>"``) of each mode whose group differs from it.
PLAN_GROUPS: dict[str, dict[str, str]] = {
    "fa3": {},
    "flashinfer": {"draft_decode_shared_prefix": "draft_decode_shared"},
    "trtllm_mla": {},
    "flashinfer_mla": {},
}
#: FlashInfer's target-verify mask forms: the bool ``custom_mask``, the packed-bit one, or both.
VERIFY_MASKS = ("bool", "packed", "both")
#: The ``flashinfer.target_verify`` fields of each mask form.
VERIFY_MASK_FIELDS = {
    "bool": ("custom_mask", "mask_indptr", "mask_indptr_host"),
    "packed": ("packed_custom_mask", "packed_mask_indptr", "packed_mask_indptr_host"),
}


def verify_mask_keys(verify_mask: str) -> set[str]:
    """The plan keys of the mask forms a FlashInfer builder made with ``verify_mask`` does not
    build, and so does not allocate (each form is ``N·ΣL + B·N²`` bytes at full capacity)."""
    return {
        f"flashinfer.target_verify.{field}"
        for form, fields in VERIFY_MASK_FIELDS.items()
        if verify_mask not in (form, "both")
        for field in fields
    }


def plan_keys(backend: str, keys: Iterable[str], modes: Iterable[str],
              verify_mask: str = "both") -> list[str]:  # fmt: skip
    """The plan keys among ``keys`` (those of :func:`specmeta.config.plan_sizes`, in plan order)
    that ``backend``'s builder serving ``modes`` allocates, its own host mirrors included."""
    groups = {PLAN_GROUPS.get(backend, {}).get(m, m) for m in modes}
    dropped = verify_mask_keys(verify_mask) if backend == "flashinfer" else set()
    prefix = backend + "."
    return [key for key in keys if key.startswith(prefix) and key not in dropped
            and key[len(prefix) :].split(".", 1)[0] in groups]  # fmt: skip
