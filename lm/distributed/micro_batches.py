"""One optimizer step's micro-batches through an engine: what every engine but the pipeline does."""

import torch


class MicroBatchLoop:
    """`accumulate` as a loop of the engine's `forward_backward`, gradients reduced on the last micro-batch."""

    def forward_backward(self, batch: list[torch.Tensor], last: bool, num_micro: int) -> torch.Tensor:
        raise NotImplementedError

    def accumulate(self, batches: list[list[torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch (on the device) of one step; the summed (2,) loss terms."""
        total = None
        for i, batch in enumerate(batches):
            terms = self.forward_backward(batch, last=i == len(batches) - 1, num_micro=len(batches))
            total = terms if total is None else total + terms
        return total
