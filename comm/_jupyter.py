"""Jupyter's ``comm`` package, a dependency of ipykernel, owns the import name ``comm`` too.

Installing this package (torch-comm-shim) where Jupyter's is installed overwrites
Jupyter's ``comm/__init__.py``, and uninstalling either then deletes the other's: nothing
in Python packaging prevents or reports it, so ``import comm`` says it.
"""

import os
import sys
import warnings
from typing import Optional

# Every Jupyter comm wheel, 0.1.0 to 0.2.3, installs comm/base_comm.py; this package has none.
_JUPYTER_FILE = "base_comm.py"


class JupyterCommWarning(UserWarning):
    """This package and Jupyter's ``comm`` package share the import name ``comm``."""


def _jupyter_comm_dir(here: str) -> Optional[str]:
    """The ``comm`` directory holding Jupyter's files: ``here`` first, then the rest of ``sys.path``."""
    candidates = [here] + [os.path.join(os.path.abspath(entry or os.curdir), "comm") for entry in sys.path]
    return next((path for path in candidates if os.path.isfile(os.path.join(path, _JUPYTER_FILE))), None)


def _clash(here: str, jupyter: str) -> str:
    """What went wrong and what to do, for Jupyter's comm in ``jupyter`` and this one in ``here``."""
    if jupyter == here:
        return (
            f"Jupyter's comm package (a dependency of ipykernel) is installed in the same directory, {here}: "
            "installing torch-comm-shim replaced its comm/__init__.py, so Jupyter's comm.create_comm and "
            "comm.get_comm_manager are gone (ipywidgets fails outside an ipykernel kernel), every ipykernel "
            "kernel imports torch at start, and uninstalling either package deletes the other's "
            "comm/__init__.py. Install torch-comm-shim in its own virtual environment; to repair "
            "Jupyter's here, pip uninstall torch-comm-shim, then pip install --force-reinstall --no-deps comm."
        )
    return (
        f"Jupyter's comm package (a dependency of ipykernel), in {jupyter}, is hidden by this one in {here}: "
        "ipykernel and ipywidgets run from this environment import torch-comm-shim instead. Install "
        "torch-comm-shim in its own virtual environment, without Jupyter."
    )


def warn_if_beside_jupyter() -> None:
    """Warns with :class:`JupyterCommWarning` when Jupyter's ``comm`` shares or is hidden by this one."""
    here = os.path.dirname(os.path.abspath(__file__))
    jupyter = _jupyter_comm_dir(here)
    if jupyter is not None:
        warnings.warn(f"torch-comm-shim and Jupyter's comm share the import name 'comm'. {_clash(here, jupyter)}",
                      JupyterCommWarning, stacklevel=2)
