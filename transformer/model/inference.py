"""A trained model made ready for fast decoding on the CPU: weight layout, and optional int8 quantization.

`for_cpu_decoding` returns a copy for inference only (it cannot be trained or saved as a checkpoint); `Translator`
uses it whenever it decodes on the CPU.

* Weight layout (float32). `nn.Linear` computes x·Wᵀ from W stored (out_features, in_features) row-major, which
  MKL's sgemm receives as a transposed operand. Storing the same W column-major (`W.t().contiguous().t()`: same
  shape, same values) hands sgemm two plain row-major operands, which it multiplies faster at decoding's small
  row counts (README, "Decoding speed"). The arithmetic is the same; only the summation order inside the kernel
  may differ (float rounding).
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
        quantization: None (float32, weights laid out column-major) or "int8".

    Returns:
        The copy, in eval mode.

    Raises:
        ValueError: the model is not on the CPU, an unknown quantization, or int8 without a quantized CPU
            engine in this PyTorch build.
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"for_cpu_decoding: the model is on {device}, not on the CPU")
    if quantization not in (None, "int8"):
        raise ValueError(f"quantization must be None or 'int8', got {quantization!r}")
    decoder = copy.deepcopy(model).eval()
    if quantization == "int8":
        return _quantize_int8(decoder)
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, nn.Linear):  # the tied output projection shares its weight with the embedding
                module.weight.data = module.weight.data.t().contiguous().t()
    return decoder


def _quantize_int8(model: Transformer) -> Transformer:
    if torch.backends.quantized.engine == "none":
        raise ValueError("this PyTorch build has no quantized CPU engine (fbgemm, onednn): int8 is unavailable")
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.split_projections()  # W^Q and [W^K; W^V] as whole layers, which quantization can replace
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
