"""Run a test function on N real processes: the one piece of multi-rank test machinery.

Ranks are forked from a forkserver that has already imported torch, so a scenario
costs one fork per rank rather than one interpreter start. Rendezvous is a
FileStore in a fresh temporary directory: no ports, safe under pytest-xdist.

``in_one_rank`` calls a function in a process kept for the whole test session: rank 0
of a one-rank hccl group on the simulated NPU, for tests that need no second rank and
no fresh process (each call then costs a round trip, not a process start).

``run_launched`` starts plain interpreters instead, with an environment as a launcher
(srun, mpirun) builds it: for rendezvous that comm must find on its own.

``error_of`` turns what a call raises into a message, a value a rank can return
(an exception may not survive the pickle to the parent) and a test can compare.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import multiprocessing
import os
import pickle
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Type

import pytest

_CONTEXT = multiprocessing.get_context("forkserver")
# What scenarios import, imported once by the forkserver rather than by every rank (DTensor and dynamo
# take about 1.4 and 1.2 s each here).
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
                                 "torch.distributed.checkpoint", "torch._dynamo", "comm"])

STORE_ENV = "COMM_TEST_STORE"
# The simulated accelerator most scenarios run on, and the error its backend (like
# the real hccl or nccl) raises for a CPU tensor: the second seed's.
NPU = {"name": "npu", "backend": "hccl"}
SEED_ERROR = "No backend type associated with device type cpu"


def gloo_lacks_all_to_all() -> Optional[str]:
    """Why this torch's gloo cannot run the list form of all_to_all (torch 2.9's has none), or None."""
    import datetime

    import torch
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    try:
        group.alltoall([torch.zeros(1)], [torch.zeros(1)]).wait()
    except RuntimeError as error:
        return f"torch {torch.__version__}'s gloo has no list all_to_all ({error})"
    return None


def no_cuda_errors() -> Dict[str, str]:
    """torch's errors when code written for CUDA runs where there is no CUDA, by what the code does.

    The CPU wheel has no CUDA bindings and no NCCL; a CUDA wheel (what pip installs on
    x86) finds no driver, and words the nccl error its own way from release to release.
    """
    import torch

    beside_an_npu = "RuntimeError: Invalid device, must be cuda device"  # PrivateUse1 registered: every wheel
    if torch.version.cuda is None:
        not_compiled = "AssertionError: Torch not compiled with CUDA enabled"
        return {"set_device": "AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'",
                "current_device": not_compiled, "model.cuda": not_compiled,
                "model.cuda(0)": "RuntimeError: Cannot access accelerator device when none is available.",
                "model.cuda(rank) beside an npu": beside_an_npu,
                "nccl": "RuntimeError: Distributed package doesn't have NCCL built in"}
    from comm._releases import TORCH_VERSION

    no_driver = ("RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
                 "and installed a driver from http://www.nvidia.com/Download/index.aspx")
    nccl = ("RuntimeError: nccl2 requires at least one CUDA device" if TORCH_VERSION >= (2, 15)
            else "ValueError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
    return {"set_device": no_driver, "current_device": no_driver, "model.cuda": no_driver,
            "model.cuda(0)": no_driver, "model.cuda(rank) beside an npu": beside_an_npu, "nccl": nccl}


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    backend: Optional[str] = "gloo",
    simulate: Optional[Dict[str, Any]] = None,
    args: Sequence[Any] = (),
    env: Optional[Dict[str, str]] = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    expect_dead: Sequence[int] = (),
) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    Results travel by pickle to a parent without the simulation: return plain
    values and CPU tensors, not simulated devices or tensors.

    ``simulate`` (keyword arguments of ``comm.testing.simulate_accelerator``) sets up
    the simulated accelerator in every rank, which is then bound to its rank's
    device. ``backend=None`` leaves group creation to ``fn`` (the store path is in
    ``$COMM_TEST_STORE``). Any rank's exception fails the call with every rank's
    traceback. Ranks in ``expect_dead`` (killed on purpose) report None.
    """
    if simulate is not None:
        skip_unless_simulation()
    workdir = tempfile.mkdtemp(prefix="comm-test-")
    results: "multiprocessing.Queue[Any]" = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_rank_main,
            args=(fn, rank, world_size, backend, simulate, args, env or {}, workdir, pg_timeout, results,
                  world_size - len(expect_dead)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, world_size, timeout, set(expect_dead))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
        shutil.rmtree(workdir, ignore_errors=True)


def in_one_rank(fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """Call ``fn(*args)`` in this test process's one-rank worker; return its result.

    The worker is what ``run_ranks(fn, 1, backend="hccl", simulate=NPU)`` makes of a
    rank (the simulated NPU bound to ``npu:0``, the default group on hccl), but started
    at the first call and kept for every later one: one per pytest (or xdist worker)
    process, stopped at exit, started again by the next call if it died. Results come
    back by pickle, as from ``run_ranks``: plain values and CPU tensors. An exception in
    ``fn`` fails the call with the worker's traceback; the worker carries on.

    ``fn`` must leave the worker as it found it: ``comm.unpatch()`` in a ``finally``,
    every group it made destroyed. The worker checks both after each call, fails the
    call that left either behind and puts it right, so one test cannot poison the next.
    """
    global _ONE_RANK
    skip_unless_simulation()
    if _ONE_RANK is None or not _ONE_RANK.is_alive():
        _ONE_RANK = _OneRankWorker()
    return _ONE_RANK.call(fn, args, timeout)


class _OneRankWorker:
    """The parent's end of the one-rank worker: its process, the queues to and from it, its scratch folder."""

    def __init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="comm-test-")
        self.requests: "multiprocessing.Queue[Optional[bytes]]" = _CONTEXT.Queue()
        self.replies: "multiprocessing.Queue[Tuple[bool, Any]]" = _CONTEXT.Queue()
        self.process = _CONTEXT.Process(target=_serve_one_rank, args=(self.workdir, self.requests, self.replies),
                                        daemon=True)
        self.process.start()
        atexit.register(self.stop)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def call(self, fn: Callable[..., Any], args: Sequence[Any], timeout: float) -> Any:
        # Pickled here, not by the queue's feeder thread, so that an unpicklable fn fails the test at once.
        self.requests.put(pickle.dumps((fn, tuple(args))))
        ok, value = self._reply(timeout)
        if not ok:
            raise AssertionError(f"one-rank test failed:\n{value}")
        return pickle.loads(value)

    def _reply(self, timeout: float) -> Tuple[bool, Any]:
        """The worker's answer; a worker that dies or overruns ``timeout`` is stopped, and the next call starts anew."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.replies.get(timeout=0.2)
            except queue.Empty:
                if not self.process.is_alive():
                    return False, f"the one-rank worker died (exit code {self.process.exitcode})"
        self.stop()
        return False, f"the one-rank worker did not answer within {timeout}s: stopped"

    def stop(self) -> None:
        """Ask the worker to tear its group down and exit; kill it if it does not."""
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


_ONE_RANK: Optional[_OneRankWorker] = None


def _serve_one_rank(workdir: str, requests: Any, replies: Any) -> None:
    """The worker: become the one rank, then answer each request until told to stop (None) or the world is gone."""
    import torch.distributed as dist

    try:
        _become_rank(0, 1, "hccl", NPU, {}, workdir, 60.0)
    except BaseException:  # noqa: BLE001 - the first caller reads why the worker could not start
        replies.put((False, traceback.format_exc()))
        return
    world = dist.group.WORLD
    try:
        for request in iter(requests.get, None):
            replies.put(_answer(request, world))
            if dist.group.WORLD is not world:
                return  # a call destroyed the world: this worker cannot serve the next one
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _answer(request: bytes, world: Any) -> Tuple[bool, Any]:
    """``fn(*args)``'s pickled result, or its traceback; either way, a failure if it left the worker changed."""
    try:
        fn, args = pickle.loads(request)
        ok, value = True, pickle.dumps(fn(*args))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        ok, value = False, traceback.format_exc()
    left = _put_right(world)
    if not left:
        return ok, value
    before = "" if ok else value + "\n"
    return False, before + "the call left the one-rank worker changed (put right now): " + "; ".join(left)


def _put_right(world: Any) -> List[str]:
    """What a call left changed in the worker, each undone: comm's patch, the translation, groups beside ``world``."""
    import torch.distributed as dist

    import comm
    import comm.slot
    import comm.translate

    left = []
    if comm.is_patched():
        left.append("comm is patched (call comm.unpatch() in a finally)")
        comm.unpatch()
    if comm.translate.is_installed():
        left.append("the device translation is installed")
        comm.translate.uninstall()
    if dist.group.WORLD is not world:
        left.append("the world group was destroyed or replaced (the worker stops; the next call starts another)")
        return left
    extra = [group for group in comm.slot.existing_groups() if group is not world]
    if extra:
        left.append(f"{len(extra)} process group(s) beside the world's not destroyed")
        for group in extra:
            dist.destroy_process_group(group)
    return left


def _collect(processes: List[Any], results: Any, world_size: int, timeout: float, dead: Set[int]) -> List[Any]:
    outcomes: Dict[int, Any] = {rank: (True, pickle.dumps(None)) for rank in dead}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            if any(processes[r].exitcode is not None for r in range(world_size) if r not in outcomes):
                deadline = min(deadline, time.monotonic() + 5.0)  # a rank died without a word
            continue
        outcomes[rank] = (ok, value)
        if not ok:
            deadline = min(deadline, time.monotonic() + 10.0)
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        detail = "\n".join(failures)
        if missing:
            codes = {r: processes[r].exitcode for r in missing}
            detail += f"\nranks {missing} did not report (exit codes {codes}; timeout {timeout}s)"
        raise AssertionError(f"multi-process test failed:\n{detail}")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: Optional[str],
    simulate: Optional[Dict[str, Any]],
    args: Sequence[Any],
    env: Dict[str, str],
    workdir: str,
    pg_timeout: float,
    results: Any,
    survivors: int,
) -> None:
    try:
        _become_rank(rank, world_size, backend, simulate, env, workdir, pg_timeout)
        value = fn(rank, world_size, *args)
        _wait_for_each_other(workdir, survivors)
        # Plain pickle copies tensor data; the queue's own pickler would share it
        # through a file descriptor that dies with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _become_rank(
    rank: int,
    world_size: int,
    backend: Optional[str],
    simulate: Optional[Dict[str, Any]],
    env: Dict[str, str],
    workdir: str,
    pg_timeout: float,
) -> None:
    """Make this process rank ``rank`` of ``world_size``: its environment, its simulated device, its group."""
    os.environ.update(env)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
         STORE_ENV: os.path.join(workdir, "store")}
    )
    if simulate is not None:
        import comm
        import comm.testing

        if ON_REAL_TORCH_NPU:
            importlib.import_module("torch_npu")  # on the fake CANN this process loaded (comm._cann_boot)
        else:
            comm.testing.simulate_accelerator(**simulate)
        comm.bind(rank)
    if backend is not None:
        init_group(backend, rank, world_size, pg_timeout)


def _wait_for_each_other(workdir: str, survivors: int) -> None:
    """Let no rank tear its group down while another may still be connecting to it."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(workdir, "exit"), survivors)
    if store.add("finished", 1) == survivors:
        store.set("all finished", "1")
    store.wait(["all finished"], datetime.timedelta(seconds=60))


def error_of(
    call: Callable[..., Any],
    *args: Any,
    catch: Tuple[Type[BaseException], ...] = (RuntimeError,),
    typed: bool = False,
) -> Optional[str]:
    """The message of the error ``call(*args)`` raises, or None when it returns.

    Only ``catch``'s exceptions are caught: any other fails the test as it stands.
    ``typed`` puts the exception's class before the message ("ValueError: ..."),
    for comparisons where the class matters too.
    """
    try:
        call(*args)
    except catch as error:
        return f"{type(error).__name__}: {error}" if typed else str(error)
    return None


# COMM_SIMULATE=cann: the tests that ask for the simulated NPU run on the real torch_npu over comm's fake
# CANN instead (make test-torch-npu runs a choice of them so), with its own hccl; the simulation's options
# (refusals, failure injection) do not apply there.
ON_REAL_TORCH_NPU = os.environ.get("COMM_SIMULATE", "").strip() == "cann"


def skip_unless_simulation() -> None:
    """Skip the calling test where the simulated accelerator cannot be built; else build it now.

    Its C++ core compiles once per machine, in minutes on 2 cores: longer than a
    scenario's timeout, so it is built here, before any rank starts, in a separate
    process (loading it registers the device in the loading process). Concurrent
    builds (pytest-xdist workers) wait for each other.
    """
    global _SIMULATION_BUILT
    from comm._native import SIMULATED

    if ON_REAL_TORCH_NPU:
        return

    reason = SIMULATED.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    if not _SIMULATION_BUILT and not SIMULATED.is_built():
        subprocess.run([sys.executable, "-c", "from comm._native import SIMULATED; SIMULATED.load()"], check=True)
    _SIMULATION_BUILT = True


_SIMULATION_BUILT = False


def init_group(backend: Optional[str], rank: int, world_size: int, pg_timeout: float = 60.0, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` on this scenario's FileStore."""
    import torch.distributed as dist

    dist.init_process_group(
        backend=backend,
        store=file_store(world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
        **kwargs,
    )


def file_store(world_size: int, name: str = "") -> Any:
    """This scenario's FileStore, for functions that create their group themselves.

    A ``name`` gives a separate store, for a scenario that initialises a second
    default group after destroying the first.
    """
    import torch.distributed as dist

    return dist.FileStore(os.environ[STORE_ENV] + name, world_size)


# Variables through which a launcher tells a process who it is (comm.launch reads them).
_LAUNCHER_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                             "MASTER_PORT"})
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "MV2_", "PMI_", "MPI_LOCAL", "JSM_", "LSB_")


def is_launcher_variable(name: str) -> bool:
    """Whether ``name`` is a variable that torchrun, srun, an MPI or jsrun sets for its processes."""
    return name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_PREFIXES)


def launched_by(env: Mapping[str, str], monkeypatch: Any = None) -> None:
    """Make this process's launcher variables exactly ``env``'s (through ``monkeypatch`` when given)."""
    for name in [name for name in os.environ if is_launcher_variable(name)]:
        if monkeypatch is None:
            del os.environ[name]
        else:
            monkeypatch.delenv(name)
    for name, value in env.items():
        if monkeypatch is None:
            os.environ[name] = value
        else:
            monkeypatch.setenv(name, value)


def without_launcher(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` without any launcher's variables: a process started by hand."""
    return {name: value for name, value in env.items() if not is_launcher_variable(name)}


def quiet_env(**extra: str) -> Dict[str, str]:
    """This process's environment for a child Python process, with ``extra`` added.

    Warnings are off, so that stderr holds only what the test reads, and OpenMP runs
    one thread per process, so that the ranks of a test do not fight over the cores.
    """
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra}


# Ports a test hands to its ranks come from below Linux's ephemeral range (32768 and up
# by default, /proc/sys/net/ipv4/ip_local_port_range), and above the 15000-24999 that
# Slurm job ids map to. A port the kernel hands out itself could, between our probe and
# the ranks' bind, go to another process's outgoing socket or listener: MPICH's mpiexec
# once took one for its proxies, and a rank's store client then spoke to it.
_TEST_PORTS = range(25000, 32768)


def free_port(avoid: Sequence[int] = ()) -> int:
    """A TCP port nothing on this host listens on right now, outside ``avoid``."""
    for _ in range(1000):
        port = random.choice(_TEST_PORTS)
        if port not in avoid and port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {_TEST_PORTS.start}-{_TEST_PORTS.stop - 1}")


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_launched(script: str, rank_envs: Sequence[Mapping[str, str]], timeout: float = 120.0) -> List[str]:
    """Run ``python script`` once per entry of ``rank_envs``, as a launcher would; return each stdout.

    Each process gets this process's environment without any launcher's variables,
    plus its entry of ``rank_envs``: nothing else tells it who it is. Any non-zero
    exit fails the call with every process's stderr.
    """
    base = without_launcher(quiet_env())
    processes = [subprocess.Popen([sys.executable, script], env={**base, **rank_env}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank_env in rank_envs]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()  # a rank that waits for a dead or missing peer would wait for the group timeout
            outputs.append(process.communicate())
    if any(process.returncode for process in processes):
        detail = "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{err}"
                           for i, (p, (_, err)) in enumerate(zip(processes, outputs)))
        raise AssertionError(f"launched processes failed (timeout {timeout}s):\n{detail}")
    return [stdout for stdout, _ in outputs]
