import subprocess
import sys

import pytest

from lm.cli import run
from lm.config import load_config
from lm.models.encdec.config import EncDecConfig
from lm.models.encoder.config import EncoderConfig
from lm.models.gpt.config import GPTConfig
from lm.models.lstm.config import LSTMConfig
from lm.plan import counts
from lm.train import main as train_main
from tests.models import conv_family

SMALL = dict(vocab_size=97, block_size=16, d_model=16, n_head=2)


@pytest.mark.parametrize("cfg", [
    GPTConfig(**SMALL, n_layer=7),
    GPTConfig(**SMALL, n_layer=9, pos="rope", norm="rmsnorm", mlp="swiglu", nope_interval=4),
    GPTConfig(**SMALL, n_layer=11, n_experts=4, experts_per_token=2, moe_every=3, moe_first_dense=2),
    GPTConfig(**SMALL, n_layer=10, n_experts=4, experts_per_token=1, moe_every=2, moe_first_dense=5,
              n_shared_experts=1, expert_d_ff=8),
    GPTConfig(**SMALL, n_layer=6, n_experts=2, experts_per_token=1),
    EncDecConfig(**SMALL, n_layer=5),
    EncoderConfig(**SMALL, n_layer=6),
    LSTMConfig(vocab_size=97, n_layer=5, d_model=16),
    conv_family.ConvConfig(vocab_size=97, block_size=16, n_layer=6, d_model=16, kernel_size=3),
], ids=["gpt", "llama-nope", "moe-every-3", "moe-dense-first", "moe-all", "encdec", "encoder", "lstm", "outside"])
def test_a_deep_model_counted_off_shallow_ones_matches_the_built_one(cfg):
    assert counts.counts(cfg) == counts._built(cfg, cfg)


def test_a_plan_of_a_hundred_million_blocks_takes_seconds():
    # the count of a block is read once, not built 10^8 times (hours); the dense prefix is counted the same way.
    # A process with a timeout, so that a regression fails here instead of hanging the suite.
    deep = ["--model.n_layer=100000003", "--model.moe_first_dense=100000000"]
    done = subprocess.run([sys.executable, "-m", "lm.train", "--config", "configs/moe-tiny.yaml", "--dry-run", *deep],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    def built(n_layer, first_dense):
        model = load_config("configs/moe-tiny.yaml", [f"--model.n_layer={n_layer}",
                                                       f"--model.moe_first_dense={first_dense}"]).model
        return counts._built(model, model).total

    dense_block = built(6, 3) - built(5, 2)
    assert f"parameters: {built(5, 2) + (100_000_003 - 5) * dense_block:,}" in done.stdout


@pytest.mark.parametrize("dry", [True, False])
def test_a_weight_past_torchs_limit_is_one_error_line(dry, tiny_data_dir, tmp_path, capsys):
    # A real run reaches the model only with prepared data, so it gets the shared fixture's, not the demo's.
    out = tmp_path / "run"
    for d_model, error in ((2 ** 40, "error: model: a decoder-only GPT (model.arch=gpt) of this size has a weight "
                                     "larger than torch can hold (2^63 bytes): Storage size calculation overflowed"),
                           (2 ** 64, "error: model.d_model: 18446744073709551616 does not fit a 64-bit integer")):
        args = ["--config", "configs/demo.yaml", f"--model.d_model={d_model}", "--model.n_head=1",
                f"--data.dir={tiny_data_dir}", "--data.seq_len=16", f"--train.out_dir={out}",
                *(["--dry-run"] if dry else [])]
        assert run(train_main, args) == 2
        err = capsys.readouterr().err
        assert err.startswith(error) and "Traceback" not in err
        assert not out.exists()


def test_the_count_without_embeddings_leaves_out_the_learned_position_table():
    """What the sweep's scaling fits and the trainer's hparams take as N."""
    learned = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, d_model=16)
    assert counts.num_params(learned, non_embedding=True) == counts.num_params(learned) - 16 * 16
    rotary = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, d_model=16, pos="rope")
    assert counts.num_params(rotary, non_embedding=True) == counts.num_params(rotary)
