
import pytest

from lm.config import load_config
from lm.data.config import DataConfig
from lm.models.encoder.config import EncoderConfig
from lm.models.encoder.model import Encoder
from lm.models.registry import get_family
from lm.plan.counts import flops_per_token, num_params
from lm.plan.memory import estimate_memory
from tests.plan.test_memory import saved_bytes

ENCODER = get_family("encoder")
TINY = dict(vocab_size=100, block_size=48, n_layer=2, n_head=2, d_model=16)


@pytest.mark.parametrize("changes", [
    {},                                                                    # tied masked-LM head, learned positions
    {"tie_embeddings": False, "norm_position": "post", "pos": "sinusoidal"},
    {"bias": False, "norm": "rmsnorm", "pos": "rope", "mlp": "swiglu", "n_kv_head": 1},
    {"head": "classify", "num_classes": 4, "pooling": "mean", "tie_embeddings": False},
    {"head": "regress", "bias": False},
], ids=["mlm", "mlm-untied-post", "mlm-llama-style", "classify", "regress"])
def test_encoder_parameter_count_equals_the_built_model(changes):
    cfg = EncoderConfig(**{**TINY, **changes})
    assert num_params(cfg) == sum(p.numel() for p in ENCODER.build(cfg).parameters())


@pytest.mark.parametrize("head", ["mlm", "classify"])
def test_encoder_flops_run_the_head_on_the_targets_alone(head):
    # counted on the parts of a built model here, from the whole model and the config in flops_per_token
    cfg = EncoderConfig(**TINY, head=head, num_classes=3 if head == "classify" else 0)
    model = Encoder(cfg)
    trunk = sum(p.numel() for p in [*model.blocks.parameters(), *model.emb_norm.parameters(),
                                    *model.ln_f.parameters()])
    if head == "mlm":
        head_weights = sum(p.numel() for p in [*model.mlm_dense.parameters(), *model.mlm_norm.parameters(),
                                               *model.lm_head.parameters()])  # the tied weight included
        per_window = 12  # round(0.3 * 39) targets in a window of 40 tokens
    else:
        head_weights, per_window = sum(p.numel() for p in model.score.parameters()), 1
    attention = 12 * 2 * 16 * 40
    expected = 6 * trunk + attention + 6 * head_weights * per_window / 40
    assert flops_per_token(cfg, 40, DataConfig()) == pytest.approx(expected, rel=1e-12)
    if head == "mlm":  # BERT's rate: 6 targets of 39
        assert flops_per_token(cfg, 40, DataConfig(mlm_rate=0.15)) == pytest.approx(
            6 * trunk + attention + 6 * head_weights * 6 / 40, rel=1e-12)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("setup", ["float32", "ddp-autocast", "fsdp-bf16"])
def test_encoder_activations_match_what_autograd_saves(setup, norm_position):
    engine, dtype = {"float32": ("ddp", "float32"), "ddp-autocast": ("ddp", "bfloat16"),
                     "fsdp-bf16": ("fsdp", "bfloat16")}[setup]
    cfg = load_config(None, ["--model.arch=encoder", f"--model.norm_position={norm_position}", "--model.n_layer=2",
                             "--model.n_head=4", "--model.d_model=64", "--model.block_size=64", "--data.seq_len=40",
                             f"--train.dtype={dtype}", "--train.micro_batch_size=3", "--train.batch_size=3",
                             f"--parallel.engine={engine}", "--train.device=cpu"])
    estimate = estimate_memory(cfg, 1)
    targets = 3 * 12  # three windows of 40 tokens, 12 targets each at the default 30%
    assert estimate.logits == targets * cfg.model.padded_vocab_size * 12
    # forward saves every counted tensor but the two fp32 gradients backward makes
    forward = estimate.activations - targets * cfg.model.padded_vocab_size * 8
    assert forward == pytest.approx(saved_bytes(cfg, setup == "fsdp-bf16", setup == "ddp-autocast"), rel=0.01)
