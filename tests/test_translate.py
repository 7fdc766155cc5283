"""comm.translate on a CPU-only process: CUDA-only calls act on the CPU, and unpatching puts torch back."""

import io
import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import comm
from comm import translate
from comm.translate import calls as translate_calls
from comm.translate import core as translate_core
from comm.translate import cuda as translate_cuda

from multiproc import error_of, in_one_rank, no_cuda_errors, quiet_env


@pytest.fixture
def translated():
    """comm.patch() for one test, with every note logged again."""
    translate_core.NOTED.clear()
    comm.patch()
    assert translate.is_installed()
    yield
    comm.unpatch()


def _under_python_m_comm(tmp_path, source, *options):
    """Run ``source`` as a script under ``python -m comm [options]``."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "comm", *options, str(script)], capture_output=True, text=True,
                          env=quiet_env(), timeout=300)


def _seed_lines(tmp_path):
    """The first seed's entry point, one process: every line that names CUDA."""
    seen = {}
    for name, line in [
        ("set_device", lambda: torch.cuda.set_device(0)),
        ("current_device", torch.cuda.current_device),
        ("init_process_group", lambda: dist.init_process_group(
            backend="nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)),
        ("model.cuda", lambda: torch.nn.Linear(2, 2).cuda()),
        ("model.cuda(0)", lambda: torch.nn.Linear(2, 2).cuda(0)),
    ]:
        seen[name] = error_of(line, catch=(RuntimeError, AttributeError, AssertionError, ValueError), typed=True)
    return seen


def test_the_seed_fails_without_comm_and_runs_on_the_cpu_under_it(tmp_path):
    errors = no_cuda_errors()
    assert _seed_lines(tmp_path) == {
        "set_device": errors["set_device"],
        "current_device": errors["current_device"],
        "init_process_group": errors["nccl"],
        "model.cuda": errors["model.cuda"],
        "model.cuda(0)": errors["model.cuda(0)"],
    }
    (tmp_path / "store").unlink(missing_ok=True)
    with comm.patched():
        assert set(_seed_lines(tmp_path).values()) == {None}
        try:
            assert dist.get_backend() == "gloo"
            total = torch.ones(2).cuda(0)
            dist.all_reduce(total)
            assert total.device == torch.device("cpu") and total.tolist() == [1.0, 1.0]
            with torch.cuda.device(torch.device("cuda", 0)):
                torch.cuda.empty_cache()
        finally:
            dist.destroy_process_group()


def _asked_from(module, filename):
    """(is_available(), device_count()) as code of ``module``, in ``filename``, is answered."""
    scope = {"__name__": module, "torch": torch}
    exec(compile("answer = (torch.cuda.is_available(), torch.cuda.device_count())", filename, "exec"), scope)
    return scope["answer"]


def test_policy_user_code_takes_its_cuda_branch_libraries_do_not(translated, launched, tmp_path):
    assert torch.cuda.is_available() is True
    assert torch.cuda.device_count() == (__import__("os").cpu_count() or 1)  # no launcher: one per core
    launched({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert torch.cuda.device_count() == 2  # one "device" per local rank
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    answers = {
        # torch's own modules (DeviceMesh, dynamo, inductor, DataLoader) and comm get the truth ...
        "torch.distributed.device_mesh": _asked_from("torch.distributed.device_mesh", torch.__file__),
        "comm.slot": _asked_from("comm.slot", comm.__file__),
        # ... and so do installed libraries (torchao's capability switches, transformers) and the standard library
        "torchao.utils": _asked_from("torchao.utils", str(site / "torchao" / "utils.py")),
        "transformers": _asked_from("transformers.utils.import_utils", str(tmp_path / "dist-packages" / "t.py")),
        "json": _asked_from("json", __import__("json").__file__),
        # the device-selection frameworks, which then run on the device through torch.cuda, see True
        "lightning": _asked_from("lightning.fabric.accelerators.cuda", str(site / "lightning" / "cuda.py")),
        # ... but not torch's own test helpers (skip_if_lt_x_gpu) on this CPU-only process, nor torch.testing
        "torch.testing._internal": _asked_from("torch.testing._internal.common_distributed", torch.__file__),
        "torch.testing": _asked_from("torch.testing._comparison", torch.__file__),
        # the user's script and its own modules (wherever they are), and code typed in, see True
        "__main__": _asked_from("__main__", str(tmp_path / "train.py")),
        "models": _asked_from("models.llama", str(tmp_path / "models" / "llama.py")),
        "<stdin>": _asked_from("__main__", "<stdin>"),
    }
    truth, told = (False, 0), (True, 2)
    assert answers == {"torch.distributed.device_mesh": truth, "comm.slot": truth, "torchao.utils": truth,
                       "transformers": truth, "json": truth, "lightning": told, "torch.testing._internal": truth,
                       "torch.testing": truth, "__main__": told, "models": told, "<stdin>": told}


def _run_skip_if_lt_x_gpu(helper) -> str:
    """What torch's ``skip_if_lt_x_gpu(2)`` does with a test method: "ran", or the skip it reports."""
    class Case:
        def _handle_test_skip(self, message):
            self.skipped = message

    case = Case()
    try:
        outcome = helper(2)(lambda self: "ran")(case)
    except SystemExit as exit_:
        return f"exit {exit_.code}"
    return f"skipped: {case.skipped}" if hasattr(case, "skipped") else outcome


def test_torchs_test_helpers_see_no_gpu_on_a_cpu_only_process(launched):
    """torch's skip_if_lt_x_gpu under the translation, on this CPU-only process, skips as without comm.

    Told the CPU's stand-in count, it ran torch's GPU-only tests on the CPU, where they fail
    (DistributedTest's test_monitored_barrier_allreduce_hang; tests/test_patch.py runs it).
    """
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu

    launched({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    plainly = _run_skip_if_lt_x_gpu(skip_if_lt_x_gpu)
    comm.patch()
    try:
        translated = _run_skip_if_lt_x_gpu(skip_if_lt_x_gpu)
    finally:
        comm.unpatch()
    assert plainly != "ran"  # told the truth (no CUDA), it skips the test
    assert translated == plainly


def _skip_if_lt_x_gpu_patched():
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu

    comm.patch()
    try:
        return _run_skip_if_lt_x_gpu(skip_if_lt_x_gpu)
    finally:
        comm.unpatch()


def test_torchs_test_helpers_count_the_accelerators_devices():
    """Where the process has an accelerator (the simulated NPU's 8 devices), torch's skip_if_lt_x_gpu(2) counts
    them and runs the test: through torch.cuda's translation up to torch 2.14, through torch.accelerator on 2.15."""
    assert in_one_rank(_skip_if_lt_x_gpu_patched) == "ran"


def test_stand_ins_for_classes_are_classes(translated):
    import inspect

    for name, value in vars(translate_cuda.stand_in()).items():
        if inspect.isclass(getattr(translate_cuda._REAL, name, None)):
            assert inspect.isclass(value), name
    # transformers 5.x, at import: a module-level annotation and a default
    optional = torch.cuda.Stream | None
    assert optional == (torch.cuda.Stream | None) and torch.cuda.Event | None is not None

    def step(stream: torch.cuda.Stream | None = None) -> None:
        pass

    assert step.__annotations__["stream"] == optional
    stream, event = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
    assert isinstance(stream, torch.cuda.Stream) and isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
    assert isinstance(event, torch.cuda.Event) and not isinstance(stream, torch.cuda.Event)
    assert not isinstance(torch.ones(1), torch.cuda.Stream)

    class Side(torch.cuda.Stream):
        pass

    side = Side(priority=-1)
    assert type(side) is Side and isinstance(side, torch.cuda.Stream) and side.device == torch.device("cpu")
    assert isinstance(torch.cuda.device(0), torch.cuda.device) and isinstance(torch.cuda.nvtx, type(sys))


def test_capability_queries_answer_as_cudas_do(translated):
    # torchao at import: True and an index into the capability, which must not raise
    assert (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10) is False
    assert torch.cuda.get_device_capability(0) == translate_cuda.NO_CAPABILITY == (0, 0)
    properties = torch.cuda.get_device_properties(0)
    cuda_fields = {"name", "major", "minor", "multi_processor_count", "total_memory", "is_integrated",
                   "is_multi_gpu_board", "max_threads_per_multi_processor", "gcnArchName", "warp_size", "uuid",
                   "L2_cache_size"}
    assert {name: hasattr(properties, name) for name in cuda_fields} == dict.fromkeys(cuda_fields, True)
    assert (properties.major, properties.minor, properties.gcnArchName) == (0, 0, "")
    assert properties.total_memory > 0 and properties.multi_processor_count >= 1
    assert torch.cuda.get_arch_list() == [] and torch.cuda.is_bf16_supported() is True
    assert isinstance(torch.cuda.get_device_name(), str) and torch.cuda.memory_stats() == {}


@pytest.mark.integration
def test_a_script_annotating_cuda_streams_runs_under_python_m_comm(tmp_path):
    """The shape of transformers 5.x's import: an annotation evaluated at module level, then an isinstance check."""
    run = _under_python_m_comm(
        tmp_path,
        "import torch\n"
        "class Cache:\n"
        "    stream: torch.cuda.Stream | None = None\n"
        "print('stream', isinstance(torch.cuda.Stream(), torch.cuda.Stream), torch.cuda.get_device_capability())\n",
    )
    assert run.returncode == 0, run.stderr
    assert "stream True (0, 0)" in run.stdout


def test_device_arguments_become_the_cpu(translated):
    cpu = torch.device("cpu")
    x = torch.ones(2)
    for device in ["cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 1), 0, 1]:
        assert torch.device(translate.translated_device(device)) == cpu
        assert x.to(device).device == cpu and x.to(device=device).device == cpu
        assert torch.zeros(2, device=device).device == cpu
        assert torch.nn.Linear(2, 2).to(device).weight.device == cpu
    assert x.cuda().device == cpu and x.cuda(1, non_blocking=True).device == cpu
    assert torch.nn.Linear(2, 2).cuda(1).weight.device == cpu
    assert torch.tensor([1.0], device="cuda").device == cpu and torch.full((2,), 1.0, device="cuda:0").device == cpu
    assert torch.empty(2, pin_memory=True).device == cpu and x.pin_memory() is x
    assert x.new_zeros(2, device="cuda").device == cpu and x.new_tensor([1.0], device="cuda:1").device == cpu
    torch.set_default_device("cuda")
    try:
        assert torch.empty(1).device == cpu
    finally:
        torch.set_default_device(None)
    # Devices that are not CUDA's pass unchanged, as the same object.
    for device in ["cpu", cpu, "meta"]:
        assert translate.translated_device(device) is device


def test_parse_to_reads_a_cuda_device_as_tensor_to_does(translated):
    """``torch._C._nn._parse_to``, with which ``Module.to`` and libraries (tensordict's ``TensorDict.to``) read
    ``.to``'s arguments: CUDA's devices and integers become the CPU, anything else is torch's own answer."""
    parse_to = torch._C._nn._parse_to
    original = getattr(parse_to, "__wrapped__", parse_to)  # torch's own, which comm's stand-in calls
    cpu = torch.device("cpu")
    for device in ["cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 1), 0, 1]:
        assert parse_to(device) == (cpu, None, False, None)
        assert parse_to(device, torch.float64, True) == (cpu, torch.float64, True, None)
        assert parse_to(device=device, dtype=torch.float16, memory_format=torch.channels_last) == \
            (cpu, torch.float16, False, torch.channels_last)
    assert parse_to is not original and parse_to.__name__ == "_parse_to"
    # What it fixes: torch reads 0 as an accelerator (a CUDA wheel says cuda:0; a CPU wheel of 2.13 raises).
    assert error_of(original, 0, catch=(RuntimeError,)) is not None or original(0)[0].type != "cpu"
    other = torch.zeros(1, dtype=torch.int64)
    for args, kwargs in [(("meta",), {}), (("cpu",), {}), ((torch.float16,), {}), ((other,), {}), ((None,), {}),
                         ((), {}), ((torch.device("meta"), torch.float64), {"non_blocking": True}),
                         ((), {"device": "meta", "memory_format": torch.channels_last}), ((True,), {})]:
        assert parse_to(*args, **kwargs) == original(*args, **kwargs), (args, kwargs)
    for bad in [("cudax",), ("cpu", "cuda"), (torch.float16, torch.float16)]:
        assert error_of(parse_to, *bad, catch=(RuntimeError, TypeError), typed=True) == \
            error_of(original, *bad, catch=(RuntimeError, TypeError), typed=True) is not None
    with torch.device("meta"):  # a torch function mode hands the call to the stand-in
        assert parse_to("cuda:1") == (cpu, None, False, None) and parse_to("cpu") == original("cpu")


def test_an_unknown_device_string_gets_torchs_own_error(translated):
    bad = ["cudax", "cuda:x", "cuda:-2", "cuda:1:2"]

    def errors():
        return ([error_of(lambda d: torch.zeros(1, device=d), device) for device in bad],
                [error_of(lambda d: torch.ones(1).to(d), device) for device in bad])

    comm.unpatch()
    expected = errors()
    comm.patch()
    assert None not in expected[0] + expected[1]
    assert errors() == expected


def test_backend_strings():
    cases = {"nccl": "gloo", "NCCL": "gloo", "cuda:nccl": "cpu:gloo", "cpu:gloo,cuda:nccl": "cpu:gloo",
             "cuda:nccl,cpu:gloo": "cpu:gloo", "gloo": "gloo", "mpi": "mpi", dist.Backend.NCCL: "gloo", None: None}
    assert {given: translate_calls.translated_backend(given) for given in cases} == cases


def _torch_objects():
    import torch.amp.grad_scaler
    import torch.distributed.device_mesh
    import torch.utils.data
    from torch.amp.autocast_mode import autocast
    from torch.nn.parallel import DistributedDataParallel

    return {
        "torch.cuda": torch.cuda, "sys.modules": sys.modules["torch.cuda"],
        "Tensor": {name: torch.Tensor.__dict__.get(name) for name in ("to", "cuda", "pin_memory")},
        "Module.to": torch.nn.Module.__dict__["to"], "_parse_to": torch._C._nn._parse_to,
        "DDP": DistributedDataParallel.__dict__["__init__"],
        "DataLoader": torch.utils.data.DataLoader.__dict__["__init__"],
        "autocast": autocast.__dict__["__init__"], "GradScaler": torch.amp.grad_scaler.GradScaler.__dict__["__init__"],
        "factories": {name: getattr(torch, name) for name in translate_calls.factory_names()},
        "dist": [dist.init_process_group, dist.new_group, dist.distributed_c10d.init_process_group,
                 torch.distributed.device_mesh.init_device_mesh],
        "load": [torch.load, torch.serialization.load],
    }


def test_unpatch_restores_torchs_exact_objects():
    before = _torch_objects()
    assert before["Tensor"] == {"to": None, "cuda": None, "pin_memory": None}  # inherited from TensorBase
    assert len(before["factories"]) > 40 and "zeros" in before["factories"]
    with comm.patched():
        during = _torch_objects()
        assert during["torch.cuda"] is during["sys.modules"] is not before["torch.cuda"]
        for key in ("Module.to", "_parse_to", "DDP", "DataLoader", "autocast", "GradScaler"):
            assert during[key] is not before[key], key
        assert all(during["factories"][name] is not before["factories"][name] for name in before["factories"])
        with comm.patched():  # nested: the outer block's translation stays
            pass
        assert translate.is_installed()
    after = _torch_objects()
    assert after == before and after["torch.cuda"] is before["torch.cuda"]
    assert all(after["factories"][name] is before["factories"][name] for name in before["factories"])
    assert "to" not in torch.Tensor.__dict__


def test_switching_it_off(monkeypatch):
    with pytest.raises(TypeError, match="devices must be a bool"):
        comm.patch(devices="yes")
    with comm.patched(devices=False):
        assert not translate.is_installed() and not isinstance(torch.cuda, translate_cuda.CudaStandIn)
        assert error_of(torch.cuda.set_device, 0, catch=(AttributeError, RuntimeError), typed=True) == \
            no_cuda_errors()["set_device"]
    monkeypatch.setenv("COMM_TRANSLATE", "0")
    with comm.patched():
        assert comm.is_patched() and not translate.is_installed()
    monkeypatch.setenv("COMM_TRANSLATE", "maybe")
    with pytest.raises(ValueError, match="COMM_TRANSLATE='maybe' is not understood"):
        comm.patch()
    comm.unpatch()


@pytest.mark.integration
def test_python_m_comm_no_devices(tmp_path):
    source = "import torch\ntorch.cuda.set_device(0)\nprint('bound', torch.ones(1).cuda().device)\n"
    translated_run = _under_python_m_comm(tmp_path, source)
    assert translated_run.returncode == 0 and "bound cpu" in translated_run.stdout, translated_run.stderr
    untranslated = _under_python_m_comm(tmp_path, source, "--no-devices")
    assert untranslated.returncode != 0 and no_cuda_errors()["set_device"] in untranslated.stderr


def test_a_cuda_process_is_untouched(monkeypatch):
    """What a CUDA machine reports, stubbed at the two probes translate asks (NVML's count, the build)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)

    def initialises_cuda():
        raise AssertionError("patch() asked torch.cuda.is_available(), which starts CUDA's driver")

    monkeypatch.setattr(torch.cuda, "is_available", initialises_cuda)
    assert translate.cuda_present()
    before = _torch_objects()
    with comm.patched():
        assert comm.is_patched() and not translate.is_installed()
        assert _torch_objects() == before and torch.cuda is before["torch.cuda"]
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0)  # a CUDA wheel on a machine without a GPU
    assert not translate.cuda_present()
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # NVML cannot be asked: the runtime is
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert translate.cuda_present()


def test_each_kind_logs_one_info_line(translated, caplog):
    with caplog.at_level(logging.INFO, logger="comm.translate"):
        for _ in range(3):
            torch.ones(2).to("cuda")
            torch.zeros(2, device="cuda:0")
            torch.cuda.set_device(0)
    lines = [record.getMessage() for record in caplog.records if record.name == "comm.translate"]
    assert lines == [
        "comm translated Tensor.to(device='cuda') into device='cpu'",
        "comm translated torch.zeros(device='cuda:0') into device='cpu'",
        "comm translated torch.cuda.set_device(0) into nothing (no accelerator: the CPU)",
    ]


def test_amp_runs_on_the_cpu(translated):
    x = torch.ones(4, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp's deprecation
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            assert (x @ x).dtype == torch.bfloat16
        scalers = [torch.amp.GradScaler("cuda"), torch.amp.GradScaler(), torch.cuda.amp.GradScaler()]
    # Off CUDA torch disables them (fp16 trains unscaled); translated, they scale on the CPU.
    assert [scaler.is_enabled() for scaler in scalers] == [True, True, True]
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.5)
    scalers[0].scale(parameter.sum()).backward()
    scalers[0].step(optimizer)
    scalers[0].update()
    assert parameter.tolist() == [0.5, 0.5]


def _checkpoint_saved_on_cuda():
    """The bytes of torch.save({"w": tensor}) on cuda:1, made on a CPU build by tagging the storage cuda:1."""
    registry = torch.serialization._package_registry
    tagger = (999, lambda storage: "cuda:1", lambda storage, location: None)
    registry.insert(0, tagger)
    try:
        buffer = io.BytesIO()
        torch.save({"w": torch.arange(4.0)}, buffer)
    finally:
        registry.remove(tagger)
    return buffer.getvalue()


def test_torch_load_of_a_cuda_checkpoint(translated):
    saved = _checkpoint_saved_on_cuda()
    comm.unpatch()
    assert "on a CUDA device but torch.cuda.is_available() is False" in error_of(torch.load, io.BytesIO(saved))
    comm.patch()
    for map_location in [None, "cuda:0", torch.device("cuda", 1), {"cuda:1": "cuda:0"}, {"cuda:7": "cpu"},
                         lambda storage, location: None]:
        loaded = torch.load(io.BytesIO(saved), map_location=map_location)
        assert loaded["w"].device == torch.device("cpu") and loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torchscript_compiles_what_calls_the_factories(translated):
    @torch.jit.script
    def made(n: int) -> torch.Tensor:
        return torch.zeros(n) + torch.ones(n, device=torch.device("cpu"))

    assert made(3).tolist() == [1.0, 1.0, 1.0]


def test_torch_cuda_on_the_cpu(translated):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    torch.cuda.manual_seed(123)
    torch.cuda.manual_seed_all(123)  # the CPU generator is not reseeded
    assert torch.equal(torch.rand(3), expected)
    assert [torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(0), torch.cuda.memory_reserved()] == [0] * 3
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total
    assert isinstance(torch.cuda.get_device_name(0), str) and torch.cuda.get_device_properties(0).total_memory == total
    assert torch.cuda.is_bf16_supported() and torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.device(1), torch.cuda.nvtx.range("step"):
        torch.cuda.nvtx.range_push("inner")
        torch.cuda.nvtx.range_pop()
        torch.cuda.current_stream().synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert start.query() and 0 <= start.elapsed_time(end) < 1000
    assert torch.cuda.get_device_capability() == (0, 0)
    torch.cuda.set_device("cuda:1")
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)


def test_pinned_data_loader_on_the_cpu(translated):
    from torch.utils.data import DataLoader, TensorDataset

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even torch's "pin_memory set but no accelerator"
        (batch,) = next(iter(DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2, pin_memory=True)))
    assert batch.cuda(non_blocking=True).shape == (2, 2)


@pytest.mark.cuda
def test_on_a_gpu_nothing_is_translated(tmp_path):
    """`make gpu-check`: a script run under python -m comm on a real GPU is exactly torch."""
    run = _under_python_m_comm(
        tmp_path,
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.INFO)  # a translation would log its line here\n"
        "import comm\n"
        "real = sys.modules['torch.cuda'].__class__ is type(sys)\n"
        "torch.cuda.set_device(0)\n"
        "x = torch.ones(2).cuda()\n"
        "y = torch.zeros(2, device='cuda:0').to(torch.device('cuda', 0))\n"
        "print('translated', comm.translate.is_installed(), 'real torch.cuda', real,\n"
        "      'Tensor.to replaced', 'to' in torch.Tensor.__dict__, 'devices', x.device, y.device,\n"
        "      'available', torch.cuda.is_available())\n",
    )
    assert run.returncode == 0, run.stderr
    assert ("translated False real torch.cuda True Tensor.to replaced False devices cuda:0 cuda:0 available True"
            in run.stdout), run.stdout
    assert "comm translated" not in run.stderr
    from test_examples import EXAMPLES, _torchrun

    trainer = _torchrun("--standalone", "--nproc-per-node", "1", "-m", "comm", str(EXAMPLES / "cuda_trainer.py"),
                        "--epochs", "1")
    assert trainer.returncode == 0, trainer.stderr
    assert "model on cuda:0, backend nccl" in trainer.stdout and "rank 0: all_reduce sum 1" in trainer.stdout


@pytest.mark.integration
def test_multiprocessing_spawn_children_run_patched(tmp_path):
    """A plain multiprocessing child (spawn start method) of a script under python -m comm is patched too."""
    run = _under_python_m_comm(
        tmp_path,
        "import multiprocessing, torch\n"
        "def child(queue):\n"
        "    import comm\n"
        "    queue.put((comm.is_patched(), str(torch.ones(1).cuda().device)))\n"
        "if __name__ == '__main__':\n"
        "    context = multiprocessing.get_context('spawn')\n"
        "    queue = context.Queue()\n"
        "    process = context.Process(target=child, args=(queue,))\n"
        "    process.start()\n"
        "    print('child', queue.get(timeout=60))\n"
        "    process.join()\n",
    )
    assert run.returncode == 0, run.stderr
    assert "child (True, 'cpu')" in run.stdout


def test_no_stand_in_torch_npu_where_the_real_one_can_be_imported(monkeypatch):
    import importlib.machinery
    import importlib.util

    from comm.testing import _torch_npu

    real = importlib.machinery.ModuleSpec("torch_npu", None, origin="/site-packages/torch_npu/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: real if name == "torch_npu" else None)
    assert _torch_npu.install() is False and "torch_npu" not in sys.modules


def test_the_stand_in_lists_torchs_names_too(translated):
    names = dir(torch.cuda)
    assert {"set_device", "amp", "FloatTensor", "nvtx"} <= set(names)
    assert torch.cuda.amp is sys.modules["torch.cuda.amp"]
    assert torch.cuda.FloatTensor is translate_cuda._REAL.FloatTensor  # not translated: torch's own


@pytest.mark.integration
def test_starting_the_simulation_without_editing_the_script_refuses_bad_names():
    bad = subprocess.run([sys.executable, "-c", "import comm"], capture_output=True, text=True,
                         env=quiet_env(COMM_SIMULATE="npu:hccl:x"), timeout=120)
    assert bad.returncode != 0 and "COMM_SIMULATE='npu:hccl:x' is not a device type" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "comm", "--simulate"], capture_output=True, text=True,
                             env=quiet_env(), timeout=120)
    assert missing.returncode != 0 and "--simulate needs an accelerator name" in missing.stderr


def test_generator_stands_in_as_a_class(translated):
    """torch.Generator("cuda") is torch's own generator of the target; every torch generator is a torch.Generator."""
    import pickle

    made = torch.Generator("cuda")
    assert type(made) is torch._C.Generator and made.device == torch.device("cpu")
    assert isinstance(made, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    plain = torch._C.Generator().manual_seed(1)
    assert torch.rand(2, generator=made.manual_seed(1)).equal(torch.rand(2, generator=plain))

    class Seeded(torch.Generator):
        pass

    assert isinstance(Seeded("cuda:0"), Seeded) and Seeded("cuda:0").device == torch.device("cpu")
    assert pickle.loads(pickle.dumps(made)).device == torch.device("cpu")
