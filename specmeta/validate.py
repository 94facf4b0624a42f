"""Host-side argument checks shared by every launcher (style §9).

They read shapes, dtypes, strides and devices only — never device values — so they cost no sync.
Each raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong device, rank, shape or
capacity) naming the argument, with what was expected and what was given.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from . import tensor_layout
from .status import default_status

INDEX_DTYPES = (torch.int32, torch.int64)


# ``_state.trusted`` is True while a caller that already checked the arguments runs a launcher
# on this thread (see :func:`trusting`); per thread, so one thread's builder never skips
# another thread's checks.
class _State(threading.local):
    trusted = False  # the class attribute is every new thread's starting value


_state = _State()


def trusting(fn):
    """``fn`` with :func:`tensor`, :func:`length` and :func:`at_least` skipped while it runs.

    For a builder calling a launcher (design §3): the builder has just run the same checks on
    the inputs it passes on as they are, and the outputs are its own buffers, sized by the plan,
    so the launcher's second pass over them would only cost host time. Everything else a
    launcher checks (ints, the status word's default) still runs.
    """

    def call(*args, **kwargs):
        _state.trusted = True
        try:
            return fn(*args, **kwargs)
        finally:
            _state.trusted = False

    call.__wrapped__ = fn
    return call


def is_trusted() -> bool:
    """Whether a :func:`trusting` caller runs on this thread now."""
    return _state.trusted


def signature(*args: object) -> tuple:
    """Everything the host checks of a call can read of ``args``: each tensor's address, shape,
    strides, dtype and device, and every other value as it is (a bool apart from the equal
    int). Calls with equal signatures pass or fail the same shape, dtype, device and capacity
    checks, so a caller may check once per signature (a builder's tensor checks, an op's
    :class:`specmeta.launch.LaunchPlans`). Device values are not part of it: no check reads
    them. :class:`Signer` computes an equivalent key faster, for a call site's own calls."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.data_ptr(), a.shape, a.stride(), a.dtype, a.device))
        elif a is None or a.__class__ is int or a.__class__ is str:
            sig.append(a)
        else:
            sig.append((a.__class__, a))
    return tuple(sig)


class OtherTypes(Exception):
    """Raised by a function a :class:`TypePatterns` wrote, for arguments of another pattern."""


class TypePatterns:
    """Straight-line functions of a call site's arguments, one per pattern of argument types.

    ``write(args, index)`` returns a function written for the types of ``args`` (which slots
    hold a tensor, an int, None, ...) that raises :class:`OtherTypes` for arguments of another
    pattern. A call tries the functions written so far, the newest first, and writes one for a
    new pattern, up to ``size`` of them; past that, ``generic(*args)`` answers. Used for the
    launch key of a kernel (:class:`specmeta.launch.Launcher`) and for plan and check keys
    (:class:`Signer`): a call site passes a few patterns, so a call costs one function call.
    """

    __slots__ = ("_fns", "_write", "_generic", "_size")

    def __init__(self, write, generic, size: int = 4) -> None:
        self._fns: list = []
        self._write = write
        self._generic = generic
        self._size = size

    def __call__(self, *args: object):
        for fn in self._fns:
            try:
                return fn(*args)
            except (OtherTypes, TypeError, AttributeError):  # other types, or arity
                continue
        if len(self._fns) < self._size:
            fn = self._write(args, len(self._fns))
            self._fns.insert(0, fn)
            return fn(*args)
        return self._generic(*args)


class Key:
    """A :class:`Signer` key: one signature, compared and hashed by identity (one C slot each,
    where a tuple of every tensor's metadata hashes element by element). A signer hands out
    one :class:`Key` per distinct signature, so equal keys are the same object."""

    __slots__ = ("signature",)

    def __init__(self, signature: tuple) -> None:
        self.signature = signature

    def __repr__(self) -> str:
        return f"Key{self.signature!r}"


def _tensor_guards():
    """torch's C++ tensor guard (``torch._C._dynamo.guards.TensorGuards``, what a compiled
    function checks its tensors with on every call) when it behaves here as :class:`Signer`
    needs, else None. It is private to torch, so it is tried once, on known answers: a guard
    made from a tensor passes the same tensor and an equal one, and fails another shape,
    another stride order, another dtype and another device."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(*ts):
            return TensorGuards(
                *ts,
                dynamic_dims_sizes=[list(t.shape) for t in ts],
                dynamic_dims_strides=[list(t.stride()) for t in ts],
            ).check

        x = torch.zeros(2, 3, dtype=torch.int32)
        check = make(x, x[0])
        if (
            check(x, x[1])
            and check(torch.ones(2, 3, dtype=torch.int32), x[0])
            and not check(x[:1], x[0])
            and not check(x.t(), x[0])
            and not check(x.long(), x[0])
            and not check(x, x[0, :2])
            and not check(x, x)
            and not make(torch.zeros(1, device="meta"))(torch.zeros(1))
        ):
            return make
    except Exception:  # noqa: BLE001 - any failure means: use the Python keys
        pass
    return None


_GUARD = _tensor_guards()


class Signer(TypePatterns):
    """A key of ``(head, *args)`` as selective as :func:`signature` of ``args``, made by
    straight-line code written for the argument types of one call site's calls.

    For each pattern of argument types (up to four) it writes one function, in the first of
    these ways that is available:

    - **native** (:mod:`specmeta.tensor_layout`): every tensor's address, dtype, device, shape
      and strides read in one native call, packed as bytes beside the other slots' values;
      the key is the :class:`Key` of that signature.
    - **torch's tensor guard** (:func:`_tensor_guards`): per tensor only its address (its
      device when the address is 0: a non-zero address names one device, host and CUDA
      memory sharing one address space), and per other slot its value; the tensors' shapes,
      strides and dtypes, which a key of the same addresses once had, are then compared by the
      guard stored with it, in one C call (up to :attr:`WAYS` such entries per address, newest
      first).
    - **Python reads**: the full signature tuple, address, shape, strides and dtype per
      tensor.

    Keys are :class:`Key` objects, the same object for the same signature (the Python reads'
    keys are the tuples themselves). Keys of different patterns or ways never meet; a pattern
    past the fourth takes :func:`signature`. ``head`` (hashable) leads every key.

    Parameters
    ----------
    guarded : bool
        Use torch's tensor guard where it is available (default); ``False``: the Python reads.
    native : bool
        Use the native layout read where it is built (default; with ``guarded`` only).
    """

    __slots__ = ("_keys", "_table", "_guard", "_native", "_record")

    #: Shapes, strides and dtypes remembered per address key (a batch's views keep their
    #: address while the batch size changes).
    WAYS = 8
    #: Distinct signatures kept; past that the signer starts again (its old keys stay valid
    #: keys that no call returns any more).
    SIZE = 4096

    def __init__(self, guarded: bool = True, native: bool = True) -> None:
        self._keys: dict = {}  # signature -> Key
        self._table: dict = {}  # address key -> [(Key, guard check), ...], newest first
        self._guard = _GUARD if guarded else None
        # The native module is looked up at the first key, not here: signers are made at
        # import, and the first lookup in a process may build it.
        self._native = guarded and native
        self._record = None
        super().__init__(self._write_pattern, self._generic_key)

    def _resolve(self) -> None:
        if self._native:
            layout = tensor_layout.module()
            self._record = layout.record if layout is not None else None
            self._native = False

    def _write_pattern(self, args: tuple, pattern: int):
        self._resolve()
        if self._record is not None:
            return _native_signer(args, pattern, self)
        if self._guard is not None:
            return _guarded_signer(args, pattern, self)
        return _signer(args, pattern, self)

    @property
    def way(self) -> str:
        """How the keys read the tensors: ``native``, ``torch's guard`` or ``python reads``."""
        self._resolve()
        if self._record is not None:
            return "native"
        return "torch's guard" if self._guard is not None else "python reads"

    def key(self, signature: tuple) -> Key:
        """The :class:`Key` of ``signature``."""
        found = self._keys.get(signature)
        if found is None:
            if len(self._keys) >= self.SIZE:
                self._keys.clear()
                self._table.clear()
            found = self._keys[signature] = Key(signature)
        return found

    @staticmethod
    def _generic_key(head: object, *args: object) -> tuple:
        return ("generic", head, *signature(*args))

    def _miss(self, address: tuple, tensors: tuple, full, args: tuple) -> Key:
        """The key of a call whose address key has no entry whose guard passes: an older
        entry of the address, or the full signature, with a guard made for it."""
        entries = self._table.get(address)
        if entries is not None:
            for i in range(1, len(entries)):
                if entries[i][1](*tensors):
                    entries.insert(0, entries.pop(i))
                    return entries[0][0]
        key = self.key(full(*args))
        entries = self._table.setdefault(address, [])
        entries.insert(0, (key, self._guard(*tensors)))
        del entries[self.WAYS :]
        return key


def _parts(names: list, args: tuple, pattern: int, *, shapes: bool,
           tensors: bool = True) -> tuple[list, list]:  # fmt: skip
    """``(guards, parts)`` of a :class:`Signer` key function: the type tests of a call's
    arguments and the key's entries (per tensor its address, and with ``shapes`` its shape,
    strides and dtype; nothing without ``tensors``; per other slot its value)."""
    guards, parts = [], [repr(f"pattern{pattern}" if tensors else f"native{pattern}"), "head"]
    for a, v in zip(names, args, strict=True):
        if isinstance(v, torch.Tensor) and not tensors:
            continue  # read by the native call; a slot of another type makes it raise
        if isinstance(v, torch.Tensor):
            # Without shapes, another type in a tensor slot fails the guard (or has no
            # data_ptr) and reaches the full signature, which tests the type.
            if shapes:
                guards.append(f"not isinstance({a}, _Tensor)")
            parts.append(f"{a}.data_ptr() or {a}.device")
            if shapes:
                parts += [f"{a}.shape", f"{a}.stride()", f"{a}.dtype"]
        elif v is None:
            guards.append(f"{a} is not None")
        elif v.__class__ in (int, str):
            guards.append(f"{a}.__class__ is not {v.__class__.__name__}")
            parts.append(a)
        else:
            guards.append(
                f"({a}.__class__ is int or isinstance({a}, (_Tensor, str)) or {a} is None)"
            )
            parts += [f"{a}.__class__", a]
    return guards, parts


def _written(src: str, name: str, scope: dict):
    """The function ``name`` defined by ``src`` in ``scope``."""
    exec(src, scope)  # noqa: S102 - code written by _parts from a call's argument types
    return scope[name]


def _full_signature(args: tuple, pattern: int) -> tuple[str, str, dict]:
    """``(source, name, scope)`` of a pattern's function ``full(head, *args)``: its full
    signature tuple (address, shape, strides and dtype per tensor, every other slot's
    value)."""
    names = [f"a{i}" for i in range(len(args))]
    guards, parts = _parts(names, args, pattern, shapes=True)
    body = f"    if {' or '.join(guards)}:\n        raise _OtherTypes\n" if guards else ""
    src = f"def full({', '.join(['head', *names])}):\n{body}    return ({', '.join(parts)},)\n"
    return src, "full", {"_Tensor": torch.Tensor, "_OtherTypes": OtherTypes}


def _signer(args: tuple, pattern: int, signer: Signer):
    """The key function of a :class:`Signer` without the tensor guard: the full signature,
    read in Python."""
    del signer
    return _written(*_full_signature(args[1:], pattern))


def _native_signer(args: tuple, pattern: int, signer: Signer):
    """The key function of a :class:`Signer` with the native layout read: the tensors'
    layouts in one call, packed beside the other slots' values. A slot that holds no tensor
    with storage makes the native call raise; the full signature then decides (it raises
    :class:`OtherTypes` for another pattern)."""
    args = args[1:]
    names = [f"a{i}" for i in range(len(args))]
    tensors = [a for a, v in zip(names, args, strict=True) if isinstance(v, torch.Tensor)]
    if not tensors:
        return _signer((None, *args), pattern, signer)
    guards, parts = _parts(names, args, pattern, shapes=False, tensors=False)
    every = ", ".join(["head", *names])
    src = (
        f"def sign({every}):\n"
        + (f"    if {' or '.join(guards)}:\n        raise _OtherTypes\n" if guards else "")
        + "    try:\n"
        + f"        layouts = _record({', '.join(tensors)})\n"
        + "    except (TypeError, RuntimeError):\n"
        + f"        return _key(_full({every}))\n"
        + f"    found = _keys.get(({', '.join(parts)}, layouts))\n"
        + "    if found is not None:\n"
        + "        return found\n"
        + f"    return _key(({', '.join(parts)}, layouts))\n"
    )
    scope = {"_Tensor": torch.Tensor, "_OtherTypes": OtherTypes, "_record": signer._record,
             "_keys": signer._keys, "_key": signer.key,
             "_full": _written(*_full_signature(args, pattern))}  # fmt: skip
    return _written(src, "sign", scope)


def _guarded_signer(args: tuple, pattern: int, signer: Signer):
    """The key function of a :class:`Signer` with the tensor guard: the address key read in
    Python, the shapes, strides and dtypes compared by the newest entry's guard."""
    args = args[1:]
    names = [f"a{i}" for i in range(len(args))]
    guards, parts = _parts(names, args, pattern, shapes=False)
    tensors = [a for a, v in zip(names, args, strict=True) if isinstance(v, torch.Tensor)]
    if not tensors:  # nothing for a guard to compare: the address key is the signature
        return _signer((None, *args), pattern, signer)
    listed = ", ".join(tensors) + ("," if len(tensors) == 1 else "")
    every = ", ".join(["head", *names])
    src = (
        f"def sign({every}):\n"
        + (f"    if {' or '.join(guards)}:\n        raise _OtherTypes\n" if guards else "")
        + f"    address = ({', '.join(parts)},)\n"
        + "    entries = _table.get(address)\n"
        + "    if entries is not None:\n"
        + "        key, check = entries[0]\n"
        + f"        if check({', '.join(tensors)}):\n"
        + "            return key\n"
        + f"    return _miss(address, ({listed}), _full, ({every},))\n"
    )
    scope = {"_Tensor": torch.Tensor, "_OtherTypes": OtherTypes, "_table": signer._table,
             "_miss": signer._miss, "_full": _written(*_full_signature(args, pattern))}  # fmt: skip
    return _written(src, "sign", scope)


def pinned(tensors: Sequence[torch.Tensor], sources: Sequence = (), *, guarded: bool = True,
           native: bool = True):  # fmt: skip
    """A function ``unchanged() -> bool``: whether ``tensors`` and the tensors the functions
    ``sources`` return (a guarded engine tensor, read again on every call) still have the
    addresses, shapes, strides, dtypes and devices they have now. One function written for
    them: with ``guarded``, the native layout check (:mod:`specmeta.tensor_layout`, one call
    for them all) where it is built and ``native``, else torch's tensor guard
    (:func:`_tensor_guards`) with an address call per tensor where it is available; else the
    :func:`signature` of them all. For a graph runner, which checks what its graphs captured
    before every replay."""
    fixed, calls = tuple(tensors), tuple(sources)
    for i, f in enumerate(calls):
        if not callable(f):
            raise TypeError(f"pinned: sources[{i}] is a {type(f).__name__}; pass a function "
                            "that returns the tensor (lambda: engine.req_to_token)")  # fmt: skip
    now = (*fixed, *[f() for f in calls])
    for i, t in enumerate(now):
        if not isinstance(t, torch.Tensor):
            what = f"tensors[{i}]" if i < len(fixed) else f"sources[{i - len(fixed)}]()"
            raise TypeError(f"pinned: {what} is a {type(t).__name__}, not a torch.Tensor; "
                            "pass the tensors a graph captured")  # fmt: skip
    names = [f"t{i}" for i in range(len(now))]
    scope = {"_fixed": fixed, "_calls": calls, "_signature": signature}
    layout = tensor_layout.module() if guarded and native and now else None
    if layout is not None:
        try:
            scope["_layouts"], scope["_same"] = layout.record(*now), layout.same
        except (TypeError, RuntimeError):  # a tensor the native check cannot read
            layout = None
    if layout is not None:
        if not calls:  # one native call, no Python frame around it
            return functools.partial(layout.same, scope["_layouts"], *fixed)
        args = [f"_fixed[{i}]" for i in range(len(fixed))]
        args += [f"_calls[{i}]()" for i in range(len(calls))]
        src = f"def unchanged():\n    return _same(_layouts, {', '.join(args)})\n"
        return _written(src, "unchanged", scope)
    reads = [f"    {n} = _fixed[{i}]\n" for i, n in enumerate(names[: len(fixed)])]
    reads += [f"    {n} = _calls[{i}]()\n" for i, n in enumerate(names[len(fixed) :])]
    if guarded and _GUARD is not None and now:
        # An address names one device unless it is 0 (an empty tensor): the guard compares
        # the device too.
        scope["_guard"] = _GUARD(*now)
        same = [f"{n}.data_ptr() == {t.data_ptr()}" for n, t in zip(names, now, strict=True)]
        same.append(f"_guard({', '.join(names)},)")
    else:
        scope["_then"] = signature(*now)
        same = [f"_signature({', '.join(names)},) == _then"] if now else ["True"]
    src = "def unchanged():\n" + "".join(reads) + f"    return {' and '.join(same)}\n"
    return _written(src, "unchanged", scope)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] = INDEX_DTYPES,
    ndim: int | None = None,
    device: torch.device | None = None,
    contiguous_last: bool = True,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of one of ``dtypes``, rank ``ndim``, on ``device``."""
    if _state.trusted:
        return t
    try:  # the common case, every condition at once; any miss takes the checks below
        if (
            t.dtype in dtypes
            and (ndim is None or t.dim() == ndim)
            and (device is None or t.device == device)
            and (not contiguous_last or t.stride(-1) == 1 or t.shape[-1] <= 1)
            and isinstance(t, torch.Tensor)
        ):
            return t
    except (AttributeError, IndexError, RuntimeError, TypeError):
        pass
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        first = str(dtypes[0]).replace("torch.", "")
        raise TypeError(
            f"{name} must be {_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}; "
            f"convert it with {name}.to(torch.{first})"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name} must have rank {ndim}, got shape {tuple(t.shape)}; see the launcher's "
            "docstring for its shape"
        )
    if device is not None and t.device != device and not same_device(t.device, device):
        raise ValueError(
            f"{name} must be on {device}, got {t.device}; pass every tensor of this call on "
            "one device"
        )
    if contiguous_last and t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension, got {t.stride()}; pass "
            f"{name}.contiguous()"
        )
    return t


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``cuda`` → ``cuda:<current>``), so that tensors
    created on it compare equal to it."""
    d = torch.device(device)
    if d.index is None and d.type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """``cuda`` and ``cuda:<current>`` name the same device; so do ``cpu`` and ``cpu:0``."""

    def norm(d: torch.device | str) -> tuple[str, int]:
        d = torch.device(d)
        if d.index is not None:
            return d.type, d.index
        if d.type == "cuda" and torch.cuda.is_available():
            return d.type, torch.cuda.current_device()
        return d.type, 0

    return norm(a) == norm(b)


def length(name: str, t: torch.Tensor, expected: int) -> None:
    """Check that a rank-1 ``t`` has exactly ``expected`` elements."""
    if _state.trusted:
        return
    if t.shape[0] != expected:
        raise ValueError(
            f"{name} must have {expected} elements, got shape {tuple(t.shape)}; its length "
            "must match the other inputs of this call"
        )


def at_least(name: str, have: int, need: int, what: str = "elements") -> None:
    """Capacity check before launch: ``need`` must not exceed ``have``."""
    if _state.trusted:
        return
    if need > have:
        raise ValueError(
            f"{name} is too small: need {need} {what}, have {have}; allocate it from "
            "specmeta.plan_buffers(cfg) with a config that covers this batch"
        )


def positive(name: str, value: object, minimum: int = 1) -> int:
    """A Python int ≥ ``minimum`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def status(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The status word a launch reports into: ``t`` (checked: ``int32 [1]`` on the launch
    device), or the device's :func:`specmeta.status.default_status` word when ``t`` is None.
    The one place of the rule "every launcher reports, with or without ``status=``"."""
    if t is None:
        return default_status(device)
    tensor("status", t, dtypes=(torch.int32,), ndim=1, device=device)
    length("status", t, 1)
    return t
