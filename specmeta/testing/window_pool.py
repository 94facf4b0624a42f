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
                     page_size: int, paged: bool = False) -> int:  # fmt: skip
    """Window-pool slots that always suffice: the sink, then per request its window
    (``w − 1`` positions below ``L``) and what an iteration allocates from ``L`` on
    (``row_need`` positions, rounded up to whole pages), and one prompt's positions at once
    (an admitted prompt is mapped whole, then evicted). ``paged``: in whole pages (a
    :class:`WindowSlots` with ``page_size``), the sink page first; the floor's page is held
    whole, one more page a request."""
    per_request = window + row_need + 2 * page_size
    if not paged:
        return 1 + max_bs * per_request + max_context_len
    pages = 1 + max_bs * (-(-per_request // page_size) + 1) + -(-max_context_len // page_size) + 1
    return pages * page_size


class WindowSlots:
    """The full → window pool map and the window pool's free slots (pages with ``page_size``).

    Parameters
    ----------
    full_pool_size, window_pool_size : int
        Slots of the two pools; slot 0 of each is the sink (``full_to_swa[0] = 0``, never
        handed out nor taken back), and with ``page_size`` the whole page 0 of each.
    window : int
        ``w`` of the window layers.
    device : torch.device
        Where the map lives (the builders read it there).
    generator : torch.Generator
        Shuffles the free window slots (pages).
    page_size : int
        ``1``: token-granular, each full slot its own window slot. ``ps > 1``: the window pool
        pages like the full pool (see the module); both pool sizes must then be multiples of
        ``ps`` and :meth:`map` takes whole full pages.

    Attributes
    ----------
    full_to_swa : torch.Tensor
        ``[P_full]`` int32, updated in place (the graphs read it).
    page_map : torch.Tensor
        ``[P_full / ps]`` int32, the window page of each full page, ``−1`` where none (``ps =
        1``: the map itself); updated in place.
    evicted, reused : int
        Window slots (pages) taken back so far, and handed out again after being taken back.
    cleared : int
        Map entries set to ``−1`` while their window page stayed held (the floor's page; 0
        with ``page_size = 1``).
    """

    def __init__(self, full_pool_size: int, window_pool_size: int, window: int, device,
                 generator: torch.Generator, page_size: int = 1):  # fmt: skip
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if page_size < 1 or full_pool_size % page_size or window_pool_size % page_size:
            raise ValueError(f"WindowSlots: page_size={page_size} must be >= 1 and divide both "
                             f"pool sizes ({full_pool_size}, {window_pool_size}): a paged "
                             f"window pool holds whole pages (design §2.10)")  # fmt: skip
        self.window, self.page_size = window, page_size
        self.full_to_swa = torch.full((full_pool_size,), -1, dtype=torch.int32, device=device)
        self.full_to_swa[0] = 0
        if page_size == 1:
            self.page_map = self.full_to_swa
        else:
            self.page_map = torch.full((full_pool_size // page_size,), -1, dtype=torch.int32,
                                       device=device)  # fmt: skip
            self.page_map[0] = 0
        pages = window_pool_size // page_size
        self.free = (torch.randperm(pages - 1, generator=generator) + 1).tolist()
        # Per row: pages [first, first + len) of its positions hold window pages (their full
        # and window pages, by page), and positions below ``_cut`` are out of the map (host
        # lists: the map's only device traffic is the writes).
        self._first: dict[int, int] = {}
        self._pages: dict[int, list[tuple[int, int]]] = {}
        self._cut: dict[int, int] = {}
        self._taken_back: set[int] = set()
        self.evicted = self.reused = self.cleared = 0

    def map(self, row: int, full_slots: list[int]) -> None:
        """Give a window slot (page) to each full slot (page) of ``row`` past those it has:
        ``full_slots`` are the row's slots by position, from position 0 (the allocator's
        pages, whole ones with ``page_size``)."""
        ps = self.page_size
        have = self._pages.setdefault(row, [])
        start = (self._first.setdefault(row, 0) + len(have)) * ps
        new = full_slots[start:]
        if not new:
            return
        full = [new[i] // ps for i in range(0, len(new), ps)]
        if new != [f * ps + j for f in full for j in range(ps)]:
            raise ValueError(f"WindowSlots.map: row {row}'s slots from position {start} are not "
                             f"whole full pages of {ps} (a paged window pool maps a full page "
                             f"to one window page at the same offsets, design §2.10)")  # fmt: skip
        if len(full) > len(self.free):
            raise ValueError(f"the window pool is out of slots ({len(self.free)} free, "
                             f"{len(full)} needed): raise its size")  # fmt: skip
        window = [self.free.pop() for _ in full]
        self.reused += sum(w in self._taken_back for w in window)
        have.extend(zip(full, window, strict=True))
        self._write(full, window)

    def evict(self, row: int, committed: int) -> None:
        """Take back what no forward of ``row`` reads again, its positions below ``f =
        committed − w + 1`` (its next forward reads from there on): their map entries go to
        ``−1``, and each window page whose every position lies below ``f`` goes back."""
        ps = self.page_size
        below = committed - self.window + 1
        have = self._pages.get(row, [])
        first = self._first.get(row, 0)
        cut = min(max(below, self._cut.get(row, 0)), (first + len(have)) * ps)
        if cut > self._cut.get(row, 0):
            # Token by token: the positions [old cut, cut) of the pages still held.
            positions = range(max(self._cut.get(row, 0), first * ps), cut)
            self._clear([have[p // ps - first][0] * ps + p % ps for p in positions])
            self.cleared += sum(p // ps >= below // ps for p in positions)
            self._cut[row] = cut
        count = min(max(below // ps - first, 0), len(have))
        if count:
            self._release(row, count)

    def release(self, row: int) -> None:
        """A finished request: every window slot (page) of ``row`` back to the free list."""
        self._release(row, len(self._pages.get(row, ())))
        for d in (self._pages, self._first, self._cut):
            d.pop(row, None)

    def _release(self, row: int, count: int) -> None:
        gone, self._pages[row] = self._pages[row][:count], self._pages[row][count:]
        self._first[row] = self._first.get(row, 0) + count
        self._write([f for f, _ in gone], [-1] * count)
        # Most recently freed first: a stale id would name a slot soon holding other KV.
        self.free.extend(w for _, w in gone)
        self._taken_back.update(w for _, w in gone)
        self.evicted += count

    def _write(self, full: list[int], window: list[int]) -> None:
        """Full pages ``full`` to window pages ``window`` (``−1``: none), slot by slot at the
        same offsets, in both maps."""
        if not full:
            return
        ps, dev = self.page_size, self.full_to_swa.device
        pages = torch.tensor(full, dtype=torch.int64)
        wins = torch.tensor(window, dtype=torch.int64)
        off = torch.arange(ps, dtype=torch.int64)
        slots = torch.where(wins.view(-1, 1) >= 0, wins.view(-1, 1) * ps + off, -1)
        self.full_to_swa[(pages.view(-1, 1) * ps + off).flatten().to(dev)] = (
            slots.flatten().to(torch.int32).to(dev))  # fmt: skip
        if ps > 1:
            self.page_map[pages.to(dev)] = wins.to(torch.int32).to(dev)

    def _clear(self, full_slots: list[int]) -> None:
        """Single map entries to ``−1`` (their pages stay held)."""
        if full_slots:
            idx = torch.tensor(full_slots, dtype=torch.int64).to(self.full_to_swa.device)
            self.full_to_swa[idx] = -1
