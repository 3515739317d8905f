"""Parity of a Hugging Face export with the checkpoint it came from: logits, greedy text, beam-search BLEU.

Usage:
    transformer export --format huggingface --checkpoint R/checkpoints/best.pt --output R/hf
    python scripts/hf_parity.py --checkpoint R/checkpoints/best.pt --export R/hf [--split test_2016_flickr]
        [--beam-size 4] [--batch-size 64] [--data DIR]

Translates the source side of the split with our `Translator` and with plain `transformers` code
(`MarianTokenizer`, `MarianMTModel.generate`), greedy and with beam search, and prints one JSON line:
    {"lines": .., "max_logit_diff": .., "greedy_equal": .., "greedy_equal_within_cap": ..,
     "bleu_ours_greedy": .., "bleu_hf_greedy": .., "bleu_ours_beam": .., "bleu_hf_beam": .., ...}
greedy_equal compares whole outputs; greedy_equal_within_cap cuts each `generate` output at our length cap
(max_len_a * src_len + max_len_b tokens), which `generate` (one max_length for all) does not have. `generate` uses
the export's generation_config.json (beam size, length_penalty α as |Y|^α where ours divides by ((5 + |Y|) / 6)^α).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import sacrebleu
import torch

from transformer.decoding import max_output_length
from transformer.translate import Translator


def read_split(folder: Path, split: str, lang: str) -> list[str]:
    path = folder / f"{split}.{lang}.gz"
    opener = gzip.open if path.exists() else open
    path = path if path.exists() else folder / f"{split}.{lang}"
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read().rstrip("\n").split("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--split", default=None, help="default: the checkpoint's data.test_split")
    parser.add_argument("--data", default=None, help="folder of {split}.{lang}.gz (default: data.path)")
    parser.add_argument("--beam-size", type=int, default=None, help="default: the checkpoint's decoding.beam_size")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    from transformers import MarianMTModel, MarianTokenizer

    ours = Translator.from_checkpoint(args.checkpoint)
    data = ours.config.data
    folder = Path(args.data or data.path)
    split = args.split or data.test_split
    src, ref = read_split(folder, split, data.src_lang), read_split(folder, split, data.tgt_lang)
    beam = args.beam_size or ours.config.decoding.beam_size
    tokenizer = MarianTokenizer.from_pretrained(args.export)
    hf = MarianMTModel.from_pretrained(args.export).eval()

    with torch.no_grad():
        batch = tokenizer(src[:32], return_tensors="pt", padding=True)
        tgt_in = torch.tensor([[2] + ours.tokenizer.encode_tgt([r])[0][:20] for r in ref[:1]] * 32)
        hf_logits = hf(**batch, decoder_input_ids=tgt_in).logits
        our_logits = ours.engine.attention_model(batch.input_ids, tgt_in)
    max_diff = (hf_logits - our_logits).abs().max().item()

    def generate(num_beams: int) -> tuple[list[str], list[str]]:
        whole, capped = [], []
        with torch.no_grad():
            for start in range(0, len(src), args.batch_size):
                encoded = tokenizer(src[start:start + args.batch_size], return_tensors="pt", padding=True)
                out = hf.generate(**encoded, num_beams=num_beams, do_sample=False)
                whole += tokenizer.batch_decode(out, skip_special_tokens=True)
                lengths = encoded.attention_mask.sum(1).tolist()
                for row, n in zip(out.tolist(), lengths):
                    cap = max_output_length(n, ours.config.decoding.max_len_a, ours.config.decoding.max_len_b,
                                            ours.config.model.max_positions)
                    capped.append(tokenizer.decode(row[:1 + cap], skip_special_tokens=True))
        return whole, capped

    hf_greedy, hf_greedy_capped = generate(1)
    our_greedy = ours.translate(src, beam_size=1, batch_size=args.batch_size)
    hf_beam, _ = generate(beam)
    our_beam = ours.translate(src, beam_size=beam, batch_size=args.batch_size)
    bleu = lambda hyps: round(sacrebleu.corpus_bleu(hyps, [ref]).score, 2)  # noqa: E731
    print(json.dumps({
        "lines": len(src), "split": split, "max_logit_diff": max_diff,
        "greedy_equal": sum(a == b for a, b in zip(hf_greedy, our_greedy)),
        "greedy_equal_within_cap": sum(a == b for a, b in zip(hf_greedy_capped, our_greedy)),
        "beam_equal": sum(a == b for a, b in zip(hf_beam, our_beam)), "beam_size": beam,
        "length_penalty": ours.config.decoding.length_penalty,
        "bleu_ours_greedy": bleu(our_greedy), "bleu_hf_greedy": bleu(hf_greedy),
        "bleu_ours_beam": bleu(our_beam), "bleu_hf_beam": bleu(hf_beam)}))


if __name__ == "__main__":
    main()
