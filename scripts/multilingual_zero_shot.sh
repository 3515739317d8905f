#!/usr/bin/env bash
# Zero-shot and pivot scores of a multilingual model (data.directions) on its test split, for directions between
# two languages that it never trained on together (`make evaluate` runs it for ZERO_SHOT, "de-fr fr-de" by default):
#   zero-shot  SRC -> TGT directly (--tgt-lang TGT), greedy and beam
#   pivot      SRC -> PIVOT -> TGT through the pivot language (English by default) with the same model, both legs
#              with the same search (greedy, then beam)
# and which language the outputs are written in (scripts/output_languages.py, over the run's languages).
#
# Usage: scripts/multilingual_zero_shot.sh RUN_DIR [CHECKPOINT_NAME] [PAIRS]
#   e.g. scripts/multilingual_zero_shot.sh runs/multi30k_multilingual best "de-fr fr-de"
# A pair is skipped, saying why, when the run is not multilingual, the pair is a trained direction, SRC-PIVOT or
# PIVOT-TGT is not one, or a test file is missing. The test files are DATA_DIR/{split}.{lang}.gz, DATA_DIR the
# environment's or the run's data.path, split its data.test_split.
# Writes RUN_DIR/zero_shot/{zero,pivot}_CKPT_SRC-TGT_{greedy,beam}.json (scores) and .hyp.txt (outputs), and
# RUN_DIR/zero_shot/languages_CKPT.jsonl (the output languages of each .hyp.txt).
set -euo pipefail
run_dir=${1:?usage: $0 RUN_DIR [CHECKPOINT_NAME] [PAIRS]}
ckpt_name=${2:-best}
pairs=${3:-de-fr fr-de}
pivot=${PIVOT:-en}
bin=${BIN:-.venv/bin}
ckpt=$run_dir/checkpoints/$ckpt_name.pt
out=$run_dir/zero_shot
# data folder, test split, the run's languages and directions, from its config.yaml
eval "$($bin/python - "$run_dir/config.yaml" "${DATA_DIR:-}" <<'EOF'
import shlex, sys, yaml
data = yaml.safe_load(open(sys.argv[1]))["data"]
directions = data.get("directions") or []
langs = list(dict.fromkeys(lang for d in directions for lang in d.split("-")))
for name, value in (("data", sys.argv[2] or data.get("path") or ""), ("split", data.get("test_split", "test")),
                    ("langs", " ".join(langs)), ("directions", " ".join(directions))):
    print(f"{name}={shlex.quote(value)}")
EOF
)"
if [ -z "$directions" ]; then
  echo "zero-shot: $run_dir is not a multilingual run (no data.directions): nothing to score"
  exit 0
fi
trained() { [[ " $directions " == *" $1 "* ]]; }
scored=()
for pair in $pairs; do
  src=${pair%-*}; tgt=${pair#*-}
  if trained "$pair"; then echo "zero-shot: $pair is a trained direction of $run_dir: skipped"; continue; fi
  if ! trained "$src-$pivot" || ! trained "$pivot-$tgt"; then
    echo "zero-shot: $pair: $run_dir does not train $src-$pivot and $pivot-$tgt: skipped"; continue
  fi
  if [ ! -f "$data/$split.$src.gz" ] || [ ! -f "$data/$split.$tgt.gz" ]; then
    echo "zero-shot: $pair: no $data/$split.$src.gz or $data/$split.$tgt.gz: skipped"; continue
  fi
  mkdir -p "$out"
  for search in greedy beam; do
    beam=$([ $search = greedy ] && echo "--beam-size 1" || echo "")
    $bin/transformer evaluate --checkpoint "$ckpt" --src "$data/$split.$src.gz" \
      --ref "$data/$split.$tgt.gz" --tgt-lang "$tgt" $beam --json "$out/zero_${ckpt_name}_${pair}_$search.json"
    $bin/transformer translate --checkpoint "$ckpt" --input "$data/$split.$src.gz" --tgt-lang "$pivot" $beam \
      --output "$out/pivot_${ckpt_name}_${src}-${pivot}_$search.txt"
    $bin/transformer evaluate --checkpoint "$ckpt" --src "$out/pivot_${ckpt_name}_${src}-${pivot}_$search.txt" \
      --ref "$data/$split.$tgt.gz" --tgt-lang "$tgt" $beam --json "$out/pivot_${ckpt_name}_${pair}_$search.json"
    scored+=(--hyp "$out/zero_${ckpt_name}_${pair}_$search.hyp.txt" --hyp "$out/pivot_${ckpt_name}_${pair}_$search.hyp.txt")
  done
done
if [ ${#scored[@]} -gt 0 ]; then
  # shellcheck disable=SC2086
  if $bin/python scripts/output_languages.py --data "$data" --langs $langs "${scored[@]}" \
      > "$out/languages_${ckpt_name}.jsonl.partial"; then
    mv "$out/languages_${ckpt_name}.jsonl.partial" "$out/languages_${ckpt_name}.jsonl"
    cat "$out/languages_${ckpt_name}.jsonl"
  else  # the scores stand without it; scores.md then has no language column
    rm -f "$out/languages_${ckpt_name}.jsonl.partial" "$out/languages_${ckpt_name}.jsonl"
    echo "zero-shot: the output languages were not measured (above: why)"
  fi
fi
