"""What comm costs: served calls on equipped groups, and staged calls against the hand-written fix.

Every table times single calls in rotating order: the reference, the candidate and
the reference again (the A/A control: the harness's own noise and bias), one of
each per round, the order rotating round by round so drift hits all three alike.
Each row shows the medians and the two ratios against the reference.

Part 1, two gloo ranks in a process with the simulated NPU, 16 floats: torch's own
function on the equipped default group (as comm.patch() leaves it), against the same
function on an unequipped twin group of the same ranks. comm's backend sits in the
NPU slot of the first; a CPU call never meets it. Then comm's explicit all_reduce
against torch's, on the same group: what the explicit API adds.
Part 2, two ranks on the simulated NPU (hccl): CPU tensors through torch's own
functions on a patched group (comm's backend stages them) against the fix written
by hand (copy to the NPU, torch's collective, copy back), at 1 and 4,096 elements.
Part 2b, by size (1 KiB to 256 MiB): all_reduce, broadcast, all_gather_into_tensor and
reduce_scatter_tensor staged against the fix by hand, CPU tensors on the hccl group and
NPU tensors on a gloo group, fewer calls at bigger sizes (SIZES). Beside the wall clock,
where valgrind is installed, the instructions of the calling thread of rank 0 (callgrind;
rank 1 runs beside it, not counted): the fix by hand, the staged call, the fix again (the
A/A) and the staged call again, each side's calls alone between marker calls. The
simulated device copies and issues collectives on that thread; gloo's own threads, which
wait for the peer, are not counted. The counts are exact for what ran.
Part 3, one rank on the simulated NPU: the CPU time a staged all_reduce of one
float adds to the hand-written fix, in microseconds.
Part 4, the simulated NPU: transfers and collectives issued for N CPU tensors.

    python benchmarks/overhead.py [--calls N] [--only-sizes] [--no-count]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

import comm
import comm.testing

from _harness import Call, instructions_by_part, marker, rotate, run_ranks

CALLS = 4000  # timed calls per side
NPU = {"name": "npu", "backend": "hccl"}
TENSOR_COUNTS = (1, 8, 64)
# Part 2b: the caller's tensor in bytes (a reduce-scatter's output, an all-gather's input), the
# timed calls per side there and the calls per side callgrind counts: fewer at big sizes, where a
# call takes tens to hundreds of milliseconds (callgrind runs the calling thread some 50 times
# slower; it counts a copy at about 9 bytes an instruction); a tenth as many warm-up rounds (at
# least 2). 256 MiB for the hccl group's all_reduce only, the chunked case.
SIZES = ((1 << 10, 400, 200), (64 << 10, 300, 100), (1 << 20, 200, 6), (16 << 20, 40, 2), (64 << 20, 12, 1),
         (256 << 20, 6, 1))
SIZED_CALLS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
COUNTED_SIDES = ("by hand", "staged", "by hand again", "staged again")


def _row(name: str, medians: List[float]) -> Dict[str, Any]:
    """Medians of the reference, the candidate and the reference again: as a table row."""
    reference, candidate, control = medians
    return {"name": name, "torch_us": reference * 1e6, "comm_us": candidate * 1e6,
            "ratio": candidate / reference, "control": control / reference}


def _served_calls(group: dist.ProcessGroup, rank: int, numel: int) -> Dict[str, Call]:
    """torch's own functions on ``group``, on CPU tensors that gloo serves."""
    size = group.size()
    x, y, big = torch.ones(numel), torch.zeros(numel), torch.zeros(numel * size)
    return {
        "all_reduce": lambda: dist.all_reduce(x, group=group),
        "broadcast": lambda: dist.broadcast(x, group_src=0, group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(big, x, group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(y, big, group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(big, torch.ones(numel * size), group=group),
        "barrier": lambda: dist.barrier(group=group),
    }


def served(rank: int, calls: int) -> List[Dict[str, Any]]:
    """Each served call on the equipped default group against the same call on an unequipped twin."""
    twin = dist.new_group([0, 1])  # left unequipped: comm's backend is not in it
    comm.equip()  # what comm.patch() does to every group
    assert comm.staged_types() == {"npu"} and not comm.staged_types(twin)
    plain, equipped = _served_calls(twin, rank, 16), _served_calls(dist.group.WORLD, rank, 16)
    rows = [_row(name, rotate([call, equipped[name], call], calls)) for name, call in plain.items()]
    x = torch.ones(16)
    explicit = [lambda: dist.all_reduce(x), lambda: comm.all_reduce(x), lambda: dist.all_reduce(x)]
    rows.append(_row("comm.all_reduce (explicit)", rotate(explicit, calls)))
    return rows


def _by_hand(rank: int, numel: int) -> Dict[str, Call]:
    """The fix comm replaces, written out (copy onto the NPU, torch's collective, copy back), and torch's call."""
    device = comm.current_device()
    x, out = torch.ones(numel), torch.zeros(numel * dist.get_world_size())

    def all_reduce() -> None:
        staged = x.to(device)
        dist.all_reduce(staged)
        x.copy_(staged)

    def broadcast() -> None:
        staged = x.to(device) if rank == 0 else torch.empty(numel, device=device)
        dist.broadcast(staged, src=0)
        if rank != 0:
            x.copy_(staged)

    def all_gather_into_tensor() -> None:
        staged_out = torch.empty(out.shape, device=device)
        dist.all_gather_into_tensor(staged_out, x.to(device))
        out.copy_(staged_out)

    return {"all_reduce": all_reduce, "broadcast": broadcast, "all_gather_into_tensor": all_gather_into_tensor,
            "staged all_reduce": lambda: dist.all_reduce(x), "staged broadcast": lambda: dist.broadcast(x, src=0),
            "staged all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x)}


def staged_against_by_hand(rank: int, calls: int) -> List[Dict[str, Any]]:
    """Each side timed from a settled device (an untimed synchronize first): a call that returns before its
    collective ends (a broadcast's source, whose wait() only orders a stream) would otherwise hand its wait to
    whichever call comes next."""
    comm.patch()
    settle = [torch.accelerator.synchronize] * 3
    rows = []
    for numel in (1, 4096):
        sides = _by_hand(rank, numel)
        for name in ("all_reduce", "broadcast", "all_gather_into_tensor"):
            timed = rotate([sides[name], sides[f"staged {name}"], sides[name]], calls, setups=settle)
            rows.append(_row(f"{name} {numel}", timed))
    return rows


def _sized_calls(home: torch.device, target: torch.device, numel: int) -> Dict[str, Call]:
    """The four collectives on tensors that live on ``home``: the fix by hand (copies onto ``target``, the
    device the group's backend serves, torch's collective there, copies back) and torch's call, which comm
    stages (prefixed "staged ")."""
    world = dist.get_world_size()
    x, whole, part = torch.ones(numel, device=home), torch.zeros(numel * world, device=home), torch.zeros(
        numel, device=home)
    source = dist.get_rank() == 0

    def all_reduce() -> None:
        staged = x.to(target)
        dist.all_reduce(staged)
        x.copy_(staged)

    def broadcast() -> None:
        staged = x.to(target) if source else torch.empty(numel, device=target)
        dist.broadcast(staged, src=0)
        if not source:
            x.copy_(staged)

    def all_gather_into_tensor() -> None:
        staged = torch.empty(whole.shape, device=target)
        dist.all_gather_into_tensor(staged, x.to(target))
        whole.copy_(staged)

    def reduce_scatter_tensor() -> None:
        staged = torch.empty(numel, device=target)
        dist.reduce_scatter_tensor(staged, whole.to(target))
        part.copy_(staged)

    return {"all_reduce": all_reduce, "broadcast": broadcast, "all_gather_into_tensor": all_gather_into_tensor,
            "reduce_scatter_tensor": reduce_scatter_tensor,
            "staged all_reduce": lambda: dist.all_reduce(x),
            "staged broadcast": lambda: dist.broadcast(x, src=0),
            "staged all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, x),
            "staged reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, whole)}


def _settle() -> None:
    """Before each timed call: the ranks aligned and the device settled (nothing queued on it)."""
    dist.barrier()
    torch.accelerator.synchronize()


def _size_name(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _sized_rows(host_tensors: bool) -> Iterator[Tuple[str, int, str, int, int]]:
    """One of Part 2b's tables, row by row: (its name, bytes, the call, calls timed, calls counted)."""
    for nbytes, timed, counted in SIZES:
        if nbytes >= 256 << 20 and not host_tensors:
            continue  # only a host tensor's all-reduce is chunked
        for call in SIZED_CALLS if nbytes < 256 << 20 else SIZED_CALLS[:1]:
            yield f"{call} {_size_name(nbytes)}", nbytes, call, timed, counted


def _with_sides(host_tensors: bool) -> Iterator[Tuple[str, int, int, Call, Call]]:
    """Each of :func:`_sized_rows` (name, calls timed, calls counted) with its two sides: the fix by hand and
    torch's call, which comm stages. The caller's tensors live on the CPU with ``host_tensors`` (the hccl group
    stages them onto the NPU), else on the NPU (the gloo group stages them onto the CPU); a size's are made at
    its first row, once the last size's are freed."""
    npu, cpu = comm.current_device(), torch.device("cpu")
    home, target = (cpu, npu) if host_tensors else (npu, cpu)
    sides: Dict[str, Call] = {}
    made_for = 0
    for row, nbytes, call, timed, counted in _sized_rows(host_tensors):
        if made_for != nbytes:
            sides = {}
            sides, made_for = _sized_calls(home, target, nbytes // 4), nbytes
        yield row, timed, counted, sides[call], sides[f"staged {call}"]


def _memory_peaks(call: Call) -> Tuple[int, int]:
    """The device memory and the pinned host memory one ``call`` took at its peak, beyond what was held before."""
    device = getattr(torch, comm.accelerator_type())
    _settle()
    device.reset_peak_memory_stats()
    pinned = comm.testing.pinned_memory(reset_peak=True)["allocated"]
    held = device.memory_allocated()
    call()
    torch.accelerator.synchronize()
    return device.max_memory_allocated() - held, comm.testing.pinned_memory()["peak_allocated"] - pinned


def staged_by_size(rank: int, host_tensors: bool) -> List[Dict[str, Any]]:
    """Each collective at each of SIZES, the fix by hand against comm's staging (and the fix again), and the memory
    one call of each side holds at its peak."""
    comm.patch()
    rows = []
    for row, calls, _, by_hand, staged in _with_sides(host_tensors):
        timed = rotate([by_hand, staged, by_hand], calls, setups=[_settle] * 3, warmup=max(2, calls // 10))
        memory = {"by hand memory": _memory_peaks(by_hand), "staged memory": _memory_peaks(staged)}
        rows.append({**_row(row, timed), **memory})
    return rows


def _count_by_size(host_tensors: bool, rank: int, store: str) -> None:
    """A rank of the process callgrind counts (rank 0, which starts rank 1 beside it, not counted): for each row,
    two warm-up calls a side and a marker call, then its counted calls of each of COUNTED_SIDES in turn (each
    call followed by a device synchronize), each side followed by a marker call."""
    peer = None
    if rank == 0:
        peer = subprocess.Popen([sys.executable, __file__, "--count-sizes", "host" if host_tensors else "device",
                                 "--rank", "1", "--store", store])
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    comm.testing.simulate_accelerator(**NPU)
    comm.bind(rank)
    dist.init_process_group("hccl" if host_tensors else "gloo", store=dist.FileStore(store, 2), rank=rank,
                            world_size=2)
    comm.patch()
    for _, _, calls, by_hand, staged in _with_sides(host_tensors):
        for side in (by_hand, staged, by_hand, staged):
            side()
        torch.accelerator.synchronize()
        marker()
        for label in COUNTED_SIDES:
            side = staged if label.startswith("staged") else by_hand
            for _ in range(calls):
                side()
                # Each call from a settled device, as the timed ones: a call that returns before its collective
                # ends (a broadcast's source) would otherwise leave the next one a longer queue to look through.
                torch.accelerator.synchronize()
            marker()
    dist.destroy_process_group()
    if peer is not None and peer.wait() != 0:
        raise RuntimeError("rank 1 of the counted run failed")


def instructions_by_size(host_tensors: bool) -> Dict[str, Dict[str, float]]:
    """Per row of Part 2b, the calling thread's instructions per call of each of COUNTED_SIDES on rank 0
    (callgrind); empty where valgrind is not installed."""
    rows = [(row, counted) for row, _, _, _, counted in _sized_rows(host_tensors)]
    with tempfile.TemporaryDirectory() as workdir:
        totals = instructions_by_part(os.path.abspath(__file__), "--count-sizes", "host" if host_tensors else "device",
                                      "--rank", "0", "--store", os.path.join(workdir, "store"),
                                      parts=(len(COUNTED_SIDES) + 1) * len(rows) - 1, main_thread=True)
    if totals is None:
        return {}
    counted = {}
    for index, (row, calls) in enumerate(rows):  # each row's warm-up, then its sides
        start = index * (len(COUNTED_SIDES) + 1)
        counted[row] = {label: total / calls
                        for label, total in zip(COUNTED_SIDES, totals[start:start + len(COUNTED_SIDES)])}
    return counted


def _cpu_seconds(call: Callable[[], Any], calls: int) -> float:
    """CPU seconds per call of ``call`` (this process's, all threads), over ``calls`` calls."""
    start = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - start) / calls


def staged_cpu_time(rank: int, calls: int) -> Dict[str, float]:
    """Microseconds of CPU per all_reduce of 1 float on one rank: by hand, staged, by hand again; five rounds."""
    comm.patch()
    sides = _by_hand(rank, 1)
    order = [sides["all_reduce"], sides["staged all_reduce"], sides["all_reduce"]]
    for side in order:
        _cpu_seconds(side, 200)
    rounds = [[_cpu_seconds(side, calls) * 1e6 for side in order] for _ in range(5)]
    middle = sorted(rounds, key=lambda r: r[1] - r[0])[2]
    return {"by hand": middle[0], "staged": middle[1], "by hand again": middle[2]}


def staging_counts(rank: int) -> List[Dict[str, Any]]:
    comm.patch()
    rows = []
    for count in TENSOR_COUNTS:
        tensors = [torch.full((256,), float(rank)) for _ in range(count)]
        dist.barrier()
        comm.testing.reset_counters()
        dist.all_reduce_coalesced(tensors)
        counted = comm.testing.counters()
        correct = all(torch.equal(t, torch.full((256,), 1.0)) for t in tensors)
        comm.testing.reset_counters()
        for tensor in tensors:
            dist.all_reduce(tensor)
        one_by_one = comm.testing.counters()
        rows.append({"tensors": count, "transfers": counted["transfers"], "collectives": counted["collectives"],
                     "one_by_one_transfers": one_by_one["transfers"],
                     "one_by_one_collectives": one_by_one["collectives"], "correct": correct})
    return rows


def _print_rows(title: str, label: str, rows: List[Dict[str, Any]], reference: str, candidate: str) -> None:
    print(f"\n{title}")
    print(f"{label:>32} {reference:>12} {candidate:>12} {'ratio':>7} {'A/A':>7}")
    for row in rows:
        print(f"{row['name']:>32} {row['torch_us']:>12.1f} {row['comm_us']:>12.1f} {row['ratio']:>7.3f}"
              f" {row['control']:>7.3f}")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f}"


def _per_size(column: int) -> str:
    """SIZES' calls per side (column 1: timed, 2: counted), as "1 KiB: 400, ..."."""
    return ", ".join(f"{_size_name(size[0])}: {size[column]}" for size in SIZES)


def print_by_size(count: bool) -> None:
    """Part 2b's two tables; with ``count``, the instructions of each side beside the wall clock."""
    for host_tensors, title in ((True, "CPU tensors on the simulated NPU's hccl group"),
                                (False, "NPU tensors on a gloo group")):
        backend = "hccl" if host_tensors else "gloo"
        rows = run_ranks(functools.partial(staged_by_size, host_tensors=host_tensors), backend=backend,
                         simulate=NPU)
        counted = instructions_by_size(host_tensors) if count else {}
        how = (f"callgrind, calls per side {_per_size(2)}" if counted else
               "not counted" if not count else "skipped, valgrind is not installed")
        print(f"\nStaged calls by size: {title} (2 ranks), rank 0 (a broadcast's source). Wall clock: calls per side "
              f"{_per_size(1)}; instructions of the calling thread: {how}")
        label = "call, caller's tensor"
        print(f"{label:>32} {'by hand us':>12} {'staged us':>12} {'ratio':>7} {'A/A':>7}"
              f" {'device MiB: hand/staged':>24} {'pinned MiB: hand/staged':>24}"
              f" {'by hand instr':>14} {'staged instr':>14} {'ratio':>7} {'A/A':>7}")
        for row in rows:
            (hand_device, hand_pinned), (staged_device, staged_pinned) = row["by hand memory"], row["staged memory"]
            line = (f"{row['name']:>32} {row['torch_us']:>12.1f} {row['comm_us']:>12.1f} {row['ratio']:>7.3f}"
                    f" {row['control']:>7.3f} {_mib(hand_device) + ' / ' + _mib(staged_device):>24}"
                    f" {_mib(hand_pinned) + ' / ' + _mib(staged_pinned):>24}")
            instr = counted.get(row["name"])
            if instr:
                ratio = (instr["staged"] + instr["staged again"]) / (instr["by hand"] + instr["by hand again"])
                line += (f" {instr['by hand']:>14,.0f} {instr['staged']:>14,.0f} {ratio:>7.4f}"
                         f" {instr['by hand again'] / instr['by hand']:>7.4f}")
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per side")
    parser.add_argument("--only-sizes", action="store_true", help="only the staged calls by size")
    parser.add_argument("--no-count", action="store_true", help="no instruction counts (callgrind) by size")
    parser.add_argument("--count-sizes", choices=("host", "device"), help=argparse.SUPPRESS)  # a counted rank
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_sizes is not None:
        _count_by_size(args.count_sizes == "host", args.rank, args.store)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; medians of single calls in rotating order "
          "(reference, candidate, reference again); ratio = candidate / reference, A/A = again / reference")
    if args.only_sizes:
        print_by_size(not args.no_count)
        return
    _print_rows(f"Served calls, 16 floats on 2 gloo ranks, {args.calls} calls per side: torch's function on the "
                "equipped group against an unequipped twin", "call",
                run_ranks(functools.partial(served, calls=args.calls), simulate=NPU), "twin us", "equipped us")
    staged = run_ranks(functools.partial(staged_against_by_hand, calls=args.calls), backend="hccl", simulate=NPU)
    _print_rows(f"Staged calls: CPU tensors through torch's functions on the simulated NPU's hccl group (2 ranks), "
                f"{args.calls} calls per side", "call, elements", staged, "by hand us", "staged us")
    print_by_size(not args.no_count)
    cpu = run_ranks(functools.partial(staged_cpu_time, calls=args.calls), world_size=1, backend="hccl",
                    simulate=NPU)
    print(f"\nCPU time of a staged all_reduce of 1 float on one rank (process_time, {args.calls} calls, the "
          "middle of five rounds): " + ", ".join(f"{name} {us:.2f} us" for name, us in cpu.items())
          + f"; staged adds {cpu['staged'] - cpu['by hand']:+.2f} us"
          f" (A/A {cpu['by hand again'] - cpu['by hand']:+.2f})")
    print("\nStaged calls: N CPU tensors of 256 floats on the simulated NPU's hccl group")
    print(f"{'tensors':>8} {'coalesced: transfers':>21} {'collectives':>12} {'one by one: transfers':>22} "
          f"{'collectives':>12} {'correct':>8}")
    for row in run_ranks(staging_counts, backend="hccl", simulate=NPU):
        print(f"{row['tensors']:>8} {row['transfers']:>21} {row['collectives']:>12} "
              f"{row['one_by_one_transfers']:>22} {row['one_by_one_collectives']:>12} {str(row['correct']):>8}")


if __name__ == "__main__":
    main()
