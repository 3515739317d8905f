"""Speed paths on the CPU, for decoding and for training, apart from the readable model of `transformer/model/`.

A reader who skips this package loses nothing of the model: each decoder here computes what
`Transformer.decode_step` computes and is tested equal to it, and training's faster dropout keeps each element
with `nn.Dropout`'s probability, rounded to a multiple of 1/65,536 (tested in distribution). The searches
(`transformer/decoding/`) are typed against `decoding.IncrementalDecoder` (`encode`, `new_cache`, `decode_step`,
`config`), which the readable `Transformer` and every decoder here implement.

* `cpu.py`: `CPUDecoder`, the eager decoder `Translator` uses on the CPU: weight layouts, optional int8, the
  memory shared by a sentence's beams, attention on the cache in three operations.
* `layout.py`: column-major weights, the oneDNN output projection (`PackedLinear`), int8 dynamic quantization.
* `cache.py`: `CPUDecoder`'s preallocated key/value buffers.
* `compiled.py`: `CompiledDecoder`, `CPUDecoder`'s step compiled by torch.compile (`--compile`); `uncompiled`,
  the module inside torch.compile's wrapper (the training step's DDP module).
* `reductions.py`: `row_argmax` and `row_topk`, the searches' reductions over the vocabulary.
* `dropout.py`: a faster CPU dropout mask for training, swapped into the model by the trainer's one call
  `use_fast_cpu_dropout(model)` (the model itself uses `nn.Dropout`); docs/training.md.

Only this package uses private PyTorch APIs (`torch.ops.mkldnn`, `torch._dynamo`, `torch._inductor`, the
`_orig_mod` attribute of torch.compile's wrapper) and `torch.ao`'s quantization; `tests/test_layout.py` checks it.
Why each decoding path exists and what it gains: docs/decoding.md.
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import OptionError
from ..model import Transformer
from .compiled import CompiledDecoder
from .cpu import CPUDecoder

__all__ = ["CPUDecoder", "CompiledDecoder", "decoder_for"]


def decoder_for(
    model: Transformer, quantization: Optional[str] = None, compile: bool = False
) -> Union[Transformer, CPUDecoder, CompiledDecoder]:
    """The fastest decoder of this package for a trained model, on the model's device.

    Args:
        model: a trained Transformer in eval mode; it is not modified.
        quantization: None (as trained) or "int8" (CPU only).
        compile: the incremental step compiled by torch.compile (CPU only, float32).

    Returns:
        On the CPU a `CPUDecoder` (a `CompiledDecoder` with compile); elsewhere the model itself.

    Raises:
        OptionError: quantization or compile on a device other than the CPU, compile with int8, an unknown
            quantization, or int8 unavailable in this PyTorch build (naming the parameters).
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        if quantization:
            raise OptionError(
                f"{{quantization}} decodes on the CPU only, not on {device}",
                quantization=quantization,
            )
        if compile:
            raise OptionError(
                f"{{compile}} decodes on the CPU only (not tested on {device})", compile=True
            )
        return model
    if compile and quantization:
        raise OptionError(
            "{compile} works on float32 models, not with {quantization}",
            compile=True,
            quantization=quantization,
        )
    decoder = CPUDecoder(model, quantization)
    return CompiledDecoder(decoder) if compile else decoder
