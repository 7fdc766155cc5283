"""The communicators comm makes for a group: one like the group's own, and a gloo one for the CPU.

comm's staging backend (:mod:`comm.slot`) runs staged calls from threads other than the
group's on a communicator of its own, made by the same backend as the group's (gloo,
nccl, xccl, or the plugin's creator) with a copy of the group's options, over the
group's store under a prefix of its own, so that they never interleave with the group's
thread's calls on the group's own communicator. CPU reductions of dtypes the group's
backend cannot reduce run on a gloo communicator over the group's store. Each is made
by a factory the backend calls at its first use.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

from comm._releases import backend_options

# torch's private names used here, with why: comm/_torch_private.py (the one list).

_LOG = logging.getLogger("comm")
# Where comm's communicator for other threads meets, under the group's store.
_STORE_PREFIX = "comm-staging"
# Where the gloo communicator for CPU reductions the group's backend cannot run meets.
_CPU_STORE_PREFIX = "comm-staging-cpu"


def communicator_factory(pg: dist.ProcessGroup, target: torch.device,
                         name: str) -> Callable[[datetime.timedelta], Any]:
    """A function of a timeout that makes comm's communicator: a new backend of kind ``name`` (the group's for
    ``target``), with the options of the group's backend there and that timeout.

    comm's backend calls it with the group's timeout (:func:`group_timeout`, or a later
    ``set_timeout``'s), so that the communicator fails a late peer when the group's own would.
    It holds the group by weak reference (the group holds the staging backend, which
    holds this function), and reads the group's store, ranks and options when it runs:
    at the first staged call from a thread other than the group's, after c10d has
    finished registering the group.
    """
    group = weakref.ref(pg)

    def make(timeout: datetime.timedelta) -> Any:
        made, store = _group_and_store(group, _STORE_PREFIX)
        ranks = dist.get_process_group_ranks(made)
        options = backend_options(made._get_backend(target))
        _LOG.info("comm makes a %s communicator for staged calls from another thread on group %r", name,
                  made.group_name)
        return _new_backend(name, store, made.rank(), made.size(), timeout, ranks,
                            f"{made.group_name}:{_STORE_PREFIX}", options)

    return make


def cpu_communicator_factory(pg: dist.ProcessGroup,
                             target: torch.device) -> Optional[Callable[[datetime.timedelta], Any]]:
    """A function that makes a gloo communicator over the group's store, or None where staging targets the CPU.

    comm's backend uses it for CPU reductions of dtypes the group's backend cannot
    reduce (float64 on hccl, a bool reduce-scatter): gloo reduces a CPU tensor where it
    is, in its own dtype. It is made at the first such call, on every rank alike, as
    every rank makes the same calls, with the timeout comm's backend calls it with (the group's).
    """
    if target.type == "cpu":
        return None
    group = weakref.ref(pg)

    def make(timeout: datetime.timedelta) -> Any:
        made, store = _group_and_store(group, _CPU_STORE_PREFIX)
        return dist.ProcessGroupGloo(store, made.rank(), made.size(), timeout)

    return make


def _group_and_store(group: "weakref.ref[dist.ProcessGroup]", prefix: str) -> Tuple[dist.ProcessGroup, Any]:
    """The group a communicator factory holds by weak reference, and its store under ``prefix``."""
    made = group()
    if made is None:
        raise RuntimeError("comm's staging backend outlived its process group")
    return made, c10d.PrefixStore(prefix, c10d._world.pg_map[made][1])


def group_timeout(pg: dist.ProcessGroup, target: torch.device, native: Any) -> datetime.timedelta:
    """The timeout of ``pg``'s own backends, which every communicator comm makes for it takes.

    That of the backend for ``target`` first, then of the group's other backends (on
    ``"cpu:gloo,npu:hccl"`` c10d gives each the group's): read from the options
    Python sees (torch_npu's ``ProcessGroupHCCL.options``; gloo's, nccl's), else from
    ``getBackendOptions()`` through ``native`` (comm's C++, which reaches it on every
    torch release). Where no backend of the group keeps options, torch's default for the
    c10d's backends, with a warning: c10d keeps a group's timeout nowhere else.
    """
    devices = [target] + [device for device in pg._device_types if device.type != target.type]
    for device in devices:
        backend = pg._get_backend(device)
        timeout = getattr(backend_options(backend), "_timeout", None)
        if not isinstance(timeout, datetime.timedelta):
            timeout = native.backend_timeout(backend)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    _LOG.warning("comm cannot read group %r's timeout (its backends keep no options): the communicators comm makes "
                 "for it time out after torch's default, %s", pg.group_name, default_pg_timeout)
    return default_pg_timeout


def _new_backend(name: str, store: Any, rank: int, size: int, timeout: datetime.timedelta, ranks: List[int],
                 group_name: str, like: Any = None) -> Any:
    """A backend of kind ``name`` for these ranks, made as c10d's ``_new_process_group_helper`` makes a group's.

    ``like``: the group's own backend's options, copied (never shared: the creators
    write the new group's name and ranks into the options they are given).
    """
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if name in ("nccl", "xccl"):  # torch's accelerator backends take the same options
        kind = getattr(dist, f"ProcessGroup{name.upper()}")
        options: Any = options_like(like, group_name, kind.Options)
        options._timeout, options.global_ranks_in_group, options.group_name = timeout, ranks, group_name
        return kind(store, rank, size, options)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise RuntimeError(f"comm cannot make a staging communicator for backend {name!r}")
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    extended: Any = c10d._DistributedBackendOptions()  # type: ignore[attr-defined]
    extended.store, extended.group_rank, extended.group_size = store, rank, size
    extended.timeout, extended.group_id, extended.global_ranks_in_group = timeout, group_name, ranks
    return plugin.creator_fn(extended, options_like(like, group_name))


# What a copy of a backend's options keeps: HCCL's hccl_config (buffer size, QoS, expansion
# mode), NCCL's config (its NCCLConfig: CTAs, cga cluster size, net name) and stream priority.
_OPTION_FIELDS = ("hccl_config", "config", "is_high_priority_stream")


def options_like(options: Any, group_name: str, default: Optional[Callable[[], Any]] = None) -> Any:
    """A new options object of ``options``' type with its settings, for a communicator named ``group_name``.

    ``default()`` (or None) where ``options`` is None or its type cannot be made empty.
    An ``hccl_config`` that names the group gets ``group_name`` instead: HCCL names the
    communicator after it.
    """
    if options is None:
        return default() if default is not None else None
    try:
        made = type(options)()
    except (TypeError, RuntimeError):
        _LOG.warning("comm cannot copy options of type %s; its communicator gets default options",
                     type(options).__name__)
        return default() if default is not None else None
    for field in _OPTION_FIELDS:
        if not hasattr(options, field):
            continue
        value = getattr(options, field)
        if field == "hccl_config" and isinstance(value, dict):
            value = {key: (group_name if key == "group_name" else item) for key, item in value.items()}
        try:
            setattr(made, field, value)
        except (AttributeError, TypeError) as error:
            _LOG.warning("comm cannot copy option %s to its communicator: %s", field, error)
    return made
