"""A metric kept on the CPU, gathered and summed across ranks through Accelerate's own operations.

Training code often keeps a metric on the CPU (after ``.cpu()`` or ``.item()``) and hands it
to ``Accelerator.gather`` and ``Accelerator.reduce``, which call torch.distributed's
collectives on the group Accelerate made: on Ascend an hccl group, which serves no CPU
tensor. Prints ``right`` where both answer as they should.
"""

import torch
from accelerate import Accelerator

accelerator = Accelerator()
metric = torch.tensor([accelerator.process_index + 1.0, 10.0])  # on the CPU
gathered = accelerator.gather(metric)
summed = accelerator.reduce(metric.clone(), reduction="sum")
ranks = accelerator.num_processes
assert gathered.device.type == "cpu" and gathered.tolist() == [v for r in range(ranks) for v in (r + 1.0, 10.0)], gathered
assert summed.tolist() == [sum(range(1, ranks + 1)), 10.0 * ranks], summed
print("right", flush=True)
