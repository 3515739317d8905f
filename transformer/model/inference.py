"""A trained model made ready for fast decoding on the CPU: weight layout, and optional int8 quantization.

`for_cpu_decoding` returns a copy for inference only (it cannot be trained or saved as a checkpoint); `Translator`
uses it whenever it decodes on the CPU.

* Float32 (the default). Every linear layer but the output projection keeps its weight column-major
  (`W.t().contiguous().t()`: same shape and values), which hands MKL's sgemm two plain row-major operands; the
  output projection (d_model x vocabulary, the largest product of a decoding step) runs oneDNN's kernel on its
  weight reordered once into oneDNN's blocked layout (`PackedLinear`, through `torch.ops.mkldnn`, the kernels
  torch.compile's CPU backend uses). Measured per layer shape (2 threads, AMD EPYC with AVX2; README, "Decoding
  speed"): oneDNN is 1.4-6x faster than sgemm on the 256 x 8,000 projection at 4-320 rows, but carries a fixed
  cost of about 50 us per call that makes it 1.2-4.5x slower on the 256 x 256 attention projections up to 64
  rows, and 1.8-3.4x slower on every other layer for a single row; on the 768- and 1,024-wide layers it was
  0.75-1.11x sgemm's time at 64 rows and 0.94-1.46x at 320 (end to end, greedy at batch 64 gained 2-5%).
  Where this PyTorch build has no oneDNN, the output projection is column-major too. Same
  arithmetic; only the summation order inside the kernels may differ (float rounding).
* Int8 dynamic quantization (`quantization="int8"`). Every linear layer — the attention projections W^Q, W^K,
  W^V, W^O, both feed-forward layers and the output projection — becomes PyTorch's dynamically quantized linear
  layer (`torch.ao`, fbgemm/oneDNN kernels): weights stored as int8 with one scale per output row (per-channel,
  as CTranslate2's int8), each call quantizes its input to uint8 with a scale from that input, multiplies in
  int8 and returns float32. Embeddings, LayerNorm, softmax and the search stay float32; the tied output
  projection gets its own int8 copy of the embedding matrix. Speed and BLEU change: README, "Decoding speed".
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch import nn

from .attention import MultiHeadAttention
from .transformer import Transformer


def for_cpu_decoding(model: Transformer, quantization: Optional[str] = None) -> Transformer:
    """A copy of `model` for decoding on the CPU (see the module docstring).

    Args:
        model: a trained Transformer on the CPU; it is not modified.
        quantization: None (float32: column-major weights, and a `PackedLinear` output projection where oneDNN is
            available) or "int8".

    Returns:
        The copy, in eval mode.

    Raises:
        ValueError: the model is not on the CPU or is already a decoding copy, an unknown quantization, or int8
            without a quantized CPU engine in this PyTorch build.
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"for_cpu_decoding: the model is on {device}, not on the CPU")
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")
    if not any(type(m) is nn.Linear for m in model.modules()):
        raise ValueError("for_cpu_decoding: this model is already a decoding copy; pass the trained model")
    decoder = copy.deepcopy(model).eval()
    if quantization == "int8":
        return _quantize_int8(decoder)
    _split_attention_projections(decoder)
    if PackedLinear.is_available():
        decoder.output_projection = PackedLinear(decoder.output_projection)  # a copy: the embedding keeps its own
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, nn.Linear):  # a tied output projection shares its weight with the embedding
                module.weight.data = module.weight.data.t().contiguous().t()
    return decoder


class PackedLinear(nn.Module):
    """y = x Wᵀ + b (inference only) by oneDNN on W reordered once into its blocked layout.

    Args:
        linear: the trained layer; its weight is copied (a tied output projection gets its own copy).

    Shapes: x `(..., in_features)` -> y `(..., out_features)`.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        # The plain weight too (not a buffer; tied: the embedding's own tensor), for `CompiledDecoding`.
        self.original_weight = linear.weight.detach()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def is_available() -> bool:
        """True when this PyTorch build has oneDNN and its (internal, torch.compile-facing) linear ops."""
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _split_attention_projections(model: Transformer) -> None:
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.split_projections()  # W^Q and [W^K; W^V] as whole layers, which can then be replaced


def _quantize_int8(model: Transformer) -> Transformer:
    if torch.backends.quantized.engine == "none":
        raise ValueError("this PyTorch build has no quantized CPU engine (fbgemm, onednn): int8 is unavailable")
    _split_attention_projections(model)
    with warnings.catch_warnings():
        # torch.ao's eager-mode quantization warns that it is deprecated in favour of the separate torchao
        # package, and that quantized tensor constructors will go; it is still PyTorch's own, tested path.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*deprecated")
        try:
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
        except ImportError as err:
            raise ValueError(f"int8 needs torch.ao.quantization, which PyTorch {torch.__version__} lacks") from err
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
