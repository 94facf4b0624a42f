"""The uniform-stride query layout every backend shares (design §3.1).

When every request contributes a fixed query width ``Q`` (``K`` for the draft-decode normal
pass, 1 for the expand pass, ``N`` for target verify and draft extend)::

    cu_seqlens_q = Q · arange(Bp + 1),   max_seqlen_q = Q,   sum_seqlens_q = Bp · Q

identical at capture and at replay, padded rows keeping their full width: a variable-stride
layout built at replay would disagree with the uniform one a graph captured, and the kernel
would read rows that are not there. The values are written once, for the largest batch, into
a planned buffer; a batch of ``B`` rows takes the view ``[:B + 1]``, which holds exactly the
same numbers a capture at ``B`` would. There is no per-iteration work at all.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import validate

__all__ = ["UniformQueryLayout"]


@dataclasses.dataclass(frozen=True)
class UniformQueryLayout:
    """``cu_seqlens_q`` of stride ``query_width`` for up to ``max_bs`` requests.

    Attributes
    ----------
    query_width : int
        ``Q``, query tokens per request.
    max_bs : int
        Largest batch the buffer serves.
    buffer : torch.Tensor
        ``[max_bs + 1]`` int32, ``Q · arange(max_bs + 1)``; written once by :meth:`create`.
    """

    query_width: int
    max_bs: int
    buffer: torch.Tensor

    @classmethod
    def create(
        cls,
        query_width: int,
        max_bs: int,
        device: torch.device | str,
        *,
        out: torch.Tensor | None = None,
    ) -> UniformQueryLayout:
        """Write ``Q · arange(max_bs + 1)`` into ``out`` (a planned ``[≥ max_bs + 1]`` int32
        buffer) or a new tensor. Call once, at set-up; never on a build path."""
        validate.positive("query_width", query_width)
        validate.positive("max_bs", max_bs, minimum=0)
        if out is None:
            out = torch.empty(max_bs + 1, dtype=torch.int32, device=device)
        validate.tensor("out", out, dtypes=(torch.int32,), ndim=1)
        validate.at_least("out", out.shape[0], max_bs + 1)
        torch.arange(max_bs + 1, dtype=torch.int32, device=out.device, out=out[: max_bs + 1])
        out[: max_bs + 1] *= query_width
        return cls(query_width, max_bs, out[: max_bs + 1])

    def cu_seqlens_q(self, batch: int) -> torch.Tensor:
        """``[batch + 1]`` int32 view: ``Q · arange(batch + 1)``. No work, no sync."""
        if not 0 <= batch <= self.max_bs:
            raise ValueError(f"batch must be in [0, {self.max_bs}], got {batch}")
        return self.buffer[: batch + 1]

    @property
    def max_seqlen_q(self) -> int:
        """``Q``: every request, padded or not, has the full width."""
        return self.query_width

    def sum_seqlens_q(self, batch: int) -> int:
        """``batch · Q`` query tokens in all."""
        return batch * self.query_width
