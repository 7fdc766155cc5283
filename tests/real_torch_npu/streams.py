"""Stream ordering on torch_npu over the fake CANN: a wait is for the record it saw, not a later one.

Stream ``a`` computes something slow and records event ``e``; stream ``c`` waits for ``e``; then
``e`` is recorded again on the idle stream ``b``. ``c`` must still wait for ``a``'s work, as a
device event is waited for on hardware; it prints ``right`` or ``wrong``.
"""

import os

import torch

torch.npu.set_device(0)
a, b, c = torch.npu.Stream(), torch.npu.Stream(), torch.npu.Stream()
big = torch.randn(1500, 1500).npu()
result = torch.zeros(1, device="npu")
event = torch.npu.Event()
torch.npu.synchronize()
wrong = 0
for _ in range(3):
    with torch.npu.stream(a):
        result.copy_((big @ big).sum().reshape(1) * 0 + 7)
        event.record(a)
    c.wait_event(event)
    event.record(b)
    with torch.npu.stream(c):
        seen = result.clone()
    torch.npu.synchronize()
    wrong += int(seen.item() != 7)
    result.zero_()
    torch.npu.synchronize()
os.write(1, b"wrong\n" if wrong else b"right\n")
