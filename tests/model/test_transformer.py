"""Properties of the whole model: shapes, causality, padding, caching, parity with torch.nn.Transformer."""

import math

import pytest
import torch
from torch import nn

from tests.conftest import PAD, random_tokens, tiny_config, tiny_model
from transformer import ConfigError, Transformer, TransformerConfig
from transformer.model.attention import causal_mask
from transformer.model.layers import SinusoidalPositionalEncoding

ATOL = 1e-5


def test_shapes_and_dtypes_for_a_padded_batch(model):
    src = random_tokens(3, 7, 23, lengths=[7, 4, 1])
    tgt_in = random_tokens(3, 5, 29, lengths=[5, 2, 3], seed=1)
    logits = model(src, tgt_in)
    assert logits.shape == (3, 5, 29) and logits.dtype == torch.float32
    memory = model.encode(src)
    assert memory.shape == (3, 7, 32) and memory.dtype == torch.float32
    assert model.decode(tgt_in, memory, model.src_key_padding_mask(src)).shape == (3, 5, 29)
    assert torch.isfinite(logits).all()


def test_no_future_leak(model):
    src = random_tokens(2, 6, 23)
    tgt_in = random_tokens(2, 8, 29, seed=1)
    base = model(src, tgt_in)
    for t in range(1, 8):
        changed = tgt_in.clone()
        changed[:, t:] = random_tokens(2, 8 - t, 29, seed=10 + t)
        out = model(src, changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=ATOL, rtol=0)
        assert not torch.allclose(out[:, t:], base[:, t:], atol=1e-3)  # the later positions do see the change


def test_padding_does_not_change_outputs(model):
    src = random_tokens(2, 6, 23, lengths=[6, 3])
    tgt_in = random_tokens(2, 5, 29, lengths=[5, 2], seed=1)
    base = model(src, tgt_in)
    src_padded = torch.cat([src, torch.full((2, 9), PAD)], dim=1)
    tgt_padded = torch.cat([tgt_in, torch.full((2, 4), PAD)], dim=1)
    for s, t in [(src_padded, tgt_in), (src, tgt_padded), (src_padded, tgt_padded)]:
        out = model(s, t)
        torch.testing.assert_close(out[0, :5], base[0, :5], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[1, :2], base[1, :2], atol=ATOL, rtol=0)


def test_padding_mask_matters(model):
    """If the source padding mask were ignored, padding would change the outputs (guards the test above)."""
    src = random_tokens(1, 6, 23, lengths=[3])
    tgt_in = random_tokens(1, 4, 29, seed=1)
    memory = model.encode(src, torch.zeros_like(src, dtype=torch.bool))
    unmasked = model.decode(tgt_in, memory, None)
    assert not torch.allclose(unmasked, model(src, tgt_in), atol=1e-3)


def test_cached_incremental_decoding_equals_full_pass(model):
    src = random_tokens(3, 7, 23, lengths=[7, 5, 2])
    tgt_in = random_tokens(3, 9, 29, seed=2)
    src_mask = model.src_key_padding_mask(src)
    memory = model.encode(src, src_mask)
    full = model.decode(tgt_in, memory, src_mask)
    cache = model.new_cache(memory, src_mask)
    for t in range(9):
        step = model.decode_step(tgt_in[:, t], cache)
        assert step.shape == (3, 29)
        torch.testing.assert_close(step, full[:, t], atol=ATOL, rtol=0)
    assert cache.length == 9
    assert cache.self_attention[0].key.shape == (3, 4, 9, 8)
    # Several new positions at once after a cached prefix (offset causal mask).
    cache = model.new_cache(memory, src_mask)
    model.decode(tgt_in[:, :4], memory, src_mask, cache=cache)
    rest = model.decode(tgt_in[:, 4:], memory, src_mask, cache=cache)
    torch.testing.assert_close(rest, full[:, 4:], atol=ATOL, rtol=0)


def test_cache_select_reorders_rows(model):
    src = random_tokens(2, 5, 23, lengths=[5, 3])
    tgt_in = random_tokens(2, 4, 29, seed=3)
    mask = model.src_key_padding_mask(src)
    memory = model.encode(src, mask)
    full = model.decode(tgt_in, memory, mask)
    cache = model.new_cache(memory, mask)
    model.decode(tgt_in[:, :2], memory, mask, cache=cache)
    index = torch.tensor([1, 0, 1])
    cache.select(index, index)
    assert torch.equal(cache.memory, memory[index]) and torch.equal(cache.memory_key_padding_mask, mask[index])
    rest = torch.stack([model.decode_step(tgt_in[index, t], cache) for t in (2, 3)], dim=1)
    torch.testing.assert_close(rest, full[index, 2:], atol=ATOL, rtol=0)


def test_a_cache_for_beams_gives_each_row_its_sentence(model):
    """`new_cache(..., beam_size=g)`: rows i*g .. i*g + g-1 decode sentence i, as with the memory repeated."""
    src = random_tokens(2, 6, 23, lengths=[6, 3])
    mask = model.src_key_padding_mask(src)
    memory = model.encode(src, mask)
    g = 3
    tgt_in = random_tokens(2 * g, 5, 29, seed=4)
    repeated = model.decode(tgt_in, memory.repeat_interleave(g, 0), mask.repeat_interleave(g, 0))
    cache = model.new_cache(memory, mask, beam_size=g)
    stepped = torch.stack([model.decode_step(tgt_in[:, t], cache) for t in range(5)], dim=1)
    torch.testing.assert_close(stepped, repeated, atol=ATOL, rtol=0)


def test_explicit_attention_path_equals_fused_path(model):
    src = random_tokens(2, 6, 23, lengths=[6, 2])
    tgt_in = random_tokens(2, 5, 29, seed=4)
    logits, weights = model.forward_with_attention(src, tgt_in)
    torch.testing.assert_close(logits, model(src, tgt_in), atol=ATOL, rtol=0)
    assert len(weights.encoder_self) == 2 and len(weights.decoder_self) == 2 and len(weights.cross) == 2
    assert weights.cross[0].shape == (2, 4, 5, 6)
    assert (weights.cross[1][1, :, :, 2:] == 0).all()
    assert (weights.decoder_self[0].triu(1) == 0).all()


def test_dropout_only_in_training_mode():
    model = tiny_model()
    src, tgt_in = random_tokens(2, 5, 23), random_tokens(2, 4, 29, seed=1)
    torch.testing.assert_close(model(src, tgt_in), model(src, tgt_in))
    model.train()
    assert not torch.allclose(model(src, tgt_in), model(src, tgt_in))


def _copy_into_torch_transformer(ours: Transformer) -> nn.Transformer:
    c = ours.config
    ref = nn.Transformer(d_model=c.d_model, nhead=c.n_heads, num_encoder_layers=c.n_encoder_layers,
                         num_decoder_layers=c.n_decoder_layers, dim_feedforward=c.d_ff, dropout=0.0,
                         batch_first=True, norm_first=c.norm_first).eval()

    def copy_attention(dst: nn.MultiheadAttention, src) -> None:
        dst.in_proj_weight.copy_(src.in_proj.weight)
        dst.in_proj_bias.copy_(src.in_proj.bias)
        dst.out_proj.weight.copy_(src.out_proj.weight)
        dst.out_proj.bias.copy_(src.out_proj.bias)

    def copy_common(dst, src, norms) -> None:
        dst.linear1.load_state_dict(src.feed_forward.linear1.state_dict())
        dst.linear2.load_state_dict(src.feed_forward.linear2.state_dict())
        for name in norms:
            getattr(dst, name).load_state_dict(getattr(src, name).state_dict())

    with torch.no_grad():
        for dst, src in zip(ref.encoder.layers, ours.encoder.layers):
            copy_attention(dst.self_attn, src.self_attn)
            copy_common(dst, src, ["norm1", "norm2"])
        for dst, src in zip(ref.decoder.layers, ours.decoder.layers):
            copy_attention(dst.self_attn, src.self_attn)
            copy_attention(dst.multihead_attn, src.cross_attn)
            copy_common(dst, src, ["norm1", "norm2", "norm3"])
        if c.norm_first:
            ref.encoder.norm.load_state_dict(ours.encoder.final_norm.state_dict())
            ref.decoder.norm.load_state_dict(ours.decoder.final_norm.state_dict())
        else:  # nn.Transformer always adds a final LayerNorm; the paper's post-norm stack has none
            ref.encoder.norm = nn.Identity()
            ref.decoder.norm = nn.Identity()
    return ref


def test_parity_with_torch_nn_transformer(model):
    # Non-trivial LayerNorm and bias parameters, so that a swapped or skipped one shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    ref = _copy_into_torch_transformer(model)
    src = random_tokens(3, 7, 23, lengths=[7, 4, 2])
    tgt_in = random_tokens(3, 6, 29, seed=5)
    src_mask = model.src_key_padding_mask(src)
    with torch.no_grad():
        src_x = model.encoder.embedding(src) + model.encoder.positional_encoding(7)
        tgt_x = model.decoder.embedding(tgt_in) + model.decoder.positional_encoding(6)
        expected = ref(src_x, tgt_x, tgt_mask=causal_mask(6), src_key_padding_mask=src_mask,
                       memory_key_padding_mask=src_mask, tgt_is_causal=True)
        memory = model.encode(src, src_mask)
        hidden = model.decoder(tgt_in, memory, src_mask)
    torch.testing.assert_close(hidden, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(model.output_projection(hidden), model(src, tgt_in), atol=ATOL, rtol=0)


def test_positional_encoding_matches_section_3_5():
    pe = SinusoidalPositionalEncoding(d_model=8, max_positions=50)
    table = pe(50)
    for pos in (0, 1, 7, 49):
        for i in range(4):
            angle = pos / 10000 ** (2 * i / 8)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    torch.testing.assert_close(pe(3, start=5), table[5:8])


def test_too_long_sequence_names_both_lengths():
    model = tiny_model(max_positions=10)
    with pytest.raises(ValueError, match=r"11 positions.*max_positions=10"):
        model(random_tokens(1, 11, 23), random_tokens(1, 3, 29))


def test_embeddings_are_scaled_by_sqrt_d_model():
    model = tiny_model()
    tokens = torch.tensor([[5, 6]])
    torch.testing.assert_close(model.encoder.embedding(tokens),
                               model.encoder.embedding.weight[tokens] * math.sqrt(32))


def test_weight_tying():
    tied = tiny_model(tgt_vocab_size=23, share_all_embeddings=True)
    assert tied.output_projection.weight is tied.decoder.embedding.weight
    assert tied.encoder.embedding is tied.decoder.embedding
    target_only = tiny_model()
    assert target_only.output_projection.weight is target_only.decoder.embedding.weight
    assert target_only.encoder.embedding is not target_only.decoder.embedding
    untied = tiny_model(tie_embeddings=False)
    assert untied.output_projection.weight is not untied.decoder.embedding.weight
    assert untied.num_parameters() == target_only.num_parameters() + 29 * 32


@pytest.mark.parametrize("preset, expected, tolerance", [("base", 65e6, 0.05), ("big", 213e6, 0.02)])
def test_parameter_counts_match_table_3(preset, expected, tolerance):
    config = getattr(TransformerConfig, preset)(37000, 37000, share_all_embeddings=True)
    with torch.device("meta"):
        n = Transformer(config).num_parameters()
    assert abs(n - expected) / expected < tolerance, n


@pytest.mark.parametrize("changes, key", [
    (dict(d_model=30, n_heads=4), "model.d_model"),
    (dict(d_ff=0), "model.d_ff"),
    (dict(n_encoder_layers=-1), "model.n_encoder_layers"),
    (dict(dropout=1.0), "model.dropout"),
    (dict(activation="tanh"), "model.activation"),
    (dict(share_all_embeddings=True), "model.share_all_embeddings"),
])
def test_config_is_validated_on_creation(changes, key):
    with pytest.raises(ConfigError, match=key):
        tiny_config(**changes)


@pytest.mark.slow
def test_learns_to_copy():
    """A small model learns to copy random sequences: the training loss falls below 0.15 in 300 steps."""
    torch.manual_seed(0)
    config = tiny_config(src_vocab_size=12, tgt_vocab_size=12, d_model=64, d_ff=128, dropout=0.0,
                         attention_dropout=0.0, share_all_embeddings=True)
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.98))
    bos, eos = 2, 3
    for _ in range(300):
        seq = torch.randint(4, 12, (32, 8))
        src = torch.cat([seq, torch.full((32, 1), eos)], 1)
        tgt_in = torch.cat([torch.full((32, 1), bos), seq], 1)
        tgt_out = src
        loss = nn.functional.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.15, loss.item()
