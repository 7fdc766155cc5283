"""Device binding in the drop-in mode: CUDA-only calls act on this process's accelerator.

Code written for CUDA (``torch.cuda.set_device(local_rank)``, ``model.cuda(local_rank)``,
``init_process_group("nccl")``, ``x.to(torch.device("cuda", r))``) fails on a torch
without CUDA. In a process that has no CUDA, decided once at :func:`install` without
initialising CUDA, comm translates those calls where a device or backend is consumed:

* ``torch.cuda`` becomes a stand-in module (:mod:`comm.translate.cuda`) whose
  functions act on the accelerator's own module, or on the CPU where there is none;
* one device-argument translator serves ``Tensor.to``, ``Tensor.cuda`` (and with it
  ``Module.cuda`` and ``Module.to``), ``torch._C._nn._parse_to`` (``.to``'s arguments as
  ``Module.to`` and libraries' own ``.to`` read them), every torch factory function that takes
  ``device=`` (found from the operator schemas, not listed by hand), the device of
  ``with torch.device(...)`` and ``torch.set_default_device``, ``pin_memory``,
  DDP's ``device_ids``/``output_device``, ``init_process_group``/``new_group``
  (backend and ``device_id``), ``init_device_mesh``, ``torch.autocast``, the gradient
  scalers, ``torch.Generator`` and ``torch.load``'s ``map_location`` (:mod:`comm.translate.calls`).

torch's own sets that recognise functions by identity keep recognising them
(:mod:`comm.translate.identities`), so what torch does where no CUDA is named, it
still does. The accelerator is looked up when a call is first translated, not at install (a
plugin may register its device after the patch), and re-checked while it is the CPU.
Each kind of translated call logs one INFO line, once, on the ``comm.translate``
logger. On a machine with CUDA :func:`install` installs nothing.
"""

from __future__ import annotations

import os
import threading

from comm import _ledger
from comm._env import env_switch
from comm.translate import calls, cuda, identities
from comm.translate.core import cuda_present, forget_target, target_type, translated_device

__all__ = ["cuda_present", "install", "is_installed", "target_type", "translated_device", "uninstall"]

_LOCK = threading.RLock()
# Who holds the translation's replacements in comm's ledger (comm._ledger).
_BY = "comm.translate"


def install() -> bool:
    """Install the translation where this process has no CUDA; return whether it did.

    ``COMM_TRANSLATE=0`` in the environment (``python -m comm --no-devices``) turns
    it off. Idempotent.
    """
    with _LOCK:
        if is_installed():
            return True
        asked = os.environ.get("COMM_TRANSLATE", "").strip()  # unset: on
        if (asked and env_switch("COMM_TRANSLATE", "1 or 0 (true/false, yes/no, on/off)") == "off") or cuda_present():
            return False
        replacements = [(owner, name, calls.findable(owner, name, replacement))
                        for owner, name, replacement in cuda.targets() + calls.targets()]
        identities.keep(replacements)
        for owner, name, replacement in replacements:
            _ledger.replace(owner, name, replacement, by=_BY)
        return True


def uninstall() -> None:
    """Put back torch's exact objects, where they still hold comm's. A no-op when nothing is installed."""
    with _LOCK:
        _ledger.restore(by=_BY)
        cuda.keep_submodules()
        forget_target()


def is_installed() -> bool:
    return bool(_ledger.held(_BY))
