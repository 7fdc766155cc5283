"""Every private torch name comm uses, each with why no public API does the job.

torch may rename or remove a private name in any release. Keeping them in one table
means a newcomer sees the whole dependency at once, and ``tests/test_torch_private.py``
fails loudly, naming the entry, on a release where one no longer resolves, or where
comm's code starts using a private name this table does not list.
"""

from __future__ import annotations

from typing import Dict

__all__ = ["PRIVATE_NAMES"]

# Dotted path (the module part importable) -> why comm needs it.
PRIVATE_NAMES: Dict[str, str] = {
    # The per-device slot of a process group (comm/slot.py): c10d has no public API to add
    # a backend for one device type to a group that exists.
    "torch.distributed.ProcessGroup._register_backend":
        "puts comm's staging backend in the slot of a device type the group's backend leaves empty",
    "torch.distributed.ProcessGroup._get_backend":
        "the group's own backend for a device type: its name, options and split",
    "torch.distributed.ProcessGroup._device_types":
        "which device types a group's slots already serve",
    "torch.distributed.ProcessGroup._start_coalescing":
        "where torch opens a coalescing block on one device type's backend: comm follows a block opened on the "
        "group's own backend, which its calls on the other device type join",
    "torch.distributed.ProcessGroup._end_coalescing":
        "the work that ends such a block, the one torch's coalescing manager waits for: comm's calls in the block "
        "complete with it",
    "torch.distributed.ProcessGroup._set_group_name":
        "c10d reads a group's name from its first backend; comm's must carry it",
    "torch.distributed.distributed_c10d._world":
        "pg_map: every group that exists, and the store each was made with (comm's communicator shares it); "
        "_default_pg: the default group, read by comm's explicit calls with one attribute read",
    "torch.distributed.distributed_c10d._new_process_group_helper":
        "where c10d creates every group: comm.patch() equips each new one there",
    "torch.distributed.distributed_c10d._DistributedBackendOptions":
        "the arguments a plugin's creator takes, to make a communicator as c10d makes the group's",
    "torch.distributed.Backend._plugins":
        "a plugin backend's creator (hccl, xccl), to make comm's communicator of the group's kind",
    "torch.distributed.ProcessGroupGloo.Options._timeout":
        "a backend's timeout, which c10d's Backend.Options (every backend's options extends it) keeps under this "
        "name only: comm's communicator takes the group's",
    "torch.distributed.distributed_c10d.Work._source_rank":
        "the rank an any-source recv received from, which dist.recv returns",
    # comm's explicit calls (comm/collectives.py) run the body of torch's function where torch
    # wraps it in its exception logger, and log a failure as that wrapper does: a call through
    # comm then has as many Python frames as torch's own (c10d records each call's Python stack),
    # which keeps comm's call within 1 % of torch's. Where these change, comm calls torch's
    # function as it is (slower, still correct).
    "torch.distributed.c10d_logger._exception_logger":
        "recognises torch's logging wrapper (its code object) around a collective's body",
    "torch.distributed.c10d_logger._get_msg_dict": "the record torch's wrapper logs for a failed collective",
    "torch.distributed.c10d_logger._c10d_logger": "the logger torch's wrapper writes that record to",
    # The device translation (comm/translate/).
    "torch._C._get_privateuse1_backend_name":
        "the name a plugin gave the PrivateUse1 device (npu, ...), without importing the plugin",
    "torch._C.TensorBase":
        "Tensor.to and pin_memory beneath torch.Tensor's, which the translation replaces",
    "torch._C._nn":
        "holds _parse_to, which Module.to and libraries (tensordict's TensorDict.to) read .to's arguments with",
    "torch._C._VariableFunctions":
        "every torch factory function, to find those taking device= from their schemas",
    "torch._C._jit_get_schemas_for_operator":
        "an operator's schemas: which factories take a device argument",
    "torch.utils._device.DeviceContext":
        "the function mode behind `with torch.device(...)` and set_default_device: its device is translated",
    "torch.utils._device._device_constructors":
        "the factories a device context recognises by identity: built from torch's own before the stand-ins",
    "torch.overrides._get_tensor_methods":
        "the Tensor methods torch.fx recognises by identity: built from torch's own, each stand-in added beside",
    "torch.jit._builtins._register_builtin":
        "TorchScript must still see a translated factory as the aten operator it stands for",
    # comm.clip_grad_norm_ (comm/norm.py): the kernels torch's own clip_grad_norm_ uses,
    # so comm's norms are bitwise torch's.
    "torch._foreach_norm": "per-tensor norms in one kernel, as torch's clip_grad_norm_ takes them",
    "torch._foreach_mul_": "scales gradients in one kernel, as torch's clip_grad_norm_ does",
    "torch.utils._foreach_utils._device_has_foreach_support":
        "whether a device has foreach kernels, the test torch's clip_grad_norm_ makes",
    # The simulated NPU (comm/testing/), for tests only.
    "torch._register_device_module": "makes torch.npu (the simulated device's module) as torch_npu does",
    "torch._C._dispatch_has_kernel_for_dispatch_key":
        "which operators the simulated device lacks a kernel for, to run them on the host",
    "torch._C._dispatch_get_all_op_names": "every operator, to find those the simulated device lacks",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec":
        "comm.testing.offloaded builds a DTensor whose local shard stays on the CPU while its mesh is on the "
        "device, as FSDP2 with CPU offload presents gradients; DTensor.from_local would move the shard (with "
        "DTensor._local_tensor, the shard itself)",
    "torch.distributed.tensor._dtensor_spec.TensorMeta": "the shape, stride and dtype a DTensorSpec carries",
    "torch.testing._internal":
        "torch's test helpers, which the translation counts as a device selector where the process has an "
        "accelerator (comm/translate/policy.py): told its device count, torch's own tests run on it; on the CPU "
        "alone they see the truth and skip their GPU-only tests",
    "torch.distributed._make_nccl_premul_sum":
        "the stand-in torch_npu.distributed._make_hccl_premul_sum, which torch_npu defines as this very function",
}
