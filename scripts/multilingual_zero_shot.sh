#!/usr/bin/env bash
# Zero-shot and pivot scores of a multilingual Multi30k model (configs/multi30k_multilingual.yaml) on
# test_2016_flickr, for directions between two non-English languages that it never trained on:
#   zero-shot  SRC -> TGT directly (--tgt-lang TGT), greedy and beam
#   pivot      SRC -> en -> TGT through English with the same model, beam both legs (and greedy both legs)
# and which language the outputs are written in (scripts/output_languages.py).
#
# Usage: scripts/multilingual_zero_shot.sh RUN_DIR [CHECKPOINT_NAME] [PAIRS]
#   e.g. scripts/multilingual_zero_shot.sh runs/multi30k_multilingual best "de-fr fr-de"
# Writes RUN_DIR/zero_shot/{zero,pivot}_CKPT_SRC-TGT_{greedy,beam}.json (scores) and .hyp.txt (outputs).
set -euo pipefail
run_dir=${1:?usage: $0 RUN_DIR [CHECKPOINT_NAME] [PAIRS]}
ckpt_name=${2:-best}
pairs=${3:-de-fr fr-de}
data=${DATA_DIR:-../shared/data/multi30k}
bin=${BIN:-.venv/bin}
ckpt=$run_dir/checkpoints/$ckpt_name.pt
out=$run_dir/zero_shot
mkdir -p "$out"
for pair in $pairs; do
  src=${pair%-*}; tgt=${pair#*-}
  for search in greedy beam; do
    beam=$([ $search = greedy ] && echo "--beam-size 1" || echo "")
    $bin/transformer evaluate --checkpoint "$ckpt" --src "$data/test_2016_flickr.$src.gz" \
      --ref "$data/test_2016_flickr.$tgt.gz" --tgt-lang "$tgt" $beam --json "$out/zero_${ckpt_name}_${pair}_$search.json"
    $bin/transformer translate --checkpoint "$ckpt" --input "$data/test_2016_flickr.$src.gz" --tgt-lang en $beam \
      --output "$out/pivot_${ckpt_name}_${src}-en_$search.txt"
    $bin/transformer evaluate --checkpoint "$ckpt" --src "$out/pivot_${ckpt_name}_${src}-en_$search.txt" \
      --ref "$data/test_2016_flickr.$tgt.gz" --tgt-lang "$tgt" $beam --json "$out/pivot_${ckpt_name}_${pair}_$search.json"
  done
done
$bin/python scripts/output_languages.py --data "$data" $(for f in "$out"/*_"$ckpt_name"_*.hyp.txt; do echo --hyp "$f"; done)
