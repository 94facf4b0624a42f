"""The host checks every builder runs on its inputs before its first launch.

One rule for the three builders: whatever the host can see is checked here, before anything is
launched or written — the type, dtype, rank, shape and device of every tensor passed in, the
batch against the plan's ``max_bs``, ``req_to_token``'s width against the row positions the plan
needs, ``tree_mask`` and ``out_cache_loc`` against the batch, and, when the engine passes
``seq_lens_cpu``, every length against the plan's ``max_context_len``. Only what the host
cannot see (device values of ``req_pool_indices``, ``seq_lens``, slot ids) is left to the masks
and the status word.

Every message names the builder call, the argument, the value it got and the fix, e.g.::

    FA3MetadataBuilder.draft_decode: seq_lens_cpu holds 1500, over the plan's
    max_context_len=256; build the SpecConfig with max_context_len >= 1500
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import validate
from ..config import SpecConfig

__all__ = ["check_build_tensors", "check_length_values", "check_node_depths_cpu", "check_num_rows",
           "check_verify_lens_cpu", "host_lengths"]  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tensor(
    where: str,
    name: str,
    t: object,
    device: torch.device,
    *,
    dtypes: tuple[torch.dtype, ...] = validate.INDEX_DTYPES,
    ndim: int,
) -> torch.Tensor:
    try:  # the common case, every condition at once; any miss takes the checks below
        if (
            t.dtype in dtypes
            and t.dim() == ndim
            and t.device == device
            and (t.stride()[-1] == 1 or t.shape[-1] <= 1)
            and isinstance(t, torch.Tensor)
        ):
            return t
    except (AttributeError, IndexError, RuntimeError, TypeError):
        pass
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(
            f"{where}: {name} has dtype {_dtype_name(t.dtype)}; pass it as {want} "
            f"(e.g. {name}.to(torch.{_dtype_name(dtypes[0])}))"
        )
    if t.dim() != ndim:
        raise ValueError(
            f"{where}: {name} has shape {list(t.shape)}; it must have {ndim} dimension"
            f"{'s' if ndim != 1 else ''}"
        )
    if t.device != device and not validate.same_device(t.device, device):
        raise ValueError(
            f"{where}: {name} is on {t.device}, but this builder lives on {device}; "
            f"pass {name} on {device} (or construct the builder on {t.device})"
        )
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{where}: {name} has strides {list(t.stride())}; its last dimension must be "
            f"contiguous (pass {name}.contiguous())"
        )
    return t


def check_num_rows(where: str, num_rows: object, num_steps: int, default: int) -> int:
    """``num_rows`` (forwards to build), ``0 ≤ rows ≤ S``; ``default`` when ``None``."""
    if num_rows is None:
        return default
    if isinstance(num_rows, bool) or not isinstance(num_rows, int):
        raise TypeError(f"{where}: num_rows must be an int, got {type(num_rows).__name__}")
    if not 0 <= num_rows <= num_steps:
        raise ValueError(
            f"{where}: num_rows={num_rows} is outside [0, num_steps={num_steps}]; "
            f"pass at most num_steps rows (the default, {default}, builds every draft forward)"
        )
    return num_rows


def check_build_tensors(
    where: str,
    cfg: SpecConfig,
    device: torch.device,
    req_pool_indices: object,
    req_to_token: object,
    seq_lens: object,
    *,
    tree_mask: object = None,
    out_cache_loc: object = None,
    status: object = None,
    entry_page_size: object = 1,
) -> int:
    """Check one build's tensors on the host, before anything is launched; returns ``B``.

    These checks read only the tensors' shapes, dtypes, strides and devices (no device value:
    no sync).

    Parameters
    ----------
    where : str
        ``"<Builder>.<mode>"``, the prefix of every message.
    cfg, device
        The builder's plan and device.
    req_pool_indices, req_to_token, seq_lens : torch.Tensor
        ``[B]``, ``[R, W_row]``, ``[B]`` int32 or int64 on ``device``; ``B ≤ max_bs`` and
        ``W_row ≥ cfg.row_width_need``.
    tree_mask : torch.Tensor, optional
        ``[B, N, N]`` bool on ``device`` (checked when given).
    out_cache_loc : torch.Tensor, optional
        ``[≥ B·K·S]`` integer draft slots on ``device`` (checked when given).
    status : torch.Tensor, optional
        ``int32 [1]`` on ``device`` (checked when given).
    entry_page_size : int
        ``E ≥ 1``: ``req_to_token`` rows hold page ids of ``E`` positions each (design §2.10),
        so a row needs ``ceil(cfg.row_width_need / E)`` entries.
    """
    if isinstance(entry_page_size, bool) or not isinstance(entry_page_size, int) or (
            entry_page_size < 1):  # fmt: skip
        raise ValueError(
            f"{where}: entry_page_size={entry_page_size!r}; pass an int >= 1 (1: rows of token "
            "ids, E > 1: rows of page ids of E positions each, design §2.10)"
        )
    rpi = _tensor(where, "req_pool_indices", req_pool_indices, device, ndim=1)
    table = _tensor(where, "req_to_token", req_to_token, device, ndim=2)
    lens = _tensor(where, "seq_lens", seq_lens, device, ndim=1)
    B = rpi.shape[0]
    if lens.shape[0] != B:
        raise ValueError(
            f"{where}: seq_lens has {lens.shape[0]} entries but req_pool_indices has {B}; "
            "pass one length per request"
        )
    if B > cfg.max_bs:
        raise ValueError(
            f"{where}: the batch has {B} requests, over the plan's max_bs={cfg.max_bs}; "
            f"build the SpecConfig with max_bs >= {B}"
        )
    need = -(-cfg.row_width_need // entry_page_size)
    if table.shape[1] < need:
        if entry_page_size == 1:
            raise ValueError(
                f"{where}: req_to_token is {table.shape[1]} positions wide, but the plan needs "
                f"{need} (a prefix of max_context_len={cfg.max_context_len} plus its draft and "
                f"verify slots); allocate req_to_token with at least {need} columns, e.g. "
                f"SpecConfig.req_to_token_width={cfg.req_to_token_width}"
            )
        raise ValueError(
            f"{where}: req_to_token is {table.shape[1]} page ids wide (entry_page_size="
            f"{entry_page_size}: {table.shape[1] * entry_page_size} positions), but the plan "
            f"needs {cfg.row_width_need} positions (a prefix of max_context_len="
            f"{cfg.max_context_len} plus its draft and verify slots); allocate req_to_token "
            f"with at least {need} columns"
        )
    if tree_mask is not None:
        n = cfg.num_draft_tokens
        mask = _tensor(where, "tree_mask", tree_mask, device, dtypes=(torch.bool,), ndim=3)
        if tuple(mask.shape) != (B, n, n):
            raise ValueError(
                f"{where}: tree_mask has shape {list(mask.shape)}; it must be [B, N, N] = "
                f"[{B}, {n}, {n}] (B requests, N = num_draft_tokens = {n})"
            )
    if out_cache_loc is not None:
        slots = _tensor(where, "out_cache_loc", out_cache_loc, device, ndim=1)
        need_slots = B * cfg.topk * cfg.num_steps
        if slots.shape[0] < need_slots:
            raise ValueError(
                f"{where}: out_cache_loc has {slots.shape[0]} slots, but the batch needs "
                f"B·K·S = {need_slots} (laid out [B, K, S]); pass the out_cache_loc filled "
                "by assign_draft_cache_locs for this batch"
            )
    if status is not None:
        word = _tensor(where, "status", status, device, dtypes=(torch.int32,), ndim=1)
        if word.shape[0] != 1:
            raise ValueError(
                f"{where}: status has shape {list(word.shape)}; it must be int32 [1] "
                "(specmeta.new_status(device))"
            )
    return B


_CPU = torch.device("cpu")


# Up to this many lengths, the host reads seq_lens_cpu as Python ints (one tolist, then min, max
# and sum in Python cost less than torch's reductions on a small CPU tensor).
_AS_INTS = 64


def host_lengths(where: str, cfg: SpecConfig, B: int, seq_lens_cpu: object, *,
                 stats: Callable | None = None) -> tuple[int, int] | None:  # fmt: skip
    """Check the host values of a build, on every call: ``seq_lens_cpu``, when given, is the
    ``[B]`` integer CPU mirror of ``seq_lens``, each value in ``[0, max_context_len]``.
    Returns ``(max L, ΣL)`` (``(0, 0)`` for an empty batch), or ``None`` without it.

    ``stats`` (the compiled ``stats`` of :mod:`.host_ops`) checks the tensor and every value
    and reads both numbers in one call; whatever it refuses, and every call without it, takes
    the checks below, which name what is wrong."""
    if seq_lens_cpu is None:
        return None
    if stats is not None:
        try:
            return stats(cfg.max_context_len, B, seq_lens_cpu)
        except (TypeError, ValueError, IndexError):  # named by the checks below
            pass
    cpu = _tensor(where, "seq_lens_cpu", seq_lens_cpu, _CPU, ndim=1)
    if cpu.shape[0] != B:
        raise ValueError(
            f"{where}: seq_lens_cpu has {cpu.shape[0]} entries but the batch has {B}; pass "
            "the CPU copy of this batch's seq_lens"
        )
    high, values = check_length_values(where, cfg, cpu)
    total = sum(values) if values is not None else int(cpu.sum())
    return high, total


def check_length_values(where: str, cfg: SpecConfig,
                        seq_lens_cpu: torch.Tensor) -> tuple[int, list[int] | None]:  # fmt: skip
    """Every value of ``seq_lens_cpu`` (a 1-D integer CPU tensor, checked) in
    ``[0, max_context_len]``, or the ``ValueError`` that names the value; returns ``max L``
    (0 for an empty batch) and, for a small batch, the values as Python ints."""
    cpu = seq_lens_cpu if seq_lens_cpu.dtype == torch.int64 else seq_lens_cpu.to(torch.int64)
    B = cpu.shape[0]
    high, values = 0, None
    if 0 < B <= _AS_INTS:
        # seq_lens_cpu is a CPU tensor (checked above): reading it syncs nothing. One tolist,
        # then plain Python, costs less than torch's reductions on a small tensor.
        values = cpu.tolist()
        low, high = min(values), max(values)
    elif B:
        low, high = (int(v) for v in torch.aminmax(cpu))
    if B:
        if low < 0:
            raise ValueError(
                f"{where}: seq_lens_cpu holds {low}; lengths must be >= 0 (pass the committed "
                "prefix length of each request)"
            )
        if high > cfg.max_context_len:
            raise ValueError(
                f"{where}: seq_lens_cpu holds {high}, over the plan's "
                f"max_context_len={cfg.max_context_len}; build the SpecConfig with "
                f"max_context_len >= {high}"
            )
    return high, values


def check_verify_lens_cpu(where: str, verify_lens_cpu: object, count: int, num_tokens: int,
                          num_draft_tokens: int) -> tuple[int, int]:  # fmt: skip
    """Check a ragged target verify's host lengths (design §2.9), on every call: a ``[count]``
    integer CPU tensor (``count`` the entries of the device ``verify_lens``), each ``v_b`` in
    ``[0, N]``, summing to at most ``num_tokens``. Returns ``(max v, Σv)`` (``(0, 0)`` for
    none). The host sees these values, so a bad one is refused here, naming it; the device
    copy's faults are the kernels' to mask and report."""
    if verify_lens_cpu is None:
        raise ValueError(
            f"{where}: verify_lens_cpu is None, but this stage was bound with verify_lens: the "
            "host mirrors plan() reads (qo_indptr_host, kv_indptr_host, mask_indptr_host) are "
            "written from it; pass verify_lens_cpu=, the CPU copy of verify_lens the engine "
            "holds (a copy made here would sync with the device)"
        )
    cpu = _tensor(where, "verify_lens_cpu", verify_lens_cpu, _CPU, ndim=1)
    if cpu.shape[0] != count:
        raise ValueError(
            f"{where}: verify_lens_cpu has {cpu.shape[0]} entries but verify_lens has {count}; "
            "pass the CPU copy of this call's verify_lens"
        )
    values = cpu.tolist()
    n = num_draft_tokens
    bad = values and not 0 <= min(values) <= max(values) <= n
    for b, v in enumerate(values if bad else ()):
        if not 0 <= v <= n:
            raise ValueError(
                f"{where}: verify_lens_cpu[{b}] = {v}, outside [0, N = {n}]; a request "
                "verifies at most the N nodes of its tree (pass the real lengths: the bucket's "
                "padding is made here)"
            )
    total = sum(values)
    if total > num_tokens:
        raise ValueError(
            f"{where}: verify_lens_cpu sums to {total}, over num_tokens = {num_tokens}; pick "
            f"a bucket of at least {total} tokens"
        )
    return (max(values) if values else 0), total


def check_node_depths_cpu(where: str, depths: object, batch: int, n: int) -> None:
    """The engine's host copy of its tree's node depths, before anything is written: a
    ``[B, N]`` integer CPU tensor (the values are checked by the mirror writer)."""
    fix = (f"pass node_depths_cpu=, the [B, N] = [{batch}, {n}] integer CPU copy of the draft "
           "tree's node depths, the root 0 (plan() reads every node's ancestor count, depth + 1, "
           "on the host)")  # fmt: skip
    if not isinstance(depths, torch.Tensor):
        raise TypeError(f"{where}: node_depths_cpu is {type(depths).__name__}; {fix}")
    if (depths.dtype not in (torch.int32, torch.int64) or depths.device.type != "cpu"
            or tuple(depths.shape) != (batch, n)):  # fmt: skip
        raise ValueError(f"{where}: node_depths_cpu is {depths.dtype} {list(depths.shape)} on "
                         f"{depths.device}; {fix}")  # fmt: skip
