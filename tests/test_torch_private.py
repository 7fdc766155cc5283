"""The private torch names comm uses: each one listed, with its reason, resolves on this torch release.

``comm/_torch_private.py`` is the one list. A release that renames or removes a name
fails the first test, naming it; code in ``comm/`` that starts using a private name
the list lacks fails the second.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from typing import Any, Dict, List, Set

import pytest
import torch
import torch.distributed as dist

from comm._torch_private import PRIVATE_NAMES

COMM = pathlib.Path(__file__).resolve().parent.parent / "comm"
# torch's classes whose private members comm reaches through an instance (a group, a work).
CLASSES: Dict[str, Any] = {
    "torch.distributed.ProcessGroup": dist.ProcessGroup,
    "torch.distributed.Backend": dist.Backend,
    "torch.distributed.distributed_c10d.Work": dist.distributed_c10d.Work,
    # Every backend's options class extends c10d's Backend.Options, whose members gloo's shows.
    "torch.distributed.ProcessGroupGloo.Options": dist.ProcessGroupGloo.Options,
}


def resolve(dotted: str) -> Any:
    """The object at ``dotted``: the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


@pytest.mark.parametrize("dotted", sorted(PRIVATE_NAMES))
def test_each_private_name_resolves_on_this_release(dotted: str) -> None:
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"torch {torch.__version__} has no {dotted} ({error}); comm uses it because: "
                    f"{PRIVATE_NAMES[dotted]}")


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _is_module(parts: List[str]) -> bool:
    try:
        importlib.import_module(".".join(parts))
    except ImportError:
        return False
    return True


def _up_to_first_private(parts: List[str]) -> str:
    """The name a private path stands for: up to its first private part, one further where that part is a
    module (``torch.a._b.c`` -> ``torch.a._b``; ``torch._C.TensorBase.to`` -> ``torch._C.TensorBase``)."""
    first = next(index for index, part in enumerate(parts) if _is_private(part))
    end = first + 2 if first + 1 < len(parts) and _is_module(parts[:first + 1]) else first + 1
    return ".".join(parts[:end])


def _bound_to_torch(tree: ast.AST) -> Dict[str, str]:
    """Each name a file binds to a torch object by import -> that object's dotted path."""
    bound: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def private_names_in(path: pathlib.Path) -> Set[str]:
    """The private torch names a file of comm's uses: imported from torch, read off torch's modules or classes."""
    tree = ast.parse(path.read_text())
    bound = _bound_to_torch(tree)
    found = set(bound.values())
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_private(node.attr):  # a member of a group, backend or work, reached through an instance
            found.update(f"{owner}.{node.attr}" for owner, cls in CLASSES.items() if hasattr(cls, node.attr))
        if id(node) in inner:  # read as part of the longer chain it begins
            continue
        chain = [node.attr]
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            found.add(".".join(bound[value.id].split(".") + chain))
    return {_up_to_first_private(name.split(".")) for name in found if _is_private(name)}


def test_comm_uses_no_private_name_the_list_lacks() -> None:
    used = {name: str(path.relative_to(COMM.parent)) for path in sorted(COMM.rglob("*.py"))
            for name in private_names_in(path)}
    missing = {name: where for name, where in used.items() if name not in PRIVATE_NAMES}
    assert not missing, f"private torch names used but not listed in comm/_torch_private.py: {missing}"
