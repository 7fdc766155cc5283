"""The figures a profile keeps, per collective and message size, and the table and dict they read as.

Sizes and bandwidths are nccl-tests': the message is the whole buffer a
collective reduces, gathers or exchanges; algorithm bandwidth is its bytes over
the seconds the call took, and bus bandwidth that times a factor per collective
(what each rank's link carries), in GB/s of 10^9 bytes; each collective's row of
:data:`comm.collectives.COLLECTIVES` names its message and factor. Message sizes are grouped
by powers of two: the row of size ``S`` holds the messages of more than ``S/2``
and at most ``S`` bytes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from comm.collectives import COLLECTIVES


def _nbytes(value: Any) -> int:
    """The bytes of a tensor, of a list of them, or of the tensor each P2POp of a list holds."""
    if type(value) is list or type(value) is tuple:
        return sum(_nbytes(item) for item in value)
    tensor = getattr(value, "tensor", value)  # a P2POp (batch_isend_irecv's) holds its tensor; a tensor has none
    return int(tensor.numel() * tensor.element_size())


def message(name: str, call: Dict[str, Any], ranks: int) -> Tuple[int, float]:
    """The message of torch's function ``name`` called with ``call`` (its arguments by name) on ``ranks`` ranks.

    Its bytes, and those times the collective's bus factor: what bus bandwidth divides
    by time. Both as the call's row of :data:`comm.collectives.COLLECTIVES` says.
    """
    collective = COLLECTIVES[name]
    if collective.message is None:
        return 0, 0.0
    nbytes = _nbytes(call[collective.message])
    if collective.message_per_rank:
        nbytes *= ranks
    return nbytes, nbytes * collective.bus_factor(ranks)


_UNREAD_LIMIT = 1024  # device event pairs kept unread before the finished ones are read


class _Row:
    """The calls of one collective at one message size."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.bus_bytes = 0.0
        self.seconds = 0.0
        self.max_seconds = 0.0
        self.clocks: Set[str] = set()
        self.unread: List[Tuple[Any, Any]] = []  # (start, end) device events not read yet

    def add(self, nbytes: int, bus: float, elapsed: Any, clock: str) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.bus_bytes += bus
        if clock not in self.clocks:
            self.clocks.add(clock)
        if type(elapsed) is float:
            self._time(elapsed)
            return
        self.unread.append(elapsed)
        if len(self.unread) > _UNREAD_LIMIT:
            self.read(only_finished=True)

    def read(self, only_finished: bool = False) -> None:
        """Turn device events into seconds; all of them (waiting for the device) unless ``only_finished``."""
        unread = []
        for start, end in self.unread:
            if only_finished and not end.query():
                unread.append((start, end))
                continue
            end.synchronize()
            self._time(start.elapsed_time(end) / 1e3)
        self.unread = unread

    def _time(self, seconds: float) -> None:
        self.seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)


class Measured:
    """Everything one profile recorded: rows per (collective, size), staging and pending calls per collective."""

    def __init__(self) -> None:
        self.rows: Dict[Tuple[str, int], _Row] = {}
        self.staging: Dict[str, List[float]] = {}  # collective -> [staged calls, bytes, seconds]
        self.pending: Dict[str, int] = {}

    def record(self, name: str, nbytes: int, bus: float, elapsed: Any, clock: str) -> None:
        key = (name, _bucket(nbytes))
        row = self.rows.get(key) or self.rows.setdefault(key, _Row())
        row.add(nbytes, bus, elapsed, clock)

    def staged(self, name: str, nbytes: int, seconds: float, new_call: bool) -> None:
        entry = self.staging.setdefault(name, [0, 0, 0.0])
        entry[0] += new_call
        entry[1] += nbytes
        entry[2] += seconds


def _bucket(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (0 for nothing): the size row it falls in."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _figures(rows: List[_Row]) -> Dict[str, Any]:
    calls = sum(row.calls for row in rows)
    nbytes = sum(row.bytes for row in rows)
    seconds = sum(row.seconds for row in rows)
    bus = sum(row.bus_bytes for row in rows)
    return {
        "calls": calls,
        "bytes": nbytes,
        "seconds": seconds,
        "mean_seconds": seconds / calls if calls else 0.0,
        "max_seconds": max((row.max_seconds for row in rows), default=0.0),
        "algbw_gbps": nbytes / seconds / 1e9 if seconds else 0.0,
        "busbw_gbps": bus / seconds / 1e9 if seconds else 0.0,
        "clock": " and ".join(sorted(set().union(*(row.clocks for row in rows)))),
    }


def collective_dict(measured: Measured) -> Dict[str, Dict[str, Any]]:
    """Per collective: the totals, staging, pending calls, and ``sizes``: one dict per size row, smallest first."""
    names = sorted({name for name, _ in measured.rows} | set(measured.staging) | set(measured.pending))
    result = {}
    for name in names:
        sizes = sorted(size for other, size in measured.rows if other == name)
        rows = [measured.rows[(name, size)] for size in sizes]
        for row in rows:
            row.read()
        staged_calls, staged_bytes, staged_seconds = measured.staging.get(name, [0, 0, 0.0])
        result[name] = {
            **_figures(rows),
            "staged_calls": int(staged_calls),
            "staged_bytes": int(staged_bytes),
            "staged_seconds": staged_seconds,
            "pending": measured.pending.get(name, 0),
            "sizes": [{"size": size, **_figures([row])} for size, row in zip(sizes, rows)],
        }
    return result


_COLUMNS = ("collective", "size", "calls", "bytes", "total ms", "mean us", "max us", "algbw GB/s", "busbw GB/s")
_STAGING_COLUMNS = ("staging", "staged calls", "bytes copied", "copy ms", "collective ms")


def summary_table(measured: Measured, rank: Optional[int], world_size: Optional[int]) -> str:
    """The profile as text: a row per collective and size (and its total when it has several), then staging."""
    collectives = collective_dict(measured)
    clocks = sorted({figures["clock"] for figures in collectives.values() if figures["clock"]})
    where = "" if rank is None else f", rank {rank} of {world_size}"
    calls = sum(figures["calls"] for figures in collectives.values())
    seconds = sum(figures["seconds"] for figures in collectives.values())
    lines = [f"comm.profile{where}: {calls} calls, {seconds * 1e3:.3f} ms in collectives "
             f"(clock: {', '.join(clocks) or 'none'})"]
    table: List[Tuple[str, ...]] = [_COLUMNS]
    for name, figures in collectives.items():
        for row in figures["sizes"]:
            table.append(_cells(name, _size_label(row["size"]), row))
        if len(figures["sizes"]) > 1:
            table.append(_cells(name, "all", figures))
    lines += _aligned(table)
    staged = [(name, figures) for name, figures in collectives.items() if figures["staged_calls"]]
    if staged:
        lines.append("")
        lines += _aligned([_STAGING_COLUMNS] + [
            (name, str(f["staged_calls"]), f"{f['staged_bytes']:,}", f"{f['staged_seconds'] * 1e3:.3f}",
             f"{f['seconds'] * 1e3:.3f}") for name, f in staged])
    pending = [f"{figures['pending']} {name}" for name, figures in collectives.items() if figures["pending"]]
    if pending:
        lines.append(f"not seen complete (never waited, or waited after the block): {', '.join(pending)}")
    return "\n".join(lines)


def _cells(name: str, size: str, figures: Dict[str, Any]) -> Tuple[str, ...]:
    return (name, size, str(figures["calls"]), f"{figures['bytes']:,}", f"{figures['seconds'] * 1e3:.3f}",
            f"{figures['mean_seconds'] * 1e6:.1f}", f"{figures['max_seconds'] * 1e6:.1f}",
            f"{figures['algbw_gbps']:.3f}", f"{figures['busbw_gbps']:.3f}")


def _aligned(table: Sequence[Tuple[str, ...]]) -> List[str]:
    """Rows as lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in table]


def _size_label(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size} {unit}"
        size //= 1024
    return f"{size} TiB"
