"""The count of optimizer steps skipped for a NaN or inf loss or gradient norm, kept on the device.

The engine decides each skip on the device (the fused AdamW's `found_inf`), so no training step waits
for the host to read its gradient norm. These counters follow the skips with a few tensor ops per step
and are read at log steps, where the trainer reads the loss anyway: a run of non-finite steps that
reaches the limit stops training at the next read, not at the step itself.
"""

import torch


class SkippedSteps:
    """Skipped optimizer steps: in all, since the last read, and in a row."""

    def __init__(self, device: torch.device) -> None:
        self.total = 0  # skipped up to the last read
        zero = torch.zeros((), dtype=torch.long, device=device)
        self._new = zero.clone()  # skipped since the last read
        self._run = zero.clone()  # skipped in a row up to the latest step
        self._longest = zero.clone()  # the longest run seen since the last read

    def add(self, applied: torch.Tensor) -> None:
        """Record one optimizer step; `applied` is its 0-dim bool tensor (False: skipped)."""
        skipped = (~applied).long()
        self._new += skipped
        self._run.mul_(skipped).add_(skipped)  # run + 1 after a skip, 0 after an applied step
        torch.maximum(self._longest, self._run, out=self._longest)

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps (one host sync, as a save makes anyway): the steps skipped in all and in a row,
        so that a resumed run counts on from them and a run of non-finite steps across a restart stays one."""
        new, run = (int(v) for v in torch.stack([self._new, self._run]).tolist())
        return {"skipped_steps": self.total + new, "skipped_in_a_row": run}

    def load_state_dict(self, state: dict) -> None:
        """The counts `state_dict` saved (0 for a checkpoint from before they were kept)."""
        self.total = state.get("skipped_steps", 0)
        self._new.zero_()
        self._run.fill_(state.get("skipped_in_a_row", 0))
        self._longest.copy_(self._run)

    def read(self) -> tuple[int, int]:
        """Fold the steps since the last read into `total` (one host sync); returns how many of them were
        skipped and the longest run of skipped steps in a row among them (counting a run that went on
        from before)."""
        new, longest = (int(v) for v in torch.stack([self._new, self._longest]).tolist())
        self._new.zero_()
        self._longest.copy_(self._run)  # a run still going on carries into the next read
        self.total += new
        return new, longest
