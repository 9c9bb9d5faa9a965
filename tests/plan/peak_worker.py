"""One rank of a small training run that reports the most heap memory it held during a training step, for
tests/plan/test_layouts.py: `main` runs as a job of the tests' 4-rank pool (`tests.workers`), or this file under
torchrun with lm.train's flags; writes <out_dir>/peak_rank<R>.json and returns the peak.

The heap is measured with glibc's mallinfo2 (bytes in use), which sees every tensor because `tune_cpu` (run
when the device is set up) makes glibc serve even large allocations from the heap. The baseline is taken after
the process group is up and before the model is built; a thread samples the heap every millisecond while the
second step trains (after the first, the optimizer state exists), and the peak over the baseline is reported,
with the heap at that step's start: the weights and AdamW's moments (this step's gradients are made in backward).
In a pool's long-lived process the garbage of earlier jobs is collected before the baseline, so none of it is
freed during the measured step, and the sampling thread ends with the job. The first job of a process also
counts the few MB that torch sets up once on first use and keeps (it is in later jobs' baselines); a comparison
of two layouts' heaps at the step's start leaves that job out.
"""

import ctypes
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.training.trainer import Trainer


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = MallInfo2


def in_use() -> int:
    """Bytes the C heap has handed out and not taken back (mmapped blocks included)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def main(argv: list[str]) -> int:
    cfg = load_config(None, argv)
    par = cfg.parallel
    env = init_distributed(cfg.train.device, tp=par.tp, pp=par.pp, cp=par.cp, dp_replicate=par.dp_replicate)
    gc.collect()
    baseline = in_use()
    trainer = Trainer(cfg, env)
    peak, start, sampling, done = [0], [0], threading.Event(), threading.Event()

    def sample() -> None:
        while not done.is_set():
            if sampling.is_set():
                peak[0] = max(peak[0], in_use())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step = trainer._train_step

    def measured_step(lr):
        if trainer.step == 1:  # the second step: the optimizer state exists
            start[0] = in_use()
            sampling.set()
        try:
            return step(lr)
        finally:
            sampling.clear()

    trainer._train_step = measured_step
    try:
        trainer.fit()
    finally:
        done.set()
        sampler.join()
    measured = {"peak": peak[0] - baseline, "start": start[0] - baseline}
    Path(cfg.train.out_dir, f"peak_rank{env.rank}.json").write_text(json.dumps(measured))
    env.barrier()
    return peak[0] - baseline

if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # no teardown of the process group (see lm.cli.exit_without_teardown)
