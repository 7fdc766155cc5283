"""Bad input across the public API: a documented exception naming the argument, nothing touched.

TypeError for a wrong type, ValueError for a wrong value (environment variables
included), RuntimeError for a state the call cannot work in (docs/api.md, "Errors").
"""

import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import comm
import comm.testing

from multiproc import error_of, launched_by


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _param():
    param = torch.zeros(3, requires_grad=True)
    param.grad = torch.ones(3)
    return param


def _env(monkeypatch, name, value, call):
    monkeypatch.setenv(name, value)
    return call()


def _launched(monkeypatch, env, call):
    launched_by(env, monkeypatch)
    return call()


_SRUN_PROCID_X = {"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
                  "SLURM_STEP_TASKS_PER_NODE": "2"}
_OPENMPI_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


# comm's collectives are torch's functions: bad input gets torch's own exception, raised
# before anything is sent or written. Each call is made on torch.distributed and on comm.
COLLECTIVE_CASES = [
    ("all_reduce non-tensor", lambda t, m: m.all_reduce([1.0])),
    ("all_reduce group", lambda t, m: m.all_reduce(t, group="world")),
    ("all_gather list length", lambda t, m: m.all_gather([t, t.clone()], t)),
    ("all_gather not a list", lambda t, m: m.all_gather(t, t)),
    ("broadcast src not in group", lambda t, m: m.broadcast(t, src=3)),
    ("broadcast both roots", lambda t, m: m.broadcast(t, src=0, group_src=0)),
    ("all_gather_into_tensor size", lambda t, m: m.all_gather_into_tensor(torch.zeros(3), t)),
    ("reduce_scatter_tensor dtype", lambda t, m: m.reduce_scatter_tensor(torch.zeros(4), t.long())),
    ("gather list length", lambda t, m: m.gather(t, [t, t.clone()], dst=0)),
    ("scatter src range", lambda t, m: m.scatter(t, [t], group_src=1)),
    ("all_to_all_single splits", lambda t, m: m.all_to_all_single(t, t.clone(), [5], [4])),
    ("batch not a list", lambda t, m: m.batch_isend_irecv(t)),
    ("P2POp op", lambda t, m: m.P2POp(m.broadcast, t, 0)),
]


# torch 2.9's gloo aborts the process on a reduce_scatter_tensor whose dtypes differ, where later releases raise.
_ABORTS_ON_2_9 = textwrap.dedent(
    """
    import tempfile, torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    try:
        dist.reduce_scatter_tensor(torch.zeros(4), torch.arange(4))
    except RuntimeError:
        pass
    """
)


def _skip_where_torch_aborts(case):
    if case != "reduce_scatter_tensor dtype":
        return
    probe = subprocess.run([sys.executable, "-c", _ABORTS_ON_2_9], capture_output=True, text=True, timeout=120)
    if probe.returncode < 0:
        pytest.skip(f"torch {torch.__version__}'s gloo aborts the process on reduce_scatter_tensor's dtype mismatch")


@pytest.mark.parametrize("case,call", COLLECTIVE_CASES, ids=[case[0] for case in COLLECTIVE_CASES])
def test_bad_input_to_a_collective_gets_torchs_error(one_rank_group, case, call):
    _skip_where_torch_aborts(case)
    tensor = torch.arange(4.0)
    errors = [error_of(call, tensor, module, catch=(Exception,), typed=True) for module in (dist, comm)]
    errors = [re.sub(r"\[F\d+ [\d:.]+ ", "[F", error or "") for error in errors]  # the backend's log stamp
    assert errors[0] and errors[1] == errors[0]
    assert torch.equal(tensor, torch.arange(4.0))


CASES = [
    ("staging_device non-tensor", lambda t, m: comm.staging_device([1.0]), TypeError, "tensor must be a torch.Tensor"),
    ("bind negative", lambda t, m: comm.bind(-1), ValueError, "local_rank must be a non-negative int, got -1"),
    ("bind string", lambda t, m: comm.bind("0"), ValueError, "local_rank must be a non-negative int, got '0'"),
    ("LOCAL_RANK=abc", lambda t, m: _env(m, "LOCAL_RANK", "abc", comm.bind), ValueError,
     "LOCAL_RANK='abc' is not an integer; expected a non-negative integer"),
    ("SLURM_PROCID=x", lambda t, m: _launched(m, _SRUN_PROCID_X, comm.bind),
     ValueError, "SLURM_PROCID='x' is not an integer; expected a non-negative integer"),
    ("RANK=2 of WORLD_SIZE=2", lambda t, m: _launched(m, {"RANK": "2", "WORLD_SIZE": "2"}, comm.launch_info),
     ValueError, "RANK=2 is out of range; expected RANK < WORLD_SIZE=2"),
    ("mpirun without MASTER_ADDR", lambda t, m: _launched(m, _OPENMPI_RANK_1, comm.init_process_group), ValueError,
     "MASTER_ADDR and MASTER_PORT are not set, so comm cannot tell where rank 0 of this openmpi launch listens; "
     "expected MASTER_ADDR"),
    ("COMM_DEVICE=tpu", lambda t, m: _env(m, "COMM_DEVICE", "tpu", comm.accelerator_type), ValueError,
     "COMM_DEVICE='tpu' names a device type that is not available.*expected 'cpu' or an available accelerator"),
    ("COMM_PATCH=maybe", lambda t, m: _env(m, "COMM_PATCH", "maybe", comm._patch_if_asked), ValueError,
     "COMM_PATCH='maybe' is not understood; expected 1 or 0"),
    ("COMM_PROFILE=maybe", lambda t, m: _env(m, "COMM_PROFILE", "maybe", comm.profiler.profile_if_asked), ValueError,
     "COMM_PROFILE='maybe' is not understood; expected 1 .*, all .* or 0"),
    ("default_backend type", lambda t, m: comm.default_backend(3), ValueError,
     "device_type must be a device type string such as 'cuda', got 3"),
    ("default_backend unknown", lambda t, m: comm.default_backend("tpu"), RuntimeError,
     "no collective backend available for device type 'tpu'.*pass backend= explicitly"),
    ("init_process_group backend", lambda t, m: comm.init_process_group(backend=3), TypeError,
     "backend must be a backend name such as 'nccl'"),
    ("empty_cache device", lambda t, m: comm.empty_cache("npu:x"), ValueError,
     "device must be a torch.device, a device string or an index"),
    ("clip max_norm", lambda t, m: comm.clip_grad_norm_([_param()], -1.0), ValueError,
     "max_norm must be a non-negative number, got -1.0"),
    ("clip norm_type", lambda t, m: comm.clip_grad_norm_([_param()], 1.0, norm_type="two"), TypeError,
     r"norm_type must be a number \(p > 0, 0, inf or -inf\), got 'two'"),
    ("clip parameters", lambda t, m: comm.clip_grad_norm_([1.0], 1.0), TypeError,
     "parameters must be tensors, got float"),
    ("total_norm negative p", lambda t, m: comm.total_norm([t], norm_type=-2), ValueError,
     "norm_type must be p > 0, 0, inf or -inf, got -2"),
    ("patch flag", lambda t, m: comm.patch(devices="yes"), TypeError, "devices must be a bool, got str"),
    ("simulate built-in name", lambda t, m: comm.testing.simulate_accelerator(name="cuda"), ValueError,
     "name must not be a built-in device type, got 'cuda'"),
    ("simulate device_count", lambda t, m: comm.testing.simulate_accelerator(device_count=0), ValueError,
     "device_count must be a positive int, got 0"),
]


@pytest.mark.parametrize("call, kind, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_raises_before_touching_anything(one_rank_group, monkeypatch, call, kind, message):
    tensor = torch.arange(4.0)
    with pytest.raises(kind, match=message):
        call(tensor, monkeypatch)
    assert torch.equal(tensor, torch.arange(4.0))
    assert not comm.is_patched() and torch._C._get_privateuse1_backend_name() == "privateuseone"
