"""model.loss_chunk under each engine on real 2-process gloo groups: the head's weight is gathered (FSDP2 at
the root, DeepSpeed ZeRO-3 in the head's hooks) for every chunk, in forward and in the backward recomputation,
and DDP reduces its gradient once, so the losses are those of one plain process."""

import pytest

from tests.distributed.test_engines import ENGINES, SAME_BATCH_REL, train

# every test here trains on 2-process gloo groups under torchrun: the full tier only
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def reference(tiny_data_dir, tmp_path_factory) -> dict[int, float]:
    """4 steps of TINY on one plain process (no chunks, ddp): what every engine's chunked 2 ranks must give."""
    return train(1, tmp_path_factory.mktemp("plain") / "run", tiny_data_dir, "--train.steps=4")


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero3"])
def test_chunked_loss_on_2_ranks_equals_one_plain_process(engine, tiny_data_dir, tmp_path, reference):
    # 2 x 16 = 32 positions per micro-batch: chunks of 12 leave a shorter last one
    losses = train(2, tmp_path / engine, tiny_data_dir, "--train.steps=4", "--model.loss_chunk=12", *ENGINES[engine])
    assert losses.keys() == reference.keys()
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], rel=SAME_BATCH_REL), step
