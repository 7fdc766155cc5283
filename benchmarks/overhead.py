"""What comm costs: every call's fast path against torch, and the staging path against the hand-written fix.

Every table times single calls in rotating order: torch's call, comm's call and
torch's call again (the A/A control: the harness's own noise and bias), one of
each per round, the order rotating round by round so drift hits all three alike.
Each row shows the medians and the two ratios against the first torch column.

Part 1, two gloo ranks, 16 floats: each collective and point-to-point call of
comm against torch's (the fast path), and torch's behind a wrapper that only
forwards its arguments (the floor: what a Python shim costs before doing anything).
Part 2, two gloo ranks: all_reduce at 1, 1 K and 1 M elements.
Part 3, one rank: what the fast path costs per call, around a real all_reduce (where
the Python runs with cold caches, as in a training loop) and around a no-op one.
Part 3b, two gloo ranks: DTensor's functional all_reduce with comm.patch() and
without, in a gloo-only process and in one that also holds an hccl group.
Part 4, two ranks on the simulated NPU (hccl): CPU tensors through comm against
the hand-written fix (copy to the NPU, torch's collective, copy back), at 1 and
4,096 elements; the A/A control repeats the hand-written fix.
Part 4b, the same, all_reduce of 1 element: the hand-written fix with one of the
staging path's duties added at a time (timing, counting, the first-staging log,
the staging device's lookup, filing the work for comm.profile()): what each costs.
Part 5, the simulated NPU: transfers and collectives issued for N CPU tensors.

    python benchmarks/overhead.py [--calls N]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import timeit
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import comm
import comm.testing
from comm.fastpath import namespace
from comm.patch import _WRAPPERS as PATCHED

from _harness import Call, rotate, run_ranks

CALLS = 4000  # timed calls per side in parts 1 and 4
SIZE_CALLS = {1: 10000, 1024: 10000, 1024 * 1024: 3000}  # part 2: 1 M calls vary by 35%
DECISION_CALLS, DECISION_REPEATS = 200_000, 7
TENSOR_COUNTS = (1, 8, 64)
NPU = {"name": "npu", "backend": "hccl"}


def _row(name: str, medians: List[float]) -> Dict[str, Any]:
    """Medians of torch, the candidate, [a forwarding wrapper,] torch again: as a table row."""
    reference, candidate, control = medians[0], medians[1], medians[-1]
    row = {"name": name, "torch_us": reference * 1e6, "comm_us": candidate * 1e6,
           "ratio": candidate / reference, "control": control / reference}
    if len(medians) == 4:
        row["floor"] = medians[2] / reference
    return row


def _forwarder(function: Callable[..., Any]) -> Callable[..., Any]:
    """A Python function that only hands its arguments to ``function``: the least any Python shim adds."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)
    return forward


# torch's calls, each behind a forwarding wrapper (a P2POp must still name torch's isend/irecv): every call
# comm.patch() replaces, read from the same kind of namespace (a module) as torch's and comm's.
FORWARDED = namespace("FORWARDED", {name: _forwarder(getattr(dist, name)) for name in PATCHED})


def _calls(module: Any, rank: int, numel: int) -> Dict[str, Call]:
    """One call per wrapper, made with ``module`` (torch.distributed, comm or FORWARDED) on prepared tensors."""
    size, peer = dist.get_world_size(), 1 - rank
    x, y = torch.ones(numel), torch.zeros(numel)
    pieces, outputs = list(torch.ones(numel * size).chunk(size)), [torch.zeros(numel) for _ in range(size)]
    big = torch.zeros(numel * size)
    ops_of = comm if module is comm else dist
    batch = [ops_of.P2POp(ops_of.isend, x, peer), ops_of.P2POp(ops_of.irecv, y, peer)]
    calls = {
        "all_reduce": lambda: module.all_reduce(x),
        "broadcast": lambda: module.broadcast(x, src=0),
        "reduce": lambda: module.reduce(x, dst=0),
        "all_gather": lambda: module.all_gather(outputs, x),
        "all_gather_into_tensor": lambda: module.all_gather_into_tensor(big, x),
        "reduce_scatter_tensor": lambda: module.reduce_scatter_tensor(y, big),
        "reduce_scatter": lambda: module.reduce_scatter(y, pieces),
        "gather": lambda: module.gather(x, outputs if rank == 0 else None, dst=0),
        "scatter": lambda: module.scatter(y, pieces if rank == 0 else None, src=0),
        "all_to_all": lambda: module.all_to_all(outputs, pieces),
        "all_to_all_single": lambda: module.all_to_all_single(big, torch.ones(numel * size)),
        "barrier": lambda: module.barrier(),
        "send / recv": lambda: module.send(x, peer) if rank == 0 else module.recv(y, peer),
        "isend / irecv": lambda: (module.isend(x, peer) if rank == 0 else module.irecv(y, peer)).wait(),
        "batch_isend_irecv": lambda: [work.wait() for work in module.batch_isend_irecv(batch)],
    }
    if hasattr(dist, "all_gather_single"):  # torch >= 2.12 deprecates the *_tensor names: time both
        calls["all_gather_single"] = lambda: module.all_gather_single(big, x)
        calls["reduce_scatter_single"] = lambda: module.reduce_scatter_single(y, big)
    return calls


def every_call(rank: int, calls: int) -> List[Dict[str, Any]]:
    """Each call: torch's, comm's, torch's behind a forwarding wrapper, and torch's again."""
    torch_calls, comm_calls, forwarded = _calls(dist, rank, 16), _calls(comm, rank, 16), _calls(FORWARDED, rank, 16)
    return [_row(name, rotate([call, comm_calls[name], forwarded[name], call], calls))
            for name, call in torch_calls.items()]


def all_reduce_sizes(rank: int) -> List[Dict[str, Any]]:
    rows = []
    for numel, calls in SIZE_CALLS.items():
        tensor = torch.ones(numel)
        sides = [functools.partial(fn, tensor) for fn in (dist.all_reduce, comm.all_reduce, dist.all_reduce)]
        rows.append(_row(f"{numel}", rotate(sides, calls)))
    return rows


def functional_patched(rank: int, calls: int, with_hccl: bool) -> List[Dict[str, Any]]:
    """DTensor's all_reduce (a functional collective) on a gloo group: unpatched, patched, unpatched again.

    ``with_hccl``: the process also holds an hccl group (on the simulated NPU), so
    the patch registers comm's CPU kernels and the gloo call passes through one.
    """
    import torch.distributed._functional_collectives as funcol

    if with_hccl:
        dist.new_group(backend="hccl")
    x, group = torch.ones(16), dist.group.WORLD

    def call() -> None:
        funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    def switch(to: Call) -> Call:
        return lambda: (to(), dist.barrier(group))  # both ranks start the timed call together

    setups = [switch(comm.unpatch), switch(comm.patch), switch(comm.unpatch)]
    medians = rotate([call, call, call], calls, setups)
    comm.unpatch()
    return [_row("functional all_reduce", medians)]


def one_rank_cost(rank: int, calls: int) -> Dict[str, float]:
    """Microseconds per all_reduce of 16 floats on a one-rank gloo group: torch's, comm's, forwarded, torch's again.

    Between calls the process sleeps on the collective, so the Python of each call
    runs with cold caches: this is what the fast path costs in a real loop.
    """
    x = torch.ones(16)
    sides = [functools.partial(fn, x) for fn in (dist.all_reduce, comm.all_reduce, FORWARDED.all_reduce,
                                                  dist.all_reduce)]
    return dict(zip(("torch", "comm", "forwarding wrapper", "torch again"), (t * 1e6 for t in rotate(sides, calls))))


def decision_cost(rank: int) -> Dict[str, float]:
    """Nanoseconds per call of comm's fast path and of a bare wrapper, around a no-op collective."""
    import comm.collectives

    def no_collective(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return None

    def bare_wrapper(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        return no_collective(tensor, op, group, async_op)

    tensor = torch.ones(1)
    comm.all_reduce(tensor)  # the first call resolves the group; later ones take the fast path
    comm.collectives._TORCH.all_reduce = no_collective
    names = {"no-op": no_collective, "bare wrapper": bare_wrapper, "comm": comm.all_reduce}
    return {name: _ns_per_call(fn, tensor) for name, fn in names.items()}


def _ns_per_call(fn: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> float:
    timings = timeit.repeat("fn(tensor)", globals={"fn": fn, "tensor": tensor}, number=DECISION_CALLS,
                            repeat=DECISION_REPEATS)
    return min(timings) / DECISION_CALLS * 1e9


def _by_hand(rank: int, numel: int) -> Dict[str, Call]:
    """The fix comm replaces, written out: copy onto the NPU, torch's collective, copy back."""
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
            "comm all_reduce": lambda: comm.all_reduce(x), "comm broadcast": lambda: comm.broadcast(x, src=0),
            "comm all_gather_into_tensor": lambda: comm.all_gather_into_tensor(out, x)}


def staged_against_by_hand(rank: int, calls: int) -> List[Dict[str, Any]]:
    rows = []
    for numel in (1, 4096):
        sides = _by_hand(rank, numel)
        for name in ("all_reduce", "broadcast", "all_gather_into_tensor"):
            rows.append(_row(f"{name} {numel}", rotate([sides[name], sides[f"comm {name}"], sides[name]], calls)))
    return rows


def staging_duties(rank: int, calls: int) -> List[Dict[str, Any]]:
    """The hand-written fix, alone and with each of the staging path's per-call duties added, against itself."""
    import comm.fastpath
    import comm.staging

    device, x, pg = comm.current_device(), torch.ones(1), dist.group.WORLD
    comm.all_reduce(x)  # resolves the group: its facts and staging device are cached from here on
    info = comm.fastpath.known_group(pg)
    assert info is not None

    def fix(duty: Call = lambda: None) -> Call:
        def call() -> None:  # the duty runs first, as most of comm's run before the collective starts
            duty()
            staged = x.to(device, copy=True, memory_format=torch.contiguous_format)
            dist.all_reduce(staged, async_op=True).wait()
            x.copy_(staged)
        return call

    duties: Dict[str, Call] = {
        "the same fix again": fix(),
        "+ timing (4 clock reads)": fix(lambda: [time.perf_counter() for _ in range(4)]),
        "+ counting": fix(lambda: comm.staging.count_staging("all_reduce", 8, 0.0, new_call=True)),
        "+ the first-staging log": fix(lambda: comm.staging.log_first_staging("all_reduce", id(pg), "device", str)),
        "+ the staging device": fix(lambda: comm.staging._staging_target(pg, info)),
        "+ filing for comm.profile()": fix(lambda: comm.staging.attribute_work(None, "all_reduce")),
        "comm.all_reduce": lambda: comm.all_reduce(x),
    }
    by_hand = fix()
    return [_row(name, rotate([by_hand, duty, by_hand], calls)) for name, duty in duties.items()]


def staging_counts(rank: int) -> List[Dict[str, Any]]:
    rows = []
    for count in TENSOR_COUNTS:
        tensors = [torch.full((256,), float(rank)) for _ in range(count)]
        dist.barrier()
        comm.testing.reset_counters()
        comm.all_reduce_coalesced(tensors)
        counted = comm.testing.counters()
        correct = all(torch.equal(t, torch.full((256,), 1.0)) for t in tensors)
        comm.testing.reset_counters()
        for tensor in tensors:
            comm.all_reduce(tensor)
        one_by_one = comm.testing.counters()
        rows.append({"tensors": count, "transfers": counted["transfers"], "collectives": counted["collectives"],
                     "one_by_one_transfers": one_by_one["transfers"],
                     "one_by_one_collectives": one_by_one["collectives"], "correct": correct})
    return rows


def _print_rows(title: str, label: str, rows: List[Dict[str, Any]], reference: str, candidate: str) -> None:
    floor = "floor" in rows[0]
    print(f"\n{title}")
    print(f"{label:>28} {reference:>12} {candidate:>12} {'ratio':>7}" + (f" {'wrapper':>8}" if floor else "")
          + f" {'A/A':>7}")
    for row in rows:
        print(f"{row['name']:>28} {row['torch_us']:>12.1f} {row['comm_us']:>12.1f} {row['ratio']:>7.3f}"
              + (f" {row['floor']:>8.3f}" if floor else "") + f" {row['control']:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per side in parts 1 and 4")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 2 ranks; medians of single calls in rotating order "
          "(torch, comm, torch again); ratio = comm / torch, A/A = torch again / torch")
    print("Part 1's 'wrapper' column: torch's call behind a Python function that only forwards its arguments, "
          "against torch's call: what any Python shim costs here before it does anything")
    _print_rows(f"Fast path, 16 floats on gloo, {args.calls} calls per side", "call",
                run_ranks(functools.partial(every_call, calls=args.calls)), "torch us", "comm us")
    _print_rows("all_reduce on gloo by size", "elements", run_ranks(all_reduce_sizes), "torch us", "comm us")
    _print_rows("Functional all_reduce (DTensor's path), 16 floats on gloo: torch patched against unpatched",
                "process", run_ranks(functools.partial(functional_patched, calls=args.calls, with_hccl=False)),
                "torch us", "patched us")
    _print_rows("... in a process that also holds an hccl group (comm's CPU kernels registered)", "process",
                run_ranks(functools.partial(functional_patched, calls=args.calls, with_hccl=True), simulate=NPU),
                "torch us", "patched us")
    one = run_ranks(functools.partial(one_rank_cost, calls=args.calls), world_size=1)
    print(f"\nThe fast path in a real loop: all_reduce of 16 floats on one gloo rank, {args.calls} calls per side, "
          "medians in rotating order")
    print("  " + ", ".join(f"{name} {us:.2f} us" for name, us in one.items())
          + f"; over torch: comm {one['comm'] - one['torch']:+.2f} us, "
          f"forwarding wrapper {one['forwarding wrapper'] - one['torch']:+.2f} us")
    costs = run_ranks(decision_cost, world_size=1)
    print("\nThe fast path's own cost: ns per call around a no-op collective (timeit, best of 7)")
    print("  " + ", ".join(f"{name} {ns:.0f} ns" for name, ns in costs.items())
          + f"; comm over the bare wrapper: {costs['comm'] - costs['bare wrapper']:+.0f} ns")
    staged = run_ranks(functools.partial(staged_against_by_hand, calls=args.calls), backend="hccl", simulate=NPU)
    _print_rows(f"Staging path: CPU tensors on the simulated NPU's hccl group, {args.calls} calls per side",
                "call, elements", staged, "by hand us", "comm us")
    duties = run_ranks(functools.partial(staging_duties, calls=args.calls // 2), backend="hccl", simulate=NPU)
    _print_rows(f"Staging path, all_reduce of 1 element: the hand-written fix plus one duty, {args.calls // 2} calls "
                "per side", "fix", duties, "by hand us", "with duty us")
    print("\nStaging path: N CPU tensors of 256 floats on the simulated NPU's hccl group")
    print(f"{'tensors':>8} {'coalesced: transfers':>21} {'collectives':>12} {'one by one: transfers':>22} "
          f"{'collectives':>12} {'correct':>8}")
    for row in run_ranks(staging_counts, backend="hccl", simulate=NPU):
        print(f"{row['tensors']:>8} {row['transfers']:>21} {row['collectives']:>12} "
              f"{row['one_by_one_transfers']:>22} {row['one_by_one_collectives']:>12} {str(row['correct']):>8}")


if __name__ == "__main__":
    main()
