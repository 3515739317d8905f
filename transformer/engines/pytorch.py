"""Our own engine: the trained Transformer decoded by `decoding.search`, on the CPU through the speed paths of
`transformer/fast/` (`fast.decoder_for`), elsewhere through the readable model itself; several models decode as an
ensemble (`decoding/ensemble.py`)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from ..config import EOS_ID, Config, DecodingConfig, OptionError
from ..config.languages import reserved_pieces
from ..data import make_batch
from ..decoding import Hypothesis, search
from ..decoding.ensemble import EnsembleDecoder
from ..decoding.options import decoding_options
from ..decoding.rules import TargetRules
from ..fast import decoder_for
from ..model import Transformer
from ..tokenizer import Tokenizer
from .base import SourceBatch

logger = logging.getLogger(__name__)

# torch's intra-op thread count is one setting for the whole process: decoding with workers > 1 lowers it for the
# duration of the call, and this lock keeps two such calls (from two threads, two engines) from interleaving their
# save and restore, which would leave the process on the lowered count.
_THREAD_COUNT_LOCK = threading.Lock()


def check_workers(workers: int) -> None:
    """Raises OptionError unless `workers` (batches decoded at once) is at least 1."""
    if workers < 1:
        raise OptionError("{workers}: must be at least 1", workers=workers)


class PyTorchEngine:
    """Trained models decoding with `decoding.search` (the `Engine` protocol).

    Args:
        models: the Transformer, or several with one tokenizer (an ensemble); moved to `device`, put in eval mode.
            The first is `attention_model`, and its config gives the decoding defaults.
        tokenizer: their sentencepiece models.
        config: the first model's run config.
        device: where to decode.
        quantization: None (float32, as trained) or "int8": linear layers int8 dynamically quantized (CPU only).
        workers: batches decoded at once (CPU only), each in its own thread on torch's thread count divided by
            `workers` (at least 1), which `search` sets for the duration of the call and then restores. That count
            is process-wide: calls with workers > 1 from several threads take turns, and a one-worker call running
            beside one of them decodes on the lowered count. The outputs are the same.
        compile: decode with the incremental step compiled by torch.compile (`fast.CompiledDecoder`): compiled at
            the first greedy batch and the first beam search (or by `warm_up`); the same tokens. CPU only, one
            model; not with int8 or workers > 1.

    Raises:
        OptionError: naming the parameters: an unknown quantization, int8 on a device other than the CPU, or int8
            unavailable in this PyTorch build; workers < 1, or workers > 1 on a device other than the CPU; compile
            with int8, with workers > 1, with an ensemble or on a device other than the CPU.
    """

    name = "pytorch"

    def __init__(
        self,
        models: Transformer | list[Transformer],
        tokenizer: Tokenizer,
        config: Config,
        device: torch.device | str = "cpu",
        quantization: Optional[str] = None,
        workers: int = 1,
        compile: bool = False,
    ) -> None:
        members = models if isinstance(models, list) else [models]
        self._device = torch.device(device)
        check_workers(workers)
        if workers > 1 and self._device.type != "cpu":
            raise OptionError(
                f"{{workers}} decodes on the CPU only, not on {self._device}", workers=workers
            )
        if compile and workers > 1:  # compiled kernels keep the thread count they were compiled for
            raise OptionError(
                "{compile} decodes with one worker (on every thread), not {workers}",
                compile=True,
                workers=workers,
            )
        if compile and len(members) > 1:
            raise OptionError(
                "{compile} compiles one model's decoder, not an ensemble", compile=True
            )
        self.members = [m.to(self._device).eval() for m in members]
        self.attention_model: Optional[Transformer] = self.members[0]
        decoders = [decoder_for(m, quantization, compile) for m in self.members]
        self.decoder = decoders[0] if len(decoders) == 1 else EnsembleDecoder(decoders)
        self.tokenizer, self.config = tokenizer, config
        # the pieces sources carry as marks (language tokens, tags) are never written: `NextTokenRules.banned`
        self.banned_ids = tuple(tokenizer.token_id(p) for p in reserved_pieces(config.data))
        self.parameters: Optional[int] = self.members[0].num_parameters()
        self.quantization, self.compile, self.workers = quantization, compile, workers
        self.max_source_len = self.decoder.config.max_positions
        self._warned_oversubscribed = False

    @property
    def device(self) -> str:
        return str(self._device)

    def search(
        self, batches: list[SourceBatch], options: DecodingConfig, scores: bool
    ) -> list[list[list[Hypothesis]]]:
        """`Engine.search`: each batch by `decoding.search`; with workers > 1, several batches at once, longest
        first, each to the next free worker."""

        def decode(batch: SourceBatch) -> list[list[Hypothesis]]:
            with torch.no_grad():  # grad mode is per thread: a worker thread needs its own
                src = make_batch(batch.src_ids).to(self._device)
                return search(
                    self.decoder,
                    src.src,
                    src.src_key_padding_mask,
                    options,
                    TargetRules(batch.prefixes, self.banned_ids),
                    scores,
                )

        if self.workers == 1 or len(batches) < 2:
            return [decode(batch) for batch in batches]
        # concurrent multi-worker calls take turns (see the lock's comment)
        with _THREAD_COUNT_LOCK:
            threads = torch.get_num_threads()
            if self.workers > threads and not self._warned_oversubscribed:
                logger.warning(
                    "--workers %d with %d CPU threads: each worker gets one thread, so %d threads share "
                    "%d; --workers %d or fewer decodes without oversubscription",
                    self.workers,
                    threads,
                    self.workers,
                    threads,
                    threads,
                )
                self._warned_oversubscribed = True
            torch.set_num_threads(max(1, threads // self.workers))
            try:  # results come back in batch order
                with ThreadPoolExecutor(self.workers) as pool:
                    return list(pool.map(decode, batches))
            finally:
                torch.set_num_threads(threads)

    def warm_up(self) -> float:
        """With `compile`, compile now what would otherwise compile at the first greedy batch and the first beam
        search (20-60 s each): decode three short sentences both ways, three steps at least. For a server, whose
        first requests should not wait for it (`transformer serve --compile`). Without compile it does nothing.

        Returns:
            The seconds it took.
        """
        start = time.perf_counter()
        if self.compile:
            # Any ids: the sizes matter. Sizes that coincide here (sentences, source length, beams times sentences)
            # can be taken as equal by the compiler, which then compiles again for sizes where they differ.
            batch = SourceBatch([[5, 6, 7, 8, EOS_ID], [8, EOS_ID], [9, 10, EOS_ID]])
            for beam_size in (1, 2):
                options = decoding_options(
                    self.config.decoding,
                    beam_size=beam_size,
                    n_best=1,
                    min_len=3,
                    max_len_a=0.0,
                    max_len_b=4,
                )
                self.search([batch], options, scores=False)
        return time.perf_counter() - start
