"""Mixture-of-experts decoders (model.n_experts) under the data-parallel engines on real 2-process gloo groups:
every logged term, the routers' included, as one process logs it on the same global batches, and a resume on
2 processes and on 1."""

import json
from pathlib import Path

import pytest
import torch

from lm.checkpoint.model_weights import load_checkpoint_weights
from lm.checkpoint.store import read_config, resolve_checkpoint
from lm.models.registry import family_of
from tests.distributed.test_engines import ENGINES, SAME_BATCH_REL, check_resumes, train

# every test here trains on 2-process gloo groups: the full tier only
pytestmark = pytest.mark.process

MOE = ["--model.n_head=4", "--model.n_experts=4", "--model.experts_per_token=2", "--model.expert_d_ff=32",
       "--model.n_shared_experts=1", "--model.router_z_loss_coef=1e-3"]


def terms(out: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("train/") and k not in ("train/lr",)}
            for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def one_process(tiny_data_dir, tmp_path_factory) -> Path:
    """The mixture trained on one process under ddp, which every engine's 2 processes must log alike."""
    out = tmp_path_factory.mktemp("one") / "ddp"
    train(1, out, tiny_data_dir, *ENGINES["ddp"], *MOE)
    return out


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2"])
def test_a_mixture_of_experts_on_two_processes_logs_what_one_process_does(engine, tiny_data_dir, tmp_path,
                                                                          one_process):
    flags = [*ENGINES[engine], *MOE]
    two = train(2, tmp_path / "two", tiny_data_dir, *flags)
    logged_one, logged_two = terms(one_process), terms(tmp_path / "two")
    assert sorted(logged_one) == sorted(logged_two) == [1, 2, 3, 4, 5, 6]
    names = {"train/loss", "train/moe_balance", "train/router_z", "train/expert_load_0", "train/expert_load_1",
             "train/objective"}
    assert names <= set(logged_one[1]) and set(logged_one[1]) == set(logged_two[1])
    for step in logged_one:
        for name in names:
            assert logged_two[step][name] == pytest.approx(logged_one[step][name], rel=SAME_BATCH_REL), (step, name)
    assert two[6] < two[1] - 0.1
    if engine != "zero2":  # DeepSpeed's resharded resume goes through its universal form (test_engines)
        check_resumes(two, tmp_path, tiny_data_dir, *flags)


BALANCED = [*MOE, "--model.router_bias_rate=0.05", "--model.aux_loss_coef=0", "--schedule.warmup_steps=0",
            "--schedule.min_lr_ratio=1"]
"""Auxiliary-loss-free balancing alone, at a rate that moves the routing of this tiny model within 6 steps, and a
constant learning rate, so every step moves a bias by the whole rate (the schedule scales it otherwise)"""


def router_biases(run: Path) -> torch.Tensor:
    """(blocks, experts): the balancing biases of the run's newest checkpoint."""
    step_dir = resolve_checkpoint(run)
    model = family_of(read_config(step_dir).model).build(read_config(step_dir).model)
    load_checkpoint_weights(step_dir, model)
    return torch.stack([block.mlp.router.score_bias for block in model.blocks])


@pytest.fixture(scope="module")
def balanced_one_process(tiny_data_dir, tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """BALANCED trained on one process under ddp, which both engines' 2 processes must match: its run directory
    (read-only) and its losses."""
    out = tmp_path_factory.mktemp("balanced") / "one"
    return out, train(1, out, tiny_data_dir, *ENGINES["ddp"], *BALANCED)


@pytest.mark.parametrize("engine", ["fsdp", "zero2"])
def test_balancing_biases_on_two_processes_are_those_of_one_and_resume(engine, tiny_data_dir, tmp_path,
                                                                        balanced_one_process):
    flags = [*ENGINES[engine], *BALANCED]
    one_dir, one = balanced_one_process
    two = train(2, tmp_path / "two", tiny_data_dir, *flags)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), step
    # 6 sign steps of 0.05 from 0: the loads counted over both ranks' micro-batches, as one process counts them
    biases = router_biases(tmp_path / "two")
    assert torch.equal(biases, router_biases(one_dir))
    assert biases.abs().max() >= 0.1 and torch.allclose(biases / 0.05, (biases / 0.05).round(), atol=1e-5)
    half = router_biases(tmp_path / "two/checkpoints/step_00000003")
    assert torch.equal(half, router_biases(one_dir / "checkpoints/step_00000003"))
    assert not torch.equal(half, biases)
    if engine == "fsdp":  # resumed at step 3 on 2 processes (bit for bit) and on 1: the biases come back too
        check_resumes(two, tmp_path, tiny_data_dir, *flags)
        assert torch.equal(router_biases(tmp_path / "again"), biases)
        assert torch.equal(router_biases(tmp_path / "alone"), biases)
