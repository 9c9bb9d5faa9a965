"""An encoder over a window packed from several documents, with data.document_mask's positions: each
document's outputs are the ones it gets alone, for every kind of position encoding."""

import pytest
import torch

from lm.models.encoder.config import EncoderConfig
from lm.models.encoder.model import Encoder


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
def test_each_document_is_encoded_as_if_alone(pos):
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=50, n_layer=2, n_head=2, d_model=16, block_size=16, pos=pos)
    model = Encoder(cfg).eval()
    first, second = [cfg.cls_id, 5, 6, 7], [49, 8, 9]  # 49: an end-of-text token opens the second document
    ids = torch.tensor([first + second])  # (1, 7)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    with torch.no_grad():
        packed = model(ids, positions=positions)[0]  # (7, C)
        alone = torch.cat([model(torch.tensor([first]))[0], model(torch.tensor([second]))[0]])
        across = model(ids)[0]  # without positions: one sequence, attention across both
    assert (packed - alone).abs().max() < 1e-5
    assert (across - alone).abs().max() > 1e-3


def test_document_positions_combine_with_padding():
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, block_size=16)
    model = Encoder(cfg).eval()
    ids = torch.tensor([[cfg.cls_id, 5, 49, 8, cfg.pad_id, cfg.pad_id]])
    keep = torch.tensor([[True, True, True, True, False, False]])
    positions = torch.tensor([[0, 1, 0, 1, 2, 3]])
    with torch.no_grad():
        both = model(ids, keep, positions)[0, :4]
        alone = torch.cat([model(ids[:, :2])[0], model(ids[:, 2:4])[0]])
    assert (both - alone).abs().max() < 1e-5
