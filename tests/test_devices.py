"""The model, decoding and training-step properties on every device: CPU always, CUDA when a GPU is present
(`pytest -m cuda` runs only the CUDA half; `scripts/gpu_check.py` runs it on a GPU machine)."""

import copy
import dataclasses

import pytest
import torch

from tests.conftest import PAD, random_tokens, search_options, tiny_model
from transformer.config import EOS_ID, Config, DataConfig, TrainingConfig
from transformer.data import make_batch
from transformer.decoding.beam import beam_search
from transformer.decoding.greedy import greedy_decode
from transformer.training.loss import LossComputation
from transformer.training.trainer import train_step


def _atol(device: torch.device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-4  # GPU kernels (SDPA's fused attention) round differently


@pytest.fixture(params=[False, True], ids=["post-norm", "pre-norm"])
def model_on(request, device):
    return tiny_model(norm_first=request.param).to(device)


def test_no_future_leak(model_on, device):
    src = random_tokens(2, 6, 23).to(device)
    tgt_in = random_tokens(2, 8, 29, seed=1).to(device)
    with torch.no_grad():
        base = model_on(src, tgt_in)
        for t in (1, 4, 7):
            changed = tgt_in.clone()
            changed[:, t:] = random_tokens(2, 8 - t, 29, seed=10 + t).to(device)
            out = model_on(src, changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=_atol(device), rtol=0)
            assert not torch.allclose(out[:, t:], base[:, t:], atol=1e-3)


def test_padding_does_not_change_outputs(model_on, device):
    src = random_tokens(2, 6, 23, lengths=[6, 3]).to(device)
    tgt_in = random_tokens(2, 5, 29, lengths=[5, 2], seed=1).to(device)
    with torch.no_grad():
        base = model_on(src, tgt_in)
        padded = model_on(torch.cat([src, torch.full((2, 9), PAD, device=device)], 1),
                          torch.cat([tgt_in, torch.full((2, 4), PAD, device=device)], 1))
    torch.testing.assert_close(padded[0, :5], base[0, :5], atol=_atol(device), rtol=0)
    torch.testing.assert_close(padded[1, :2], base[1, :2], atol=_atol(device), rtol=0)


def test_cached_incremental_decoding_equals_full_pass(model_on, device):
    src = random_tokens(3, 7, 23, lengths=[7, 5, 2]).to(device)
    tgt_in = random_tokens(3, 9, 29, seed=2).to(device)
    with torch.no_grad():
        mask = model_on.src_key_padding_mask(src)
        memory = model_on.encode(src, mask)
        full = model_on.decode(tgt_in, memory, mask)
        cache = model_on.new_cache(memory, mask)
        for t in range(9):
            torch.testing.assert_close(model_on.decode_step(tgt_in[:, t], cache), full[:, t], atol=_atol(device),
                                       rtol=0)


def _sources(device):
    lengths = [7, 3, 5, 1, 6]
    src = random_tokens(5, 7, 23, lengths=lengths)
    for i, n in enumerate(lengths):
        src[i, n - 1] = EOS_ID
    return src.to(device), src.eq(PAD).to(device)


def test_beam_one_equals_greedy_and_a_batch_equals_each_sentence_alone(device):
    model = tiny_model(seed=3, tgt_vocab_size=10).to(device)
    src, mask = _sources(device)
    options = search_options(max_len_b=8)
    greedy = greedy_decode(model, src, mask, options)
    beam1 = beam_search(model, src, mask, search_options(beam_size=1, length_penalty=0.0, max_len_b=8))
    assert [h.tokens for h in greedy] == [b[0].tokens for b in beam1]
    four = search_options(beam_size=4, n_best=4, max_len_b=8)
    beam4 = beam_search(model, src, mask, four)
    for i in range(src.size(0)):
        row = src[i:i + 1, : int((~mask[i]).sum())]
        alone = beam_search(model, row, row.eq(PAD), four)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in beam4[i]]
        assert greedy_decode(model, row, row.eq(PAD), options)[0].tokens == greedy[i].tokens


def test_decoding_on_the_device_equals_the_cpu(device):
    model = tiny_model(seed=3, tgt_vocab_size=10)
    src, mask = _sources(torch.device("cpu"))
    options = search_options(beam_size=4, max_len_b=8)
    on_cpu = beam_search(model, src, mask, options)
    on_device = beam_search(copy.deepcopy(model).to(device), src.to(device), mask.to(device), options)
    assert [b[0].tokens for b in on_device] == [b[0].tokens for b in on_cpu]


# ---------------------------------------------------------------------------------------------------------------
# One training update under autocast and the fp16 gradient scaler (trainer.train_step).
# ---------------------------------------------------------------------------------------------------------------

def _update(device, precision="fp32", clip=0.0, scaler=None, batches=2, model=None):
    """One update over `batches` batches (gradient accumulation) with SGD(lr=1): returns (result, model). Without
    dropout: on CUDA, attention kernels differ between fp32 and autocast and draw their dropout masks differently."""
    model = (model or tiny_model(seed=1, dropout=0.0, attention_dropout=0.0)).to(device).train()
    training = dataclasses.replace(TrainingConfig(), clip_grad_norm=clip, precision=precision)
    config = Config(model.config, DataConfig(path="unused"), training)
    data = [make_batch([[5, 6, 7, 3], [8, 9, 3]], [[4, 5, 6], [7, 8]]),
            make_batch([[10, 11, 12, 13, 3]], [[9, 10, 11, 12]])][:batches]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    result = train_step(LossComputation(model, 0.1), optimizer, [b.to(device) for b in data], config,
                        scaler=scaler)
    return result, model


def _scaler(device):
    return torch.amp.GradScaler(device.type, init_scale=2.0 ** 16, growth_interval=1000)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_autocast_update_is_finite_and_close_to_fp32(device, precision):
    (loss32, _, norm32), model32 = _update(device)
    scaler = _scaler(device) if precision == "fp16" else None
    (loss, _, norm), model = _update(device, precision, scaler=scaler)
    assert torch.isfinite(loss) and torch.isfinite(norm)
    assert abs(loss.item() - loss32.item()) < 0.02 * loss32.item()
    assert abs(norm.item() - norm32.item()) < 0.05 * norm32.item()
    moved32 = torch.cat([(p - q).flatten() for p, q in zip(model32.parameters(), tiny_model(seed=1).to(device)
                                                           .parameters())])
    moved = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), tiny_model(seed=1).to(device)
                                                         .parameters())])
    assert torch.nn.functional.cosine_similarity(moved, moved32, dim=0) > 0.99  # the same update direction


def test_the_gradient_scaler_unscales_once_and_clips_unscaled_gradients(device):
    """With a scale of 2^16, an fp32 update through the scaler must equal the plain one: the reported norm is the
    unscaled gradient's (unscaled once per update over the accumulated batches) and clipping acts on it."""
    (_, _, plain_norm), plain = _update(device, clip=1e-3)
    (_, _, scaled_norm), scaled = _update(device, clip=1e-3, scaler=_scaler(device))
    torch.testing.assert_close(scaled_norm, plain_norm, rtol=1e-4, atol=0)
    assert plain_norm > 1e-3  # so clipping did act
    for p, q in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_an_overflowing_update_is_skipped_and_lowers_the_scale(device):
    model = tiny_model(seed=1)
    model.output_projection.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = copy.deepcopy(model.state_dict())
    scaler = _scaler(device)
    result, model = _update(device, scaler=scaler, model=model)
    assert result is None  # the trainer logs and counts it as a skipped update
    assert scaler.get_scale() == 2.0 ** 15
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.cpu(), before[name]), name
