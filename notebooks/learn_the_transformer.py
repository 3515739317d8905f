# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Learn the Transformer by running it: from attention to a trained translator
#
# This notebook follows the lesson on "Attention Is All You Need" (Vaswani et al., 2017) one idea at a time, with
# the code of this repository: every concept below is the package's own function, called and shown, never a copy
# of it. In order:
#
# 1. attention by hand: Q, K, V, the scores, the softmax, the weighted sum;
# 2. multi-head attention and the shapes at each step;
# 3. sinusoidal positional encoding, and why order matters;
# 4. the masks: padding and causal;
# 5. the whole encoder-decoder from a config, against the paper's Table 3;
# 6. a tiny model trained on the CPU in seconds to reverse sequences;
# 7. the real thing: a German→English model of Multi30k, its cross-attention, and "it" / "animal";
# 8. where to go next.
#
# **Running it.** Locally: `make notebook` (or `jupyter lab notebooks/learn_the_transformer.ipynb` in the
# repository's `.venv`). On Colab: the cell below clones the repository and installs the package (that needs
# internet); set `REPOSITORY` to the address you opened this notebook from. Sections 1-6 need no data and no GPU;
# section 7 uses a trained model when there is one (it says which) and otherwise trains a short one itself.

# %%
REPOSITORY = "https://github.com/OWNER/REPO.git"  # Colab only: the Git address of this repository

import os
import subprocess
import sys

if "google.colab" in sys.modules and os.path.basename(os.getcwd()) != "notebooks":
    if not os.path.isdir("transformer-repo"):
        if "OWNER/REPO" in REPOSITORY:
            raise SystemExit("set REPOSITORY (first line of this cell) to the Git address of this repository")
        subprocess.run(["git", "clone", "--depth", "1", REPOSITORY, "transformer-repo"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "transformer-repo[viz]"], check=True)
    os.chdir("transformer-repo/notebooks")
    sys.path.insert(0, os.path.abspath(".."))  # the editable install is seen by new processes, not this one

# %%
import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import transformer

ROOT = next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "configs" / "multi30k_de_en.yaml").is_file()),
            None)
if ROOT is None:
    raise SystemExit("run this notebook from inside the repository (its notebooks/ folder)")
print(f"package: {Path(transformer.__file__).parent}\nrepository: {ROOT}\ntorch {torch.__version__}")

plt.rcParams.update({"figure.dpi": 72, "font.size": 9, "axes.titlesize": 9})
torch.manual_seed(0)


def heatmap(ax, matrix, rows, cols, title, numbers=False, colorbar=False):
    """Draw `matrix` (rows: queries, columns: keys) on `ax`, from 0 (dark) to 1 (yellow), or to its largest value if
    that is above 1. Display only: nothing is computed here."""
    matrix = torch.as_tensor(matrix).detach().float()
    vmin, vmax = min(0.0, float(matrix.min())), max(1.0, float(matrix.max()))
    image = ax.imshow(matrix, cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
    small = max(matrix.shape) > 12
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7 if small else None)
    ax.set_yticks(range(len(rows)), rows, fontsize=7 if small else None)
    ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(image, ax=ax)
    for i in range(matrix.shape[0] if numbers else 0):
        for j in range(matrix.shape[1]):
            value = float(matrix[i, j])
            ax.text(j, i, f"{value:.2f}", ha="center", va="center",
                    color="white" if value < (vmin + vmax) / 2 else "black")


# %% [markdown]
# ## 1. Attention by hand
#
# Three words, each a vector of 4 numbers. Every word is projected three times: a **query** (what it looks
# for), a **key** (what it offers) and a **value** (what it passes on). The attention of each query over the
# keys is softmax(Q Kᵀ / √d_k), and each word's output is the weighted sum of the values:
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right)V$$
#
# First in plain torch, one step per line:

# %%
words = ["the", "cat", "sat"]
x = torch.tensor([[1.0, 0.0, 1.0, 0.0],
                  [0.0, 2.0, 0.0, 2.0],
                  [1.0, 1.0, 1.0, 1.0]])  # (3 words, 4 numbers each)
generator = torch.Generator().manual_seed(0)
W_q, W_k, W_v = (torch.randn(4, 4, generator=generator) / 2 for _ in range(3))  # learned in a real model

Q, K, V = x @ W_q, x @ W_k, x @ W_v                 # (3, 4) each: one row per word
scores = Q @ K.T / math.sqrt(K.shape[-1])           # (3, 3): query i against key j, divided by √d_k
weights = scores.softmax(dim=-1)                    # (3, 3): each row sums to 1
output = weights @ V                                # (3, 4): each word's weighted sum of the values
print("scores\n", scores.round(decimals=2), "\nweights\n", weights.round(decimals=2),
      "\nrow sums", weights.sum(-1), "\noutput\n", output.round(decimals=2))

# %% [markdown]
# The package's `scaled_dot_product_attention` (in `transformer/model/attention.py`) computes the same thing for
# a batch of sentences and several heads at once: its inputs are `(batch, n_heads, len, d_head)`, so we add two
# axes of size 1. It gives the same numbers:

# %%
from transformer.model.attention import scaled_dot_product_attention

ours_output, ours_weights = scaled_dot_product_attention(Q[None, None], K[None, None], V[None, None])
print(ours_output.shape, ours_weights.shape)  # (batch, n_heads, q_len, d_head), (batch, n_heads, q_len, k_len)
print("same weights:", torch.allclose(ours_weights[0, 0], weights), "| same output:",
      torch.allclose(ours_output[0, 0], output))

fig, axes = plt.subplots(1, 2, figsize=(6, 2.8))
heatmap(axes[0], scores, words, words, "scores Q·Kᵀ/√d_k", numbers=True)
heatmap(axes[1], ours_weights[0, 0], words, words, "weights = softmax(scores)", numbers=True)
axes[0].set_ylabel("query")
for ax in axes:
    ax.set_xlabel("key")
fig.tight_layout()

# %% [markdown]
# Each row of the right-hand picture is one word looking at the three words: the brighter the cell, the more of
# that word's value goes into its output. (The projections are random here, so the pattern means nothing yet:
# training is what makes it useful.)
#
# ## 2. Multi-head attention
#
# One attention looks for one kind of relation. Multi-head attention runs `n_heads` of them side by side, each on
# its own `d_head = d_model / n_heads` slice of the projections, then concatenates the heads and mixes them with
# W^O. `MultiHeadAttention` keeps W^Q, W^K and W^V in one matrix, `in_proj`, and W^O in `out_proj`. Here are the
# steps, with the shapes (a sentence of 6 words, `d_model` 16, 4 heads of 4):

# %%
from transformer.model import MultiHeadAttention

torch.manual_seed(0)
sentence = ["the", "cat", "sat", "on", "the", "mat"]
mha = MultiHeadAttention(d_model=16, n_heads=4).eval()
x = torch.randn(1, len(sentence), 16)                 # (batch, len, d_model): 6 word vectors

q, k, v = mha.project_self(x)                         # x W^Q, x W^K, x W^V, split into heads
heads, head_weights = scaled_dot_product_attention(q, k, v)   # every head at once
concat = heads.transpose(1, 2).reshape(1, len(sentence), 16)  # Concat(head_1, ..., head_4)
out = mha.out_proj(concat)                            # ... W^O
for name, tensor in [("x", x), ("q, k, v (each)", q), ("weights", head_weights), ("heads", heads),
                     ("concat", concat), ("output", out)]:
    print(f"{name:>15} {tuple(tensor.shape)}")

module_out, module_weights = mha(x, need_weights=True)   # the module does all of the above in one call
print("module gives the same output:", torch.allclose(out, module_out, atol=1e-6),
      "and weights:", torch.allclose(head_weights, module_weights))

fig, axes = plt.subplots(1, 4, figsize=(8, 2.6))
for h, ax in enumerate(axes):
    heatmap(ax, module_weights[0, h], sentence, sentence, f"head {h}")
fig.tight_layout()

# %% [markdown]
# Shapes read `(batch, n_heads, len, d_head)` inside the heads and `(batch, len, d_model)` outside them. The four
# heads, each with its own projections, already attend differently (still untrained: the patterns are random).
#
# ## 3. Positional encoding, and why order matters
#
# Attention compares every word with every other and has no notion of position: shuffle the words and each word
# gets exactly the same output as before, only at its new place. So "dog bites man" and "man bites dog" look
# alike to it. We take the package's `TokenEmbedding` and the `mha` above and check:

# %%
from transformer.config import PAD_ID
from transformer.model.layers import SinusoidalPositionalEncoding, TokenEmbedding

vocabulary = {"dog": 4, "bites": 5, "man": 6}
torch.manual_seed(0)
embed = TokenEmbedding(vocab_size=7, d_model=16, pad_id=PAD_ID)
a = embed(torch.tensor([[vocabulary[w] for w in "dog bites man".split()]]))  # (1, 3, 16)
b = embed(torch.tensor([[vocabulary[w] for w in "man bites dog".split()]]))
out_a, out_b = mha(a)[0], mha(b)[0]
print('without positions, "dog" is the same in both sentences:', torch.allclose(out_a[0, 0], out_b[0, 2], atol=1e-6))

position = SinusoidalPositionalEncoding(d_model=16, max_positions=50)
out_a, out_b = mha(a + position(3))[0], mha(b + position(3))[0]
print('with positions added, "dog" differs:', not torch.allclose(out_a[0, 0], out_b[0, 2], atol=1e-6))

# %% [markdown]
# The paper adds to each word vector a fixed pattern of sines and cosines of its position,
# PE(pos, 2i) = sin(pos / 10000^(2i/d_model)) and PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)):
# low dimensions change fast with the position, high dimensions slowly, like the hands of a clock.

# %%
position = SinusoidalPositionalEncoding(d_model=64, max_positions=100)
table = position(100)  # (positions, d_model)
print(table.shape)

fig, axes = plt.subplots(1, 2, figsize=(8, 2.8))
image = axes[0].imshow(table.T, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
axes[0].set(xlabel="position", ylabel="dimension", title="the encoding of positions 0-99 (d_model 64)")
fig.colorbar(image, ax=axes[0])
for dim in (0, 10, 20, 40):
    axes[1].plot(table[:, dim], label=f"dimension {dim}")
axes[1].set(xlabel="position", title="a few dimensions: sines of decreasing frequency")
axes[1].legend(fontsize=7, loc="lower left")
fig.tight_layout()

# %% [markdown]
# ## 4. The masks
#
# Two masks, both boolean and **True where attention is blocked** (the convention at the top of
# `transformer/model/attention.py`):
#
# - the **padding mask**: sentences of a batch are padded to one length with the id 0; nobody may attend to the
#   padding (`make_key_padding_mask`);
# - the **causal mask**: while the decoder predicts word *t*, it must not see words *t+1, ...* (`causal_mask`).

# %%
from transformer.data.batching import pad_sequences
from transformer.model import causal_mask, make_key_padding_mask

src = pad_sequences([[12, 7, 9, 15, 3], [5, 8, 3]])  # two sentences of ids, ending with eos (3), padded with 0
padding = make_key_padding_mask(src, PAD_ID)
future = causal_mask(5)
print(src, padding, future.int(), sep="\n")

torch.manual_seed(0)
x = torch.randn(1, 5, 16)
_, masked_weights = mha(x, attn_mask=future, need_weights=True)

fig, axes = plt.subplots(1, 3, figsize=(8, 2.6))
positions = [str(i) for i in range(5)]
heatmap(axes[0], padding, ["sentence 0", "sentence 1"], positions, "padding mask (yellow: blocked)")
heatmap(axes[1], future, positions, positions, "causal mask (yellow: blocked)")
heatmap(axes[2], masked_weights[0, 0], positions, positions, "weights under the causal mask")
fig.tight_layout()

# %% [markdown]
# The right-hand picture is head 0 of `mha` with the causal mask: every weight above the diagonal is zero.
#
# Does the future really not leak? Change the last two target words fed to a whole (untrained) `Transformer` and
# compare its outputs at every position: the positions before the change must not move. And a sentence alone
# must be encoded exactly as in a padded batch.

# %%
from transformer import Transformer, TransformerConfig
from transformer.config import BOS_ID

torch.manual_seed(0)
model = Transformer(TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, d_model=32, n_heads=4, d_ff=64,
                                      n_encoder_layers=2, n_decoder_layers=2)).eval()
tgt_in = torch.tensor([[BOS_ID, 5, 6, 7, 8]])
changed = torch.tensor([[BOS_ID, 5, 6, 11, 12]])  # positions 3 and 4 changed
with torch.no_grad():
    moved = (model(src[:1], tgt_in) - model(src[:1], changed)).abs().amax(-1)[0]
    alone, in_batch = model.encode(src[1:2, :3]), model.encode(src)[1, :3]
print("largest change of the logits at positions 0-4:", [round(v, 3) for v in moved.tolist()])
print("sentence 1 alone encoded as in the padded batch:", torch.allclose(alone[0], in_batch, atol=1e-5))

# %% [markdown]
# Positions 0-2 are unchanged (0.0); only 3 and 4, which read the changed words, move.
#
# ## 5. The whole encoder-decoder from a config
#
# A `TransformerConfig` holds the sizes; `Transformer(config)` builds the encoder and decoder stacks (each layer:
# attention and feed-forward, each followed by Add & Norm), the embeddings and the output projection. The paper's
# Table 3 lists 65 million parameters for "base" and 213 million for "big" (a shared vocabulary of about 37,000
# pieces). Built on the `meta` device, the models cost no memory:

# %%
from transformer import load_config

for name, expected in [("base", 65e6), ("big", 213e6)]:
    config = getattr(TransformerConfig, name)(37000, 37000, share_all_embeddings=True)
    with torch.device("meta"):
        n = Transformer(config).num_parameters()
    print(f"{name}: d_model {config.d_model}, {config.n_heads} heads, {config.n_encoder_layers}+"
          f"{config.n_decoder_layers} layers: {n / 1e6:.1f}M parameters (Table 3: {expected / 1e6:.0f}M)")

recipe = load_config(ROOT / "configs" / "multi30k_de_en.yaml")  # the recipe section 7 uses
with torch.device("meta"):
    n = Transformer(recipe.model).num_parameters()
print(f"the Multi30k recipe: d_model {recipe.model.d_model}, {recipe.model.n_heads} heads, "
      f"{recipe.model.n_encoder_layers}+{recipe.model.n_decoder_layers} layers, a shared vocabulary of "
      f"{recipe.model.src_vocab_size} pieces: {n / 1e6:.1f}M parameters")

# %% [markdown]
# Our counts agree with Table 3 to within 3% (the paper gives its vocabulary size only as "about 37000").
#
# One layer of each stack, printed (the recipe's sizes, with 1 layer instead of 3), and one pass through the
# recipe's model: `encode` turns the source into the memory, `decode` reads the target so far and the memory
# and gives a score (logit) for every word of the vocabulary at every position.

# %%
import dataclasses

print(Transformer(dataclasses.replace(recipe.model, n_encoder_layers=1, n_decoder_layers=1)))

model = Transformer(recipe.model).eval()
src = torch.randint(4, 8000, (2, 7))           # 2 sentences of 7 pieces
tgt_in = torch.randint(4, 8000, (2, 5))        # the target so far, 5 pieces each
with torch.no_grad():
    memory = model.encode(src)
    logits = model.decode(tgt_in, memory)
print(f"src {tuple(src.shape)} → memory {tuple(memory.shape)}; tgt_in {tuple(tgt_in.shape)} → logits "
      f"{tuple(logits.shape)}")

# %% [markdown]
# ## 6. A tiny model, trained in seconds: reverse a sequence
#
# The task: read a sequence of letters, write it backwards (`c a f e` → `e f a c`). It needs no data, and its
# right attention is easy to picture: to write its first letter, the decoder must look at the *last* source
# letter, and so on: an anti-diagonal. Ids 0-3 are reserved (padding, unknown, begin, end of sentence), so the
# letters are ids 4-13.

# %%
import random

from transformer.config import EOS_ID

LETTERS = "abcdefghij"


def ids(text):
    return [4 + LETTERS.index(c) for c in text.split()]


def text(ids):
    return " ".join(LETTERS[i - 4] for i in ids)


def reverse_examples(n, rng):
    sources = [[rng.randrange(4, 14) for _ in range(rng.randint(4, 9))] for _ in range(n)]
    return [s + [EOS_ID] for s in sources], [s[::-1] for s in sources]  # sources end with eos; targets without


print(reverse_examples(2, random.Random(0)))

# %% [markdown]
# A small model, and one training update exactly as `transformer train` makes it: `make_batch` pads the pairs
# and builds `tgt_in` (begin + target) and `tgt_out` (target + end), `learning_rate` is the warm-up schedule of
# §5.3, `LossComputation` is the model with its loss, and `train_step` does forward, backward and the Adam step.

# %%
from transformer.config import Config, DataConfig, TrainingConfig
from transformer.data.batching import make_batch
from transformer.training.loss import LossComputation
from transformer.training.optim import build_optimizer, learning_rate, set_lr
from transformer.training.trainer import train_step

toy = TransformerConfig(src_vocab_size=14, tgt_vocab_size=14, d_model=64, n_heads=2, d_ff=128,
                        n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, max_positions=32,
                        share_all_embeddings=True)
training = TrainingConfig(max_steps=400, warmup_steps=80, lr_scale=0.2, lr_schedule="linear", label_smoothing=0.0)
config = Config(model=toy, data=DataConfig(path="(no files: the examples are made above)"), training=training)

torch.manual_seed(0)
model = Transformer(toy)
module = LossComputation(model, training.label_smoothing)
optimizer = build_optimizer(model, training, torch.device("cpu"))
test_src, test_tgt = reverse_examples(200, random.Random(1))
test_batch = make_batch(test_src, test_tgt)
with torch.no_grad():
    _, before = model.eval().forward_with_attention(test_batch.src[:1], test_batch.tgt_in[:1])

threads = torch.get_num_threads()
torch.set_num_threads(1)  # a model this small trains faster on one CPU thread than on several
rng, losses, start = random.Random(0), [], time.perf_counter()
model.train()
for step in range(1, training.max_steps + 1):
    batch = make_batch(*reverse_examples(64, rng))  # 64 new random pairs
    set_lr(optimizer, learning_rate(step, training, toy.d_model))
    loss, nll, grad_norm = train_step(module, optimizer, [batch], config)
    losses.append(loss.item() / batch.n_tgt_tokens)
torch.set_num_threads(threads)
print(f"{training.max_steps} updates in {time.perf_counter() - start:.0f} s; loss per token "
      f"{losses[0]:.2f} → {losses[-1]:.3f}")

fig, ax = plt.subplots(figsize=(5, 2.5))
ax.plot(losses)
ax.set(xlabel="update", ylabel="loss per target token", yscale="log", title="training the reverser")
fig.tight_layout()

# %% [markdown]
# Decoding: `decoding.search` runs greedy decoding (`beam_size=1`: take the best letter at each step) or beam search
# (keep the `beam_size` best partial outputs), as a `DecodingConfig` says; both reuse the keys and values of the
# earlier steps (incremental decoding) instead of recomputing them.

# %%
from transformer.config import DecodingConfig
from transformer.decoding import search

model.eval()
greedy = DecodingConfig(beam_size=1, max_repeat=0)
beam = DecodingConfig(beam_size=4, n_best=2, max_repeat=0)
with torch.no_grad():
    greedy_out = search(model, test_batch.src, test_batch.src_key_padding_mask, greedy)
    beam_out = search(model, test_batch.src, test_batch.src_key_padding_mask, beam)
for i in range(3):
    print(f"{text(test_src[i][:-1]):>20} → greedy: {text(greedy_out[i][0].tokens):<20}"
          f"beam: {text(beam_out[i][0].tokens)} (score {beam_out[i][0].score:.3f}), "
          f"2nd best: {text(beam_out[i][1].tokens)} ({beam_out[i][1].score:.2f})")
correct = sum(hyps[0].tokens == tgt for hyps, tgt in zip(greedy_out, test_tgt))
print(f"greedy: {correct} of {len(test_tgt)} unseen sequences reversed exactly")

# %% [markdown]
# And the attention: `forward_with_attention` runs the model through the explicit attention path and returns
# every weight. Before training, the decoder's attention over the source (cross-attention) is spread out; after,
# each output letter looks at the source letter it copies: the anti-diagonal.

# %%
with torch.no_grad():
    _, after = model.forward_with_attention(test_batch.src[:1], test_batch.tgt_in[:1])
n = len(test_src[0])
src_labels = text(test_src[0][:-1]).split() + ["</s>"]
out_labels = text(test_tgt[0]).split() + ["</s>"]  # row t: the letter written at step t

fig, axes = plt.subplots(1, 2, figsize=(6, 3))
for ax, weights, when in [(axes[0], before, "before training"), (axes[1], after, "after training")]:
    cross = weights.cross[-1][0].mean(0)[:n, :n]  # last decoder layer, mean of the heads: (tgt_len, src_len)
    heatmap(ax, cross, out_labels, src_labels, f"cross-attention, {when}")
    ax.set(xlabel="source letter", ylabel="output letter")
fig.tight_layout()

# %% [markdown]
# ## 7. The real thing: translating German to English
#
# Now a model trained on Multi30k (30,000 image captions in German and English) by this repository's recipe,
# `configs/multi30k_de_en.yaml` (3+3 layers, `d_model` 256, 4 heads). The cell below takes, in order:
#
# 1. the checkpoint named by the environment variable `TRANSFORMER_NOTEBOOK_DE_EN` (the test of this notebook
#    sets it to a model it trains);
# 2. the recipe's own model, `runs/multi30k_de_en/checkpoints/best.pt`, which `make train` writes (about half an
#    hour on a 2-core CPU; 42.8 BLEU on the test set, see the README), or the back-translation recipe's,
#    `runs/multi30k_de_en_bt` (`make backtranslate`), if its run finished (a run that stopped half-way is named,
#    not used);
# 3. otherwise it says so and trains a short run itself, 200 updates into `runs/notebook_de_en_short`, for at most
#    10 minutes (about a minute on a quiet 2-core CPU; a run cut short says so and goes on the next time the cell
#    runs). It reads Multi30k from `../shared/data/multi30k`, or downloads it from Hugging Face.
#    **A short run translates poorly** (validation BLEU about 2): its words are frequent caption words and its
#    attention is blurred. It shows the machinery, not the quality.
#
# The outputs saved in this notebook come from the model its first printed line names (`make notebook-run` executes
# the notebook and saves it again).

# %%
from transformer import Translator
from transformer.checkpoint import load_checkpoint
from transformer.training.checkpoint import run_progress

SHORT_RUN_LIMIT_S = 600  # the fallback's training stops here; running the cell again goes on from where it stopped


def recipe_checkpoint(variable, recipes):
    """The model named by `variable`, else the best.pt of the first of `recipes` whose run finished."""
    if os.environ.get(variable):
        return Path(os.environ[variable])
    for recipe in recipes:
        run = ROOT / "runs" / recipe
        if (run / "checkpoints" / "best.pt").is_file() and (run / "checkpoints" / "last.pt").is_file():
            done, planned, finished = run_progress(run)
            if finished:
                return run / "checkpoints" / "best.pt"
            print(f"runs/{recipe} stopped at {done} of {planned} updates: `make train RESUME=1` finishes it")
    return None


de_en = recipe_checkpoint("TRANSFORMER_NOTEBOOK_DE_EN", ["multi30k_de_en", "multi30k_de_en_bt"])
if de_en is None:
    run_dir = ROOT / "runs" / "notebook_de_en_short"
    print("No trained German->English model: `make train` trains the recipe's (see the README). Meanwhile a SHORT "
          f"run of 200 updates, stopped after {SHORT_RUN_LIMIT_S // 60} minutes at most:")
    command = [sys.executable, "-m", "transformer", "train", "--config", "configs/multi30k_de_en.yaml",
               "--run-dir", str(run_dir.relative_to(ROOT)), "--set", "training.max_steps=200",
               "--set", "training.warmup_steps=100", "--set", "training.eval_every_steps=100",
               "--set", "data.subword_sampling=false"]
    last = run_dir / "checkpoints" / "last.pt"
    done, planned, finished = run_progress(run_dir) if last.is_file() else (0, 200, False)
    if not finished:
        command += ["--resume"] if last.is_file() else []
        print("$ transformer", " ".join(command[3:]))
        start = time.perf_counter()
        try:
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SHORT_RUN_LIMIT_S)
            if result.returncode:
                raise SystemExit(f"training failed (delete {run_dir} to start again):\n{result.stderr[-2000:]}")
        except subprocess.TimeoutExpired:
            pass  # the run saved its checkpoints as it went; the cell goes on with the last one
        print(f"{time.perf_counter() - start:.0f} s")
        done, planned, finished = run_progress(run_dir)
    de_en = run_dir / "checkpoints" / ("best.pt" if finished else "last.pt")
    status = "finished" if finished else "NOT finished: run this cell again to go on"
    print(f"short run {status}: {done} of {planned} updates")

state = load_checkpoint(de_en)["train_state"]
print(f"{de_en.relative_to(ROOT) if de_en.is_relative_to(ROOT) else de_en}: {state['step']} updates, "
      f"best validation BLEU {state['best_bleu']:.1f}")
translator = Translator.from_checkpoint(de_en)

# %% [markdown]
# `Translator` is the text-to-text pipeline (`transformer/translate.py`): tokenize into sentencepiece pieces,
# decode, detokenize. The first three sentences of the Multi30k test set, with their reference translations:

# %%
german = ["Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
          "Ein Boston Terrier läuft über saftig-grünes Gras vor einem weißen Zaun.",
          "Ein Mädchen in einem Karateanzug bricht ein Brett mit einem Tritt."]
references = ["A man in an orange hat starring at something.",
              "A Boston Terrier is running on lush green grass in front of a white fence.",
              "A girl in karate uniform breaking a stick with a front kick."]
greedy_en = translator.translate(german, beam_size=1)
beam_en = translator.translate(german, beam_size=4)
for de, ref, g, b in zip(german, references, greedy_en, beam_en):
    print(f"{de}\n  reference: {ref}\n  greedy:    {g}\n  beam 4:    {b}\n")

# %% [markdown]
# **Cross-attention.** `attention_for` (from `transformer/attention_plot.py`, what `transformer attention` draws)
# translates a sentence and returns every attention weight with the pieces as labels. Below: the last decoder
# layer's attention over the German source, averaged over the heads. Row *t* is the English piece written at step
# *t*. A trained model looks at the German word it is translating, close to a word alignment; a short run spreads
# its attention.

# %%
from transformer.attention_plot import attention_for

data = attention_for(translator, "Eine Frau spielt Gitarre auf der Straße.")
print("translation:", data["translation"])
cross = torch.tensor(data["cross"][-1]).mean(0)  # (target pieces + 1, source pieces)

fig, ax = plt.subplots(figsize=(5, 4))
heatmap(ax, cross, data["tgt_out_pieces"], data["src_pieces"], "cross-attention, last layer, mean of heads",
        colorbar=True)
ax.set(xlabel="German source piece", ylabel="English piece written")
fig.tight_layout()

# %% [markdown]
# With the recipe's fully trained model the same sentence gives this picture (the repository's `docs/attention.png`,
# `transformer attention` with every head: top row cross-attention, then encoder and decoder self-attention):
#
# ![attention of the recipe's de→en model](../docs/attention.png)
#
# **"it" and "animal".** The lesson's sentence, "The animal didn't cross the street because it was too tired",
# showed one encoder self-attention head linking "it" to "animal". Below, each row is one head of one encoder
# layer, and shows how the pronoun's query spreads its attention over the pieces of the sentence. An English source
# needs an English→German model:
# `TRANSFORMER_NOTEBOOK_EN_DE`, or the finished run of `make train CONFIG=configs/multi30k_en_de.yaml`
# (`runs/multi30k_en_de`) or of `make backtranslate BT=en_de` (`runs/multi30k_en_de_bt`). Without one, we ask the
# German→English model the same question in German ("es" and "Tier").

# %%
en_de = recipe_checkpoint("TRANSFORMER_NOTEBOOK_EN_DE", ["multi30k_en_de", "multi30k_en_de_bt"])
if en_de is not None:
    reader, sentence, pronoun = Translator.from_checkpoint(en_de), \
        "The animal didn't cross the street because it was too tired.", "▁it"
else:
    reader, sentence, pronoun = translator, "Das Tier überquerte die Straße nicht, weil es zu müde war.", "▁es"
data = attention_for(reader, sentence)
pieces = data["src_pieces"]
print(f"{sentence} → {data['translation']}\npieces: {pieces}")

encoder_self = torch.tensor(data["encoder_self"])  # (layers, heads, query piece, key piece)
query = pieces.index(pronoun)
from_pronoun = encoder_self[:, :, query].flatten(0, 1)  # (layers x heads, key piece): the pronoun's row in each
labels = [f"layer {i}, head {h}" for i in range(encoder_self.shape[0]) for h in range(encoder_self.shape[1])]

fig, ax = plt.subplots(figsize=(6, 0.25 * len(labels) + 1.5))
heatmap(ax, from_pronoun, labels, pieces, f"encoder self-attention of {pronoun!r} in every head", colorbar=True)
ax.set(xlabel="source piece attended to")
fig.tight_layout()
best = from_pronoun.max(-1)
i = int(best.values.argmax())
print(f"strongest: {labels[i]} gives {best.values[i]:.2f} of the attention of {pronoun!r} to "
      f"{pieces[best.indices[i]]!r} (spread evenly, each piece would get {1 / len(pieces):.2f})")

# %% [markdown]
# Whether some head of *this* model puts the pronoun's weight on the noun is an empirical question, answered by the
# picture for the model at hand. The lesson's picture came from a large model trained on millions of sentences;
# Multi30k's captions hold few pronouns; a short run has learned little. And a bright cell is not yet an
# explanation: some heads look at a fixed place (the next word, the first word) whatever the words are, so try
# other sentences before concluding. Attention weights show where a head looks, not why the model decides.
#
# ## 8. Where to go next
#
# Commands (from the repository's root, in `.venv`; the [README](../README.md) has every option):
#
# ```bash
# make train                                     # the Multi30k de→en recipe, then BLEU of best.pt
# make train CONFIG=configs/multi30k_en_de.yaml  # en→de, for the "it" / "animal" picture above
# transformer translate --checkpoint runs/multi30k_de_en/checkpoints/best.pt "Ein Mann fährt Fahrrad."
# transformer attention --checkpoint runs/multi30k_de_en/checkpoints/best.pt "Eine Frau spielt Gitarre." \
#     --out attention.png
# transformer serve --checkpoint runs/multi30k_de_en/checkpoints/best.pt   # an attention explorer in the browser
# ```
#
# The code, in the paper's order (paths under `transformer/`; the README's "Reading the code" has the whole map):
#
# | paper | where |
# |---|---|
# | §3.2.1-3.2.2 attention, multi-head | `model/attention.py`: `scaled_dot_product_attention`, `MultiHeadAttention` |
# | §3.2.3 masks | `model/attention.py`: `make_key_padding_mask`, `causal_mask` |
# | §3.3-3.5 feed-forward, embeddings, positional encoding | `model/layers.py` |
# | §3.1 encoder and decoder stacks | `model/transformer.py`: `Encoder`, `Decoder`, `Transformer` |
# | §5 training: batches, schedule, loss, the loop | `data/batching.py`, `training/` (`trainer.py` first) |
# | §6.1 greedy and beam search | `decoding/` (`search.py`, `greedy.py`, `beam.py`) |
# | text in, text out; attention pictures | `translate.py`, `attention_plot.py` |
