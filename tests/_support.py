"""What several test modules share: row widths of test batches and compile counts.

One definition each, imported where needed (tests import from here, never from each other).
"""

from __future__ import annotations


def row_width(k: int, s: int, ps: int, *, extra: int = 0, prefix: int = 40) -> int:
    """A ``req_to_token`` width for test batches of prefixes up to ``prefix`` tokens: room for
    ``k`` branches of ``s`` draft steps each on their own pages, ``extra`` more tokens (a verify
    window) and two spare pages, rounded up to whole pages."""
    return -(-(prefix + k * (s + ps) + extra + 2 * ps) // ps) * ps


def compiled_variants(fn) -> int:
    """Compiled specialisations of one Triton kernel (Triton 3.x keeps them per device)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in fn.cache.values())


def all_compiled_variants() -> int:
    """Compiled specialisations of every specmeta Triton kernel imported so far."""
    import sys

    import triton

    total = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("specmeta."):
            for obj in vars(module).values():
                if isinstance(obj, triton.runtime.JITFunction):
                    total += compiled_variants(obj)
    return total
