"""One update (`trainer.train_step`): the gradient norm it reports is the norm before clipping, and clipping applies;
compiled (training.compile) it equals the eager update."""

import copy
import dataclasses
import logging

import pytest
import torch

from tests.conftest import random_tokens, tiny_model
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


@pytest.mark.slow
def test_compiled_updates_equal_eager_ones_and_the_loss_is_not_recompiled_per_shape(caplog):
    # training.compile wraps the LossComputation with torch.compile, as here. Ten batches of different shapes: the
    # chunked loss, left out of the compiled graph, must not make torch recompile it for each (8 is its limit).
    shapes = [(b, s, t) for b, s, t in zip(range(2, 12), range(13, 3, -1), range(3, 13))]  # 10 target row counts
    batches = [make_batch(random_tokens(b, s, 23, seed=i).tolist(), random_tokens(b, t, 29, seed=99 + i).tolist())
               for i, (b, s, t) in enumerate(shapes)]
    _, config, _ = _setup(clip=1.0)
    losses = {}
    for compiled in (False, True):
        model = tiny_model(seed=1, dropout=0.0, attention_dropout=0.0).train()
        module = LossComputation(model, config.training.label_smoothing)
        module = torch.compile(module) if compiled else module
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        dynamo_log = logging.getLogger("torch._dynamo")  # it does not propagate to the root logger
        dynamo_log.addHandler(caplog.handler)
        try:
            losses[compiled] = [train_step(module, optimizer, [batch], config)[0] for batch in batches]
        finally:
            dynamo_log.removeHandler(caplog.handler)
    torch.testing.assert_close(torch.stack(losses[True]), torch.stack(losses[False]), rtol=1e-4, atol=1e-4)
    assert not [r.getMessage() for r in caplog.records if "recompile" in r.getMessage()]
