"""A checkpoint loaded for inference (`lm.checkpoint.loading.load_for_inference`)."""

import torch

from lm.checkpoint.loading import load_for_inference


def test_a_checkpoint_is_loaded_for_inference_in_eval_mode(trained_run):
    """Scoring and sampling must not run dropout (a model trained with model.dropout > 0 would score and sample
    differently on every call)."""
    model, _, _ = load_for_inference(trained_run, torch.device("cpu"))
    assert not model.training and not any(m.training for m in model.modules())
