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
expected = [value for rank in range(ranks) for value in (rank + 1.0, 10.0)]
# Accelerate gathers into a tensor on its own device, whatever the metric's.
assert gathered.cpu().tolist() == expected, gathered
assert summed.cpu().tolist() == [sum(range(1, ranks + 1)), 10.0 * ranks], summed
print("right", flush=True)
