"""The configuration sections: one dataclass per section of a YAML recipe, with every default and its meaning.

A YAML recipe mirrors the dataclasses section by section::

    model:    {d_model: 256, n_heads: 4, ...}      -> TransformerConfig (vocab sizes come from `data`)
    data:     {src_lang: de, tgt_lang: en, ...}    -> DataConfig
    training: {max_steps: 5000, ...}               -> TrainingConfig
    decoding: {beam_size: 4, ...}                  -> DecodingConfig

Each dataclass checks its values when built (`errors.ConfigError` naming the key path); reading YAML, type checks
and `--set` overrides are in `loading.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import _require
from .languages import Corpus, check_directions, check_synthetic, corpora_of

# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


ACTIVATIONS = ("relu", "gelu", "swish")
"""The feed-forward non-linearities `TransformerConfig.activation` takes."""


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and switches of the encoder-decoder Transformer (Vaswani et al. 2017, §3 and Table 3).

    Raises:
        ConfigError: on creation, when a size is not positive, d_model is not divisible by n_heads,
            a dropout is outside [0, 1), the activation is unknown, or full embedding sharing is asked
            for with two vocabularies of different size.
    """

    src_vocab_size: int
    """Number of source token ids (pieces), special tokens included."""
    tgt_vocab_size: int
    """Number of target token ids (pieces), special tokens included."""
    d_model: int = 512
    """Width of embeddings and of every sub-layer output (§3.1)."""
    n_heads: int = 8
    """Attention heads h; each head has d_head = d_model / n_heads (§3.2.2)."""
    d_ff: int = 2048
    """Inner width of the position-wise feed-forward network (§3.3)."""
    n_encoder_layers: int = 6
    """N for the encoder stack (§3.1)."""
    n_decoder_layers: int = 6
    """N for the decoder stack (§3.1)."""
    dropout: float = 0.1
    """P_drop on each sub-layer output and on the embedding sums (§5.4)."""
    attention_dropout: float = 0.0
    """Dropout on the attention weights (not in the paper; fairseq and tensor2tensor offer it)."""
    activation: str = "relu"
    """Feed-forward non-linearity: "relu" (paper, eq. 2), "gelu" or "swish" (x * sigmoid(x), Marian's)."""
    norm_first: bool = False
    """False: post-norm LayerNorm(x + Sublayer(x)) as in the paper; True: pre-norm with a final LayerNorm."""
    max_positions: int = 1024
    """Longest sequence (tokens) the positional encoding table covers."""
    tie_embeddings: bool = True
    """Share the decoder input embedding with the output projection (§3.4)."""
    share_all_embeddings: bool = False
    """Also share the encoder embedding (one joint vocabulary; §3.4 "the two embedding layers")."""
    output_bias: bool = False
    """A bias on the pre-softmax projection (not in the paper; Marian models have one)."""

    def __post_init__(self) -> None:
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_model",
            "n_heads",
            "d_ff",
            "n_encoder_layers",
            "n_decoder_layers",
            "max_positions",
        ):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value > 0,
                f"model.{name}",
                f"must be a positive integer, got {value!r}",
            )
        _require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}",
        )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"model.{name}", f"must be in [0, 1), got {value!r}")
        _require(
            self.activation in ACTIVATIONS,
            "model.activation",
            f"must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}",
        )
        if self.share_all_embeddings:
            _require(
                self.src_vocab_size == self.tgt_vocab_size,
                "model.share_all_embeddings",
                "sharing source, target and output embeddings needs one joint vocabulary "
                f"(got src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}); "
                "set data.joint_vocab: true, or keep only model.tie_embeddings (target and output)",
            )

    @property
    def d_head(self) -> int:
        """Width of one attention head, d_k = d_v = d_model / n_heads (§3.2.2)."""
        return self.d_model // self.n_heads

    @classmethod
    def base(cls, src_vocab_size: int, tgt_vocab_size: int, **changes: Any) -> "TransformerConfig":
        """The paper's "base" model (Table 3): N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1."""
        return cls(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, **changes)

    @classmethod
    def big(cls, src_vocab_size: int, tgt_vocab_size: int, **changes: Any) -> "TransformerConfig":
        """The paper's "big" model (Table 3): N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3."""
        sizes = dict(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3)
        sizes.update(changes)
        return cls(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, **sizes)


# --------------------------------------------------------------------------------------------------
# Data, training, decoding
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SynthesisConfig:
    """How a synthetic corpus is made: `made_by` of a `data.synthetic` entry. `transformer chain` writes the corpus
    with `transformer synthesize` when its folder has no origin.json, after training the models it names that are
    recipes (docs/training.md, "Chains")."""

    model: list[str]
    """The model that translates: a checkpoint file, or a recipe (a name ending in .yaml, relative to the recipe that
    names it) whose run `runs/<its name>` is trained first and whose best.pt translates. Several entries: an ensemble
    (their probabilities averaged)."""
    input: list[str]
    """Monolingual text files in the model's source language, plain or .gz (relative to the working directory)."""
    exclude: list[str] = field(default_factory=list)
    """Files whose lines are not translated (the parallel training text in the inputs' language: pairs the run has
    already)."""
    beam_size: int = 1
    """The search: 1 for greedy, else beam search of this width with the model's length penalty."""
    sampling: bool = False
    """Sample each translation from the model's distribution instead (Edunov et al. 2018); beam_size must be 1."""
    max_length_ratio: float = 3.0
    """Pairs where one side has more than this many times the other's words are dropped."""
    max_lines: int = 0
    """Translate only the first this many unique input lines (0: all), e.g. to try a chain at toy scale."""

    def __post_init__(self) -> None:
        _require(bool(self.model), "made_by.model", "name at least one checkpoint or recipe")
        _require(bool(self.input), "made_by.input", "name at least one monolingual text file")
        _require(
            self.beam_size >= 1, "made_by.beam_size", f"must be at least 1, got {self.beam_size}"
        )
        _require(
            not (self.sampling and self.beam_size > 1),
            "made_by.sampling",
            f"sampling draws one translation: beam_size must be 1, got {self.beam_size}",
        )
        _require(self.max_lines >= 0, "made_by.max_lines", f"must be >= 0, got {self.max_lines}")
        _require(
            self.max_length_ratio >= 1,
            "made_by.max_length_ratio",
            f"must be at least 1, got {self.max_length_ratio}",
        )


@dataclass(frozen=True)
class SyntheticCorpusConfig:
    """A corpus made by a model (`transformer synthesize`: back-translated text), trained on beside the parallel
    data: an entry of `data.synthetic` (Sennrich et al. 2016; tagged: Caswell et al. 2019)."""

    path: str
    """Folder with `{train_split}.{src_lang}.gz` and `.{tgt_lang}.gz` (as `transformer synthesize` writes it, with
    its origin.json); training pairs only."""
    tag: str = field(
        metadata={
            "required": 'required: "<bt>" to mark back-translated sources (Caswell et al. 2019), "" for none (a '
            "teacher's translations, which are real sources)"
        }
    )
    """A reserved piece put first on each of its sources (after a language token), so that the model can tell
    synthetic sources from real ones; "" for none. Translation never puts it. Required: no choice fits every
    corpus."""
    name: str = "bt"
    """Names its subword samples and its lines in the logs (unique among the run's corpora)."""
    weight: float = 1.0
    """Its share of an epoch: weight x its pairs, over the same for every corpus of the run (`data/mixing.py`)."""
    direction: str = ""
    """With data.directions: the direction it adds pairs to ("de-en"); "" for a run of one direction."""
    made_by: Optional[SynthesisConfig] = None
    """How the corpus is made (`SynthesisConfig`), for `transformer chain`; null: it is given (made by hand)."""


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel corpus comes from and how it is tokenized and batched.

    Attributes:
        corpora: the run's corpora (`languages.Corpus`), made once from src_lang/tgt_lang (one corpus, no marks) or
            directions (one per entry, each with its target language's token): what the rest of the code walks.
    """

    src_lang: str = "de"
    """Source language code: file suffix (`train.de.gz`) or dataset column / translation key. The short form of a
    run of one direction; with `directions` set, each corpus has its own (`corpora`)."""
    tgt_lang: str = "en"
    """Target language code; as src_lang."""
    directions: list[str] = field(default_factory=list)
    """A multilingual run (docs/training.md): the "src-tgt" directions trained together, e.g. [de-en, fr-en, en-de];
    each source starts with its target language's token (`>>fra<<`, `config/languages.py`). Empty: one direction,
    src_lang -> tgt_lang with no token."""
    language_tokens: dict[str, str] = field(default_factory=dict)
    """With directions: a target language's token where the vocabulary spells it otherwise than `>>` + ISO 639-3
    code + `<<` (`>>deu<<`), e.g. {de: ">>de<<"} for an imported OPUS-MT model whose vocabulary has two-letter
    tokens (`transformer translate --tgt-lang` still takes de, deu or >>de<<); {} for a model trained here."""
    synthetic: list[SyntheticCorpusConfig] = field(default_factory=list)
    """Corpora made by a model, trained on beside the parallel data (`SyntheticCorpusConfig`); [] for none."""
    parallel_weight: float = 1.0
    """The parallel corpora's weight in each epoch against the synthetic ones (2: their pairs count twice, an
    upsampling of the real data; 0: none is trained on, they validate only, as for a student trained on its
    teacher's translations); with no synthetic corpus it changes nothing."""
    direction_temperature: float = 1.0
    """With directions: each epoch draws direction d's share of pairs with probability proportional to n_d^(1/T),
    n_d its training pairs (T >= 1; 1: in proportion to the sizes; 5 is common; large: uniform)."""
    path: Optional[str] = None
    """Local folder with `{split}.{lang}` or `{split}.{lang}.gz` files, one sentence per line.
    Relative paths are taken from the working directory. Used when it exists."""
    hf_dataset: Optional[str] = None
    """Hugging Face `datasets` id (e.g. `bentrevett/multi30k`, `wmt14`), or a loader name such as
    `json`, `csv`, `parquet` together with `data_files`. Used when `path` is unset or missing."""
    hf_config: Optional[str] = None
    """Dataset config name (e.g. `de-en` for wmt14)."""
    data_files: Optional[dict[str, str]] = None
    """Split name -> local file for the `json`/`csv`/`parquet` loaders."""
    hf_split_names: dict[str, str] = field(default_factory=dict)
    """Our split name -> the dataset's split name, e.g. {val: validation, test_2016_flickr: test}."""
    train_split: str = "train"
    valid_split: str = "val"
    test_split: str = "test_2016_flickr"
    vocab_size: int = 8000
    """Sentencepiece vocabulary size (pieces, special tokens included) of the joint model, or of each
    model when joint_vocab is false."""
    joint_vocab: bool = True
    """One sentencepiece model for both languages (true) or one per language (false)."""
    spm_model_type: str = "bpe"
    """Sentencepiece algorithm: "bpe" or "unigram"."""
    spm_max_sentences: int = 1_000_000
    """Sentencepiece trains on a random sample of at most this many sentences per model: with a joint vocabulary,
    spm_max_sentences / (number of languages) random sentences of each language (a bilingual run: both sides of
    spm_max_sentences / 2 random training pairs; `training/data.py: joint_sample`); otherwise each language's side
    of spm_max_sentences random pairs. The sample is fixed by training.seed."""
    max_len: int = 128
    """Training pairs with more than this many tokens on either side (eos included) are dropped."""
    max_tokens_per_batch: int = 4096
    """Token budget of one batch: padded source and padded target tokens are each at most this (§5.1)."""
    pool_factor: int = 100
    """Batches are cut from pools of pool_factor * (sentences per batch) pairs sorted by length."""
    subword_sampling: bool = False
    """Subword regularisation of the training split: every epoch after the first is encoded afresh with one random
    segmentation per sentence (BPE-dropout for a bpe model, n-best sampling for a unigram one; the first epoch uses
    the token cache), fixed by training.seed and the epoch so that a resumed run sees the same pieces. The next
    epoch is encoded by a background process while the current one trains (`data/subword_sampling.py`). Validation
    and test are always encoded deterministically."""
    subword_alpha: float = 0.1
    """With subword_sampling: for bpe, the probability of skipping each merge (BPE-dropout; 0.1 in Provilkov et al.
    2020); for unigram, the exponent of the segmentation probabilities (Kudo 2018: P(x)^alpha)."""
    subword_nbest_size: int = 16
    """With subword_sampling and a unigram model: sample from the best N segmentations of each sentence. Not used
    by bpe."""
    subword_workers: int = 1
    """With subword_sampling: processes that encode each epoch's sample (each takes one core). One is enough for
    Multi30k; at WMT14 size a fast GPU finishes an epoch sooner than one process samples it (docs/training.md)."""
    valid_max_sentences: int = 0
    """Use only the first N validation pairs for BLEU during training (0: all)."""
    unknown_characters: str = "warn"
    """Training pairs whose text holds characters the vocabulary maps to unk (a fixed vocabulary, e.g. when
    fine-tuning on new text, or rare characters a fresh one left out) are counted at the start of training, with
    the most frequent such characters: "warn" logs them and trains; "refuse" stops with that report instead."""
    cache_dir: Optional[str] = None
    """Folder of the token caches (the training split encoded once into memory-mapped files, see
    `data/token_cache.py`); null: $TRANSFORMER_NMT_CACHE, else ~/.cache/transformer-nmt."""

    def __post_init__(self) -> None:
        check_directions(self)
        check_synthetic(self)
        object.__setattr__(
            self, "corpora", corpora_of(self)
        )  # derived, not a field: saved configs keep their keys
        _require(
            bool(self.src_lang) and bool(self.tgt_lang),
            "data.src_lang",
            "languages must be non-empty",
        )
        _require(
            self.src_lang != self.tgt_lang,
            "data.tgt_lang",
            f"source and target language are both {self.src_lang!r}",
        )
        for name in (
            "vocab_size",
            "max_len",
            "max_tokens_per_batch",
            "pool_factor",
            "spm_max_sentences",
        ):
            value = getattr(self, name)
            _require(value > 0, f"data.{name}", f"must be a positive integer, got {value}")
        _require(
            self.vocab_size > 8, "data.vocab_size", f"must be larger than 8, got {self.vocab_size}"
        )
        _require(
            self.max_tokens_per_batch >= self.max_len,
            "data.max_tokens_per_batch",
            f"must be at least data.max_len={self.max_len} so that every kept pair fits a batch",
        )
        _require(
            self.spm_model_type in ("bpe", "unigram"),
            "data.spm_model_type",
            f"must be 'bpe' or 'unigram', got {self.spm_model_type!r}",
        )
        _require(self.valid_max_sentences >= 0, "data.valid_max_sentences", "must be >= 0")
        _require(
            self.unknown_characters in ("warn", "refuse"),
            "data.unknown_characters",
            f"must be 'warn' or 'refuse', got {self.unknown_characters!r}",
        )
        _require(
            0.0 < self.subword_alpha <= 1.0
            if self.spm_model_type == "bpe"
            else self.subword_alpha > 0.0,
            "data.subword_alpha",
            f"must be in (0, 1] for a bpe model (the merge dropout probability) and > 0 for "
            f"a unigram model, got {self.subword_alpha}",
        )
        _require(
            self.subword_workers >= 1,
            "data.subword_workers",
            f"must be at least 1, got {self.subword_workers}",
        )
        _require(
            self.subword_nbest_size >= 2,
            "data.subword_nbest_size",
            f"must be at least 2 (segmentations to sample from), got {self.subword_nbest_size}",
        )
        _require(
            self.path is not None or self.hf_dataset is not None,
            "data.path",
            "set data.path (a local folder) or data.hf_dataset (a Hugging Face dataset id)",
        )

    @property
    def corpus(self) -> Corpus:
        """The one corpus of the data section of one corpus (`Corpus.section`).

        Raises:
            ValueError: the section has several corpora (take one with `Corpus.section` first).
        """
        if len(self.corpora) != 1:
            raise ValueError(f"{len(self.corpora)} corpora: take one with Corpus.section first")
        return self.corpora[0]


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation, schedule, validation and checkpointing (Vaswani et al. 2017, §5)."""

    seed: int = 1234
    device: str = "auto"
    """"auto" (cuda, then mps, then cpu), "cpu", "cuda", "cuda:1", "mps"."""
    threads: int = 0
    """torch intra-op threads on CPU (0: leave torch's default)."""
    max_steps: int = 100_000
    """Stop after this many optimizer updates."""
    max_epochs: int = 0
    """Stop after this many passes over the training data (0: no limit)."""
    lr_scale: float = 1.0
    """The factor in lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (§5.3); the peak,
    lr_scale * (d_model * warmup_steps)^-0.5, is also the peak of the linear and cosine schedules."""
    warmup_steps: int = 4000
    """Linear warm-up length (updates) of the schedule (§5.3)."""
    lr_schedule: str = "inverse_sqrt"
    """After the warm-up peak: "inverse_sqrt" (the paper's step^-0.5 decay), or "linear" / "cosine" decay to zero at
    max_steps (better for a fixed budget: the last updates anneal the weights). These two depend on max_steps, so
    resuming with a different max_steps changes the rest of the schedule."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    """ε_ls of §5.4."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    accumulate_steps: int = 1
    """Batches whose gradients are summed before one update."""
    log_every_steps: int = 50
    eval_every_steps: int = 1000
    """Validate (loss, perplexity, greedy BLEU) every N updates and at the end."""
    patience: int = 0
    """Stop when validation BLEU has not improved for this many validations (0: never)."""
    keep_last_checkpoints: int = 2
    """Step checkpoints `checkpoints/step_N.pt` kept besides last.pt and best.pt (0: none). They are written at every
    validation and every save_every_steps updates; `transformer average` averages the last N of them."""
    save_every_steps: int = 0
    """Also write step_N.pt (and last.pt) every N updates between validations, e.g. for averaging (0: only at
    validations)."""
    max_nonfinite_steps: int = 10
    """Stop after this many updates in a row with a non-finite loss or gradient (each is skipped, not a step). Under
    fp16, gradient overflows count only once the loss scale is below 1 or after 64 skips in a row
    (`training/stop.py`)."""
    precision: str = "fp32"
    """Forward/backward precision through torch.autocast: "fp32", "bf16" (CPU and CUDA), "fp16" (CUDA only,
    with a gradient scaler) or "auto" (bf16 where it is faster: on CUDA with bf16 support, and on a CPU whose
    bf16 matmuls measure at least 1.25x fp32 ones; else fp32; the choice is logged and kept on --resume).
    Weights and optimizer state stay fp32."""
    compile: bool = False
    """Wrap the training module with torch.compile."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms for the run (and CUBLAS_WORKSPACE_CONFIG=:4096:8 when unset), so that on
    CUDA a resumed run ends with the same weights as an uninterrupted one, as on the CPU (where it is exact
    anyway). Slower on GPUs; an operation without a deterministic kernel raises an error."""
    tensorboard: Optional[bool] = None
    """Write TensorBoard logs to RUN_DIR/tensorboard/ (losses, learning rate, gradient norm, tokens/s, validation
    scores, sample translations, a cross-attention image; `training/tensorboard.py`). null: on when the
    tensorboard package is installed; true without it is an error."""
    init_from: Optional[str] = None
    """Set by `transformer train --init-from SOURCE`: the checkpoint or MarianMT folder whose weights and tokenizer
    the run started from (fine-tuning); null: trained from scratch."""
    init_from_sha256: Optional[str] = None
    """SHA-256 of init_from's content (the file, or the folder's files), recorded when the run started."""

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "warmup_steps",
            "accumulate_steps",
            "log_every_steps",
            "eval_every_steps",
            "max_nonfinite_steps",
        ):
            value = getattr(self, name)
            _require(value > 0, f"training.{name}", f"must be a positive integer, got {value}")
        for name in (
            "max_epochs",
            "patience",
            "keep_last_checkpoints",
            "threads",
            "save_every_steps",
        ):
            _require(
                getattr(self, name) >= 0,
                f"training.{name}",
                f"must be >= 0, got {getattr(self, name)}",
            )
        _require(self.lr_scale > 0, "training.lr_scale", f"must be positive, got {self.lr_scale}")
        _require(
            0.0 <= self.label_smoothing < 1.0,
            "training.label_smoothing",
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        _require(
            self.clip_grad_norm >= 0,
            "training.clip_grad_norm",
            "must be >= 0 (0 disables clipping)",
        )
        _require(
            all(0.0 <= b < 1.0 for b in self.adam_betas),
            "training.adam_betas",
            "both must be in [0, 1)",
        )
        _require(self.adam_eps > 0, "training.adam_eps", "must be positive")
        _require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0")
        _require(
            self.lr_schedule in ("inverse_sqrt", "linear", "cosine"),
            "training.lr_schedule",
            f"must be inverse_sqrt, linear or cosine, got {self.lr_schedule!r}",
        )
        _require(
            self.lr_schedule == "inverse_sqrt" or self.warmup_steps < self.max_steps,
            "training.warmup_steps",
            f"must be below training.max_steps ({self.max_steps}) for the {self.lr_schedule} schedule",
        )
        _require(
            self.precision in ("fp32", "bf16", "fp16", "auto"),
            "training.precision",
            f"must be fp32, bf16, fp16 or auto, got {self.precision!r}",
        )
        _require(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
            "training.device",
            f"must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}",
        )


def _option(default: Any, help: str, metavar: Optional[str] = None) -> Any:
    """A decoding option: its default and the help its flag and request field show (`decoding/options.py`)."""
    return field(default=default, metadata={"help": help, "metavar": metavar})


@dataclass(frozen=True)
class DecodingConfig:
    """Defaults for translate and evaluate (beam search: Vaswani et al. 2017, §6.1), and the options of one decoding
    call: every field is a `transformer translate` flag (--beam-size, ...), a field of a server request and a keyword
    of `Translator.translate` (the exceptions: `decoding/options.py`)."""

    beam_size: int = _option(4, "beam size; 1 is greedy decoding")
    length_penalty: float = _option(0.6, "α of the length penalty ((5+|Y|)/6)^α; 0 disables it")
    n_best: int = _option(
        1,
        "hypotheses per input, best first, with their scores (with sampling: independent "
        "samples); translate prints them as 'index<TAB>score<TAB>text<TAB>end' (end: eos, or cut at the "
        "length cap)",
    )
    max_len_a: float = _option(1.5, "output length cap: max_len_a * src_len + max_len_b tokens")
    max_len_b: int = _option(10, "see max_len_a")
    min_len: int = _option(0, "tokens that must come before eos may be produced")
    batch_size: int = _option(64, "sentences decoded together")
    max_tokens_per_batch: int = _option(
        0, "if > 0, batches also hold at most this many padded source tokens"
    )
    no_repeat_ngram_size: int = _option(
        0, "no output repeats an N-gram of pieces (0: off; eos is never blocked)", "N"
    )
    max_repeat: int = _option(
        3, "no output has one piece more than R times in a row (default 3; 0: no limit)", "R"
    )
    """If R > 0, no output has one piece more than R times in a row (greedy, beam search and sampling): it stops the
    loops of one subword ("Marininininin") a model can fall into on a word it barely knows. 0: no limit."""
    sampling: bool = _option(
        False,
        "draw each token at random from the model's distribution (beam size 1; with "
        "n_best K: K samples per input)",
    )
    """Draw each token from the model's distribution (filtered by top_k / top_p, sharpened by temperature) instead
    of searching; beam_size must be 1, and n_best is the number of independent samples per input."""
    top_k: int = _option(0, "with sampling: draw among the K most probable tokens (0: all)", "K")
    """With sampling: keep the K most probable tokens (and any tied with the K-th); 1 is greedy; 0 or K >= the
    vocabulary: all."""
    top_p: float = _option(
        1.0,
        "with sampling: draw among the fewest most probable tokens whose probabilities sum "
        "to at least P (the nucleus)",
        "P",
    )
    """With sampling: in (0, 1]; the most probable token is always kept, so a P below its probability is greedy;
    1: all tokens."""
    temperature: float = _option(1.0, "with sampling: divide the logits by T (default 1)", "T")
    """With sampling: divide the logits by this (< 1 sharper, > 1 flatter). Any positive finite value holds
    numerically: so small that the scaled logits would overflow, it draws the most probable token (greedy); so large
    that they all round to one value, it draws uniformly among the tokens the rules allow."""
    seed: int = _option(0, "with sampling: the random seed (same seed and line, same samples)")
    """With sampling: the random stream of a sentence depends on this, its source tokens and the sample's number
    only, so an input gets the same samples whatever else is decoded with it."""
    copy_unknown: bool = _option(
        True,
        "copy text the vocabulary lacks (emoji, other scripts) through untranslated; "
        "off: the model sees it as unk",
    )
    """Text the source vocabulary cannot represent (emoji, symbols, other scripts) is taken out before translating and
    put back, unchanged, into the translation (`transformer/passthrough.py`); false: it reaches the model as unk."""
    tgt_lang: Optional[str] = _option(
        None,
        "the language to translate into (a code such as fr): a multilingual "
        "model needs it; a bilingual one takes only its own",
        "LANG",
    )
    """The target language: put as its token (`>>fra<<`) at the start of each source of a multilingual model; None
    with one is refused, naming its languages. A bilingual model accepts None or its own data.tgt_lang. A code is
    matched to the model's as their tokens are, without case: fra and FR name fr (`languages.find_language`)."""

    def __post_init__(self) -> None:
        _require(
            self.max_tokens_per_batch >= 0, "decoding.max_tokens_per_batch", "must be >= 0 (0: off)"
        )
        _require(
            self.beam_size > 0,
            "decoding.beam_size",
            f"must be a positive integer, got {self.beam_size}",
        )
        _require(
            not self.sampling or self.beam_size == 1,
            "decoding.beam_size",
            f"sampling draws one token at a time: beam_size must be 1, got {self.beam_size}",
        )
        _require(
            0 < self.n_best <= (256 if self.sampling else self.beam_size),
            "decoding.n_best",
            f"must be between 1 and 256 samples, got {self.n_best}"
            if self.sampling
            else f"must be between 1 and beam_size={self.beam_size}, got {self.n_best}",
        )
        _require(
            self.no_repeat_ngram_size >= 0, "decoding.no_repeat_ngram_size", "must be >= 0 (0: off)"
        )
        _require(
            self.max_repeat >= 0,
            "decoding.max_repeat",
            f"must be >= 0 (0: no limit), got {self.max_repeat}",
        )
        _require(
            self.top_k >= 0, "decoding.top_k", f"must be >= 0 (0: all tokens), got {self.top_k}"
        )
        _require(0.0 < self.top_p <= 1.0, "decoding.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(
            0.0 < self.temperature < float("inf"),
            "decoding.temperature",
            f"must be positive and finite, got {self.temperature}",
        )
        _require(self.length_penalty >= 0, "decoding.length_penalty", "must be >= 0")
        _require(
            self.max_len_a >= 0 and self.max_len_b >= 0,
            "decoding.max_len_a",
            "max_len_a and max_len_b must be >= 0",
        )
        _require(
            self.max_len_a > 0 or self.max_len_b > 0,
            "decoding.max_len_b",
            "max_len_a * src_len + max_len_b must allow at least one token",
        )
        _require(self.min_len >= 0, "decoding.min_len", "must be >= 0")
        _require(self.batch_size > 0, "decoding.batch_size", "must be a positive integer")
        _require(
            self.tgt_lang is None
            or (
                isinstance(self.tgt_lang, str)
                and self.tgt_lang.strip() == self.tgt_lang
                and bool(self.tgt_lang)
            ),
            "decoding.tgt_lang",
            f"a language code such as fr, got {self.tgt_lang!r}",
        )


@dataclass(frozen=True)
class Config:
    """A whole run: the four sections of a YAML recipe. `model` is complete (vocab sizes filled in)."""

    model: TransformerConfig
    data: DataConfig
    training: TrainingConfig = field(default_factory=TrainingConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (only str/int/float/bool/list/dict/None) for YAML and checkpoints."""
        out = dataclasses.asdict(self)
        for key in _DERIVED_MODEL_KEYS:
            out["model"].pop(key)
        out["training"]["adam_betas"] = list(self.training.adam_betas)
        return out


def check_trainable(config: Config) -> None:
    """Refuse a training run whose kept pairs could not be encoded: `data.max_len` (the longest pair kept, in tokens)
    above `model.max_positions` (the longest sequence the position encodings cover).

    Only training reads `data.max_len`, so loading a model to translate does not call this.

    Raises:
        ConfigError: naming both keys.
    """
    _require(
        config.data.max_len <= config.model.max_positions,
        "data.max_len",
        f"{config.data.max_len} tokens is more than model.max_positions={config.model.max_positions} (the "
        "longest sequence the position encodings cover): lower data.max_len or raise model.max_positions",
    )


# Model fields that the tokenizer decides, not the YAML file.
_DERIVED_MODEL_KEYS = ("src_vocab_size", "tgt_vocab_size")

# Special ids, fixed for every tokenizer this project trains (checked in tokenizer.py): the one definition that the
# model (embeddings, padding masks), the loss, batching and decoding all use.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
