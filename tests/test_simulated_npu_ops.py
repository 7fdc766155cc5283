"""Every operator of torch's OpInfo database on the simulated NPU, against the CPU (issue 34).

The simulated NPU runs operators with the CPU's kernels (comm/testing/csrc/device.cpp),
so each op's sample inputs (``op.sample_inputs``) in every dtype the CPU runs it in, made
on ``npu`` and run there and, copied, on the CPU, must give the CPU's results, on the
device, and the CPU's input gradients where the CPU has the op's backward in that dtype.
Random ops compare by value (both runs start from one seed; the device draws from the
CPU's generator), ops returning uninitialised memory by everything but their values.
What cannot run, or computes other values by torch's own choice, is in ``CANNOT_RUN``,
with why; the tests fail when an op outside it fails, and when an op in it runs, so the
table stays honest (docs/simulated-npu.md reports it, and a test holds the page to it).
``make test`` runs a fast subset (``FAST``); the whole database is the integration tier
(``make test-integration``), in two processes of its own.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from multiproc import NPU, error_of, in_one_rank, run_ranks

# Ops that do not run on the simulated NPU as on the CPU: op (name, then ``.variant``) ->
# (what fails, the dtypes it fails in, or "every dtype", why). "forward": the op itself;
# "backward": its forward matches and its input gradients do not.
EVERY_DTYPE = "every dtype"
SPARSE = "sparse layouts: the simulated device's tensors are strided only (it registers no sparse kernels)"
# torch/nn/modules/linear_cross_entropy_options.py, _resolve_auto_acc_dtype: acc_policy "auto" accumulates
# float16 and bfloat16 in float32 on the CPU (and on CUDA from sm 7.0 or 8.0), in the input's dtype elsewhere.
TORCH_ACCUMULATES = ("torch's choice by device type: the chunked path accumulates in float32 on the CPU and in the "
                     "input's dtype on devices other than CUDA (an NPU too, as torch's code reads; whether torch_npu "
                     "changes that is not checked), so the values differ by rounding")
CANNOT_RUN: Dict[str, Tuple[str, str, str]] = {
    # Which of the two a rounding difference shows in first depends on the samples' random values.
    "nn.functional.linear_cross_entropy.chunked": ("forward or backward", "bfloat16, float16", TORCH_ACCUMULATES),
    "nn.functional.linear_cross_entropy.chunked_none": ("forward", "bfloat16, float16", TORCH_ACCUMULATES),
    "sparse.mm.reduce": ("forward", EVERY_DTYPE, SPARSE + "; a CSR sample cannot be made on it"),
    "sparse.sampled_addmm": ("forward", EVERY_DTYPE, SPARSE + "; a CSR sample cannot be made on it"),
    "to_sparse": ("forward", EVERY_DTYPE, SPARSE + "; a COO result cannot be handed back to it"),
}

# Ops whose values the CPU and the device cannot agree on, uninitialised memory: compared by
# dtype, shape, strides and device only.
UNINITIALISED = {
    "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided",
}

# make test's subset, in float32: the ops on the *_overrideable routes (every convolution,
# attention), a sample of each family (pointwise, reductions, norms, views, indexing, linear
# algebra, nn, random, uninitialised, device-crossing), what device.cpp fixed for op_db (sgn's
# gradient is a zero tensor; layer and group norm run the CPU's kernels, not a composite), and
# one op CANNOT_RUN lists; then FAST_DTYPES.
FAST_FLOAT32 = [
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d", "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d", "nn.functional.conv_transpose3d", "nn.functional.scaled_dot_product_attention",
    "add", "mul", "div.no_rounding_mode", "sin", "exp", "sigmoid", "sgn", "where", "clamp", "pow",
    "sum", "mean", "amax", "std", "cumsum", "softmax",
    "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.batch_norm",
    "view", "reshape", "transpose", "as_strided", "cat", "stack", "chunk", "expand",
    "index_select", "index_put", "__getitem__", "scatter_add", "gather", "masked_fill", "nonzero", "sort",
    "matmul", "addmm", "linalg.solve", "linalg.svd",
    "nn.functional.linear", "nn.functional.relu", "nn.functional.gelu", "nn.functional.cross_entropy",
    "nn.functional.embedding", "nn.functional.max_pool2d", "nn.functional.avg_pool2d",
    "nn.functional.interpolate.bilinear",
    "nn.functional.dropout", "bernoulli", "empty_like", "item", "to", "to_sparse",
]
# ... and in other dtypes: half precision and integers, ops the CPU has no float32 kernel
# for, what the sweep of every dtype found (conjugate views of complex inputs; mish's
# gradient on the CPU's kernel, not an implicit composite; a window sliced under no_grad),
# and an op CANNOT_RUN lists in some dtypes.
FAST_DTYPES = [
    ("add", torch.bfloat16), ("matmul", torch.float16), ("sum", torch.int64), ("where", torch.bool),
    ("bitwise_and", torch.int32), ("nn.functional.one_hot", torch.int64), ("bincount", torch.uint8),
    ("dot", torch.complex64), ("mm", torch.complex128), ("nn.functional.mish", torch.float16),
    ("istft", torch.complex64), ("nn.functional.linear_cross_entropy.chunked", torch.bfloat16),
]
FAST = [(name, torch.float32) for name in FAST_FLOAT32] + FAST_DTYPES

SEED = 20261202


def op_key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def case_key(op: Any, dtype: torch.dtype) -> str:
    """One case: an op in one dtype, as ``"add bfloat16"``."""
    return f"{op_key(op)} {dtype_name(dtype)}"


def _cases() -> List[Tuple[Any, torch.dtype]]:
    """op_db's ops, each in every dtype the CPU runs it in: the cases compared here."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [(op, dtype) for op in op_db for dtype in sorted(op.supported_dtypes("cpu"), key=str)]


def _differentiable(op: Any, dtype: torch.dtype) -> bool:
    return bool(op.supports_autograd) and dtype in op.supported_backward_dtypes("cpu")


# ---- the comparison (runs in a rank with the simulated NPU) ------------------------------


def _without_gradient_edge(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` requires grad yet can have no gradient: a view op_db made under no_grad
    (it makes every sample so) of a tensor that requires grad, not marked ``requires_grad_()`` itself."""
    if not (tensor.requires_grad and tensor.is_leaf):
        return False
    with torch.enable_grad():
        return tensor.view_as(tensor).grad_fn.next_functions[0][0] is None


class _ToHost:
    """A device sample's tensors on the host, views of copies of the same storages (aliasing kept)."""

    def __init__(self) -> None:
        self.storages: Dict[int, torch.Tensor] = {}
        self.device = False  # whether the sample holds a device tensor or names the device
        self.names_cpu = False  # whether it names the CPU (empty_like(x, device="cpu"))

    def __call__(self, value: Any) -> Any:
        if isinstance(value, (torch.device, str)) and str(value) == "cpu":
            self.names_cpu = True
        if isinstance(value, torch.device) and value.type == "npu":
            self.device = True
            return torch.device("cpu")
        if isinstance(value, str) and value.split(":")[0] == "npu":
            self.device = True
            return "cpu"
        if not isinstance(value, torch.Tensor) or value.device.type != "npu":
            return value
        self.device = True
        if value.layout != torch.strided:
            return value.detach().cpu().requires_grad_(value.requires_grad)
        plain = torch.empty(0, dtype=value.dtype).set_(
            self._storage(value), value.storage_offset(), value.size(), value.stride())
        if _without_gradient_edge(value):
            plain.requires_grad_()
            with torch.no_grad():
                return self._bits_of(value, plain) if value.is_conj() or value.is_neg() else plain.view_as(plain)
        return self._bits_of(value, plain).requires_grad_(value.requires_grad)

    @staticmethod
    def _bits_of(tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """``view`` with ``tensor``'s conjugate and negative bits (lazy ``conj()`` and its imaginary part)."""
        if tensor.is_neg():
            view = torch._neg_view(view)
        return view.conj() if tensor.is_conj() else view

    def _storage(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -id(tensor)
        if key not in self.storages:
            raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self.storages[key] = raw.cpu()
        return self.storages[key].untyped_storage()


def _on_host(sample: Any) -> Tuple[Any, Tuple[str, ...]]:
    """``sample`` on the host (the CPU where it names the device), and where its results may be.

    A result the CPU has on the CPU is on the device when the sample holds a device tensor
    or names the device, or on either where it also names the CPU.
    """
    from torch.testing._internal.opinfo.core import SampleInput

    to_host = _ToHost()
    moved = torch.utils._pytree.tree_map(to_host, (sample.input, sample.args, sample.kwargs))
    return SampleInput(moved[0], args=moved[1], kwargs=moved[2],
                       output_process_fn_grad=sample.output_process_fn_grad), (
        ("npu", "cpu") if to_host.names_cpu else ("npu",)) if to_host.device else ("cpu",)


def _call(op: Any, sample: Any) -> Tuple[Any, Optional[BaseException]]:
    torch.manual_seed(SEED)  # random ops draw the same numbers: the device's come from the CPU's generator
    try:
        return sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs)), None
    except Exception as error:  # noqa: BLE001 - the CPU's error is compared with the device's
        return None, error


def _problem(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _compare(expected: Any, actual: Any, devices: Tuple[str, ...], values: bool) -> Optional[str]:
    """Why ``actual`` (the device's results) is not ``expected`` (the CPU's), or None.

    ``devices``: where a result the CPU has on the CPU may be.
    """
    leaves, spec = torch.utils._pytree.tree_flatten(expected)
    got, got_spec = torch.utils._pytree.tree_flatten(actual)
    if spec != got_spec:
        return f"results differ in structure: {got_spec} for {spec}"
    for i, (want, have) in enumerate(zip(leaves, got)):
        if isinstance(want, torch.Tensor):
            if not isinstance(have, torch.Tensor):
                return f"result {i} is {type(have).__name__}, not a tensor"
            if have.device.type not in (devices if want.device.type == "cpu" else (want.device.type,)):
                return f"result {i} is on {have.device}"
            if want.layout == torch.strided and have.stride() != want.stride():
                return f"result {i} has strides {have.stride()}, the CPU's {want.stride()}"
            if (want.dtype, want.shape) != (have.dtype, have.shape):
                return f"result {i} is {have.dtype} {tuple(have.shape)}, the CPU's {want.dtype} {tuple(want.shape)}"
            if values:
                try:
                    torch.testing.assert_close(have.detach().cpu(), want.detach(), equal_nan=True)
                except AssertionError as error:
                    return f"result {i}: " + " ".join(str(error).split())[:300]
        elif isinstance(want, float) and isinstance(have, float) and math.isnan(want) and math.isnan(have):
            continue
        elif isinstance(want, torch.device):
            if have.type not in (devices if want.type == "cpu" else (want.type,)):
                return f"result {i} is {have}, the CPU's {want}"
        elif values and want != have:
            return f"result {i} is {have!r}, the CPU's {want!r}"
    return None


def _grad_leaves(tree: Any) -> List[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(tree)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def _gradients(outputs: Any, inputs: Any, cotangents: List[torch.Tensor]) -> Tuple[Any, Optional[BaseException]]:
    try:
        return list(torch.autograd.grad(_grad_leaves(outputs), _grad_leaves(inputs), cotangents,
                                        allow_unused=True)), None
    except Exception as error:  # noqa: BLE001 - the CPU's error is compared with the device's
        return None, error


def _same_error(cpu_error: Optional[BaseException], error: Optional[BaseException]) -> Optional[str]:
    """Why the device's outcome differs from the CPU's where either raised, or None."""
    if cpu_error is None:
        return None if error is None else _problem(error)
    if error is None or type(error) is not type(cpu_error):
        return f"the CPU raised {_problem(cpu_error)}, the device " + (_problem(error) if error else "did not")
    return None


class _Outcome:
    """One op's outcome: the samples compared forward and backward, and its first failure (part, why)."""

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0
        self.failure: Optional[Tuple[str, str]] = None

    def fail(self, part: str, why: str) -> None:
        if self.failure is None or (part == "forward" and self.failure[0] == "backward"):
            self.failure = (part, why)

    def as_tuple(self) -> Tuple[int, int, Optional[Tuple[str, str]]]:
        return self.forward, self.backward, self.failure


def _check_sample(op: Any, sample: Any, backward: bool, outcome: _Outcome, index: int) -> None:
    """Run ``sample`` (on the device) and its copy on the host; record in ``outcome`` where they differ."""
    try:
        on_host, devices = _on_host(sample)
    except Exception as error:  # noqa: BLE001
        outcome.fail("forward", f"sample {index}: copying it to the host: {_problem(error)}")
        return
    expected, cpu_error = _call(op, on_host)
    actual, error = _call(op, sample)
    outcome.forward += 1
    why = _same_error(cpu_error, error)
    if why is None and cpu_error is None:
        why = _compare(expected, actual, devices, values=op_key(op) not in UNINITIALISED)
    if why is not None:
        outcome.fail("forward", f"sample {index}: {why}")
        return
    if cpu_error is not None or not backward or not _grad_leaves(expected):
        return
    torch.manual_seed(SEED)
    cotangents = [torch.randn_like(out) for out in _grad_leaves(expected)]
    grads, cpu_error = _gradients(expected, (on_host.input, on_host.args, on_host.kwargs), cotangents)
    device_grads, error = _gradients(actual, (sample.input, sample.args, sample.kwargs),
                                     [t.to("npu") for t in cotangents])
    outcome.backward += 1
    why = _same_error(cpu_error, error)
    if why is None and cpu_error is None:
        why = _compare(grads, device_grads, devices, values=True)
    if why is not None:
        outcome.fail("backward", f"sample {index}: {why}")


def check_op(op: Any, dtype: torch.dtype) -> Tuple[int, int, Optional[Tuple[str, str]]]:
    """``op``'s samples in ``dtype``, made on the device, run there and on the CPU.

    Returns how many samples were compared forward and backward, and the first failure
    (``("forward" or "backward", why)``) or None.
    """
    backward = _differentiable(op, dtype)
    outcome = _Outcome()
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for index, sample in enumerate(op.sample_inputs("npu", dtype, requires_grad=backward)):
                _check_sample(op, sample, backward, outcome, index)
                if outcome.failure is not None and outcome.failure[0] == "forward":
                    break
        except Exception as error:  # noqa: BLE001 - making the samples runs operators on the device
            outcome.fail("forward", f"making the samples on the device: {_problem(error)}")
    return outcome.as_tuple()


def _run(rank: int, world_size: int, chosen: Optional[List[Tuple[str, torch.dtype]]] = None) -> Dict[str, Any]:
    """Each case's outcome on this rank's simulated NPU, as ``check_op`` returns it, and op_db's census.

    ``chosen``: the cases to run, (op, dtype); None: this rank's share of the whole database.
    """
    cases = _cases()
    if chosen is not None:
        keys = {f"{name} {dtype_name(dtype)}" for name, dtype in chosen}
        mine = [(op, dtype) for op, dtype in cases if case_key(op, dtype) in keys]
    else:
        mine = cases[rank::world_size]
    return {"results": {case_key(op, dtype): check_op(op, dtype) for op, dtype in mine},
            "cases": [case_key(op, dtype) for op, dtype in cases],
            "differentiable": [case_key(op, dtype) for op, dtype in cases if _differentiable(op, dtype)]}


# ---- the tests ------------------------------------------------------------------------------


def listed(case: str) -> Optional[Tuple[str, str]]:
    """What ``CANNOT_RUN`` says fails in ``case`` (``"op dtype"``) and why, or None where it lists nothing."""
    op, dtype = case.rsplit(" ", 1)
    entry = CANNOT_RUN.get(op)
    if entry is None or (entry[1] != EVERY_DTYPE and dtype not in entry[1].split(", ")):
        return None
    return entry[0], entry[2]


def _not_as_listed(results: Dict[str, Tuple[int, int, Optional[Tuple[str, str]]]]) -> List[str]:
    """Where ``results`` and ``CANNOT_RUN`` disagree: a case failing unlisted, a listed case passing."""
    problems = []
    for key, (forward, _, failure) in sorted(results.items()):
        expected = listed(key)
        if failure is not None and expected is None:
            problems.append(f"{key} fails ({failure[0]}): {failure[1]}")
        elif failure is None and expected is not None:
            problems.append(f"{key} runs now: take it out of CANNOT_RUN (and docs/simulated-npu.md)")
        elif failure is not None and expected is not None and failure[0] not in expected[0].split(" or "):
            problems.append(f"{key} fails {failure[0]}, where CANNOT_RUN says {expected[0]}: {failure[1]}")
        elif failure is None and forward == 0:
            problems.append(f"{key} has no samples: nothing was compared")
    return problems


def test_the_table_is_held_both_ways(monkeypatch):
    monkeypatch.setitem(CANNOT_RUN, "add", ("forward", "bfloat16", "listed, though it runs"))
    results = {"add bfloat16": (11, 11, None), "add float32": (11, 11, None),
               "to_sparse int8": (1, 0, ("forward", "a COO result")),
               "mul float32": (9, 9, ("backward", "sample 2: result 0 is NoneType")), "sum int64": (0, 0, None)}
    assert _not_as_listed(results) == [
        "add bfloat16 runs now: take it out of CANNOT_RUN (and docs/simulated-npu.md)",
        "mul float32 fails (backward): sample 2: result 0 is NoneType",
        "sum int64 has no samples: nothing was compared"]


def _coverage(census: Dict[str, Any]) -> Dict[str, Tuple[int, int]]:
    """(what runs, what is compared): ops, and (op, dtype) cases forward and backward, from op_db's census."""
    cases, differentiable = census["cases"], set(census["differentiable"])
    ops = {case.rsplit(" ", 1)[0] for case in cases}
    failing = {case: listed(case) for case in cases if listed(case) is not None}
    forward_failing = [case for case, (part, _) in failing.items() if "forward" in part.split(" or ")]  # may fail there
    return {"ops": (len(ops - {case.rsplit(" ", 1)[0] for case in failing}), len(ops)),
            "forward": (len(cases) - len(forward_failing), len(cases)),
            "backward": (len(differentiable - set(failing)), len(differentiable))}


DOC = Path(__file__).resolve().parent.parent / "docs" / "simulated-npu.md"


def _documented() -> Tuple[str, Dict[str, Tuple[int, ...]], Dict[str, Tuple[str, str, str]]]:
    """docs/simulated-npu.md's report: the torch release, its figures, and its table of ops that cannot run."""
    text = DOC.read_text()
    section = text[text.index("## Operators"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    release = re.search(r"[Oo]n torch (\d+\.\d+\.\d+)", section)
    figures = {}
    for part in ("ops", "forward", "backward"):
        found = re.search(rf"{part}: \*\*([\d,]+) of ([\d,]+)\*\*", section)
        if found:
            figures[part] = tuple(int(found.group(i).replace(",", "")) for i in (1, 2))
    assert release is not None and len(figures) == 3, "docs/simulated-npu.md's Operators section lost its figures"
    rows = re.findall(r"^\| `([^`]+)` \| (forward or backward|forward|backward) \| ([^|]+?) \| (.+?) \|$", section,
                      re.MULTILINE)
    return release.group(1), figures, {key: (part, dtypes, why) for key, part, dtypes, why in rows}


@pytest.fixture(scope="module")
def fast() -> Dict[str, Any]:
    """The fast subset, run once on a simulated NPU of its own."""
    result: Dict[str, Any] = run_ranks(_run, 1, backend=None, simulate=NPU, args=(FAST,), timeout=300)[0]
    return result


def on_the_documented_release() -> bool:
    """Whether this torch is the release docs/simulated-npu.md reports: op_db differs from release to release
    (linear_cross_entropy came after 2.9), so what names ops by name holds fully there."""
    return torch.__version__.split("+")[0] == _documented()[0]


def test_fast_subset_runs_as_on_the_cpu(fast):
    wanted = sorted(f"{name} {dtype_name(dtype)}" for name, dtype in FAST)
    if not on_the_documented_release():
        wanted = [case for case in wanted if case in fast["cases"]]
    assert sorted(fast["results"]) == wanted, "FAST names cases op_db has not (an op the CPU runs in that dtype)"
    problems = _not_as_listed(fast["results"])
    assert not problems, "\n".join(problems)


def test_docs_report_the_table_and_its_figures(fast):
    release, figures, table = _documented()
    assert table == CANNOT_RUN
    if on_the_documented_release():
        assert figures == _coverage(fast)


@pytest.mark.integration
def test_every_op_db_op_runs_as_on_the_cpu():
    ranks = run_ranks(_run, 2, backend=None, simulate=NPU, timeout=1200)
    results = {key: outcome for rank in ranks for key, outcome in rank["results"].items()}
    assert sorted(results) == sorted(ranks[0]["cases"])
    problems = _not_as_listed(results)
    assert not problems, "\n".join(problems)
    if on_the_documented_release():
        ops = {key.rsplit(" ", 1)[0] for key in results}
        assert set(CANNOT_RUN) <= ops, "CANNOT_RUN names ops op_db has not"
        for op, (_, dtypes, _) in CANNOT_RUN.items():
            assert dtypes == EVERY_DTYPE or {f"{op} {dtype}" for dtype in dtypes.split(", ")} <= set(results), op


def _convolutions() -> List[Dict[str, Any]]:
    import copy

    torch.manual_seed(SEED)
    cases = [
        (torch.nn.Conv1d(3, 4, 3), (2, 3, 10)),
        (torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 8, 8)),
        (torch.nn.Conv2d(4, 6, 3, groups=2, dilation=2, bias=False), (1, 4, 9, 9)),
        (torch.nn.Conv2d(3, 4, 3, padding="same"), (2, 3, 6, 6)),
        (torch.nn.Conv3d(2, 3, 2), (1, 2, 4, 4, 4)),
        (torch.nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1), (2, 3, 5, 5)),
    ]
    seen = []
    for module, shape in cases:
        on_device = copy.deepcopy(module).to("npu")
        x = torch.randn(shape, requires_grad=True)
        x_device = x.detach().to("npu").requires_grad_()
        out, out_device = module(x), on_device(x_device)
        cotangent = torch.randn_like(out)
        out.backward(cotangent)
        out_device.backward(cotangent.to("npu"))
        pairs = [(out_device, out), (x_device.grad, x.grad)] + [
            (mine.grad, theirs.grad) for mine, theirs in zip(on_device.parameters(), module.parameters())]
        seen.append({"module": repr(module), "devices": [str(mine.device) for mine, _ in pairs],
                     "pairs": [(mine.detach().cpu(), theirs.detach()) for mine, theirs in pairs]})
    return seen


def test_convolutions_run_on_the_device():
    # torch sends a PrivateUse1 device's convolutions to convolution_overrideable and
    # convolution_backward_overrideable, which the CPU has no kernel for: NotImplementedError
    # before the simulated device had its own.
    for case in in_one_rank(_convolutions):
        assert set(case["devices"]) == {"npu:0"}, case["module"]
        for mine, theirs in case["pairs"]:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=case["module"])


def _attention() -> Dict[str, Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(SEED)
    seen: Dict[str, Any] = {}
    q, k, v = (torch.randn(2, 3, 8, 16, requires_grad=True) for _ in range(3))
    on_device = [t.detach().to("npu").requires_grad_() for t in (q, k, v)]
    for name, kwargs in (("plain", {}), ("causal", {"is_causal": True}),
                         ("mask", {"attn_mask": torch.randn(8, 8)}), ("dropout", {"dropout_p": 0.5})):
        device_kwargs = {key: value.to("npu") if isinstance(value, torch.Tensor) else value
                         for key, value in kwargs.items()}
        torch.manual_seed(SEED)
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.manual_seed(SEED)
        out_device = F.scaled_dot_product_attention(*on_device, **device_kwargs)
        cotangent = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), cotangent)
        device_grads = torch.autograd.grad(out_device, on_device, cotangent.to("npu"))
        seen[name] = {"route": type(out_device.grad_fn).__name__, "device": str(out_device.device),
                      "pairs": [(out_device.detach().cpu(), out.detach())] + [
                          (mine.cpu(), theirs) for mine, theirs in zip(device_grads, grads)]}
    with sdpa_kernel(SDPBackend.MATH):
        seen["math only"] = type(F.scaled_dot_product_attention(*on_device).grad_fn).__name__
    mask = torch.randn(8, 8, device="npu", requires_grad=True)
    F.scaled_dot_product_attention(*on_device, attn_mask=mask).sum().backward()
    seen["mask needing a gradient"] = mask.grad is not None
    fused = torch.ops.aten._scaled_dot_product_fused_attention_overrideable
    seen["fused's mask needing a gradient"] = error_of(fused, *on_device, mask)
    with torch.no_grad():
        results = fused(*on_device, mask)
    seen["fused returns"] = [str(r.device) if isinstance(r, torch.Tensor) else r for r in results]
    return seen


def test_attention_takes_the_fused_route_and_computes_the_cpus():
    # The device answers scaled_dot_product_attention's choice as the CPU does: its fused
    # (overrideable) kernel where the CPU runs flash attention, the math elsewhere.
    seen = in_one_rank(_attention)
    for name in ("plain", "causal", "mask"):
        assert seen[name]["route"] == "ScaledDotProductFusedAttentionOverrideableBackward0", name
    assert seen["dropout"]["route"] != "ScaledDotProductFusedAttentionOverrideableBackward0"
    for name in ("plain", "causal", "mask", "dropout"):
        assert seen[name]["device"] == "npu:0"
        for mine, theirs in seen[name]["pairs"]:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    assert seen["math only"] != "ScaledDotProductFusedAttentionOverrideableBackward0"
    assert seen["mask needing a gradient"]  # the CPU, and so the device, takes the math there
    assert "the derivative for 'attn_bias' is not implemented" in seen["fused's mask needing a gradient"]
    assert seen["fused returns"] == ["npu:0", "npu:0", None, None, 8, 8, "npu:0", "npu:0", None]
