"""What ``specmeta plan`` prints: each planned builder's buffers, with totals per mode, per
builder and per id space, and the buffers an engine allocates itself (design §5).

A configuration with window layers (``sliding_window_size = w``, design §2.10) plans, beside each
full layers' builder, that backend's window builder: ``FlashInferBuilder(cfg, device,
sliding_window_size=w)`` (a ``FlashInferWindowBuilder``, plan keys ``flashinfer_swa.*``) and
``FA3MetadataBuilder(cfg, device, sliding_window_size=w)`` (an ``FA3WindowBuilder``,
``fa3_swa.*``), for chains and trees, each made for the window form of the full layers' modes
(the same mode where it builds it; FlashInfer's shared-prefix cascade, built for ``w > S`` only,
is its ``draft_decode`` otherwise). An engine makes one window builder per id space, not one per
layer: every window layer reads the same lists. Its buffers hold window-pool ids, so the plan
totals the full pool's metadata and the window pool's apart. What the window builders serve is
the data their classes read (:mod:`specmeta.metadata.capabilities`), not a copy.

Torch-free, like the plan it reads (:func:`specmeta.config.plan_sizes`): ``specmeta plan`` needs
neither torch nor Triton.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .config import check_fits, human_bytes
from .metadata.capabilities import (
    BUILDERS,
    CAPABILITIES,
    FA3_WINDOW_CAPABILITIES,
    FLASHINFER_WINDOW_CAPABILITIES,
    PLAN_GROUPS,
    Capabilities,
    plan_keys,
    verify_mask_keys,
)
from .metadata.window_plan import FA3_WINDOW_PREFIX, WINDOW_PREFIX, shared_prefix_served

if TYPE_CHECKING:
    from .config import SpecConfig

__all__ = ["ENGINE_GROUPS", "ID_SPACES", "WindowBuilder", "WINDOW_BUILDERS", "Planned",
           "window_plan_keys", "plan_builders", "human", "table", "print_header",
           "print_builder", "print_engine", "print_summary"]  # fmt: skip

# What uses each group of plan keys that no builder allocates (the engine allocates those it
# needs with allocate_buffers).
ENGINE_GROUPS = {
    "draft": "draft KV slots, layout-B prefix-tail pairs: draft decode, any backend",
    "verify": "accepted-KV move pairs: accept_cache_locs + move_kv_cache after verify",
    "runner": "static inputs of GraphRunner (CUDA graphs)",
    "draft_decode": "draft_decode_kv_indices called directly (FlashInferBuilder has its own)",
    "status": "a status word (specmeta.new_status)",
    "host_lengths_host": "the seq_lens_cpu check's host slots every builder owns (design §3)",
    "host_lengths_seen": "the seq_lens_cpu check's device words every builder owns",
}

#: The id spaces a plan totals apart (design §2.10), by the label of their total: the full
#: pool's metadata (the full layers' builders and the engine's buffers) and the window pool's
#: (the window layers' builders, their status words included).
ID_SPACES = {"full": "full-pool metadata", "window": "window-pool metadata"}


@dataclasses.dataclass(frozen=True)
class WindowBuilder:
    """A backend's builder of a hybrid model's window layers, as data (design §2.10).

    Attributes
    ----------
    key : str
        Its plan prefix without the dot (``"flashinfer_swa"``).
    builder : str
        The class its backend's builder makes for ``sliding_window_size=w``.
    capabilities : Capabilities
        What it serves: the object its class reads (:mod:`specmeta.metadata.capabilities`).
    wide_window : tuple of str
        Modes it builds only for a window wider than the draft steps (FlashInfer's
        shared-prefix cascade, :func:`~specmeta.metadata.window_plan.shared_prefix_served`),
        as its ``check_modes`` refuses them.
    """

    key: str
    builder: str
    capabilities: Capabilities
    wide_window: tuple[str, ...] = ()

    def why_not(self, mode: str, cfg: SpecConfig) -> str | None:
        """Why it does not build ``mode`` for ``cfg`` (its capabilities' reason, or a window no
        wider than the draft steps), or ``None``."""
        if mode not in self.capabilities.modes:
            return f"{self.builder} has no {mode}"
        why = self.capabilities.why_not(mode, cfg)
        if why is None and mode in self.wide_window and not shared_prefix_served(cfg):
            return (f"{mode} needs a window wider than the draft steps (sliding_window_size="
                    f"{cfg.sliding_window_size} <= num_steps={cfg.num_steps}: a step would "
                    "keep no prefix position)")  # fmt: skip
        return why

    def served(self, cfg: SpecConfig) -> tuple[str, ...]:
        """Every mode it builds for ``cfg``, in its capabilities' order (its default modes)."""
        return tuple(m for m in self.capabilities.modes if self.why_not(m, cfg) is None)

    def form(self, mode: str, cfg: SpecConfig) -> tuple[str | None, str | None]:
        """The mode it builds for the full layers' ``mode``, and why that is not ``mode``
        itself (design §2.10): ``(mode, None)`` where it serves ``mode``; for another draft
        form it does not serve (the shared-prefix cascade for ``w ≤ S``) its ``draft_decode``,
        whose per-branch lists serve any window; ``(None, why)`` where it serves neither."""
        why = self.why_not(mode, cfg)
        if why is None:
            return mode, None
        if mode.startswith("draft_decode") and self.why_not("draft_decode", cfg) is None:
            return "draft_decode", why
        return None, why


#: The window builder of each backend that has one (design §2.10), what it serves read from
#: the data its class reads: FA3's serves chains and trees in its three modes, FlashInfer's
#: those and its shared-prefix (``w > S``) and paged draft forms; TRT-LLM MLA and FlashInfer
#: MLA have none.
WINDOW_BUILDERS = {
    "fa3": WindowBuilder(FA3_WINDOW_PREFIX[:-1], "FA3WindowBuilder", FA3_WINDOW_CAPABILITIES),
    "flashinfer": WindowBuilder(WINDOW_PREFIX[:-1], "FlashInferWindowBuilder",
                                FLASHINFER_WINDOW_CAPABILITIES,
                                wide_window=("draft_decode_shared_prefix",)),
}  # fmt: skip


def window_plan_keys(backend: str, keys: Iterable[str], modes: Iterable[str],
                     verify_mask: str = "both") -> list[str]:  # fmt: skip
    """The plan keys among ``keys`` that ``backend``'s window builder serving ``modes``
    allocates (its own host mirrors included): its modes' groups are its backend's
    (FlashInfer's shared-prefix form under ``draft_decode_shared``), and FlashInfer's drops the
    mask form that ``verify_mask`` does not build, as its full layers' builder does."""
    prefix = WINDOW_BUILDERS[backend].key + "."
    groups = {PLAN_GROUPS[backend].get(m, m) for m in modes}
    dropped = set()
    if backend == "flashinfer":
        dropped = {key.replace("flashinfer.", WINDOW_PREFIX, 1)
                   for key in verify_mask_keys(verify_mask)}  # fmt: skip
    return [key for key in keys if key.startswith(prefix) and key not in dropped
            and key[len(prefix) :].split(".", 1)[0] in groups]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Planned:
    """One builder of the plan: its plan prefix (``key``), its class, how it is made, its id
    space (a key of :data:`ID_SPACES`) and the plan keys it allocates."""

    key: str
    builder: str
    call: str
    space: str
    names: tuple[str, ...]


def _by_mode(names: list[str]) -> list[str]:
    """``names`` (plan keys, in plan order) grouped by mode, in plan order within a mode."""
    order = list(dict.fromkeys(name.split(".")[1] for name in names))
    return sorted(names, key=lambda name: order.index(name.split(".")[1]))


def plan_builders(cfg: SpecConfig, plan: Mapping[str, Any], backends: Iterable[str],
                  modes: tuple[str, ...] = (), verify_mask: str = "both",
                  ) -> tuple[list[Planned], list[str]]:  # fmt: skip
    """The builders a plan of ``backends`` lists: each backend's for ``modes`` (default: every
    mode it serves for ``cfg``), then, when ``cfg`` has window layers, its window builder for
    the window form of each of those modes (:meth:`WindowBuilder.form`), with a line for each
    full-layer mode whose window form is another mode or none, and for each backend with no
    window builder. ``verify_mask`` is FlashInfer's builders'. The command line has refused (or
    left out) a backend whose window builder builds no form of a mode ``modes`` names."""
    w = cfg.sliding_window_size
    builders, notes = [], []
    own = ("status", "host_lengths_host", "host_lengths_seen")  # every builder owns them
    for backend in backends:
        served = CAPABILITIES[backend].served(cfg)  # what the config allows it to serve
        chosen = tuple(m for m in served if m in (modes or served))
        # The keys the builder allocates, by the rule its plan_keys follows.
        extra = {"verify_mask": verify_mask} if backend == "flashinfer" else {}
        names = _by_mode(plan_keys(backend, plan, chosen, **extra))
        options = "".join(f", {k}={v!r}" for k, v in extra.items())
        call = f"{BUILDERS[backend]}(cfg, device, modes={list(chosen)}{options})"
        builders.append(Planned(backend, BUILDERS[backend], call, "full", (*names, *own)))
        if not w:
            continue
        window = WINDOW_BUILDERS.get(backend)
        if window is None:  # specmeta plan leaves such a backend out first
            notes.append(f"{backend}: its window layers not planned: it has no window-layer "
                         "builder")  # fmt: skip
            continue
        forms = {mode: window.form(mode, cfg) for mode in chosen}
        for mode, (form, why) in forms.items():
            if form is None:
                notes.append(f"{window.key}: the full layers' {mode} has no window-layer form: "
                             f"{window.builder} does not build it ({why})")  # fmt: skip
            elif form != mode:
                notes.append(f"{window.key}: the full layers' {mode} is {form} for the window "
                             f"layers ({window.builder}'s {form} serves any window): {why}, "
                             "design §2.10")  # fmt: skip
        wanted = {form for form, _ in forms.values()}
        chosen = tuple(m for m in window.served(cfg) if m in wanted)
        if not chosen:
            notes.append(f"{window.key}: not planned, {window.builder} builds none of the full "
                         f"layers' modes for this config ({', '.join(forms)})")  # fmt: skip
            continue
        names = _by_mode(window_plan_keys(backend, plan, chosen, **extra))
        call = (f"{BUILDERS[backend]}(cfg, device, sliding_window_size={w}, "
                f"modes={list(chosen)}{options}) ({window.builder}: window-pool ids)")  # fmt: skip
        builders.append(Planned(window.key, window.builder, call, "window", (*names, *own)))
    return builders, notes


def print_header(cfg: SpecConfig) -> None:
    """The configuration a plan is for, its derived widths and, with window layers, how an
    engine builds them."""
    window = (f" draft window {cfg.draft_window_size} + sink {cfg.draft_sink_size}"
              if cfg.draft_window_size else "")  # fmt: skip
    w = cfg.sliding_window_size
    print(f"specmeta plan: topk={cfg.topk} num_steps={cfg.num_steps} num_draft_tokens="
          f"{cfg.num_draft_tokens} page_size={cfg.page_size} max_bs={cfg.max_bs} "
          f"max_context_len={cfg.max_context_len}{window}"
          f"{f' sliding window {w}' if w else ''}")  # fmt: skip
    print(f"  req_to_token_width={cfg.req_to_token_width} pool_size={cfg.pool_size} "
          f"slot layout {'B' if cfg.layout_b else 'A'}")  # fmt: skip
    if w:
        print("  window layers: one window builder per id space beside each full layers' "
              "builder, not one per layer;\n  its buffers hold window-pool ids and are totalled "
              "apart (design §2.10)")  # fmt: skip


def human(nbytes: int) -> str:
    """Bytes in the largest binary unit below them (:func:`specmeta.config.human_bytes`)."""
    return human_bytes(nbytes)


def _is_host(name: str) -> bool:
    """Plan keys that the builders allocate on the CPU (FlashInfer's ``plan()`` mirrors)."""
    return name.endswith("_host")


def table(rows: list[tuple[str, ...]], right: set[int], indent: str = "  ") -> list[str]:
    """Rows as columns as wide as their widest cell (column ``i`` right-aligned if in ``right``)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]  # fmt: skip
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _buffer_rows(plan: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    rows = [("buffer", "shape", "dtype", "on", "bytes")]
    for name in names:
        spec = plan[name]
        rows.append((name, str(list(spec.shape)), spec.dtype,
                     "host" if _is_host(name) else "device", human(spec.nbytes)))  # fmt: skip
    return table(rows, right={4})


def print_builder(planned: Planned, plan: Mapping[str, Any]) -> tuple[int, int, bool]:
    """Print what ``planned`` allocates when it is created, with its totals per mode; return
    its device and host bytes and whether it can be created (the int32-offset limit of
    :func:`~specmeta.config.check_fits`, which holds on every device)."""
    print(f"\n{planned.key}: {planned.call} allocates these when it is created")
    for line in _buffer_rows(plan, planned.names):
        print(line)
    modes: dict[str, dict[str, int]] = {}
    for name in planned.names:
        mode = name.split(".")[1] if "." in name else "(status, host lengths)"
        where = "host" if _is_host(name) else "device"
        modes.setdefault(mode, {"device": 0, "host": 0})[where] += plan[name].nbytes
    rows = [("mode", "device", "host")]
    rows += [(mode, human(b["device"]), human(b["host"])) for mode, b in modes.items()]
    dev, host = (sum(b[w] for b in modes.values()) for w in ("device", "host"))
    rows.append((f"{planned.key} total", human(dev), human(host)))
    print()
    for line in table(rows, right={1, 2}):
        print(line)
    if host:
        print("  host: one set of CPU mirrors for plan(), pinned when the device is CUDA; the")
        print("  builder keeps mirror_depth sets (default 16) of the per-build index pointers")
    try:  # "meta": no memory check, only what no device can hold
        check_fits({name: plan[name] for name in planned.names}, "meta", planned.builder)
    except ValueError as err:
        print(f"  cannot be created: {err}")
        return dev, host, False
    return dev, host, True


def print_engine(plan: Mapping[str, Any], engine: Iterable[str],
                 window: bool) -> dict[str, int]:  # fmt: skip
    """Print the engine's buffer groups (every one listed, those of ``engine`` in full); return
    the bytes of each of ``engine``. ``window``: the plan has window layers, whose engine
    buffers in window-pool ids are named too."""
    engine = list(engine)
    groups = {g: [name for name in plan if name.split(".")[0] == g] for g in ENGINE_GROUPS}
    print("\nengine buffers: no builder allocates these; an engine allocates those it uses with")
    print("specmeta.allocate_buffers(cfg, device, names); --with GROUP adds a group to the total")
    if window:
        print("(window layers: the draft slots and accepted-KV move pairs in window-pool ids, from")
        print("assign_draft_cache_locs and accept_cache_locs with full_to_swa, are one more")
        print("draft.out_cache_loc, verify.tgt_cache_loc and verify.src_cache_loc; not counted)")
    rows = [("group", "bytes", "in total", "what uses it")]
    for group, names in groups.items():
        nbytes = sum(plan[name].nbytes for name in names)
        rows.append((group, human(nbytes), "yes" if group in engine else "no",
                     ENGINE_GROUPS[group]))  # fmt: skip
    for line in table(rows, right={1}):
        print(line)
    totals = {}
    for group in engine:
        print(f"\n{group}:")
        for line in _buffer_rows(plan, groups[group]):
            print(line)
        totals[group] = sum(plan[name].nbytes for name in groups[group])
    return totals


def print_summary(builders: list[tuple[Planned, int, int]], engine: Mapping[str, int]) -> None:
    """The closing table: one row per builder (device, host bytes) and engine group, the totals
    per id space when a window builder is planned (the engine's buffers count in the full
    pool's), and the grand total."""
    summary: list[tuple[str, ...]] = [("", "device", "host")]
    spaces = {space: [0, 0] for space in ID_SPACES}
    for planned, dev, host in builders:
        summary.append((planned.builder, human(dev), human(host)))
        spaces[planned.space][0] += dev
        spaces[planned.space][1] += host
    for group, nbytes in engine.items():
        summary.append((f"engine: {group}", human(nbytes), human(0)))
        spaces["full"][0] += nbytes
    if any(planned.space == "window" for planned, _, _ in builders):
        summary += [(label, human(spaces[space][0]), human(spaces[space][1]))
                    for space, label in ID_SPACES.items()]  # fmt: skip
    grand = [sum(totals[i] for totals in spaces.values()) for i in (0, 1)]
    summary.append(("grand total", human(grand[0]), human(grand[1])))
    print()
    for line in table(summary, right={1, 2}, indent=""):
        print(line)
