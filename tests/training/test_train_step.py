"""One update (`trainer.train_step`): the gradient norm it reports is the norm before clipping, and clipping applies."""

import copy
import dataclasses

import torch

from tests.conftest import tiny_model
from transformer.config import Config, DataConfig, TrainingConfig
from transformer.data import make_batch
from transformer.training.loss import LossComputation, batch_loss
from transformer.training.trainer import train_step


def _setup(clip: float):
    model = tiny_model(seed=1).train()
    training = dataclasses.replace(TrainingConfig(), clip_grad_norm=clip, precision="fp32")
    config = Config(model.config, DataConfig(path="unused"), training)
    batch = make_batch([[5, 6, 7, 2], [8, 9, 2]], [[4, 5, 6], [7, 8]])
    return model, config, batch


def test_reported_gradient_norm_is_the_norm_before_clipping():
    model, config, batch = _setup(clip=1e-3)
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    loss, _ = batch_loss(LossComputation(reference, config.training.label_smoothing), batch)
    (loss / batch.n_tgt_tokens).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()
                                                     if p.grad is not None]))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    torch.manual_seed(0)  # the same dropout masks as the reference pass
    _, _, grad_norm = train_step(LossComputation(model, config.training.label_smoothing), optimizer, [batch], config)
    torch.testing.assert_close(grad_norm, expected, rtol=1e-5, atol=1e-6)
    assert grad_norm > 1e-3  # larger than the clip: it was measured before clipping
    # SGD with lr 1 moves the weights by exactly the clipped gradient, whose norm is the clip
    step = torch.linalg.vector_norm(torch.stack([(a - p.detach()).norm() for a, p in zip(before, model.parameters())]))
    torch.testing.assert_close(step, torch.tensor(1e-3), rtol=1e-3, atol=1e-7)
