"""comm.profile(): what it counts, times and reports, on gloo and staged on the simulated NPU."""

import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import comm
from comm import collectives
from comm._profile_figures import message

from multiproc import NPU, gloo_lacks_all_to_all, quiet_env, run_ranks

FLOATS = 1024
WAIT_LATE = 0.5  # seconds rank 0 waits before calling wait() on an async all_reduce


# torch's own functions, as imported: what comm's calls and torch.distributed hold with profiling off.
_TORCHS_OWN = dict(collectives.TORCH)


def _torch_entries():
    """Whether comm's table and torch.distributed hold torch's own functions again (profiling off)."""
    return all(collectives.TORCH[name] is function for name, function in _TORCHS_OWN.items()) and all(
        getattr(dist, name) is function for name, function in _TORCHS_OWN.items() if hasattr(dist, name))


def _acceptance(rank, world_size):
    """The issue's scenario: 5 all_reduce, 3 broadcast, 2 all_gather inside, others before and after."""
    tensor = torch.ones(FLOATS)
    comm.all_reduce(tensor)
    comm.broadcast(tensor, src=0)
    with comm.profile() as prof:
        entries_inside = _torch_entries()
        for _ in range(5):
            comm.all_reduce(tensor)
        for _ in range(3):
            comm.broadcast(tensor, src=1)
        gathered = [torch.zeros(FLOATS) for _ in range(world_size)]
        for _ in range(2):
            comm.all_gather(gathered, tensor)
    comm.all_reduce(tensor)
    comm.all_gather(gathered, tensor)
    expected = torch.ones(FLOATS) * world_size ** 7  # 7 all_reduce, broadcasts of equal values
    return {"dict": prof.to_dict(), "summary": prof.summary(), "entries_inside": entries_inside,
            "entries_after": _torch_entries(), "results_right": torch.equal(gathered[1], expected)}


def _every_call(rank, world_size):
    """One of each collective and point-to-point call, under comm.patch() too; async timed until wait."""
    peer, n = 1 - rank, world_size
    one = torch.full((FLOATS,), float(rank + 1))
    with comm.profile() as prof:
        comm.reduce(one.clone(), dst=0)
        comm.all_gather_into_tensor(torch.zeros(n * FLOATS), one)
        comm.reduce_scatter(torch.zeros(FLOATS), [one.clone() for _ in range(n)])
        comm.reduce_scatter_tensor(torch.zeros(FLOATS // n), one)
        comm.gather(one, [torch.zeros(FLOATS) for _ in range(n)] if rank == 0 else None, dst=0)
        comm.scatter(torch.zeros(FLOATS), [one.clone() for _ in range(n)] if rank == 0 else None, src=0)
        if not gloo_lacks_all_to_all():
            comm.all_to_all([torch.zeros(FLOATS) for _ in range(n)], [one.clone() for _ in range(n)])
        comm.all_to_all_single(torch.zeros(FLOATS), one)
        comm.barrier()
        received = torch.zeros(FLOATS)
        if rank == 0:
            comm.send(one, group_dst=peer)
        else:
            comm.recv(received, group_src=peer)
        (comm.isend, comm.irecv)[rank](one if rank == 0 else received, peer).wait()
        ops = [dist.P2POp(dist.isend, one, peer), dist.P2POp(dist.irecv, received, peer)]
        with comm.patched():
            for work in dist.batch_isend_irecv(ops):  # torch's own batch, timed once: not its isend inside
                work.wait()
            dist.all_reduce(one.clone())
    late = _async_timing(rank)
    return {"dict": prof.to_dict(), "late": late, "received": received.tolist()[:1]}


def _async_timing(rank):
    """Rank 0 waits WAIT_LATE seconds before wait(); polling is_completed and the future also end a call."""
    tensor = torch.ones(FLOATS)
    with comm.profile() as prof:
        work = comm.all_reduce(tensor, async_op=True)
        before_wait = prof.to_dict()["all_reduce"]
        if rank == 0:
            time.sleep(WAIT_LATE)
        waited = work.wait()
        polled = comm.broadcast(tensor, src=0, async_op=True)
        while not polled.is_completed():
            time.sleep(0.001)
        future = comm.all_reduce(tensor, async_op=True).get_future()
        future_value = future.wait()[0].tolist()[:1]
        after = prof.to_dict()
        unwaited = comm.all_reduce(tensor, async_op=True)
    unwaited.wait()  # after the block: not counted
    return {"before_wait": before_wait, "waited": waited, "after": after, "final": prof.to_dict(),
            "future_value": future_value}


def _nested_and_threads(rank, world_size):
    """An inner block sees its own calls; the outer sees those and another thread's."""
    tensor = torch.ones(4)
    side = dist.new_group([0, 1])

    def other_thread():
        for _ in range(4):
            comm.all_reduce(torch.ones(4), group=side)

    with comm.profile() as outer:
        comm.all_reduce(tensor)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        with comm.profile() as inner:
            comm.broadcast(tensor, src=0)
            comm.broadcast(tensor, src=0)
        entries_between = _torch_entries()
    return {"outer": outer.to_dict(), "inner": inner.to_dict(), "entries_between": entries_between,
            "entries_after": _torch_entries()}


def _gloo_scenarios(rank, world_size):
    return {"acceptance": _acceptance(rank, world_size), "every": _every_call(rank, world_size),
            "nested": _nested_and_threads(rank, world_size)}


@pytest.fixture(scope="module")
def gloo_ranks():
    return run_ranks(_gloo_scenarios, 2, timeout=180)


def test_counts_exactly_the_calls_inside_the_block(gloo_ranks):
    for seen in gloo_ranks:
        acceptance = seen["acceptance"]
        profiled = acceptance["dict"]
        assert sorted(profiled) == ["all_gather", "all_reduce", "broadcast"]
        assert [profiled[name]["calls"] for name in sorted(profiled)] == [2, 5, 3]
        assert profiled["all_reduce"]["bytes"] == 5 * 4 * FLOATS
        assert profiled["broadcast"]["bytes"] == 3 * 4 * FLOATS
        assert profiled["all_gather"]["bytes"] == 2 * 2 * 4 * FLOATS  # the whole gathered buffer, as nccl-tests
        for figures in profiled.values():
            assert figures["algbw_gbps"] > 0 and figures["busbw_gbps"] > 0
            assert figures["seconds"] >= figures["max_seconds"] > 0
            assert figures["mean_seconds"] == pytest.approx(figures["seconds"] / figures["calls"])
            assert figures["clock"] == "host" and figures["pending"] == 0 and figures["staged_calls"] == 0
            [size_row] = figures["sizes"]
            assert size_row["calls"] == figures["calls"] and size_row["bytes"] == figures["bytes"]
        assert profiled["all_reduce"]["sizes"][0]["size"] == 4096
        assert profiled["all_gather"]["sizes"][0]["size"] == 8192
        assert acceptance["results_right"]
        assert acceptance["entries_after"] and not acceptance["entries_inside"]


def test_summary_names_each_collective_with_a_busbw_column(gloo_ranks):
    summary = gloo_ranks[0]["acceptance"]["summary"]
    header = next(line for line in summary.splitlines() if line.startswith("collective"))
    assert "busbw GB/s" in header and "algbw GB/s" in header and "mean us" in header
    assert summary.startswith("comm.profile, rank 0 of 2: 10 calls")
    for name, calls, size in [("all_reduce", 5, "4 KiB"), ("broadcast", 3, "4 KiB"), ("all_gather", 2, "8 KiB")]:
        assert re.search(rf"^{name}\s+{size}\s+{calls}\s", summary, re.MULTILINE), summary


# Bus bandwidth over algorithm bandwidth on 2 ranks: nccl-tests' factors, and comm's for the others.
FACTOR = {"all_reduce": 1.0, "reduce": 1.0, "all_gather_into_tensor": 0.5, "reduce_scatter": 0.5,
          "reduce_scatter_tensor": 0.5, "gather": 0.5, "scatter": 0.5, "all_to_all": 0.5, "all_to_all_single": 0.5,
          "send": 1.0, "recv": 1.0, "isend": 1.0, "irecv": 1.0, "batch_isend_irecv": 1.0}


def test_every_call_is_timed_with_its_message_size_and_bus_factor(gloo_ranks):
    for rank, seen in enumerate(gloo_ranks):
        profiled = seen["every"]["dict"]
        p2p_calls = {"send", "isend"} if rank == 0 else {"recv", "irecv"}
        lacking = {"all_to_all"} if gloo_lacks_all_to_all() else set()  # torch 2.9's gloo
        assert set(profiled) == set(FACTOR) - {"send", "recv", "isend", "irecv"} - lacking | p2p_calls | {"barrier"}
        message = 4 * FLOATS
        expected_bytes = {"reduce": message, "all_gather_into_tensor": 2 * message, "reduce_scatter": 2 * message,
                          "reduce_scatter_tensor": message, "gather": 2 * message, "scatter": 2 * message,
                          "all_to_all": 2 * message, "all_to_all_single": message, "batch_isend_irecv": 2 * message,
                          "all_reduce": message, "barrier": 0, **{name: message for name in p2p_calls}}
        expected_bytes = {name: size for name, size in expected_bytes.items() if name not in lacking}
        assert {name: figures["bytes"] for name, figures in profiled.items()} == expected_bytes
        assert all(figures["calls"] == 1 for figures in profiled.values())
        for name, figures in profiled.items():
            if name != "barrier":
                assert figures["busbw_gbps"] == pytest.approx(figures["algbw_gbps"] * FACTOR[name]), name
        assert profiled["barrier"]["seconds"] > 0 and profiled["barrier"]["busbw_gbps"] == 0
    assert gloo_ranks[1]["every"]["received"] == [1.0]


def test_message_sizes_and_bus_factors_follow_nccl_tests():
    kib = torch.ones(256)  # 1 KiB
    four = [kib] * 4
    for name, arguments, expected_bytes, factor in [
        ("all_reduce", {"tensor": kib}, 1024, 1.5),
        ("all_gather", {"tensor_list": four, "tensor": kib}, 4096, 0.75),
        ("all_gather_into_tensor", {"output_tensor": torch.ones(1024), "input_tensor": kib}, 4096, 0.75),
        ("reduce_scatter", {"output": kib, "input_list": four}, 4096, 0.75),
        ("reduce_scatter_tensor", {"output": kib, "input": torch.ones(1024)}, 4096, 0.75),
        ("all_to_all", {"output_tensor_list": four, "input_tensor_list": four}, 4096, 0.75),
        ("all_to_all_single", {"output": torch.ones(1024), "input": torch.ones(1024)}, 4096, 0.75),
        ("gather", {"tensor": kib}, 4096, 0.75),
        ("scatter", {"tensor": kib}, 4096, 0.75),
        ("broadcast", {"tensor": kib}, 1024, 1.0),
        ("reduce", {"tensor": kib}, 1024, 1.0),
        ("isend", {"tensor": kib}, 1024, 1.0),
        ("batch_isend_irecv", {"p2p_op_list": [SimpleNamespace(tensor=kib)] * 2}, 2048, 1.0),  # what a P2POp holds
        ("barrier", {}, 0, 0.0),
    ]:
        assert message(name, arguments, 4) == (expected_bytes, expected_bytes * factor), name


def test_async_calls_are_timed_until_wait_returns(gloo_ranks):
    for rank, seen in enumerate(gloo_ranks):
        late = seen["every"]["late"]
        assert late["before_wait"]["calls"] == 0 and late["before_wait"]["pending"] == 1
        assert late["waited"] is True
        after = late["after"]
        assert after["all_reduce"]["calls"] == 2 and after["all_reduce"]["pending"] == 0  # wait, then the future
        assert after["broadcast"]["calls"] == 1  # is_completed() seen True
        waited_late = after["all_reduce"]["max_seconds"]
        assert waited_late >= WAIT_LATE if rank == 0 else waited_late < WAIT_LATE
        assert late["final"]["all_reduce"]["calls"] == 2 and late["final"]["all_reduce"]["pending"] == 1
        assert late["future_value"] == [4.0]


def test_nested_blocks_and_other_threads(gloo_ranks):
    for seen in gloo_ranks:
        nested = seen["nested"]
        assert {name: f["calls"] for name, f in nested["inner"].items()} == {"broadcast": 2}
        assert {name: f["calls"] for name, f in nested["outer"].items()} == {"all_reduce": 5, "broadcast": 2}
        assert not nested["entries_between"] and nested["entries_after"]


def test_a_profile_records_one_block():
    block = comm.profile()
    with block:
        pass
    with pytest.raises(RuntimeError, match="already recorded a block"):
        block.__enter__()
    assert _torch_entries()


def _staged_on_simulated_npu(rank, world_size):
    """CPU tensors on the hccl group: staged. Figures must agree with comm.stats(); torch's profiler sees ranges."""
    gloo = dist.new_group([0, 1], backend="gloo")
    comm.reset_stats()
    cpu = torch.ones(FLOATS)
    with comm.profile() as prof:
        for _ in range(3):
            comm.all_reduce(cpu)
        comm.all_reduce(cpu, async_op=True).wait()
        comm.all_gather_into_tensor(torch.zeros(world_size * FLOATS), cpu)
        comm.reduce_scatter_tensor(torch.zeros(FLOATS // world_size), cpu)
        comm.all_reduce(torch.ones(FLOATS, device="npu"))  # served: not staged
        comm.all_gather_into_tensor(torch.zeros(world_size * FLOATS, device="npu"), torch.ones(FLOATS, device="npu"),
                                    group=gloo)  # staged onto the CPU, where gloo gathers into a list
    stats = comm.stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as traced:
        comm.all_reduce(torch.ones(8))
    return {"dict": prof.to_dict(), "stats": stats, "summary": prof.summary(),
            "trace": sorted({event.name for event in traced.events() if event.name.startswith("comm.")})}


def test_staged_calls_report_copies_consistent_with_stats():
    for seen in run_ranks(_staged_on_simulated_npu, 2, backend="hccl", simulate=NPU):
        profiled, stats = seen["dict"], seen["stats"]
        assert {name: f["calls"] for name, f in profiled.items()} == {
            "all_reduce": 5, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}
        gathers = profiled["all_gather_into_tensor"]
        assert gathers["bytes"] == 2 * 2 * 4 * FLOATS
        assert gathers["busbw_gbps"] == pytest.approx(gathers["algbw_gbps"] / 2)
        # Timed by the clock of the caller's tensors: the host for CPU tensors, events for the NPU's.
        assert gathers["clock"] == "host and npu events"
        assert profiled["all_reduce"]["clock"] == "host and npu events"
        for name, figures in profiled.items():
            assert figures["staged_calls"] == stats[name]["staged_calls"] > 0
            assert figures["staged_bytes"] == stats[name]["bytes_staged"] > 0
            assert figures["staged_seconds"] == pytest.approx(stats[name]["staging_seconds"]) and \
                figures["staged_seconds"] > 0
            assert figures["busbw_gbps"] > 0
        assert profiled["all_reduce"]["staged_calls"] == 4  # the served one is timed, not staged
        assert profiled["all_reduce"]["staged_bytes"] == 4 * 2 * 4 * FLOATS  # in and back
        assert re.search(r"^staging\s+staged calls\s+bytes copied", seen["summary"], re.MULTILINE)
        assert seen["trace"] == ["comm.copy_back", "comm.stage_in", "comm.write_back"]


SCRIPT = """
import sys, torch, torch.distributed as dist, comm
if "RANK" not in __import__("os").environ:
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
else:
    dist.init_process_group("gloo")
for _ in range(4):
    comm.all_reduce(torch.ones(256))
comm.broadcast(torch.ones(4), src=0)
print("done", dist.get_rank())
dist.destroy_process_group()
"""


def _run(tmp_path, value, *launcher):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, *launcher, str(script), str(tmp_path / "store")], capture_output=True,
                            text=True, env=quiet_env(COMM_PROFILE=value), timeout=180)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.integration
def test_comm_profile_prints_the_table_at_exit(tmp_path):
    printed = _run(tmp_path, "1").stderr
    assert printed.startswith("comm.profile, rank 0 of 1: 5 calls")
    assert re.search(r"^all_reduce\s+1 KiB\s+4\s+4,096\s", printed, re.MULTILINE), printed
    assert re.search(r"^broadcast\s+16 B\s+1\s+16\s", printed, re.MULTILINE), printed


def test_comm_profile_0_or_unset_profiles_nothing(monkeypatch):
    for value in ("0", "off", ""):
        monkeypatch.setenv("COMM_PROFILE", value)
        comm.profiler.profile_if_asked()
        assert not comm.profiler.is_profiling() and _torch_entries()


@pytest.mark.integration
def test_comm_profile_prints_on_rank_0_or_every_rank(tmp_path):
    """Under torchrun rank 0 alone prints; with ``all`` a rank other than 0 (its rank from the launcher's
    variables, as before a group exists) prints too."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert re.findall(r"comm.profile, rank (\d) of 2: 5 calls", _run(tmp_path, "1", *torchrun).stderr) == ["0"]
    rank_1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for value, prints in (("1", False), ("all", True)):
        result = subprocess.run([sys.executable, "-c", "import comm"], capture_output=True, text=True,
                                env=quiet_env(COMM_PROFILE=value, **rank_1), timeout=180)
        assert result.returncode == 0, result.stderr
        assert result.stderr.startswith("comm.profile") == prints, result.stderr
