"""Decoding speed: greedy and beam search at two batch sizes, side by side with CTranslate2.

Usage:
    python scripts/benchmark_decode.py --checkpoint runs/multi30k_de_en/checkpoints/best.pt
        [--sentences 1000] [--threads 2] [--modes greedy,beam4] [--batch-sizes 1,64]
        [--ctranslate2 DIR [--ctranslate2 DIR_INT8]] [--int8] [--compile] [--repeat N] [--workers N]
        [--interleave] [--system-malloc] [--profile N] [--student CHECKPOINT ...] [--bleu]

Modes: greedy, beamN (natural output lengths), and greedy_fix20, beamN_fix20: every output forced to exactly 20
pieces (eos forbidden before 20, cut at 20), so that engines are compared on equal work whatever their models
say. With --ctranslate2 DIR (a folder from `transformer export`), the same modes run through
`ctranslate2.Translator.translate_batch` on the same source pieces with the same threads, and the summary gives our
speed over CTranslate2's per mode and batch size. With --int8 our decoder also runs with int8 dynamically quantized
linear layers (`Translator.from_checkpoint(..., quantization="int8")`, engine "ours int8"), and with --compile with
the decoding step compiled by torch.compile (`Translator.from_checkpoint(..., compile=True)`, engine "ours
compiled", compiled before the timed rounds), compared the same way.

With --student CHECKPOINT (repeatable; e.g. a distilled student of --checkpoint, its teacher) each student decodes
the same sentences in the same modes (engine "student NAME", NAME its run folder; with --int8 also "student NAME
int8"), each with its own tokenizer, and the summary adds each student setting's speed over the teacher's
(`--checkpoint`, float32) in every mode at the same batch size: "student greedy against teacher beam4".

With --bleu each setting's outputs are also scored against the test references (sacreBLEU, "bleu" in its line and
in the summary; CTranslate2's pieces detokenized by the teacher's tokenizer): quality and speed from the same
decoding.

Reads the source side of the checkpoint's test split (Multi30k test_2016_flickr: 1,000 sentences), decodes
it in each setting and prints one JSON line per setting:
    {"engine": "ours", "mode": "beam4", "batch_size": 64, "sentences": 1000, "seconds": ..,
     "sentences_per_s": .., "tgt_tokens_per_s": .., "threads": 2}
tgt_tokens_per_s counts the output tokens (eos included) per second of decoding, tokenization excluded. Neither
engine is asked for scores (CTranslate2's default, `return_scores=False`; ours `decode_ids(..., scores=False)`, as
`Translator.translate` and `transformer translate` without --n-best): greedy then takes the argmax of the logits
without a log-softmax; beam search needs the log-probabilities either way.
Like `transformer translate`, it first calls `transformer.device.reuse_freed_memory` (glibc keeps freed memory
for reuse instead of re-faulting its pages); --system-malloc skips that, to measure what it changes.
A last line {"summary": ...} gives, over the --repeat rounds, each setting's fastest speed and our speed over
CTranslate2's (fastest round against fastest round; with
--interleave also each round's ratio, both engines timed in that round).
With --workers N (default 1) both engines decode N batches at once, each on threads / N threads: ours through
`Translator.from_checkpoint(..., workers=N)`, CTranslate2 with inter_threads=N and intra_threads=threads / N.
With --interleave the engines take turns batch by batch instead of file by file: the sentences, sorted longest
first, are cut into slices of batch_size x workers, every engine decodes each slice in turn (after a 50 ms pause),
and each engine's seconds are summed over the slices. On a shared host whose speed drifts by +-20% within minutes,
whole-file turns give ratios that move by +-0.1 between runs; turns of a fraction of a second put both engines
under the same conditions (ratios within about +-0.03 between runs, measured).
With --profile N, our float32 decoder then runs each setting once more under torch.profiler (CPU activities) and
the N operators with the most self CPU time are printed per setting, with the wall time of the profiled run and
the share of it that no operator accounts for (Python and dispatch between operators): where the time goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from transformer.config import DecodingConfig
from transformer.data import load_split
from transformer.decoding import max_output_length
from transformer.device import reuse_freed_memory
from transformer.translate import Translator


def mode_options(decoding: DecodingConfig, mode: str, batch_size: int) -> DecodingConfig:
    """Decoding settings of a mode: beam size from "greedy"/"beamN"; "_fix20" forces 20 output pieces."""
    name, _, fixed = mode.partition("_")
    beam_size = 1 if name == "greedy" else int(name.removeprefix("beam"))
    options = dataclasses.replace(decoding, beam_size=beam_size, n_best=1, batch_size=batch_size)
    if fixed == "fix20":
        options = dataclasses.replace(options, min_len=20, max_len_a=0.0, max_len_b=20)
    return options


def bleu(outputs: list[str], references: Optional[list[str]]) -> dict:
    """{"bleu": sacreBLEU of the outputs} with --bleu (`references`), else {}."""
    if references is None:
        return {}
    import sacrebleu

    return {"bleu": round(sacrebleu.corpus_bleu(outputs, [references[:len(outputs)]]).score, 2)}


def run(translator: Translator, src_ids: list, mode: str, batch_size: int, engine: str = "ours",
        references: Optional[list[str]] = None) -> dict:
    options = mode_options(translator.config.decoding, mode, batch_size)
    start = time.perf_counter()
    hyps = translator.decode_ids(src_ids, options, scores=False)
    seconds = time.perf_counter() - start
    n_tokens = sum(len(h[0].tokens) + h[0].finished for h in hyps)
    return {"engine": engine, "mode": mode, "batch_size": batch_size, "sentences": len(src_ids),
            "seconds": round(seconds, 2), "sentences_per_s": round(len(src_ids) / seconds, 1),
            "tgt_tokens_per_s": round(n_tokens / seconds, 1), "threads": torch.get_num_threads(),
            **bleu([translator.tokenizer.decode_tgt(h[0].tokens) for h in hyps], references),
            "seconds_exact": seconds, "tokens": n_tokens}


def run_ctranslate2(model, name: str, pieces: list, decoding: DecodingConfig, mode: str, batch_size: int,
                    references: Optional[list[str]] = None, tokenizer=None) -> dict:
    """The same mode through CTranslate2 (sorted longest first, as ours; tokenization excluded); with
    `references`, the BLEU of its pieces detokenized by `tokenizer` (the teacher's)."""
    options = mode_options(decoding, mode, batch_size)
    order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i]))
    cap = max(max_output_length(len(p) + 1, options.max_len_a, options.max_len_b, 1 << 30) for p in pieces)
    start = time.perf_counter()
    out = model.translate_batch([pieces[i] for i in order], beam_size=options.beam_size, max_batch_size=batch_size,
                                length_penalty=options.length_penalty if options.beam_size > 1 else 0.0,
                                max_decoding_length=cap, min_decoding_length=options.min_len)
    seconds = time.perf_counter() - start
    n_tokens = sum(len(r.hypotheses[0]) for r in out)
    outputs = [""] * len(pieces)
    if references is not None:
        for i, r in zip(order, out):
            outputs[i] = tokenizer.decode_tgt(tokenizer.piece_ids(r.hypotheses[0]))
    return {"engine": name, "mode": mode, "batch_size": batch_size, "sentences": len(pieces),
            "seconds": round(seconds, 2), "sentences_per_s": round(len(pieces) / seconds, 1),
            "tgt_tokens_per_s": round(n_tokens / seconds, 1), "threads": torch.get_num_threads(),
            **bleu(outputs, references), "seconds_exact": seconds, "tokens": n_tokens}


def interleaved(ctranslate2_models: list, ours: list, pieces: Optional[list], src_ids: list,
                decoding: DecodingConfig, mode: str, slice_size: int, batch_size: int) -> list[dict]:
    """One --interleave round of a setting: every engine decodes each slice of slice_size sentences (longest
    first by the teacher's pieces) in turn; per engine, the `run` fields with seconds and tokens summed over the
    slices. `ours`: (name, translator, its source ids of the sentences)."""
    order = sorted(range(len(src_ids)), key=lambda i: -len(src_ids[i]))
    totals: dict[str, dict] = {}
    for start in range(0, len(order), slice_size):
        part = order[start:start + slice_size]
        for name, engine, ids in [(n, m, None) for n, m in ctranslate2_models] + ours:
            time.sleep(0.05)  # let the other engine's OpenMP threads stop spinning (see the rounds' comment in main)
            if ids is None:
                result = run_ctranslate2(engine, name, [pieces[i] for i in part], decoding, mode, batch_size)
            else:
                result = run(engine, [ids[i] for i in part], mode, batch_size, name)
            total = totals.setdefault(name, {**result, "seconds": 0.0, "tokens": 0, "sentences": 0})
            total["seconds"] += result["seconds_exact"]
            total["tokens"] += result["tokens"]
            total["sentences"] += len(part)
    return [public({**total, "seconds": round(total["seconds"], 2),
                    "sentences_per_s": round(total["sentences"] / total["seconds"], 1),
                    "tgt_tokens_per_s": round(total["tokens"] / total["seconds"], 1), "interleaved": True})
            for total in totals.values()]


def public(result: dict) -> dict:
    """A result without the unrounded fields `interleaved` sums."""
    return {k: v for k, v in result.items() if k not in ("seconds_exact", "tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="greedy,beam4")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--ctranslate2", action="append", default=[], metavar="DIR",
                        help="also decode with this exported CTranslate2 model (repeatable, e.g. float32 and int8)")
    parser.add_argument("--int8", action="store_true", help="also decode with our int8-quantized model")
    parser.add_argument("--compile", action="store_true",
                        help="also decode with our decoding step compiled by torch.compile (compiled before timing)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over every engine and setting; the summary keeps each setting's fastest")
    parser.add_argument("--workers", type=int, default=1,
                        help="batches decoded at once by each engine, each on threads / workers threads")
    parser.add_argument("--interleave", action="store_true",
                        help="engines take turns batch by batch (steadier ratios on a shared host)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile our float32 decoder once per setting and print its N costliest operators")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's allocator settings as they are (see reuse_freed_memory)")
    parser.add_argument("--student", action="append", default=[], metavar="CHECKPOINT",
                        help="also decode with this model (repeatable), compared with --checkpoint as its teacher")
    parser.add_argument("--bleu", action="store_true",
                        help="also score every setting's outputs against the references (sacreBLEU; not with "
                             "--interleave)")
    args = parser.parse_args()
    if args.bleu and args.interleave:
        parser.error("--bleu scores whole-file rounds: leave out --interleave")
    if not args.system_malloc:
        reuse_freed_memory()
    torch.set_num_threads(args.threads)
    translator = Translator.from_checkpoint(args.checkpoint, device="cpu", workers=args.workers)
    data = translator.config.data
    corpus = load_split(data, data.test_split)
    src_ids = translator.tokenizer.encode_src(corpus.src[:args.sentences])
    references = corpus.tgt[:args.sentences] if args.bleu else None
    ctranslate2_models = []
    if args.ctranslate2:
        import ctranslate2

        pieces = translator.tokenizer.src.encode(corpus.src[:args.sentences], out_type=str)
        for folder in args.ctranslate2:
            model = ctranslate2.Translator(folder, device="cpu", intra_threads=max(1, args.threads // args.workers),
                                           inter_threads=args.workers)
            quantization = json.loads((Path(folder) / "transformer_nmt.json").read_text())["quantization"]
            model.translate_batch(pieces[:16])  # warm-up
            ctranslate2_models.append((f"ctranslate2 {ctranslate2.__version__} {quantization}", model))
    ours = [("ours", translator, src_ids)]
    if args.int8:
        ours.append(("ours int8", Translator.from_checkpoint(args.checkpoint, device="cpu", quantization="int8",
                                                             workers=args.workers), src_ids))
    settings = [(mode, int(b)) for mode in args.modes.split(",") for b in args.batch_sizes.split(",")]
    if args.compile:
        ours.append(("ours compiled", Translator.from_checkpoint(args.checkpoint, device="cpu", compile=True,
                                                                 workers=args.workers), src_ids))
    students = []
    for checkpoint in args.student:
        name = f"student {Path(checkpoint).resolve().parent.parent.name}"
        for suffix, quantization in [("", None)] + ([(" int8", "int8")] if args.int8 else []):
            student = Translator.from_checkpoint(checkpoint, device="cpu", quantization=quantization,
                                                 workers=args.workers)
            students.append(name + suffix)
            ours.append((name + suffix, student, student.tokenizer.encode_src(corpus.src[:args.sentences])))
    for engine, decoder, ids in ours:
        start = time.perf_counter()
        decoder.decode_ids(ids[:16], decoder.config.decoding)  # warm-up, with the engine's own source ids
        if engine == "ours compiled":  # each search compiles at its first use: timed here, before the rounds
            for mode, batch_size in settings:
                decoder.decode_ids(ids[:2 * batch_size], mode_options(decoder.config.decoding, mode, batch_size))
            print(json.dumps({"engine": engine, "compile_and_warm_up_seconds": round(time.perf_counter() - start, 1)}),
                  flush=True)
    results = []
    # Rounds: every engine once per round, so that a machine whose speed drifts (shared hosts) affects all alike;
    # the summary keeps each setting's fastest round. CTranslate2 first in a round, after a pause: torch's OpenMP
    # threads spin for a while after our decoder ran and took the cores from CTranslate2's threads (measured once:
    # its greedy speed fell 3-6x when run right after ours).
    for round_index in range(args.repeat):
        time.sleep(1.0)
        if args.interleave:
            for mode, batch_size in settings:
                for result in interleaved(ctranslate2_models, ours, pieces if ctranslate2_models else None, src_ids,
                                          translator.config.decoding, mode, batch_size * args.workers, batch_size):
                    results.append({**result, "round": round_index})
                    print(json.dumps(results[-1]), flush=True)
            continue
        for name, model in ctranslate2_models:
            for mode, batch_size in settings:
                result = public(run_ctranslate2(model, name, pieces, translator.config.decoding, mode, batch_size,
                                                references, translator.tokenizer))
                results.append({**result, "round": round_index})
                print(json.dumps(results[-1]), flush=True)
        for engine, decoder, ids in ours:
            for mode, batch_size in settings:
                result = public(run(decoder, ids, mode, batch_size, engine, references))
                results.append({**result, "round": round_index})
                print(json.dumps(results[-1]), flush=True)
    best: dict[tuple, dict] = {}
    for r in results:
        key = (r["engine"], r["mode"], r["batch_size"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    ratios, fastest, scores = {}, {}, {}
    for (engine, mode, batch_size), r in best.items():
        fastest[f"{engine} {mode} batch{batch_size}"] = r["sentences_per_s"]
        if "bleu" in r:
            scores[f"{engine} {mode} batch{batch_size}"] = r["bleu"]
        if engine.startswith("ctranslate2"):
            for mine, _, _ in ours:
                ratios[f"{mine.replace(' ', '_')}_over_{engine.split()[-1]}_{mode}_batch{batch_size}"] = round(
                    r["seconds"] / best[(mine, mode, batch_size)]["seconds"], 2)
    summary = {"rounds": args.repeat, "best_sentences_per_s": fastest, "speed_ours_over_ctranslate2": ratios,
               **({"bleu": scores} if scores else {})}
    if students:  # each student setting against the teacher (float32) in every mode at the same batch size
        summary["speed_student_over_teacher"] = {
            f"{student.replace(' ', '_')}_{mode}_over_teacher_{teacher_mode}_batch{batch_size}": round(
                best[("ours", teacher_mode, batch_size)]["seconds"] / best[(student, mode, batch_size)]["seconds"], 2)
            for student in students for mode, batch_size in settings
            for teacher_mode, teacher_batch in settings if teacher_batch == batch_size}
    if args.interleave:  # both engines of a ratio measured in the same round: each round's ratio
        per_round: dict[str, list] = {}
        for r in results:
            if r["engine"].startswith("ctranslate2"):
                for mine, _, _ in ours:
                    same = next(o for o in results if o["engine"] == mine and o["round"] == r["round"]
                                and o["mode"] == r["mode"] and o["batch_size"] == r["batch_size"])
                    key = f"{mine.replace(' ', '_')}_over_{r['engine'].split()[-1]}_{r['mode']}_batch{r['batch_size']}"
                    per_round.setdefault(key, []).append(round(r["seconds"] / same["seconds"], 2))
        summary["speed_ours_over_ctranslate2_per_round"] = per_round
    print(json.dumps({"summary": summary}))
    for mode, batch_size in settings if args.profile else []:
        options = mode_options(translator.config.decoding, mode, batch_size)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            translator.decode_ids(src_ids, options, scores=False)
            seconds = time.perf_counter() - start
        events = prof.key_averages()
        # self times of aten:: operators only: other events (autograd functions, profiler records) nest them
        op_seconds = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e6
        print(f"\nprofile: ours, {mode}, batch {batch_size}: {seconds:.2f} s wall (profiled), aten operators "
              f"{op_seconds:.2f} s self time, the rest {max(seconds - op_seconds, 0.0):.2f} s (Python, dispatch)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.profile))


if __name__ == "__main__":
    main()
