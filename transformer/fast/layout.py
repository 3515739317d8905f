"""Weight layouts and int8 quantization for decoding on the CPU.

* Column-major weights (`column_major_`): `W.t().contiguous().t()` has the same shape and values, and hands
  MKL's sgemm two plain row-major operands for y = x Wᵀ.
* `PackedLinear`: the output projection (d_model x vocabulary, the largest product of a decoding step) through
  oneDNN's kernel on its weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn`, the kernels
  torch.compile's CPU backend uses). oneDNN carries a fixed cost per call that makes it slower than sgemm on the
  small projections, so only the output projection takes it.
* `quantize_int8_`: every linear layer becomes PyTorch's dynamically quantized linear layer (`torch.ao`): int8
  weights with one scale per output row (per-channel, as CTranslate2's int8); each call quantizes its input to
  uint8 with a scale from that input, multiplies in int8 and returns float32. Embeddings, LayerNorm and softmax
  stay float32; a tied output projection gets its own int8 copy of the embedding matrix.

Measured effects: docs/decoding.md and docs/benchmarks.md.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..config import OptionError


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
        # The plain weight too (not a buffer; when tied, the embedding's own tensor), for the compiled step.
        self.original_weight = linear.weight.detach()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def is_available() -> bool:
        """True when this PyTorch build has oneDNN and its (internal, torch.compile-facing) linear ops."""
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


@torch.no_grad()
def column_major_(module: nn.Module) -> None:
    """Store the weight of every `nn.Linear` in `module` column-major, in place (a tied weight changes for every
    module that shares it: same values)."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            layer.weight.data = layer.weight.data.t().contiguous().t()


def quantize_int8_(module: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `module` by a dynamically quantized int8 layer (per-channel weights).

    Returns:
        the module, changed in place (or its replacement if it is itself an `nn.Linear`).

    Raises:
        OptionError: this PyTorch build has no quantized CPU engine (fbgemm, onednn) or no `torch.ao.quantization`.
    """
    if torch.backends.quantized.engine == "none":
        raise OptionError(
            "{quantization}: this PyTorch build has no quantized CPU engine (fbgemm, onednn)",
            quantization="int8",
        )
    with warnings.catch_warnings():
        # torch.ao's eager-mode quantization warns that it is deprecated in favour of the separate torchao
        # package, and that quantized tensor constructors will go; it is still PyTorch's own, tested path.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*deprecated")
        try:
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
        except ImportError as err:
            raise OptionError(
                f"{{quantization}} needs torch.ao.quantization, which PyTorch {torch.__version__} "
                "lacks",
                quantization="int8",
            ) from err
        return quantize_dynamic(
            module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )


def has_float_linear(module: nn.Module) -> bool:
    """True if some layer of `module` is a plain (float) `nn.Linear`, i.e. it is not int8-quantized."""
    return any(type(layer) is nn.Linear for layer in module.modules())
