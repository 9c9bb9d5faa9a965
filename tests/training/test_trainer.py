import dataclasses
import functools
import json
import logging
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lm import eval as eval_tool
from lm import sample
from lm.checkpoint.model_weights import load_model_weights
from lm.checkpoint.store import complete_checkpoints
from lm.cli import run
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.distributed.optim import build_optimizer
from lm.errors import CheckpointError, ConfigError
from lm.models.gpt.model import GPT
from lm.models.registry import family_of
from lm.plan.counts import flops_per_token
from lm.report.metrics import read_metrics
from lm.training.evaluate import evaluate
from lm.training.logger import MetricLogger
from lm.training.trainer import Trainer
from tests.distributed.test_engines import heads_for, train

TINY = [
    "--model.n_layer=2", "--model.d_model=32", "--model.block_size=32",
    "--data.seq_len=16", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
    "--train.eval_every=3", "--train.eval_batches=2", "--log.every=1", "--log.tensorboard=false",
    "--checkpoint.every=3", "--checkpoint.keep=5", "--optim.lr=3e-3", "--schedule.warmup_steps=2",
    "--log.sample_tokens=4",  # the end-of-run sample: its path, not the default's 64 decode steps
]


def tiny_config(data_dir, out_dir, *extra):
    return load_config(None, [*TINY, *heads_for(extra), f"--data.dir={data_dir}", f"--train.out_dir={out_dir}",
                              *extra])


def train_losses(history):
    return {row["step"]: row["train/loss"] for row in history if "train/loss" in row}


def check_resume_is_bit_for_bit(config, tmp_path, build) -> None:
    """A 6-step run, and a second run started from its step-3 checkpoint, retrace steps 4..6 exactly:
    the same losses and, built by `build(model_cfg)`, the same final weights. `config(out_dir, *extra)`."""
    env = init_distributed("cpu")
    full = Trainer(config(tmp_path / "full", "--train.steps=6"), env).fit()
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step_00000003", resumed_dir / "step_00000003")
    trainer = Trainer(config(tmp_path / "resumed", "--train.steps=6"), env)
    assert trainer.step == 3 and trainer.loader.state_dict()["position"] == 12
    resumed = trainer.fit()
    assert sorted(train_losses(resumed)) == [4, 5, 6]
    # the wall-time count goes on from the checkpoint's instead of restarting at zero
    before = json.loads((resumed_dir / "step_00000003/state.json").read_text())["elapsed_s"]
    rows = [json.loads(line) for line in (tmp_path / "resumed/metrics.jsonl").read_text().splitlines()]
    assert before > 0 and rows[0]["elapsed_s"] > before
    for step, loss in train_losses(resumed).items():
        assert loss == train_losses(full)[step]
    model_cfg = config(tmp_path / "x").model
    a, b = build(model_cfg), build(model_cfg)
    load_model_weights(tmp_path / "full/checkpoints/step_00000006", a)
    load_model_weights(tmp_path / "resumed/checkpoints/step_00000006", b)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_resume_continues_bit_for_bit(tiny_data_dir, tmp_path):
    check_resume_is_bit_for_bit(functools.partial(tiny_config, tiny_data_dir), tmp_path, GPT)


def test_resume_from_an_asynchronous_checkpoint_continues_bit_for_bit(tiny_data_dir, tmp_path):
    def config(out_dir, *extra):
        return tiny_config(tiny_data_dir, out_dir, "--checkpoint.async=true", *extra)

    check_resume_is_bit_for_bit(config, tmp_path, GPT)


@pytest.mark.slow
def test_an_asynchronous_save_holds_training_up_a_fraction_of_a_synchronous_one(tiny_data_dir, tmp_path, caplog):
    # 6.6M parameters (78 MB with AdamW's moments): writing them, with fsync and the manifest's hashes, takes
    # several times as long as copying them. Each write is waited for after its save, outside the time measured,
    # as in a run whose saves are further apart than a write takes; the medians of 3 saves stand a busy machine.
    seconds = {}
    for mode in ("false", "true"):
        trainer = Trainer(load_config(None, [
            *TINY, "--model.n_head=2", "--model.d_model=64", "--model.n_layer=1", "--train.steps=3",
            "--checkpoint.every=1", "--checkpoint.keep=1", "--log.sample_every=0", "--train.eval_every=1000",
            f"--checkpoint.async={mode}", f"--data.dir={tiny_data_dir}", f"--train.out_dir={tmp_path / mode}"]),
            init_distributed("cpu"))
        if trainer.background is not None:
            trainer.after_step.append(lambda step, saves=trainer.background: saves.wait())
        with caplog.at_level(logging.INFO, logger="lm"):
            trainer.fit()
        assert [p.name for p in complete_checkpoints(tmp_path / mode / "checkpoints")] == ["step_00000003"]
        seconds[mode] = sorted(trainer.save_seconds)[1]
    assert seconds["true"] <= 0.3 * seconds["false"], seconds
    # the log tells the copy apart from a wait for the previous write, which the hook above left nothing of
    assert caplog.text.count("s, after 0.00 s waiting for the previous write; writing") == 3
    assert caplog.text.count("allocated the host copy for checkpoint.async") == 1  # after step 1, once


def test_run_directory_contents(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    history = Trainer(tiny_config(tiny_data_dir, out, "--train.steps=4", "--checkpoint.keep=1"),
                      init_distributed("cpu")).fit()
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000004"]  # keep=1
    assert load_config(out / "config.yaml").train.steps == 4
    assert load_config(out / "checkpoints/step_00000004/config.yaml").train.steps == 4
    state = json.loads((out / "checkpoints/step_00000004/state.json").read_text())
    manifest = json.loads((tiny_data_dir / "manifest.json").read_text())
    data = {"content_hash": manifest["content_hash"], "source": manifest["source"], "train_tokens": 25_450}
    elapsed = state.pop("elapsed_s")
    assert state == {"step": 4, "tokens_seen": 4 * 4 * 16, "position": 16, "data": data, "world_size": 1,
                     "engine": "ddp", "skipped_steps": 0, "skipped_in_a_row": 0}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["tokens"] for r in rows if "train/loss" in r] == [64, 128, 192, 256]
    times = [r["elapsed_s"] for r in rows]
    assert times == sorted(times) and 0 < times[-1] <= elapsed
    assert [r["step"] for r in rows if "val/loss" in r] == [3, 4]
    assert rows[0]["train/ppl"] == pytest.approx(2.718281828 ** rows[0]["train/loss"], rel=1e-6)
    assert history[-1]["val/loss"] == rows[-1]["val/loss"]


@pytest.mark.parametrize("saves", ["sync", "async"])
def test_a_run_that_never_saves_writes_no_checkpoint_and_a_signal_stops_it_unsaved(saves, tiny_data_dir, tmp_path,
                                                                                   caplog):
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=400", "--checkpoint.every=0",
                                  f"--checkpoint.async={saves == 'async'}"), init_distributed("cpu"))
    trainer.after_step.append(lambda step: step == 2 and signal.raise_signal(signal.SIGTERM))
    with caplog.at_level(logging.INFO, logger="lm"):
        trainer.fit()
    assert trainer.step == 2 and not (tmp_path / "run/checkpoints").exists()
    assert "stopped at step 2 by SIGTERM; nothing saved (checkpoint.every=0)" in caplog.text
    assert trainer.background is None and "host copy" not in caplog.text  # none allocated (pinned on a GPU) for no save
    finished = tiny_config(tiny_data_dir, tmp_path / "finished", "--train.steps=2", "--checkpoint.every=0")
    assert Trainer(finished, init_distributed("cpu")).fit()[-1]["step"] == 2
    assert not (tmp_path / "finished/checkpoints").exists()  # nor at the end of the run


def test_a_stop_under_checkpoint_async_says_saved_once_the_checkpoint_is_published(tiny_data_dir, tmp_path, caplog):
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_data_dir, out, "--train.steps=400", "--log.every=2", "--checkpoint.every=1000",
                                  "--checkpoint.async=true"), init_distributed("cpu"))
    write = trainer.engine.write_staged

    def slow_write(staged, directory):
        time.sleep(1)
        write(staged, directory)

    trainer.engine.write_staged = slow_write
    published = []

    class AtTheStopLine(logging.Handler):
        def emit(self, record):
            if "stopped at step" in record.getMessage():
                published.append([p.name for p in complete_checkpoints(out / "checkpoints")])

    trainer.after_step.append(lambda step: step == 1 and signal.raise_signal(signal.SIGTERM))
    logging.getLogger("lm").addHandler(handler := AtTheStopLine())
    try:
        trainer.fit()
    finally:
        logging.getLogger("lm").removeHandler(handler)
    assert published == [["step_00000002"]]  # the line came while the background write still ran


def test_resume_modes(tiny_data_dir, tmp_path):
    env = init_distributed("cpu")
    with pytest.raises(CheckpointError, match="checkpoint.resume=required, but .* holds no complete checkpoint"):
        Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--checkpoint.resume=required"), env)
    Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=3"), env).fit()
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="checkpoint.resume=never, but .* already holds checkpoints"):
        Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--checkpoint.resume=never"), env)
    with pytest.raises(Exception, match="model.d_model: 32 -> 64"):
        Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--model.d_model=64"), env)
    assert before == {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}


@pytest.mark.parametrize("norm", [["--model.norm=layernorm"], ["--model.norm=rmsnorm", "--model.qk_norm=true",
                                                                 "--model.pos=rope"]], ids=["layernorm", "rmsnorm"])
def test_no_weight_decay_on_biases_norms_embeddings(norm):
    cfg = load_config(None, ["--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", *norm])
    model = GPT(cfg.model)
    decay, no_decay = build_optimizer(model, cfg.optim, [model.lm_head]).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and p.dim() == 2 for p in decay["params"])
    norms = {n for n, m in model.named_modules() if type(m).__name__ in ("LayerNorm", "RMSNorm")}
    assert norms and {f"{n}.weight" for n in norms} <= {names[id(p)] for p in no_decay["params"]}
    assert "wte.weight" in {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.process
def test_two_process_ddp_loss_falls_and_its_checkpoint_loads_in_one(tiny_data_dir, tmp_path, capsys):
    # on the session's 2-rank pool: the launcher is not what this checks (tests/test_launch.py runs torchrun)
    out = tmp_path / "ddp"
    history = train(2, out, tiny_data_dir, "--train.steps=20", "--train.batch_size=8", "--train.eval_every=20",
                    "--checkpoint.every=20", "--optim.lr=1e-2")
    losses = [history[step] for step in sorted(history)]
    assert len(losses) == 20
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4
    log = (tmp_path / "ddp.log").read_text()
    assert "step 20/20 | loss" in log and "val ppl" in log
    # each rank wrote its own shard, and no wrapper prefix leaked into the saved names
    step_dir = out / "checkpoints/step_00000020"
    assert {p.name for p in step_dir.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    keys = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata.keys()
    assert "model.wte.weight" in keys
    assert not [k for k in keys if "module." in k or "_orig_mod" in k]
    assert json.loads((step_dir / "state.json").read_text())["world_size"] == 2
    # a checkpoint written by 2 ranks loads whole on one process, for sampling and evaluation
    capsys.readouterr()
    assert run(sample.main, ["--checkpoint", str(out), "--max-new-tokens", "5", "--prompt", "KING:"]) == 0
    assert run(eval_tool.main, ["--checkpoint", str(out), "--max-tokens", "100"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("KING:") and "tokens scored: 99" in printed


@pytest.fixture(scope="module")
def two_step_run(tiny_data_dir, tmp_path_factory) -> Path:
    """A run directory of TINY trained 2 steps eagerly, with TensorBoard on (which changes no loss): its events,
    metrics and step-2 checkpoint. Read-only, shared by the module's tests."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    Trainer(tiny_config(tiny_data_dir, out, "--train.steps=2", "--log.tensorboard=true"), init_distributed("cpu")).fit()
    return out


def metrics_rows(out: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_receives_the_logged_scalars(two_step_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = two_step_run
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/ppl", "train/lr", "train/grad_norm", "perf/tokens_per_s", "val/loss", "val/ppl"}
    assert expected <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    rows = metrics_rows(out)
    assert events.Scalars("val/loss")[0].value == pytest.approx(rows[-1]["val/loss"], rel=1e-6)


def test_an_lstms_biases_are_not_decayed_and_muon_is_refused_it():
    cfg = load_config("configs/demo.yaml", ["--model.arch=lstm", "--model.n_layer=2", "--model.d_model=16"])
    model = family_of(cfg.model).build(cfg.model)
    decay, no_decay = build_optimizer(model, cfg.optim, [model.lm_head]).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() == 2 for p in decay["params"])  # nn.LSTM names its biases bias_ih_l0, bias_hh_l0
    assert {names[id(p)] for p in no_decay["params"]} >= {"layers.0.bias_ih_l0", "layers.1.bias_hh_l0"}
    # Muon steps nn.Linear matrices; an LSTM's are its own, so muon would have trained as plain AdamW
    with pytest.raises(ConfigError, match=r"optim.name: muon steps a model's hidden nn.Linear matrices, and an LSTM "
                                          r"\(model.arch=lstm\) has none; use optim.name=adamw"):
        load_config("configs/demo.yaml", ["--model.arch=lstm", "--optim.name=muon"])


def test_a_resumed_run_steps_with_the_optimizer_settings_it_is_given(tiny_data_dir, tmp_path, caplog):
    env = init_distributed("cpu")
    Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=3"), env).fit()
    caplog.set_level(logging.INFO, logger="lm")
    changed = ["--train.steps=4", "--optim.weight_decay=0.5", "--optim.beta2=0.9", "--optim.eps=1e-6"]
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", *changed), env)
    assert trainer.step == 3 and any("optim.weight_decay 0.1 -> 0.5" in m for m in caplog.messages)
    decay, no_decay = trainer.engine.optimizer.param_groups  # the checkpoint's state, not its settings
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.5, 0.0)
    assert decay["betas"] == no_decay["betas"] == (0.9, 0.9) and decay["eps"] == no_decay["eps"] == 1e-6
    assert all(trainer.engine.optimizer.state[p]["step"] == 3 for p in decay["params"])


def test_another_seed_resumes_only_when_told_and_then_reads_in_the_new_order(tiny_data_dir, tmp_path, caplog):
    out, env = tmp_path / "run", init_distributed("cpu")
    Trainer(tiny_config(tiny_data_dir, out, "--train.steps=2", "--checkpoint.every=2"), env).fit()
    reseeded = ["--train.steps=3", "--checkpoint.every=2", "--train.seed=7"]
    with pytest.raises(CheckpointError, match=r"read its samples in the order of train.seed=1337, now 7"):
        Trainer(tiny_config(tiny_data_dir, out, *reseeded), env)
    caplog.set_level(logging.WARNING, logger="lm.checkpoint")
    trainer = Trainer(tiny_config(tiny_data_dir, out, *reseeded, "--checkpoint.allow_data_change=true"), env)
    assert trainer.step == 2 and any("going on in the new order" in m for m in caplog.messages)


def test_a_resumed_run_replaces_tensorboards_points_after_its_checkpoint(tiny_data_dir, tmp_path):
    # a run killed after step 4, its last checkpoint step 2: the steps after 2 are trained and logged again
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, env = tmp_path / "run", init_distributed("cpu")
    flags = ["--train.steps=4", "--checkpoint.every=2", "--log.tensorboard=true"]
    Trainer(tiny_config(tiny_data_dir, out, *flags), env).fit()
    shutil.rmtree(out / "checkpoints/step_00000004")
    Trainer(tiny_config(tiny_data_dir, out, *flags, "--optim.lr=3e-3"), env).fit()  # other losses from step 3
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    read = {row["step"]: row["train/loss"] for row in read_metrics(out) if "train/loss" in row}
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == pytest.approx(list(read.items()), rel=1e-6)
    assert list(read) == [1, 2, 3, 4] and len(metrics_rows(out)) > len(read_metrics(out))


@pytest.mark.slow
def test_compiled_training_matches_eager_and_saves_bare_names(tiny_data_dir, tmp_path, two_step_run):
    eager = metrics_rows(two_step_run)  # the same 2 steps, eager
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "compiled", "--train.steps=2", "--train.compile=true"),
                      init_distributed("cpu"))
    assert all(block._compiled_call_impl is not None for block in trainer.model.blocks)  # really compiled
    compiled = trainer.fit()
    for step, loss in train_losses(eager).items():
        assert train_losses(compiled)[step] == pytest.approx(loss, rel=1e-4)
    reader = dcp.FileSystemReader(str(tmp_path / "compiled/checkpoints/step_00000002"))
    keys = reader.read_metadata().state_dict_metadata
    assert "model.wte.weight" in keys and not [k for k in keys if "_orig_mod" in k]


def tensorboard_events(tb_dir):
    """(step, tag, plugin, summary value) of every plugin summary in a run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [(event.step, value.tag, value.metadata.plugin_data.plugin_name, value)
            for path in sorted(tb_dir.glob("events.out.tfevents.*")) for event in EventFileLoader(str(path)).Load()
            for value in event.summary.value]


def test_tensorboard_holds_the_hparams_and_the_periodic_samples(tiny_data_dir, tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    from lm.tokenizer import load_tokenizer
    from lm.training.samples import sample_options

    out = tmp_path / "tb_run"
    cfg = tiny_config(tiny_data_dir, out, "--train.steps=4", "--log.tensorboard=true", "--log.sample_every=2",
                      "--log.sample_prompt=KING: the", "--log.sample_tokens=6")
    trainer = Trainer(cfg, init_distributed("cpu"))
    trainer.fit()
    events = tensorboard_events(out / "tb")
    start = [v for _, tag, plugin, v in events if tag == "_hparams_/session_start_info"]
    assert len(start) == 1 and all(plugin == "hparams" for _, tag, plugin, _ in events if tag.startswith("_hparams_"))
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start[0].metadata.plugin_data.content)
    values = hparams.session_start_info.hparams
    assert values["model.n_layer"].number_value == 2 and values["optim.lr"].number_value == pytest.approx(3e-3)
    assert values["model.arch"].string_value == "gpt" and values["params"].number_value == trainer.n_params
    samples = {step: v.tensor.string_val[0].decode() for step, tag, plugin, v in events if plugin == "text"}
    assert sorted(samples) == [2, 4] and all(text.startswith("KING: the") for text in samples.values())
    # the step-4 text is what the final weights write for the fixed prompt and seed
    model = GPT(cfg.model)
    load_model_weights(out / "checkpoints/step_00000004", model)
    with torch.no_grad():
        again = trainer.family.sampler.sample(model, load_tokenizer("gpt2"), cfg.log.sample_prompt,
                                      sample_options(cfg, torch.device("cpu")))
    assert samples[4] == again
    assert len(samples[4]) > len("KING: the")


def test_a_finished_run_run_again_trains_nothing_and_writes_nothing(trained_run, tmp_path):
    import hashlib

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    cfg = load_config(run_dir / "config.yaml", [f"--train.out_dir={run_dir}", "--log.tensorboard=true",
                                                "--log.every=1"])  # settings that would rewrite config.yaml

    def digest() -> dict[str, str]:
        return {p.relative_to(run_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
                for p in sorted(run_dir.rglob("*"))}

    before = digest()
    assert Trainer(cfg, init_distributed("cpu")).fit() == []
    assert digest() == before


def test_the_routers_balancing_bias_moves_with_the_learning_rate_schedule(tiny_data_dir, tmp_path):
    # one step of warmup's four: the learning rate is a quarter of its peak, and so is each bias's sign step
    moe = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.expert_d_ff=16",
           "--model.router_bias_rate=0.08", "--model.aux_loss_coef=0", "--schedule.warmup_steps=4"]
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=1", *moe),
                      init_distributed("cpu"))
    trainer.fit()
    biases = torch.stack([m.score_bias for name, m in trainer.engine.model.named_modules()
                          if name.endswith("router")])  # (layers, experts)
    assert biases.shape == (2, 4)
    steps = biases.abs().flatten()
    assert ((steps == 0) | torch.isclose(steps, torch.tensor(0.02))).all() and steps.max() > 0.019  # not 0.08
    # a resume may move the bias at another rate above 0: the bias comes back and goes on from where it was
    env = init_distributed("cpu")
    Trainer(tiny_config(tiny_data_dir, tmp_path / "again", "--train.steps=3", "--checkpoint.every=2", *moe), env).fit()
    slower = [*moe[:3], "--model.router_bias_rate=0.04", *moe[4:]]
    resumed = Trainer(tiny_config(tiny_data_dir, tmp_path / "again", "--train.steps=4", *slower), env)
    assert resumed.step == 3 and resumed.model.cfg.router_bias_rate == 0.04
    saved = torch.stack([m.score_bias for name, m in resumed.engine.model.named_modules() if name.endswith("router")])
    assert saved.abs().max() > 0.019  # the checkpoint's bias, not a fresh zero one
    resumed.fit()
    # but not to 0, which drops the bias the model routes by
    with pytest.raises(ConfigError, match=r"different model shape \(model.router_bias_rate: 0.04 -> 0.0\)"):
        Trainer(tiny_config(tiny_data_dir, tmp_path / "again", "--train.steps=5", *moe[:3],
                            "--model.router_bias_rate=0", *moe[4:]), env)


def test_a_val_split_smaller_than_train_eval_batches_is_said_at_the_start(tiny_data_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lm.train")
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.eval_batches=100000"),
                      init_distributed("cpu"))
    scored = trainer.data.val_windows[0].num_samples // 2
    assert f"the val split holds {scored} micro-batches of 2 windows per rank (of 1 data-parallel): an evaluation " \
           "scores these, not train.eval_batches=100000" in caplog.text


def test_validation_is_the_mean_over_the_micro_batches_it_scored(tiny_data_dir, tmp_path):
    """A val split smaller than train.eval_batches is scored whole: its loss is the mean over the micro-batches
    there are, the same as with train.eval_batches set to exactly that many (not a sum over a nominal count)."""
    env = init_distributed("cpu")
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.eval_batches=100000"), env)
    cfg = trainer.cfg
    scored = trainer.data.val_windows[0].num_samples // cfg.train.micro_batch_size
    exact = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=scored))
    whole = evaluate(trainer.engine, trainer.family, trainer.data, cfg, env)["val/loss"]
    assert whole == pytest.approx(evaluate(trainer.engine, trainer.family, trainer.data, exact, env)["val/loss"],
                                  rel=1e-6)
    assert 9 < whole < 12  # an untrained model over gpt2's 50,257 ids scores about ln(50257) = 10.8
    trainer.lock.release()


def test_training_goes_on_in_training_mode_after_an_evaluation(tiny_data_dir, tmp_path):
    """An evaluation switches the model to eval mode and back: the steps after it train with dropout on."""
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=2", "--train.eval_every=1",
                                  "--model.dropout=0.1"), init_distributed("cpu"))
    trainer.fit()
    assert all(module.training for module in trainer.engine.model.modules())


def test_checkpoint_keep_holds_under_checkpoint_async(tiny_data_dir, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny_config(tiny_data_dir, out, "--train.steps=4", "--checkpoint.every=1", "--checkpoint.keep=2",
                        "--checkpoint.async=true"), init_distributed("cpu")).fit()
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


def test_the_initial_weights_are_drawn_from_train_seed_alone(tiny_data_dir, tmp_path):
    """The weights a new run starts from depend on train.seed, and on nothing else that drew random numbers before."""
    env = init_distributed("cpu")

    def initial(seed, name):
        torch.manual_seed(1000 + len(name))  # whatever ran before in this process
        trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / name, f"--train.seed={seed}"), env)
        trainer.lock.release()
        return {k: v.clone() for k, v in trainer.engine.model.state_dict().items()}

    a, again, other = initial(1, "a"), initial(1, "again"), initial(2, "other_seed")
    assert all(torch.equal(a[k], again[k]) for k in a)
    assert not torch.equal(a["wte.weight"], other["wte.weight"])


class Window:
    """A window of 3000 token positions (every rank's) over 2 seconds, its loss 2."""

    def read(self, env):
        return {"loss": 2.0}, 3000, 2.0


def test_throughput_counts_every_ranks_tokens_and_mfu_is_each_devices_share_of_six_flops_per_parameter(
        tiny_data_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run"), init_distributed("cpu"))
    try:
        cfg = trainer.cfg
        per_token = flops_per_token(cfg.model, cfg.data.seq_len, cfg.data)
        assert trainer.flops_per_token == per_token
        trainer.metrics = MetricLogger(tmp_path / "run", enabled=False, tensorboard=False)
        trainer.peak_flops = 1e12  # a device of 1 TFLOP/s
        trainer.env = dataclasses.replace(trainer.env, world_size=4)  # the window's tokens are 4 ranks'
        row = trainer._log_train(Window(), 1e-3, torch.tensor(0.5))
        assert row["perf/tokens_per_s"] == 1500.0
        assert row["perf/tflops_per_device"] == pytest.approx(per_token * 1500 / 4 / 1e12, rel=1e-12)
        assert row["perf/mfu"] == pytest.approx(per_token * 1500 / 4 / 1e12, rel=1e-12)
        assert row["train/loss"] == 2.0 and row["train/ppl"] == pytest.approx(2.718281828459045 ** 2)
        assert row["train/lr"] == 1e-3 and row["train/grad_norm"] == 0.5
    finally:
        trainer.lock.release()


def test_every_log_every_steps_a_line_of_that_windows_tokens_at_the_learning_rate_its_last_step_took(
        tiny_data_dir, tmp_path, monkeypatch):
    from lm.training import logger
    from lm.training.schedule import lr_at

    windows = []  # the token positions each train line read
    read = logger.TrainWindow.read

    def recorded(self, env):
        values, tokens, seconds = read(self, env)
        windows.append(tokens)
        return values, tokens, seconds

    monkeypatch.setattr(logger.TrainWindow, "read", recorded)
    trainer = Trainer(tiny_config(tiny_data_dir, tmp_path / "run", "--train.steps=5", "--log.every=2",
                                  "--checkpoint.every=0"), init_distributed("cpu"))
    history = trainer.fit()
    cfg = trainer.cfg
    rows = [row for row in history if "train/loss" in row]
    assert [row["step"] for row in rows] == [2, 4, 5]  # and the last step, which ends the run
    assert windows == [2 * 4 * 16, 2 * 4 * 16, 1 * 4 * 16]  # steps x train.batch_size x data.seq_len
    # the learning rate step n trained at: lr_at(n - 1), the warmup's (n / 2) x 3e-3 over its first two steps
    assert [row["train/lr"] for row in rows] == [lr_at(s - 1, cfg.optim.lr, cfg.schedule, cfg.train.steps)
                                                 for s in (2, 4, 5)]
    assert rows[0]["train/lr"] == pytest.approx(3e-3)
