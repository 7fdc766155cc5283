"""comm.patch: torch's collectives replaced in place, restored exactly, safely from threads."""

import inspect
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.utils
import torch.nn.utils.clip_grad

import comm

import thirdparty
from multiproc import NPU, SEED_ERROR, run_ranks

WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
           "all_gather_single", "reduce_scatter_single",
           "all_reduce_coalesced", "gather", "scatter", "reduce_scatter", "all_to_all", "all_to_all_single", "barrier",
           "send", "recv", "isend", "irecv", "batch_isend_irecv")
PLACES = [(m, n) for m in (dist, c10d) for n in WRAPPED]
CLIP_PLACES = [(torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils.clip_grad, "clip_grad_norm_")]


@pytest.fixture(autouse=True)
def restore_torch():
    yield
    comm.unpatch()


def _snapshot():
    return {(m.__name__, n): getattr(m, n) for m, n in PLACES + CLIP_PLACES}


def test_patch_and_unpatch_restore_the_exact_objects():
    originals = _snapshot()
    comm.patch()
    assert comm.is_patched()
    for (module_name, name), original in originals.items():
        stand_in = getattr(sys.modules[module_name], name)
        assert stand_in is not original
        assert stand_in.__name__ == original.__name__ and stand_in.__doc__ == original.__doc__
        assert inspect.signature(stand_in) == inspect.signature(original)
        assert stand_in.__comm_replaces__ is original
    # One stand-in per function, in both modules: torch's P2POp compares op against c10d.isend.
    assert all(getattr(dist, name) is getattr(c10d, name) for name in WRAPPED)
    comm.unpatch()
    assert not comm.is_patched()
    assert _snapshot() == originals and all(_snapshot()[k] is v for k, v in originals.items())


def test_patch_is_idempotent_and_clip_is_optional():
    originals = _snapshot()
    comm.patch(clip_grad_norm=False)
    first = _snapshot()
    assert torch.nn.utils.clip_grad_norm_ is originals[("torch.nn.utils", "clip_grad_norm_")]
    comm.patch(clip_grad_norm=False)
    assert _snapshot() == first
    comm.patch()  # adds the clip patch, keeps the rest
    assert dist.all_reduce is first[("torch.distributed", "all_reduce")]
    assert torch.nn.utils.clip_grad_norm_.__comm_replaces__ is originals[("torch.nn.utils", "clip_grad_norm_")]
    comm.unpatch()
    assert all(_snapshot()[k] is v for k, v in originals.items())
    with pytest.raises(TypeError, match="clip_grad_norm must be a bool"):
        comm.patch(clip_grad_norm="yes")


def test_patched_context_manager_nests():
    original = dist.all_reduce
    with comm.patched():
        outer = dist.all_reduce
        with comm.patched():
            assert dist.all_reduce is outer  # already patched: the inner block adds nothing
        assert dist.all_reduce is outer
        with comm.patched(clip_grad_norm=False):
            pass
        assert comm.is_patched()
    assert dist.all_reduce is original and not comm.is_patched()


def _threads_patching_and_calling(rank, world_size):
    originals = _snapshot()
    errors, results = [], []

    def worker(index):
        try:
            for step in range(50):
                comm.patch()
                value = torch.full((3,), float(index))
                dist.all_reduce(value)  # whichever function is in place now: both are right
                results.append(torch.equal(value, torch.full((3,), float(index))))
                with comm.patched(clip_grad_norm=False):
                    pass
                if step % 7 == 0:
                    comm.unpatch()
        except Exception as error:  # noqa: BLE001 - reported to the parent
            errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    comm.patch()
    no_double_wrap = all(getattr(m, n).__comm_replaces__ is originals[(m.__name__, n)] for m, n in PLACES)
    comm.unpatch()
    restored = all(_snapshot()[k] is v for k, v in originals.items())
    return errors, len(results), all(results), no_double_wrap, restored


def test_eight_threads_patching_and_calling_at_once():
    # One rank: the threads' collectives need no cross-rank ordering.
    [(errors, count, correct, no_double_wrap, restored)] = run_ranks(_threads_patching_and_calling, 1)
    assert errors == [] and count == 400 and correct and no_double_wrap and restored


def _third_party_library(rank, world_size):
    seen = {}
    with pytest.raises(RuntimeError, match=SEED_ERROR):
        thirdparty.sum_metric(torch.full((2,), float(rank + 1)))
    with comm.patched():
        seen["patched"] = thirdparty.sum_metric(torch.full((2,), float(rank + 1)))
        seen["comm_still_works"] = comm.all_reduce(torch.ones(1)) is None  # no recursion
        params = [torch.zeros(3, requires_grad=True)]
        params[0].grad = torch.full((3,), 4.0)
        seen["clip"] = torch.nn.utils.clip_grad_norm_(params, 1.0)  # comm's, group=None: local
    seen["unpatched_again"] = not comm.is_patched()
    return seen


def test_third_party_code_fails_unpatched_and_works_patched_on_simulated_hccl():
    for seen in run_ranks(_third_party_library, 2, backend="hccl", simulate=NPU):
        assert torch.equal(seen["patched"], torch.full((2,), 3.0))
        assert seen["comm_still_works"] and seen["unpatched_again"]
        assert seen["clip"].item() == pytest.approx(48 ** 0.5)


def _groups_created_while_patched(rank, world_size):
    """Under the patch c10d creates groups as usual, on member and non-member ranks alike, and comm registers its
    functional kernels once a group that does not serve the CPU exists (here, an hccl one)."""
    from torch.distributed.device_mesh import init_device_mesh

    import comm.functional

    seen = {}
    with comm.patched():
        seen["gloo only"] = comm.functional.is_registered()
        mesh = init_device_mesh("cpu", (2, 1))  # its size-1 dimension: groups this rank is not in
        seen["mesh"] = mesh.shape
        outsider = dist.new_group([0], backend="hccl")  # rank 1 gets torch's NON_GROUP_MEMBER
        seen["member"] = outsider != dist.GroupMember.NON_GROUP_MEMBER
        seen["after hccl subgroup"] = comm.functional.is_registered()
        dist.new_group([0, 1], backend="hccl")
        seen["after hccl group"] = comm.functional.is_registered()
    seen["after unpatch"] = comm.functional.is_registered()
    return seen


def test_groups_created_while_patched():
    results = run_ranks(_groups_created_while_patched, 2, backend="gloo", simulate=NPU)
    for rank, seen in enumerate(results):
        assert seen["gloo only"] is False and seen["mesh"] == (2, 1)
        assert seen["member"] == (rank == 0)
        assert seen["after hccl subgroup"] == (rank == 0)  # only a member holds the new group
        assert seen["after hccl group"] is True and seen["after unpatch"] is False


def _python(code, **env):
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_comm_patch_environment_variable():
    check = "import comm, torch.distributed as d; print(hasattr(d.all_reduce, '__comm_replaces__'))"
    assert _python(check, COMM_PATCH="1").stdout.strip() == "True"
    assert _python(check, COMM_PATCH="0").stdout.strip() == "False"
    bad = _python(check, COMM_PATCH="maybe")
    assert bad.returncode != 0 and "COMM_PATCH='maybe' is not understood" in bad.stderr


# PyTorch's own DistributedTest cases (torch/testing/_internal/distributed/distributed_test.py) for the
# calls comm wraps that run on gloo: its all_to_all cases run on MPI only, its list reduce_scatter
# cases on NCCL only, and its *_group cases need 8 ranks (tests/test_collectives.py covers those).
TORCH_CASES = {
    "gather": ["test_gather", "test_gather_checks", "test_gather_full_group"],
    "scatter": ["test_scatter", "test_scatter_checks", "test_scatter_full_group"],
    "send": ["test_send_recv", "test_send_recv_with_tag"],
    "recv": ["test_send_recv_any_source"],
    "isend": ["test_isend"],
    "irecv": ["test_irecv"],
    "batch_isend_irecv": ["test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags"],
    "barrier": ["test_barrier", "test_barrier_full_group"],
}
TORCH_WORLD = 2


@pytest.mark.parametrize("calls", [["gather", "scatter", "barrier"],
                                   ["send", "recv", "isend", "irecv", "batch_isend_irecv"]],
                         ids=["collectives", "point-to-point"])
def test_torchs_own_distributed_tests_pass_patched(tmp_path, calls):
    """torch's cases pass under COMM_PATCH=1, and in every rank comm's wrappers carried the calls."""
    import json
    import os

    cases = [case for call in calls for case in TORCH_CASES[call]]
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    env = {**os.environ, "COMM_PATCH": "1", "BACKEND": "gloo", "WORLD_SIZE": str(TORCH_WORLD),
           "TEMP_DIR": str(tmp_path), "STATS_DIR": str(stats_dir), "PYTHONWARNINGS": "ignore"}
    suite = os.path.join(os.path.dirname(__file__), "torch_suite.py")
    run = subprocess.run([sys.executable, suite, *cases], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["ran"] == len(cases) and report["failures"] == [] and report["skipped"] == [], run.stderr[-3000:]
    for call in calls:
        for case in TORCH_CASES[call]:
            ranks = [json.loads((stats_dir / f"{case}.{rank}.json").read_text()) for rank in range(TORCH_WORLD)]
            assert all(seen["patched"] for seen in ranks), case
            assert any(seen["stats"].get(call, {}).get("calls", 0) > 0 for seen in ranks), (case, ranks)
