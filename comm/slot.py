"""Staging where torch routes by device: comm's backend in the slots a group leaves empty.

A ``ProcessGroup`` holds one backend per device type and hands every call to the
backend of its tensors' device, whoever makes the call: ``torch.distributed``'s
functions, the functional collectives (DTensor, ``torch.compile``), DDP's C++
reducer, the coalescing manager, object collectives, DCP. :func:`equip` registers
comm's staging backend (C++, ``comm/csrc``) for each device type the group's own
backend does not serve: the CPU on an nccl, hccl or xccl group, this process's
accelerator on a gloo group. Calls on served devices never meet comm.

Staged calls from the group's thread (the thread that equips it: where the group is
created under ``comm.patch()``, or where ``comm.equip()`` is called) run on the
group's own backend for the target device, the communicator its calls there already
use, in the order that thread issues them, as the fix written by hand does. Staged
calls from any other thread (``dcp.async_save`` saves from one) run on a communicator
comm makes at that thread's first staged call, by the same backend as the group's
(gloo, nccl, or the plugin's creator) with the group's options, over the group's store
under a prefix of its own: they never interleave with the group's thread's calls on
the group's own communicator (:mod:`comm._communicators` makes them).
:func:`communicators` counts what comm made; :func:`adopt_thread` makes another thread
the group's.

Each slot is keyed by a ``BackendType`` label: ``CUSTOM`` on groups of torch's own
backends, and, on groups whose backend is itself ``CUSTOM`` (a plugin such as hccl),
the first of ``MPI`` and ``UCC`` the group does not use (c10d would otherwise hand
the slot to the plugin's backend). The label only names the slot: c10d routes by
device type. ``get_backend`` and ``get_backend_config`` keep reporting what the
group was created with; ``group._device_types`` lists the staged types too.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, FrozenSet, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from comm import _ledger
from comm._communicators import communicator_factory, cpu_communicator_factory, group_timeout
from comm._env import env_bytes
from comm._native import STAGING
from comm.device import accelerator_type, bound_device, current_device
from comm.gaps import AVERAGES_INTEGERS
from comm.groups import GroupCache, GroupFacts, facts_of, resolve_group

__all__ = ["adopt_thread", "cached_groups", "communicators", "equip", "equipped_once", "existing_groups",
           "own_types", "set_staging_budget", "staged_types", "staging_budget", "staging_device", "target_device",
           "unavailable_reason"]

# A host tensor's all-reduce of at least twice this many bytes is staged in chunks of
# this size, pipelined (COMM_STAGING_CHUNK_BYTES overrides it; 0: never). Chosen by a sweep
# on two simulated NPUs (benchmarks/chunking.py, docs/benchmarks.md): 8 MiB chunks were the
# quickest at 64 and 256 MiB (x0.88 and x0.86 of the fix by hand, where one copy, one
# collective and one copy back took x0.98 and x0.99), and level with the rest from 16 to 32 MiB;
# each chunk is a collective of its own, so fewer chunks cost fewer instructions.
CHUNK_BYTES = 8 << 20
# The device memory one thread's staged collectives on a group hold at once: four chunks,
# so that a chunk's copy in, another's collective and a third's copy back overlap as
# before (COMM_STAGING_BUDGET_BYTES or set_staging_budget() override it; 0: no bound).
BUDGET_BYTES = 4 * CHUNK_BYTES

# torch's private names used here, with why: comm/_torch_private.py (the one list).
# GROUP_CREATION is where c10d creates every group. comm.patch() wraps whatever function
# that attribute holds, also one a plugin assigns later (torch_npu assigns a full copy of
# its own), as c10d's callers look it up in the module at each call (tests/test_patch.py).
GROUP_CREATION = ("torch.distributed.distributed_c10d", "_new_process_group_helper")

_LOG = logging.getLogger("comm")
_LOCK = threading.Lock()
# Guards the following of coalescing blocks; reentrant: a group collected while it is held
# (the garbage collector runs anywhere) calls _stop_following_coalescing_blocks.
_LOCK_FOLLOWING = threading.RLock()
_TYPE = dist.ProcessGroup.BackendType
# The slot labels comm can take, in order of preference (see the module docstring).
_LABELS = (_TYPE.CUSTOM, _TYPE.MPI, _TYPE.UCC)
_BUILTIN_TYPES = {"gloo": _TYPE.GLOO, "nccl": _TYPE.NCCL, "xccl": _TYPE.XCCL, "ucc": _TYPE.UCC, "mpi": _TYPE.MPI}
# Per group: whether equipped_once() has equipped it (False: comm's backend cannot be built here).
_EQUIPPED = GroupCache()
# Who holds ProcessGroup's coalescing methods in comm's ledger (comm._ledger), and the
# groups comm equipped that are alive: while there is one, comm follows coalescing blocks.
_FOLLOWS_BLOCKS = "comm.slot"
_FOLLOWED_GROUPS: "Dict[int, weakref.finalize[Any, Any]]" = {}  # id(group) -> what forgets it once it is collected


def unavailable_reason() -> Optional[str]:
    """Why this process cannot stage in c10d (no compiler, an old torch), or None."""
    return STAGING.unavailable_reason()


def equip(group: Optional[dist.ProcessGroup] = None) -> FrozenSet[str]:
    """Give ``group`` (the default group by default) comm's backend for the device types it lacks.

    Returns the device types comm stages for on this group: the CPU where the
    group's backend serves only an accelerator, this process's accelerator where it
    serves only the CPU (gloo); empty where it serves both, or serves neither the
    CPU nor any device of this process. Idempotent; call it on every rank of the
    group (the communicator comm makes later is a collective of the group's ranks),
    from the thread that issues the group's collectives: staged calls from that
    thread run on the group's own backend, those of other threads on a communicator
    comm makes (see :func:`adopt_thread`).
    """
    pg = resolve_group(group)
    with _LOCK:
        registered = _registered_types(pg)
        missing = _missing_types(registered)
        if not missing:  # a group of no device of this process's, or with no backend yet (it has no name then)
            return _staged_on(pg)
        facts = facts_of(pg)
        target = _target_of(registered, facts.bound)
        native = STAGING.load()
        factories = (communicator_factory(pg, target, _kind_on(facts, target)), cpu_communicator_factory(pg, target))
        settings = {"chunk_bytes": env_bytes("COMM_STAGING_CHUNK_BYTES", CHUNK_BYTES),
                 "budget_bytes": env_bytes("COMM_STAGING_BUDGET_BYTES", BUDGET_BYTES),
                 "averages_integers": set(AVERAGES_INTEGERS)}
        timeout = group_timeout(pg, target, native)
        try:
            backend = native.staging_backend(pg.rank(), pg.size(), target, pg._get_backend(target), timeout,
                                             *factories, **settings)
        except TypeError:  # the group's backend there is no c10d Backend comm can hold: comm's own for every thread
            backend = native.staging_backend(pg.rank(), pg.size(), target, None, timeout, *factories, **settings)
        label = _free_label(facts)
        for device_type in missing:
            pg._register_backend(torch.device(device_type), label, backend)
        pg._set_group_name(facts.name)  # c10d reads the name from the first backend by device type: put it back
        native.route_mixed_devices()
        _follow_coalescing_blocks(pg, native)
        _LOG.info("comm stages %s on group %r onto %s", ", ".join(missing), facts.name, target)
        return _staged_on(pg)


def _follow_coalescing_blocks(pg: dist.ProcessGroup, native: Any) -> None:
    """While ``pg`` lives: a coalescing block torch opens on an equipped group's own backend reaches comm's too.

    torch opens a block (``batch_isend_irecv``, ``_coalescing_manager(group, device)``) on
    the backend of one device type only, and its manager waits for the work that ends
    that block alone. Where that is the group's own backend, comm's calls on the other
    device type join the block (they run on that backend), and comm's backend, told
    here, hands their write-backs to the work that ends it. On groups comm has not
    equipped both calls are torch's alone. ProcessGroup's two methods are replaced in
    comm's ledger at the first equipped group and put back once no equipped group lives.
    """
    with _LOCK_FOLLOWING:
        if id(pg) not in _FOLLOWED_GROUPS:
            forget = weakref.finalize(pg, _stop_following_coalescing_blocks, id(pg))
            forget.atexit = False  # nothing to put back while the interpreter exits
            _FOLLOWED_GROUPS[id(pg)] = forget
        if _ledger.held(_FOLLOWS_BLOCKS):
            return
        torch_start, torch_end = dist.ProcessGroup._start_coalescing, dist.ProcessGroup._end_coalescing

        def _start_coalescing(self: dist.ProcessGroup, device_type: torch.device) -> None:
            torch_start(self, device_type)
            native.follow_block(self, device_type)

        def _end_coalescing(self: dist.ProcessGroup, device_type: torch.device) -> Any:
            try:
                ended = torch_end(self, device_type)
            except BaseException:
                native.end_followed_block(self, device_type, None)  # not left in a dead block: later calls run apart
                raise
            return native.end_followed_block(self, device_type, ended)

        _start_coalescing.__wrapped__ = torch_start  # type: ignore[attr-defined]
        _end_coalescing.__wrapped__ = torch_end  # type: ignore[attr-defined]
        _ledger.replace(dist.ProcessGroup, "_start_coalescing", _start_coalescing, by=_FOLLOWS_BLOCKS)
        _ledger.replace(dist.ProcessGroup, "_end_coalescing", _end_coalescing, by=_FOLLOWS_BLOCKS)


def _stop_following_coalescing_blocks(key: int) -> None:
    """An equipped group was collected: put torch's coalescing methods back where it was the last."""
    with _LOCK_FOLLOWING:
        _FOLLOWED_GROUPS.pop(key, None)
        if not _FOLLOWED_GROUPS:
            _ledger.restore(by=_FOLLOWS_BLOCKS)


def existing_groups() -> List[dist.ProcessGroup]:
    """Every process group this rank belongs to."""
    return [group for group in list(c10d._world.pg_map) if isinstance(group, dist.ProcessGroup)]


def equipped_once(group: Optional[dist.ProcessGroup]) -> bool:
    """Equip ``group`` the first time it is seen; return whether torch can take its calls as they are.

    False only where comm's backend cannot be built here: comm's explicit calls
    then stage in plain Python. True for a rank outside the group and before
    ``init_process_group``, where torch's own call does what torch does.
    """
    if group is None:
        group = c10d.GroupMember.WORLD
        if group is None:
            return True
    elif not isinstance(group, dist.ProcessGroup):
        return True
    known: Optional[bool] = _EQUIPPED.get(group)
    if known is None:
        known = unavailable_reason() is None
        if known:
            equip(group)
        _EQUIPPED.set(group, known)
    return known


def cached_groups() -> int:
    """How many process groups :func:`equipped_once` remembers, equipped or not.

    For tests that comm keeps no group alive: once a destroyed group is collected,
    the count drops by one.
    """
    return len(_EQUIPPED)


def adopt_thread(group: Optional[dist.ProcessGroup] = None) -> None:
    """Make the calling thread ``group``'s thread: its staged calls run on the group's own backend from now on.

    For a program that creates its groups on one thread and trains on another (call it
    from the training thread, on every rank). Staged calls from the thread that was the
    group's until now run on a communicator comm makes, from their next call on. A no-op
    on a group comm does not stage for.
    """
    pg = resolve_group(group)
    backend = _staging_backend(pg)
    if backend is not None:
        STAGING.load().adopt_thread(backend)


def communicators(group: Optional[dist.ProcessGroup] = None) -> Dict[str, Dict[str, int]]:
    """The communicators comm has made, per group name and kind: ``{"0": {"hccl": 1, "gloo": 0}}``.

    One entry per equipped group this rank belongs to (``group`` alone where given): the
    communicator of the group's kind comm made for staged calls from threads other than
    the group's (0 until such a thread stages), and the gloo one for CPU reductions the
    group's backend cannot run (0 until the first). The group's own backend, on which
    its thread's staged calls run, is not comm's and not counted. Each costs what a
    communicator of that kind costs: on Ascend, HCCL_BUFFSIZE of device memory (200 MB
    by default) and a watchdog thread, and 40 MB more per point-to-point peer.
    """
    groups = [resolve_group(group)] if group is not None else existing_groups()
    counts: Dict[str, Dict[str, int]] = {}
    for pg in groups:
        backend = _staging_backend(pg)
        if backend is None:
            continue
        made = STAGING.load().communicators_made(backend)
        target = STAGING.load().staging_target(backend)
        kind = _kind_on(facts_of(pg), target)
        entry = counts.setdefault(pg.group_name, {})
        entry[str(kind)] = entry.get(str(kind), 0) + int(made.get("collectives", 0))
        if target.type != "cpu":
            entry["gloo"] = entry.get("gloo", 0) + int(made.get("cpu", 0))
    return counts


def set_staging_budget(nbytes: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Bound the device memory one thread's staged collectives on ``group`` hold at once to ``nbytes``.

    A host tensor's chunked all-reduce keeps at most ``nbytes`` // chunk size chunks on
    the device (at least one), and a staged collective first waits for the thread's
    earlier ones that nobody waited for, oldest first, until what they hold is below
    ``nbytes``; 0 removes the bound. Point-to-point calls are not bounded. The default is
    ``COMM_STAGING_BUDGET_BYTES``, else 32 MiB. Local to this rank: ranks may differ.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a whole number of bytes >= 0 (0: no bound), got {nbytes!r}")
    STAGING.load().set_staging_budget(_equipped_backend(group), nbytes)


def staging_budget(group: Optional[dist.ProcessGroup] = None) -> int:
    """The device memory one thread's staged collectives on ``group`` hold at once (see :func:`set_staging_budget`)."""
    return int(STAGING.load().staging_budget(_equipped_backend(group)))


def _equipped_backend(group: Optional[dist.ProcessGroup]) -> Any:
    pg = resolve_group(group)
    backend = _staging_backend(pg)
    if backend is None:
        raise ValueError(f"group {pg.group_name!r} has no comm backend: comm stages nothing on it (see comm.equip)")
    return backend


def _staging_backend(pg: dist.ProcessGroup) -> Any:
    """comm's backend on ``pg``, or None."""
    if not STAGING.is_loaded():
        return None
    native = STAGING.load()
    for device in pg._device_types:
        backend = pg._get_backend(device)
        if native.staging_target(backend) is not None:
            return backend
    return None


def staged_types(group: Optional[dist.ProcessGroup] = None) -> FrozenSet[str]:
    """The device types comm's backend serves on ``group``."""
    return _staged_on(resolve_group(group))


def _staged_on(pg: dist.ProcessGroup) -> FrozenSet[str]:
    if not STAGING.is_loaded():
        return frozenset()  # nothing can have equipped a group yet
    native = STAGING.load()
    return frozenset(d.type for d in pg._device_types if native.staging_target(pg._get_backend(d)) is not None)


def staging_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> Optional[torch.device]:
    """None when ``group``'s own backend serves ``tensor``'s device; else the device its calls are staged onto.

    That is the group's bound device, else the calling thread's current device of
    this process's accelerator where the group serves it, else the CPU.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    pg = resolve_group(group)
    served = own_types(pg)
    if tensor.device.type in served:
        return None
    staged = [d for d in pg._device_types if d.type == tensor.device.type]
    target = STAGING.load().staging_target(pg._get_backend(staged[0])) if staged else None
    target = target if target is not None else target_device(pg, served)
    if target.index is None and target.type != "cpu":
        return current_device(target.type)
    return torch.device(target)


def own_types(group: dist.ProcessGroup) -> FrozenSet[str]:
    """The device types ``group``'s own backends serve: those it lists, less comm's."""
    return _registered_types(group) - staged_types(group)


def _registered_types(pg: dist.ProcessGroup) -> FrozenSet[str]:
    return frozenset(d.type for d in pg._device_types)


def _missing_types(served: FrozenSet[str]) -> List[str]:
    """The device types this process computes on that ``served`` lacks, where one of them can stand in."""
    here = ["cpu"]
    accelerator = accelerator_type()
    if accelerator != "cpu":
        here.append(accelerator)
    if not any(kind in served for kind in here):
        return []  # nothing of this process's to stage onto
    return [kind for kind in here if kind not in served]


def target_device(pg: dist.ProcessGroup, served: FrozenSet[str]) -> torch.device:
    """Where staged calls run: the group's bound device, else the device comm.bind() bound, else the CPU.

    Where neither is bound, this process's accelerator without an index: the current
    device of the thread that makes the first staged call, fixed from then on.
    """
    return _target_of(served, getattr(pg, "bound_device_id", None))


def _target_of(served: FrozenSet[str], bound_to_group: Optional[torch.device]) -> torch.device:
    for bound in (bound_to_group, bound_device()):
        if bound is not None and bound.type in served:
            return torch.device(bound)
    accelerator = accelerator_type()
    return torch.device(accelerator if accelerator in served else "cpu")


def _kind_on(facts: GroupFacts, target: torch.device) -> str:
    """The name of the backend the group was created with for ``target``'s device type (else its one backend's)."""
    return facts.backends.get(target.type) or str(c10d.get_backend(facts.group))


def _free_label(facts: GroupFacts) -> Any:
    used = {_BUILTIN_TYPES.get(name, _TYPE.CUSTOM) for name in facts.backends.values()}
    for label in _LABELS:
        if label not in used:
            return label
    raise RuntimeError(f"process group {facts.name!r} uses every backend label comm could take: {used}")
