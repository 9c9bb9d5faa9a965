"""Document masking under the ddp and fsdp engines on real 2-process gloo groups: the loss of a packed window
equals the losses of its documents run one by one, and training with the mask on 2 ranks gives 1 rank's losses."""

import numpy as np
import pytest
import torch

from lm.config import load_config
from lm.data.objectives import NextToken
from lm.distributed.engine import build_engine
from lm.distributed.env import init_distributed
from lm.models.registry import family_of
from tests.distributed.test_engines import HEADS, TINY, train
from tests.workers import pool

# every test here trains on 2-process gloo groups: the full tier only
pytestmark = pytest.mark.process

EOT = 50256
# A window's tokens (T + 1 = 25): the tail of a document, then documents of 6, 3 and 9 tokens, each closed by
# the end-of-text token, which opens the next one
LENGTHS = [3, 6, 3, 9]


def packed_rows() -> np.ndarray:
    """Two windows (2, 25) of documents of LENGTHS tokens, each document followed by EOT."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(2):
        parts = [np.append(rng.integers(0, EOT, n), EOT) for n in LENGTHS]
        rows.append(np.concatenate(parts)[:25])
    return np.stack(rows)


def _scores(engine: str, pos: str) -> tuple[float, float, list[int]]:
    """In each rank of a 2-rank pool: the packed windows' loss, their documents' loss one by one, and the
    documents each window opens."""
    cfg = load_config(None, [*TINY, *HEADS, f"--parallel.engine={engine}", f"--model.pos={pos}",
                             "--data.document_mask=true"])
    env = init_distributed("cpu")
    family = family_of(cfg.model)
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = family.build(cfg.model)
    eng = build_engine(model, family, cfg.parallel, cfg.train, cfg.optim, env)

    def loss_of(batch: list[torch.Tensor]) -> float:
        return eng.evaluate(lambda model, run: family.training.score(model, run, batch)).loss.item()

    eng.train(False)
    x, y, positions = NextToken(document_eot=EOT)(packed_rows(), np.zeros(2, dtype=np.int64))
    with torch.no_grad():
        packed = loss_of([torch.from_numpy(t) for t in (x, y, positions)])
        # each document alone, from position 0 and without any mask: (loss x tokens) summed over documents
        total = 0.0
        for row in range(2):
            starts = [*np.flatnonzero(positions[row] == 0).tolist(), x.shape[1]]
            for a, b in zip(starts, starts[1:]):
                doc = [torch.from_numpy(t[row:row + 1, a:b].copy()) for t in (x, y)]
                total += loss_of(doc) * (b - a)
    return packed, total / x.size, [len(np.flatnonzero(p == 0)) for p in positions]


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_a_packed_window_scores_as_its_documents_one_by_one(engine, pos):
    results = {reply["rank"]: reply["value"] for reply in pool(2).run(_scores, engine, pos)}
    for rank in (0, 1):
        packed, alone, documents = results[rank]
        assert documents == [4, 4]  # the tail, then three documents each opened by EOT
        assert packed == pytest.approx(alone, abs=1e-5)
        assert packed > 5.0  # a real loss over a 50k vocabulary, not a degenerate one


MASKED = ["--data.document_mask=true", "--model.pos=rope", "--data.seq_len=32"]


@pytest.fixture(scope="module")
def one_process(tiny_data_dir, tmp_path_factory) -> tuple[dict[int, float], dict[int, float]]:
    """MASKED's losses on one process under ddp, which both engines' 2 ranks must give, and those of the same run
    without the mask."""
    root = tmp_path_factory.mktemp("one")
    masked = train(1, root / "masked", tiny_data_dir, "--parallel.engine=ddp", *MASKED)
    plain = train(1, root / "plain", tiny_data_dir, "--parallel.engine=ddp", *MASKED[1:])
    return masked, plain


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_ranks_train_with_the_mask_as_one_does(engine, tiny_data_dir, tmp_path, one_process):
    one, plain = one_process
    two = train(2, tmp_path / "two", tiny_data_dir, f"--parallel.engine={engine}", *MASKED)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    assert [two[s] for s in one] == pytest.approx([one[s] for s in one], rel=1e-5)
    # some windows span two scenes, and the mask scores them differently
    assert [plain[s] for s in one] != [one[s] for s in one]
