"""A stage: work bound once to tensors, made again by plain calls (design §2.7, §3, §4).

A stage holds the launches of one piece of work, each bound to its arguments
(:class:`specmeta.launch.Launch`), and, for a builder mode, the host part that reads the
engine's ``seq_lens_cpu``: :meth:`Stage.launch` makes the launches (inside a CUDA graph capture,
what the graph holds); :meth:`Stage.host` checks ``seq_lens_cpu``, writes what the host
computes from it (exact maxima, FlashInfer's ``plan()`` mirrors) and returns the result;
calling the stage does both, the host part first, so a bad length is refused before anything
is launched. Neither checks a tensor or computes a key: the checks ran when it was bound.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Stage", "launcher"]


class Stage:
    """Bound launches and an optional host part.

    Parameters
    ----------
    launches : iterable of callables or Stages
        The launches, in order (a :class:`Stage` among them contributes its own launches; a
        ``None``, an optional launch left out, contributes nothing). A launch is any callable
        of no arguments: a bound kernel launch, or a torch reference call for a reference
        build.
    result : object
        What the stage returns when it has no host part (a launcher's outputs).
    host : callable, optional
        ``host(seq_lens_cpu) -> result``: the host part of a builder mode.
    """

    __slots__ = ("launches", "result", "_host")

    def __init__(self, launches: Iterable[Callable[[], Any] | Stage] = (), result: Any = None,
                 host: Callable[[torch.Tensor | None], Any] | None = None) -> None:  # fmt: skip
        flat: list[Callable[[], Any]] = []
        for launch in launches:
            if isinstance(launch, Stage):
                flat.extend(launch.launches)
            elif launch is None:
                continue
            elif callable(launch):
                flat.append(launch)
            else:
                raise TypeError(f"Stage: a launch must be callable, got {type(launch).__name__}")
        self.launches = tuple(flat)
        self.result = result
        self._host = host

    def launch(self) -> None:
        """Make every launch, in order."""
        for launch in self.launches:
            launch()

    def host(self, seq_lens_cpu: torch.Tensor | None = None, **host_inputs: Any) -> Any:
        """The host part on ``seq_lens_cpu`` and the other host values it reads
        (``verify_lens_cpu`` of a ragged target verify), each checked before anything is
        written, and the result; a stage without one returns :attr:`result`."""
        if self._host is None:
            return self.result
        return self._host(seq_lens_cpu, **host_inputs)

    def __call__(self, seq_lens_cpu: torch.Tensor | None = None, **host_inputs: Any) -> Any:
        """:meth:`host`, then :meth:`launch`; returns the result."""
        result = self.host(seq_lens_cpu, **host_inputs)
        for launch in self.launches:
            launch()
        return result


def launcher(bind: Callable[..., Stage]) -> Callable[..., Any]:
    """The eager form of a ``bind_<op>``: ``<op>(*args, **kwargs)`` is ``bind_<op>(*args,
    **kwargs)()``, bound and launched at once, returning the stage's result. Its signature and
    docstring are ``bind``'s (``inspect.signature`` follows ``__wrapped__``)."""

    @functools.wraps(bind)
    def call(*args: Any, **kwargs: Any) -> Any:
        return bind(*args, **kwargs)()

    call.__name__ = call.__qualname__ = bind.__name__.removeprefix("bind_")
    return call
