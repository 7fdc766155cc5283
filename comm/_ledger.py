"""The one ledger of what comm replaces in torch, and how each is put back.

Four parts of comm put objects of their own where torch's were: the drop-in mode
(:mod:`comm.patch`: where c10d creates groups), the device translation
(:mod:`comm.translate`: ``torch.cuda``, ``Tensor.to``, factories, ...), an open
profile (:mod:`comm.profiler`: torch.distributed's functions) and the slot
(:mod:`comm.slot`: ``ProcessGroup._start_coalescing`` and ``_end_coalescing``, while a
group comm equipped lives). Each calls :func:`replace` with its name as ``by`` and
:func:`restore` with the same name to undo all it replaced, or some of it.

An owner is a module, a class or a dict (``sys.modules``, a module's namespace). The
ledger remembers the object each replacement displaced, or that a class only inherited
the attribute (restoring then deletes it, so the class inherits again). It restores
only what still holds comm's replacement: where someone put an object of their own
there after comm (torch_npu imported after ``comm.patch()``), theirs stays, and the
``comm`` logger says so at DEBUG.

:func:`follow` is for an attribute that others replace too, as torch_npu replaces
c10d's group-creation helper: comm's stand-in wraps whatever was there, and whatever is
assigned there later (the module's class is swapped for one that sees assignments),
so comm's wrapper stays in front whoever came first. Only the newest of its stand-ins
acts; every other one, and all of them once restored, hands the call straight to what
it wraps. So a plugin that wrapped comm's stand-in, or a test that saved it and puts it
back later, never runs comm twice, and nothing of comm's acts after :func:`restore`,
wherever a stand-in of comm's was kept. An assignment of one of comm's own stand-ins
(a ``monkeypatch`` undone) is recognised, not wrapped again. Thread-safe: one lock
guards the ledger and every write it makes.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple

__all__ = ["Key", "Replaced", "entries", "follow", "held", "replace", "restore"]

_LOG = logging.getLogger("comm")
_LOCK = threading.RLock()
# Stands for "the class had no attribute of its own by this name": it only inherited one.
_ABSENT = object()

# One replaced attribute: its owner's identity and its name.
Key = Tuple[int, str]


class _Entry:
    """One replacement: where, what comm put there, what it displaced, who made it; ``around`` for a followed one."""

    def __init__(self, owner: Any, name: str, original: Any, replacement: Any, by: str,
                 around: Optional[Callable[..., Any]] = None) -> None:
        self.owner, self.name, self.original, self.replacement, self.by = owner, name, original, replacement, by
        self.around = around

    def follow(self, value: Any) -> Any:
        """``value`` was put at the followed attribute: make comm's stand-in in front of it the acting one."""
        made = _made_by(value)
        if made is not None and made[0] is self:  # one of this entry's own, put back
            self.original, self.replacement = made[1], value
        else:
            self.original = _unwrapped(value)
            self.replacement = _stand_in(self, self.original)
        return self.replacement


_ENTRIES: Dict[Key, _Entry] = {}  # in the order they were made; restored in reverse
# Every stand-in follow() made -> (its entry, the function it stands in front of), for as long as it lives.
_MADE: "weakref.WeakKeyDictionary[Any, Tuple[_Entry, Any]]" = weakref.WeakKeyDictionary()


class Replaced(NamedTuple):
    """What :func:`entries` reports of one replacement."""

    owner: Any
    name: str
    original: Any  # what the attribute read before comm's: for a class that only inherited it, its base's
    by: str


def replace(owner: Any, name: str, replacement: Any, *, by: str) -> bool:
    """Put ``replacement`` at ``owner``'s ``name``, remembering what was there; return whether it did now.

    A second call for an attribute ``by`` already holds does nothing (the first
    replacement stays). Another part of comm holding it is a bug: ``RuntimeError``.
    """
    with _LOCK:
        if not _claim(owner, name, by):
            return False
        _ENTRIES[(id(owner), name)] = _Entry(owner, name, _read(owner, name), replacement, by)
        _write(owner, name, replacement)
        return True


def follow(owner: types.ModuleType, name: str, around: Callable[..., Any], *, by: str) -> bool:
    """Put a stand-in at module ``owner``'s ``name`` that calls ``around(inner, *args, **kwargs)``, and again in
    front of whatever is assigned there later (``inner`` is the function it stands in front of).

    Each object assigned later becomes the one :func:`restore` puts back: the module
    then holds what it would hold had comm never been there. Returns whether it
    replaced now (False where ``by`` already follows it).
    """
    if not isinstance(owner, types.ModuleType):
        raise TypeError(f"only a module's attributes can be followed, not {type(owner).__name__}'s")
    with _LOCK:
        if not _claim(owner, name, by):
            return False
        entry = _Entry(owner, name, None, None, by, around)
        entry.follow(_read(owner, name))
        _ENTRIES[(id(owner), name)] = entry
        if type(owner) is types.ModuleType:
            owner.__class__ = _Watched
        _write(owner, name, entry.replacement)
        return True


def restore(*, by: str, only: Optional[Iterable[Key]] = None) -> None:
    """Put back what ``by`` displaced (all of it, or the attributes in ``only``), newest first.

    Where an attribute no longer holds comm's replacement, whatever holds it now stays.
    """
    with _LOCK:
        keys = [key for key, entry in _ENTRIES.items() if entry.by == by]
        if only is not None:
            chosen = set(only)
            keys = [key for key in keys if key in chosen]
        for key in reversed(keys):
            entry = _ENTRIES.pop(key)
            if _read(entry.owner, entry.name) is entry.replacement:
                _write(entry.owner, entry.name, entry.original)
            else:
                _LOG.debug("comm leaves %s.%s as it is: it was replaced after comm's stand-in", _label(entry.owner),
                           entry.name)
            if entry.around is not None:
                entry.replacement = None  # every stand-in of this entry now only hands calls on
                _unwatch(entry.owner)


def held(by: str) -> FrozenSet[Key]:
    """The attributes ``by`` has replaced and not restored."""
    with _LOCK:
        return frozenset(key for key, entry in _ENTRIES.items() if entry.by == by)


def entries() -> List[Replaced]:
    """Everything comm holds replaced now, with the object each displaced: what a test compares after restoring."""
    with _LOCK:
        return [Replaced(entry.owner, entry.name, _inherited(entry), entry.by) for entry in _ENTRIES.values()]


class _Watched(types.ModuleType):
    """A module whose followed attributes comm keeps wrapping when code assigns them."""

    def __setattr__(self, name: str, value: Any) -> None:
        with _LOCK:
            entry = _ENTRIES.get((id(self), name))
            if entry is not None and entry.around is not None and value is not entry.replacement:
                _LOG.debug("%s.%s was replaced after comm's stand-in: comm stands in front of the new one",
                           self.__name__, name)
                value = entry.follow(value)
            types.ModuleType.__setattr__(self, name, value)


def _claim(owner: Any, name: str, by: str) -> bool:
    """Whether ``by`` may replace ``owner``'s ``name`` now: False where it holds it already."""
    entry = _ENTRIES.get((id(owner), name))
    if entry is None:
        return True
    if entry.by == by:
        return False
    raise RuntimeError(f"{by} cannot replace {_label(owner)}.{name}: {entry.by} holds it")


def _unwatch(owner: Any) -> None:
    """Give ``owner`` back its plain module class once comm follows none of its attributes."""
    still_followed = any(entry.owner is owner and entry.around is not None for entry in _ENTRIES.values())
    if type(owner) is _Watched and not still_followed:
        _write(owner, "__class__", types.ModuleType)


def _stand_in(entry: _Entry, inner: Any) -> Callable[..., Any]:
    """comm's stand-in in front of ``inner``: ``entry.around`` while it is the entry's acting one, else ``inner``."""
    around = entry.around
    assert around is not None  # made only for a followed entry

    @functools.wraps(inner)
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        if entry.replacement is stand_in:
            return around(inner, *args, **kwargs)
        return inner(*args, **kwargs)

    stand_in.__comm_replaces__ = inner  # type: ignore[attr-defined]
    _MADE[stand_in] = (entry, inner)
    return stand_in


def _made_by(value: Any) -> Optional[Tuple[_Entry, Any]]:
    """(the entry, what it stands in front of) where ``value`` is a stand-in :func:`follow` made, else None.

    Told by identity, not by attributes: ``functools.wraps`` copies a function's
    attributes onto a plugin's wrapper around it.
    """
    try:
        return _MADE.get(value)
    except TypeError:  # unhashable, or cannot be weakly referenced: not one of comm's
        return None


def _unwrapped(value: Any) -> Any:
    """``value`` without comm's followed stand-ins in front of it (one kept from an earlier follow, put back)."""
    made = _made_by(value)
    while made is not None:
        value = made[1]
        made = _made_by(value)
    return value


def _read(owner: Any, name: str) -> Any:
    """What ``owner`` holds by ``name`` itself: for a class, only its own attribute (else _ABSENT)."""
    if isinstance(owner, type):
        return owner.__dict__.get(name, _ABSENT)
    if isinstance(owner, dict):
        return owner.get(name, _ABSENT)
    return getattr(owner, name, _ABSENT)


def _write(owner: Any, name: str, value: Any) -> None:
    """Set (or, for _ABSENT, delete) ``owner``'s ``name``, past a watched module's own assignment hook."""
    if isinstance(owner, dict):
        if value is _ABSENT:
            owner.pop(name, None)
        else:
            owner[name] = value
    elif value is _ABSENT:
        delattr(owner, name)
    elif isinstance(owner, types.ModuleType):
        types.ModuleType.__setattr__(owner, name, value)
    else:
        setattr(owner, name, value)


def _inherited(entry: _Entry) -> Any:
    """What ``entry`` displaced as its owner's attribute read it: for a class that only inherited it, a base's."""
    if entry.original is not _ABSENT:
        return entry.original
    return next(base.__dict__[entry.name] for base in entry.owner.__mro__[1:] if entry.name in base.__dict__)


def _label(owner: Any) -> str:
    return str(getattr(owner, "__name__", type(owner).__name__))
