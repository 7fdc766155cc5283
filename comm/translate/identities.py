"""torch's tables that recognise functions by identity, kept true while comm's stand-ins stand in torch.

torch builds some sets once, at first use, from its own attributes, and later asks
whether a function it is handed is in one of them:

* ``torch.utils._device._device_constructors()``: the factories a device context
  (``with torch.device("meta")``, ``torch.set_default_device``) gives its device. The
  function it is handed is always torch's own (C++ passes the function it was called
  as), so a set built while comm's stand-ins stood in ``torch`` would hold none of
  them, and every factory would land on the CPU.
* ``torch.overrides.get_ignored_functions()`` and ``torch.overrides._get_tensor_methods()``
  (what ``torch.fx`` asks to record a call as a tensor method): torch's functions, or
  the stand-in where code looks the attribute up while comm's stands there.

:func:`keep` builds each before the stand-ins are put in place, so each holds torch's
objects, and adds each stand-in beside the object it stands for, so it holds both.
A stand-in stays in the sets after the translation is removed: it still stands for
the same torch function, and the sets are torch's caches, which nothing removes from.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Set, Tuple

__all__ = ["keep", "tables"]


def tables() -> List[Set[Any]]:
    """torch's identity sets, each built now if it was not yet (so from torch's own objects, before the stand-ins)."""
    import torch.overrides
    from torch.utils._device import _device_constructors

    found: List[Callable[[], Set[Any]]] = [
        _device_constructors, torch.overrides.get_ignored_functions, torch.overrides._get_tensor_methods]
    return [table() for table in found]


def keep(replacements: Iterable[Tuple[Any, str, Any]]) -> None:
    """Build torch's identity sets, then add each stand-in of ``replacements`` where the object it replaces is.

    Call with the stand-ins not yet in place: ``getattr(owner, name)`` must still be torch's.
    """
    sets = tables()
    for owner, name, stand_in in replacements:
        original = getattr(owner, name, None) if not isinstance(owner, dict) else owner.get(name)
        for table in sets:
            if _member(original, table):
                table.add(stand_in)


def _member(candidate: Any, table: Set[Any]) -> bool:
    try:
        return candidate in table
    except TypeError:  # an unhashable attribute (a dict of sys.modules' entries): in no set
        return False
