"""What the text-to-text pipeline (`translate.Translator`) needs from an engine: `Engine`.

An engine decodes batches of source token ids into hypotheses; everything textual (tokenizing, copying unknown
text through, truncation, length-sorted batching, n-best selection, detokenizing) is the `Translator`'s, written
once for every engine. Two engines implement it: `pytorch.PyTorchEngine` (our model, the CPU decoders of
`transformer/fast/`, ensembles) and `ctranslate2.CTranslate2Engine` (an exported CTranslate2 folder). What an
engine can do is stated by its attributes, never found out by probing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from ..config import Config, DecodingConfig
from ..decoding import Hypothesis
from ..model import Transformer
from ..tokenizer import Tokenizer


@dataclass
class SourceBatch:
    """Sentences decoded together.

    Attributes:
        src_ids: per sentence, source token ids ending in eos (at most the engine's `max_source_len`), longest
            first.
        prefixes: per sentence, target ids its outputs must start with (None: free); None when no sentence has one.
    """

    src_ids: list[list[int]]
    prefixes: Optional[list[Optional[list[int]]]] = None


class Engine(Protocol):
    """A loaded model that decodes source ids (see the module docstring).

    Attributes:
        name: "pytorch" or "ctranslate2".
        config: the model's config: its sizes, languages and decoding defaults (`config.decoding`).
        tokenizer: the model's sentencepiece models.
        device: where it decodes ("cpu", "cuda:0", ...).
        max_source_len: the longest source the engine takes, in tokens (eos included); longer inputs are cut.
        attention_model: the readable model whose attention can be read (alignments, attention plots), or None
            when the engine has none (CTranslate2).
        parameters: the model's parameter count, where known (None for CTranslate2).
        quantization: the weight type it decodes with, where it was chosen at load time (None: as trained).
        compile: whether its decoding step is compiled (`transformer/fast/compiled.py`).
        workers: batches it decodes at once.
    """

    name: str
    config: Config
    tokenizer: Tokenizer
    device: str
    max_source_len: int
    attention_model: Optional[Transformer]
    parameters: Optional[int]
    quantization: Optional[str]
    compile: bool
    workers: int

    def search(
        self, batches: list[SourceBatch], options: DecodingConfig, scores: bool
    ) -> list[list[list[Hypothesis]]]:
        """Decode the batches of one call.

        Args:
            batches: the batches, in the order the pipeline made them.
            options: validated decoding options; `options.n_best` hypotheses are returned per sentence.
            scores: False when no scores are needed: every `Hypothesis.score` is then NaN.

        Returns:
            Per batch, per sentence, `options.n_best` hypotheses: a beam's best first (finished ones before those
            cut at the length cap), samples in the order drawn.
        """

    def warm_up(self) -> float:
        """Prepare what would otherwise slow the first requests (compilation); return the seconds it took."""
