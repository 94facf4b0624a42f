"""The engine side of a hybrid model's window pool (design §2.10): which window-pool slot holds
each full-pool slot's window-layer KV, kept as an engine keeps it.

A hybrid model's sliding-window layers (window ``w``) keep their KV in a second, smaller pool.
The engine maps every full-pool slot it hands out to a window-pool slot (``full_to_swa``, a
token-granular ``[P_full]`` map, ``−1`` where none) and takes the window slot back once the
position falls out of every window that will still read it: a request's next forward (its
target verify at its committed length ``L``) reads positions ``≥ L − w + 1``, and every later
one reads further on. Window slots are reused most recently freed first, so a stale id read
through an old mapping would read another request's KV, and an evicted slot read through the
map is a ``−1`` the kernels report.
"""

from __future__ import annotations

import torch

__all__ = ["WindowSlots", "window_pool_size"]


def window_pool_size(window: int, max_bs: int, max_context_len: int, row_need: int,
                     page_size: int) -> int:  # fmt: skip
    """Window-pool slots that always suffice: the sink, then per request its window
    (``w − 1`` positions below ``L``) and what an iteration allocates from ``L`` on
    (``row_need`` positions, rounded up to whole pages), and one prompt's positions at once
    (an admitted prompt is mapped whole, then evicted)."""
    per_request = window + row_need + 2 * page_size
    return 1 + max_bs * per_request + max_context_len


class WindowSlots:
    """The full → window pool map and the window pool's free slots.

    Parameters
    ----------
    full_pool_size, window_pool_size : int
        Slots of the two pools; slot 0 of each is the sink (``full_to_swa[0] = 0``, never
        handed out nor taken back).
    window : int
        ``w`` of the window layers.
    device : torch.device
        Where the map lives (the builders read it there).
    generator : torch.Generator
        Shuffles the free window slots.

    Attributes
    ----------
    full_to_swa : torch.Tensor
        ``[P_full]`` int32, updated in place (the graphs read it).
    evicted, reused : int
        Window slots taken back so far, and handed out again after being taken back.
    """

    def __init__(self, full_pool_size: int, window_pool_size: int, window: int, device,
                 generator: torch.Generator):  # fmt: skip
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.full_to_swa = torch.full((full_pool_size,), -1, dtype=torch.int32, device=device)
        self.full_to_swa[0] = 0
        self.free = (torch.randperm(window_pool_size - 1, generator=generator) + 1).tolist()
        # Per row: positions [evicted, mapped) hold window slots; their full slots and window
        # slots, by position (host lists: the map's only device traffic is the writes).
        self._evicted: dict[int, int] = {}
        self._slots: dict[int, list[tuple[int, int]]] = {}
        self._taken_back: set[int] = set()
        self.evicted = self.reused = 0

    def map(self, row: int, full_slots: list[int]) -> None:
        """Give a window slot to each full slot of ``row`` past those it has: ``full_slots``
        are the row's slots by position, from position 0 (the allocator's pages)."""
        have = self._slots.setdefault(row, [])
        start = self._evicted.setdefault(row, 0) + len(have)
        new = full_slots[start:]
        if not new:
            return
        if len(new) > len(self.free):
            raise ValueError(f"the window pool is out of slots ({len(self.free)} free, "
                             f"{len(new)} needed): raise its size")  # fmt: skip
        window = [self.free.pop() for _ in new]
        self.reused += sum(w in self._taken_back for w in window)
        have.extend(zip(new, window, strict=True))
        self._write(new, window)

    def evict(self, row: int, committed: int) -> None:
        """Take back the window slots of ``row``'s positions below ``committed − w + 1``: no
        forward of the request reads them again (its next reads positions from there on)."""
        below = committed - self.window + 1
        first = self._evicted.get(row, 0)
        count = min(max(below - first, 0), len(self._slots.get(row, ())))
        if count:
            self._release(row, count)

    def release(self, row: int) -> None:
        """A finished request: every window slot of ``row`` back to the free list."""
        self._release(row, len(self._slots.get(row, ())))
        self._slots.pop(row, None)
        self._evicted.pop(row, None)

    def _release(self, row: int, count: int) -> None:
        gone, self._slots[row] = self._slots[row][:count], self._slots[row][count:]
        self._evicted[row] = self._evicted.get(row, 0) + count
        self._write([f for f, _ in gone], [-1] * count)
        # Most recently freed first: a stale id would name a slot soon holding other KV.
        self.free.extend(w for _, w in gone)
        self._taken_back.update(w for _, w in gone)
        self.evicted += count

    def _write(self, full: list[int], window: list[int]) -> None:
        if full:
            idx = torch.tensor(full, dtype=torch.int64)
            self.full_to_swa[idx.to(self.full_to_swa.device)] = torch.tensor(
                window, dtype=torch.int32).to(self.full_to_swa.device)  # fmt: skip
