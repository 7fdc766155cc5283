"""Packaging. A plain build (``pip install .``) makes a pure wheel, which compiles comm's C++ at first use.

``COMM_PREBUILT=1`` (``make wheel``; with ``pip wheel --no-build-isolation``, so that the
build sees the installed torch) makes a platform wheel instead: it carries comm's two C++
extensions built against that torch, in ``comm/_prebuilt`` with a manifest of what each was
built from, pins that torch release, and names it in its version
(``0.2.0+torch2.13.0.cpu``), so that wheels for several releases can sit in one folder.
Installed beside any other torch, it builds at first use as the pure wheel does.
"""

import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


class BuildWithPrebuilt(build_py):
    """build_py, then comm's extensions built against this torch and copied into the wheel's comm/_prebuilt."""

    def run(self) -> None:
        super().run()
        from comm import _native

        folder = Path(self.build_lib) / "comm" / _native.PREBUILT.name
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {extension.name: extension.copy_build_to(folder)
                    for extension in (_native.STAGING, _native.SIMULATED)}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


class PlatformDistribution(Distribution):
    """A distribution whose wheel is tagged for this Python and platform: it carries compiled code."""

    def has_ext_modules(self) -> bool:
        return True


def prebuilt_options() -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    import comm

    release = torch.__version__.split("+")[0]
    return {
        "version": f"{comm.__version__}+torch{torch.__version__.replace('+', '.')}",
        "install_requires": [f"torch=={release}", "ninja"],
        "cmdclass": {"build_py": BuildWithPrebuilt},
        "distclass": PlatformDistribution,
    }


setup(**(prebuilt_options() if os.environ.get("COMM_PREBUILT") == "1" else {}))
