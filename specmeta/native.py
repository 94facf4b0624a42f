"""Optional compiled modules, each built, loaded and tried at most once per process: the native
tensor reads (:mod:`specmeta.tensor_layout`) and the host ops
(:mod:`specmeta.metadata.host_ops`).

Each has a Python path beside it. Where a module cannot be built here (no compiler, no
headers), fails its own known answers, or is turned off by its environment switch, its
callers keep the Python path and :meth:`OptionalModule.why` says why.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["OptionalModule"]


class OptionalModule:
    """A module made by ``load()`` on the first :meth:`get`, or ``None``.

    Parameters
    ----------
    switch : str
        The environment variable that turns it off when set to ``0``.
    load : callable
        ``load() -> module``: builds and imports it; any exception means "not here" and is
        kept as the reason.
    """

    __slots__ = ("_switch", "_load", "_found", "_why", "_tried")

    def __init__(self, switch: str, load: Callable[[], object]) -> None:
        self._switch, self._load = switch, load
        self._found: object | None = None
        self._why: str | None = None
        self._tried = False

    def get(self) -> object | None:
        """The module, or ``None`` (then :meth:`why` says why)."""
        if not self._tried:
            self._tried = True
            if os.environ.get(self._switch, "1") == "0":
                self._why = f"{self._switch}=0"
            else:
                try:
                    self._found = self._load()
                except Exception as exc:  # no compiler or headers, failed known answers
                    self._why = f"{type(exc).__name__}: {str(exc)[-400:]}"
        return self._found

    def why(self) -> str | None:
        """Why :meth:`get` is ``None`` (``None`` when it is not)."""
        return None if self.get() is not None else self._why
