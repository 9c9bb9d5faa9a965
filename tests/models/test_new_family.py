"""The design holds: a family defined outside lm (tests/models/conv_family.py, a decoder whose blocks are causal
convolutions) trains with two processes on two engines, checkpoints and resumes, and is evaluated, sampled and
planned by lm's own tools, with no change to lm/. The tools' processes find it through LM_FAMILIES."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lm import eval as eval_tool
from lm import sample as sample_tool
from lm.cli import run
from lm.config import load_config
from lm.errors import ConfigError
from lm.models.registry import family_of
from lm.plan.counts import num_params
from lm.plan.memory import estimate_memory
from tests.distributed.test_engines import SAME_BATCH_REL, resume_copy, train
from tests.models import conv_family
from tests.plan.test_memory import saved_bytes

CONV = ["--model.arch=conv", "--model.kernel_size=3", "--train.steps=4", "--checkpoint.every=2", "--optim.lr=1e-2"]
PLUGIN = "tests.models.conv_family"


@pytest.fixture(scope="module")
def conv_runs(tiny_data_dir, tmp_path_factory):
    """The convolutional decoder trained 4 steps: on one process (ddp) and on two (fsdp), and the two-process
    run resumed from its step-2 checkpoint on two processes under ddp. {name: (run dir, losses)}."""
    root = tmp_path_factory.mktemp("conv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LM_FAMILIES", PLUGIN)
        runs = {"one": train(1, root / "one", tiny_data_dir, *CONV),
                "two": train(2, root / "two", tiny_data_dir, *CONV, "--parallel.engine=fsdp")}
        runs["resumed"] = train(2, resume_copy(root / "two", root / "resumed", step=2), tiny_data_dir, *CONV)
    return {name: (root / name, losses) for name, losses in runs.items()}


@pytest.mark.process
def test_it_trains_alike_on_one_and_two_processes_and_resumes_under_another_engine(conv_runs):
    (_, one), (two_dir, two), (_, resumed) = conv_runs["one"], conv_runs["two"], conv_runs["resumed"]
    assert sorted(one) == sorted(two) == [1, 2, 3, 4] and two[4] < two[1]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=SAME_BATCH_REL), step
    # the fsdp checkpoint of step 2, resumed by ddp on two processes: the same steps 3 and 4
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(two[step], rel=SAME_BATCH_REL), step
    state = json.loads((two_dir / "checkpoints/step_00000004/state.json").read_text())
    assert state["engine"] == "fsdp" and state["world_size"] == 2


@pytest.mark.process
def test_the_tools_evaluate_and_sample_its_checkpoint(conv_runs, capsys):
    run_dir = conv_runs["two"][0]
    assert run(eval_tool.main, ["--checkpoint", str(run_dir), "--max-tokens", "200"]) == 0
    printed = capsys.readouterr().out
    assert "window 16, stride 8" in printed and "tokens scored: 199" in printed
    loss = float(printed.split("loss: ")[1].split()[0])
    assert 5.0 < loss < 11.0  # 4 steps from ln(50304) = 10.8
    flags = ["--checkpoint", str(run_dir), "--prompt", "KING:", "--max-new-tokens", "6", "--seed", "3"]
    assert run(sample_tool.main, flags) == 0
    text = capsys.readouterr().out
    assert text.startswith("KING:") and len(text) > len("KING:\n")
    assert run(sample_tool.main, flags) == 0
    assert capsys.readouterr().out == text  # the convolution's decoding state gives the same text each time


def test_its_sampling_state_gives_the_logits_of_the_whole_sequence():
    cfg = conv_family.ConvConfig(vocab_size=100, block_size=16, n_layer=2, d_model=16, kernel_size=3)
    torch.manual_seed(0)
    model = conv_family.ConvLM(cfg).eval()
    idx = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        full = model.logits(model(idx))
        state = model.new_cache(2, 12)
        pieces = [model.logits(model(idx[:, a:b], cache=state)) for a, b in [(0, 5), (5, 6), (6, 12)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_the_planner_counts_its_parameters_and_its_activations(capsys):
    cfgs = [load_config(None, ["--model.arch=conv", f"--model.n_layer={n}", "--model.d_model=32",
                               "--model.block_size=64", "--data.seq_len=40", "--train.micro_batch_size=3",
                               "--train.batch_size=3", "--train.device=cpu", "--train.dtype=float32"])
            for n in (2, 4)]
    family = family_of(cfgs[0].model)
    model = family.build(cfgs[0].model)
    assert num_params(cfgs[0].model) == sum(p.numel() for p in model.parameters())  # the tied head once
    predicted = [estimate_memory(c, 1).activations for c in cfgs]
    measured = [saved_bytes(c, bf16_weights=False, autocast=False) for c in cfgs]
    # two more blocks: what autograd saves for them, as the family counts it
    assert predicted[1] - predicted[0] == pytest.approx(measured[1] - measured[0], rel=0.05)
    from lm.train import dry_run

    dry_run(cfgs[0], 1, 80.0)  # its batch of 3 in one micro-batch of 3 splits over no more replicas
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "model: conv, 2 layers, d_model 32, vocabulary 50,304 (padded)"
    assert any(line.startswith("pick: ddp") for line in lines)


def test_its_config_takes_its_own_keys_and_refuses_the_others():
    assert load_config(None, ["--model.arch=conv", "--model.kernel_size=7"]).model.kernel_size == 7
    with pytest.raises(ConfigError, match=r"model.n_head: not a key of a convolutional decoder \(model.arch=conv\); "
                                          r"it takes \[.*'kernel_size'"):
        load_config(None, ["--model.arch=conv", "--model.n_head=2"])
    with pytest.raises(ConfigError, match="data.document_mask: a convolutional decoder"):
        load_config(None, ["--model.arch=conv", "--data.document_mask=true"])


@pytest.mark.process
def test_the_command_line_finds_it_through_lm_families(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "lm.train", "--help"], capture_output=True, text=True,
                               env={**os.environ, "LM_FAMILIES": PLUGIN}).stdout
    assert "model (model.arch=conv: a convolutional decoder):" in help_text and "--model.kernel_size=4" in help_text
    missing = subprocess.run([sys.executable, "-m", "lm.train", "--model.arch=conv", "--dry-run"],
                             capture_output=True, text=True)
    assert missing.returncode == 2
    assert "error: model.arch: unknown model family 'conv'" in missing.stderr
