"""comm's collectives and the drop-in mode inside torch.compile'd code.

Inside a compiled function comm's calls are torch's (dynamo turns them into
functional collectives), and the staged ones reach comm's backend as eager calls
do: a group must be equipped before it is compiled against.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from test_examples import example
from torch.distributed import ReduceOp

import comm
import comm.testing

from multiproc import NPU, SEED_ERROR, error_of, gloo_lacks_all_to_all, run_ranks

pytestmark = pytest.mark.integration  # the integration tier: make test-integration

# The collectives every supported torch compiles with fullgraph=True, those it compiles
# so only with P2P compilation on (TORCHDYNAMO_ENABLE_P2P_COMPILATION=1), and those where
# torch 2.13 breaks the graph ("marked as skipped", or P2P compilation off). Later
# releases trace some of the last (torch 2.14: reduce_scatter): where torch's own call
# compiles, comm's must compile to its graph.
TRACED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
P2P = ("isend_irecv", "batch_isend_irecv")
BREAKING = ("broadcast", "reduce", "reduce_scatter", "all_to_all", "gather", "scatter", "barrier", "send_recv", *P2P)
CALLS = 3


class Counting:
    """A compile backend that runs the graph as it is and keeps each graph's code."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(_operations(gm.code))
        return gm.forward


# Lines of a graph's code that compute nothing: its signature and the input names
# (whose order is the order dynamo met the inputs), and the dead read of ``is_cpu``
# that comm.P2POp's argument check leaves when it is built inside the graph.
_NOT_OPERATIONS = re.compile(r"\s*(def |l_\w+ = L_\w+$|(getattr_\d+) = l_\w+\.is_cpu;  (l_\w+ = )?\2 = None$|$)")


def _operations(code):
    """What a graph computes, line by line."""
    return [line.strip() for line in code.splitlines() if not _NOT_OPERATIONS.match(line)]


def _computing(graphs):
    """The graphs that compute something."""
    return [graph for graph in graphs if graph != ["return ()"]]


def _calls(rank, size):
    """name -> (step(lib, *tensors), make(i) -> tensors): one call of each collective, then arithmetic."""
    def one(i):
        return [torch.arange(4.0) * (rank + 1) + i]

    def p2p(lib, t):
        if rank == 0:
            lib.send(t, dst=1)
        else:
            lib.recv(t, src=0)

    def ip2p(lib, t):
        (lib.isend(t, dst=1) if rank == 0 else lib.irecv(t, src=0)).wait()

    def batch(lib, t, u):
        ops = [lib.P2POp(lib.isend, t, 1 - rank), lib.P2POp(lib.irecv, u, 1 - rank)]
        for work in lib.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_reduce": (lambda lib, t: lib.all_reduce(t, op=ReduceOp.MAX), one),
        "all_gather": (lambda lib, t, *out: lib.all_gather(list(out), t),
                       lambda i: one(i) + [torch.zeros(4) for _ in range(size)]),
        "all_gather_into_tensor": (lambda lib, out, t: lib.all_gather_into_tensor(out, t),
                                   lambda i: [torch.zeros(4 * size)] + one(i)),
        "reduce_scatter_tensor": (lambda lib, out, t: lib.reduce_scatter_tensor(out, t),
                                  lambda i: [torch.zeros(2), torch.arange(2.0 * size) * (rank + 1) + i]),
        "all_to_all_single": (lambda lib, out, t: lib.all_to_all_single(out, t),
                              lambda i: [torch.zeros(2 * size), torch.arange(2.0 * size) + 10 * rank + i]),
        "broadcast": (lambda lib, t: lib.broadcast(t, src=0), one),
        "reduce": (lambda lib, t: lib.reduce(t, dst=0), one),
        "reduce_scatter": (lambda lib, out, *ins: lib.reduce_scatter(out, list(ins)),
                           lambda i: [torch.zeros(4)] + [torch.full((4,), float(rank + i + k)) for k in range(size)]),
        "all_to_all": (lambda lib, *ts: lib.all_to_all(list(ts[:size]), list(ts[size:])),
                       lambda i: [torch.zeros(4) for _ in range(size)]
                       + [torch.full((4,), float(10 * rank + i + k)) for k in range(size)]),
        "gather": (lambda lib, t, *out: lib.gather(t, list(out) if rank == 0 else None, dst=0),
                   lambda i: one(i) + [torch.zeros(4) for _ in range(size)]),
        "scatter": (lambda lib, t, *ins: lib.scatter(t, list(ins) if rank == 0 else None, src=0),
                    lambda i: [torch.zeros(4)] + [torch.full((4,), float(i + k)) for k in range(size)]),
        "barrier": (lambda lib, t: lib.barrier(), one),
        "send_recv": (p2p, one),
        "isend_irecv": (ip2p, one),
        "batch_isend_irecv": (batch, lambda i: one(i) + [torch.zeros(4)]),
    }


def _function(lib, step):
    def f(*tensors):
        step(lib, *tensors)
        return [t * 2 for t in tensors]

    return f


def _run(f, make, backend=None, fullgraph=True, calls=CALLS):
    """Compile ``f``, call it ``calls`` times with new values; check each call against eager ``f``.

    Returns the backend (its graphs) and the compiled outputs of the last call.
    """
    torch._dynamo.reset()
    backend = backend or Counting()
    compiled = torch.compile(f, backend=backend, fullgraph=fullgraph)
    for i in range(calls):
        compiled_in, eager_in = make(i), make(i)
        compiled_out, eager_out = compiled(*compiled_in), f(*eager_in)
        for got, want in zip([*compiled_in, *compiled_out], [*eager_in, *eager_out]):
            assert torch.equal(got.cpu(), want.cpu()), (i, got, want)
    return backend


def _fullgraph_fails(f, make):
    """The first line of why dynamo cannot compile ``f`` in one graph, or None when it can."""
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    message = error_of(compiled, *make(0), catch=(torch._dynamo.exc.Unsupported,))
    return None if message is None else message.splitlines()[0]


def _gloo_scenario(rank, world_size):
    calls = _calls(rank, world_size)
    for name in TRACED:
        _check_same_graph(*calls[name])
    if hasattr(torch._dynamo.config, "enable_p2p_compilation"):  # torch 2.9 has no P2P compilation
        with torch._dynamo.config.patch(enable_p2p_compilation=True):
            for name in P2P:
                _check_same_graph(*calls[name])
    breaks = {}
    for name in BREAKING:
        if name == "all_to_all" and gloo_lacks_all_to_all():
            breaks[name] = None  # nothing to compile against: torch's own call fails on this gloo
            continue
        step, make = calls[name]
        torch_says = _fullgraph_fails(_function(dist, step), make)
        if torch_says is None:  # this release traces it
            _check_same_graph(step, make)
            breaks[name] = None
            continue
        comm_says = _fullgraph_fails(_function(comm, step), make)
        assert comm_says is not None, name
        breaks[name] = (torch_says, comm_says)
        # Without fullgraph: as many graphs as torch's (the arithmetic after the break), compiled once.
        graphs = _computing(_run(_function(dist, step), make, fullgraph=False).graphs)
        assert _computing(_run(_function(comm, step), make, fullgraph=False).graphs) == graphs, name
    _check_groups_and_arguments(rank)
    _check_norms(rank, world_size)
    return breaks


def _check_same_graph(step, make):
    """torch compiles the call fullgraph, once for every call; comm's and the patched call compile to its graph."""
    torch_graphs = _run(_function(dist, step), make).graphs
    assert len(torch_graphs) == 1
    assert _run(_function(comm, step), make).graphs == torch_graphs
    with comm.patched():
        assert _run(_function(dist, step), make).graphs == torch_graphs


def _check_groups_and_arguments(rank):
    """Each group compiles once (its name is guarded); AVG, async and bad input behave as eagerly."""
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    backend = Counting()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, g: comm.all_reduce(t, group=g), backend=backend, fullgraph=True)
    for i in range(4):
        tensor = torch.full((3,), float(rank + i))
        compiled(tensor, groups[i % 2])
        assert torch.equal(tensor, torch.full((3,), float(2 * i + 1)))
    assert [re.findall(r"'(\d+)'\)", "\n".join(graph)) for graph in backend.graphs] == [
        [groups[0].group_name], [groups[1].group_name]]

    avg = _run(lambda t: (comm.all_reduce(t, op=ReduceOp.AVG), t)[1:], lambda i: [torch.arange(3.0) * rank + i])
    assert "'avg'" in "\n".join(avg.graphs[0])
    _run(lambda t: (comm.all_reduce(t, async_op=True).wait(), t)[1:], lambda i: [torch.arange(3.0) + rank + i],
         fullgraph=False)
    torch._dynamo.reset()
    eager = error_of(dist.all_gather_into_tensor, torch.zeros(5), torch.ones(3), catch=(Exception,), typed=True)
    compiled_bad = torch.compile(lambda o, t: comm.all_gather_into_tensor(o, t), backend="eager")
    assert eager is not None
    assert error_of(compiled_bad, torch.zeros(5), torch.ones(3), catch=(Exception,), typed=True) is not None


def _check_norms(rank, world_size):
    """total_norm and clip_grad_norm_ run in compiled code (behind a graph break) with eager's results."""
    def clip(*grads):
        parameters = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for parameter, grad in zip(parameters, grads):
            parameter.grad = grad
        norm = comm.clip_grad_norm_(parameters, 0.5, group=dist.group.WORLD)
        return [norm, comm.total_norm(grads, 3.0, group=dist.group.WORLD), *grads]

    _run(clip, lambda i: [torch.arange(4.0) * (rank + 1) + i, torch.ones(2) * i], fullgraph=False, calls=3)


def test_collectives_compile_as_torch_does_on_gloo():
    """fullgraph wherever torch's own call compiles, with torch's graph; one graph break where torch breaks."""
    breaks = run_ranks(_gloo_scenario, 2, timeout=600)[0]
    assert set(breaks) == set(BREAKING)


def _hccl_scenario(rank, world_size):
    device = torch.device("npu", rank)
    with pytest.raises(Exception, match=SEED_ERROR):  # what torch alone does with a CPU tensor
        torch._dynamo.reset()
        torch.compile(lambda t: dist.all_reduce(t), backend="eager", fullgraph=True)(torch.ones(2))
    comm.equip()
    backends = {}
    for backend in ("eager", "aot_eager"):
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            step, make = _calls(rank, world_size)[name]
            comm.testing.reset_counters()
            graphs = _run(_function(comm, step), make, backend=_counting(backend)).graphs
            assert len(graphs) == 1, (backend, name)
            # One copy onto the NPU and one back per call, compiled as eagerly: 4 per pair of calls.
            assert comm.testing.counters()["transfers"] == 4 * CALLS, (backend, name)
        # AVG of staged tensors: comm's backend runs it as SUM then divide, behind the graph's op.
        graphs = _run(lambda t: (comm.all_reduce(t, op=ReduceOp.AVG), t)[1:],
                      lambda i: [torch.arange(3.0) * rank + i], backend=_counting(backend)).graphs
        assert len(graphs) == 1 and "'avg'" in "\n".join(graphs[0])
        with comm.patched():
            graphs = _run(lambda t: (dist.all_reduce(t), t)[1:], lambda i: [torch.arange(3.0) + rank + i],
                          backend=_counting(backend)).graphs
        assert len(graphs) == 1
        backends[backend] = "ok"
    # Served (NPU) tensors: torch's own graph.
    step, make = _calls(rank, world_size)["all_reduce"]
    npu_make = lambda i: [t.to(device) for t in make(i)]  # noqa: E731
    assert _run(_function(comm, step), npu_make).graphs == _run(_function(dist, step), npu_make).graphs
    backends["inductor"] = _inductor_on_npu(step, make, npu_make)
    _check_norms(rank, world_size)  # CPU gradients on the hccl group: staged by the eager call at the break
    with comm.patched():
        _check_training_steps(rank, world_size)
    return backends


def _train(backend, rank, world_size, steps=3):
    """Losses, final parameters and staged all_reduce calls of a few steps, compiled with ``backend`` (or eager)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train_step = example("legacy_trainer").train_step

    def step(inputs):
        return train_step(model, optimizer, inputs, world_size)

    torch._dynamo.reset()
    comm.reset_stats()
    run = torch.compile(step, backend=backend) if backend else step
    losses = [run(torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * i + rank))) for i in range(steps)]
    return losses, [parameter.detach().clone() for parameter in model.parameters()], \
        comm.stats()["all_reduce"]["staged_calls"]


def _aot_eager_is_bitwise_without_collectives():
    """Whether this torch's aot_eager gives eager's values bit for bit on the step's arithmetic alone (torch 2.9's
    decompositions do not: its compiled SGD step differs from eager in the last bit)."""
    def step(model, optimizer, inputs):
        loss = torch.nn.functional.mse_loss(model(inputs), inputs.prod(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    outcomes = []
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        run = torch.compile(step, backend=backend) if backend else step
        outcomes.append([run(model, optimizer, torch.randn(8, 4, generator=torch.Generator().manual_seed(i)))
                         for i in range(3)][-1])
    return all(torch.equal(a, b) for a, b in zip(*outcomes))


def _check_training_steps(rank, world_size):
    """examples/legacy_trainer.py's steps (torch's all_reduce of CPU gradients, torch's clip) compiled with aot_eager
    give eager's losses and parameters bit for bit where torch's own compilation does, staging as many calls."""
    eager_losses, eager_parameters, eager_staged = _train(None, rank, world_size)
    compiled_losses, compiled_parameters, compiled_staged = _train("aot_eager", rank, world_size)
    same = torch.equal if _aot_eager_is_bitwise_without_collectives() else torch.allclose
    assert all(same(a, b) for a, b in zip(eager_losses, compiled_losses)), (eager_losses, compiled_losses)
    assert all(same(a, b) for a, b in zip(eager_parameters, compiled_parameters))
    assert compiled_staged == eager_staged == 3 * 5  # per step: 4 gradients and the metric


def _counting(backend):
    """``backend``, counting the graphs it compiles."""
    counting = Counting()

    def run(gm, example_inputs):
        counting(gm, example_inputs)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    run.graphs = counting.graphs
    return run


def _inductor_on_npu(step, make, npu_make):
    """What inductor does with torch's graph of NPU tensors, and with comm's of CPU tensors staged in c10d."""
    outcomes = {}
    for label, lib, inputs in (("npu", dist, npu_make), ("staged", comm, make)):
        torch._dynamo.reset()
        compiled = torch.compile(_function(lib, step), backend="inductor", fullgraph=True)
        message = error_of(compiled, *inputs(0), catch=(Exception,), typed=True)  # the outcome is what is compared
        outcomes[label] = "ok" if message is None else message.splitlines()[0]
    return outcomes


def test_staging_path_compiles_on_simulated_hccl():
    """CPU tensors on the hccl group: the copies, the collective and the write-back in one graph; a
    training step of CPU gradients compiled under the patch."""
    backends = run_ranks(_hccl_scenario, 2, backend=NPU["backend"], simulate=NPU, timeout=600)[0]
    assert backends["eager"] == backends["aot_eager"] == "ok"
    # The simulated device has no inductor code generator; a staged graph holds only CPU tensors.
    assert backends["inductor"] == {"npu": "InductorError: KeyError: 'npu'", "staged": "ok"}


IMPORT_COMM = """
import sys, torch, torch.distributed as dist
import comm
assert "torch._dynamo" not in sys.modules, "import comm must not import dynamo"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
torch.compile(lambda t: comm.all_reduce(t, op=dist.ReduceOp.AVG), backend="eager", fullgraph=True)(t)
assert torch.equal(t, torch.ones(3))
print("compiled")
"""


def test_import_comm_leaves_dynamo_unimported_and_compiles():
    result = subprocess.run([sys.executable, "-c", IMPORT_COMM], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr
