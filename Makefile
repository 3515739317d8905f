# Entry points. `make train` trains and evaluates the Multi30k de->en recipe; `make test` runs every test (as CI does),
# `make test-fast` the quick ones (not marked slow).
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
TORCH       ?= torch==2.13.0
# Where pip also looks for torch: PyTorch's CPU-only builds (on Linux PyPI's torch is a CUDA build of several GB).
# For a CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cu128, or TORCH_INDEX= for PyPI's.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
CONFIG      ?= configs/multi30k_de_en.yaml
RUN_DIR     ?= runs/$(basename $(notdir $(CONFIG)))
# Folder with the Multi30k files ({split}.{lang}.gz); empty: the recipe's own data.path (then the HF hub).
DATA_DIR    ?=
SET         ?=
PYTEST_ARGS ?=

DATA_SET := $(if $(DATA_DIR),data.path=$(DATA_DIR),)
SETS     := $(strip $(DATA_SET) $(SET))
SET_FLAGS := $(foreach s,$(SETS),--set $(s))
EVAL_SET_FLAGS := $(foreach s,$(DATA_SET),--set $(s))

.PHONY: install browser test test-fast lint train evaluate backtranslate distill distilled-corpora distill-multilingual notebook notebook-run bench-decode bench-train bench-serve gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned torch first, so that no dependency pulls a multi-GB CUDA build on a CPU machine.
	$(BIN)/pip install -q --retries 1 --timeout 30 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),) "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,viz,ct2,serve,hf,tensorboard,notebook]"
	touch $@

install: $(VENV)/.installed browser

# Debian's Chromium, for the browser test of `transformer serve` (installed when run as root with apt-get).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "note: the browser test of 'transformer serve' needs Chromium: apt-get install -y chromium"; fi

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check transformer tests scripts

# RESUME=1 continues an interrupted run of RUN_DIR (train --resume); without it, a RUN_DIR that holds a run is refused.
# INIT_FROM=CHECKPOINT starts the run from that model's weights and tokenizer (train --init-from: fine-tuning).
RESUME ?=
INIT_FROM ?=
train: install
	$(BIN)/transformer train --config $(CONFIG) --run-dir $(RUN_DIR) $(SET_FLAGS) $(if $(RESUME),--resume,) \
		$(if $(INIT_FROM),$(if $(RESUME),,--init-from $(INIT_FROM)),)
	$(BIN)/transformer plot --run-dir $(RUN_DIR) --out $(RUN_DIR)/curves.png
	$(MAKE) --no-print-directory evaluate

AVERAGE_LAST ?= 5
# A multilingual run's directions never trained, scored directly and through English (scripts/multilingual_zero_shot.sh;
# pairs whose languages the run lacks are skipped).
ZERO_SHOT ?= de-fr fr-de

# Scores best.pt and the average of the last AVERAGE_LAST step checkpoints (of as many as there are, if fewer; said) on
# the test split, greedy and with the config's beam search (the Multi30k recipes: beam 4, α 2.0).
# A multilingual run (data.directions) is scored direction by direction: eval_test_CKPT_DIRECTION_{greedy,beam}.json.
# A multilingual run also scores ZERO_SHOT with best.pt. Then RUN_DIR/scores.md: every score in one table, a row per
# direction (scripts/score_table.py).
evaluate: install
	n=$$(ls $(RUN_DIR)/checkpoints/step_*.pt 2>/dev/null | wc -l); n=$$(( n < $(AVERAGE_LAST) ? n : $(AVERAGE_LAST) )); \
	avg=; if [ $$n -gt 0 ]; then \
		$(BIN)/transformer average --run-dir $(RUN_DIR) --last $$n --output $(RUN_DIR)/checkpoints/avg_last$$n.pt \
			|| exit 1; avg=avg_last$$n; fi; \
	if [ $$n -lt $(AVERAGE_LAST) ]; then echo "evaluate: $$n step checkpoints in $(RUN_DIR)/checkpoints, fewer than" \
		"AVERAGE_LAST=$(AVERAGE_LAST): $${avg:-no average} scored beside best.pt"; fi; \
	directions=$$($(BIN)/python -c "import yaml; print(' '.join(yaml.safe_load(open('$(RUN_DIR)/config.yaml'))['data'].get('directions') or []))"); \
	for ckpt in best $$avg; do for d in $${directions:-none}; do \
		flags=$$([ $$d = none ] || echo "--direction $$d"); name=$${ckpt}$$([ $$d = none ] || echo "_$$d"); \
		$(BIN)/transformer evaluate --checkpoint $(RUN_DIR)/checkpoints/$$ckpt.pt --split test --beam-size 1 $$flags \
			--json $(RUN_DIR)/eval_test_$${name}_greedy.json $(EVAL_SET_FLAGS) && \
		$(BIN)/transformer evaluate --checkpoint $(RUN_DIR)/checkpoints/$$ckpt.pt --split test $$flags \
			--json $(RUN_DIR)/eval_test_$${name}_beam.json $(EVAL_SET_FLAGS) || exit 1; \
	done; done
	BIN=$(BIN) DATA_DIR=$(DATA_DIR) scripts/multilingual_zero_shot.sh $(RUN_DIR) best "$(ZERO_SHOT)"
	$(BIN)/python scripts/score_table.py $(RUN_DIR)

# Back-translation (configs/multi30k_de_en_bt.yaml, multi30k_en_de_bt.yaml; BT=de_en or en_de): the reverse model
# (BT_REVERSE: by default runs/multi30k_TGT_SRC_reverse, the other bilingual recipe trained for BT_REVERSE_STEPS
# updates, trained or resumed until it has them (a finished run returns at once); BT_REVERSE=runs/multi30k_en_de uses
# a finished run as it is),
# Multi30k task 2's target-language descriptions translated by it into runs/synthetic/task2_TGT_SRC
# (`transformer synthesize`, without the lines of the parallel training text; it goes on where it stopped), then the
# BT recipe trained (resumed if it stopped) and evaluated. Every step can be interrupted and the same command goes on.
BT        ?= de_en
TASK2_DIR ?= ../shared/data/multi30k_task2
# The search that makes the synthetic sources (any `transformer translate` decoding flags).
BT_SEARCH ?= --beam-size 1
BT_SRC    := $(word 1,$(subst _, ,$(BT)))
BT_TGT    := $(word 2,$(subst _, ,$(BT)))
BT_REVERSE_STEPS ?= 3000
BT_REVERSE_RUN := runs/multi30k_$(BT_TGT)_$(BT_SRC)_reverse
BT_REVERSE ?= $(BT_REVERSE_RUN)
BT_CORPUS := runs/synthetic/task2_$(BT_TGT)_$(BT_SRC)
PARALLEL_DIR := $(or $(DATA_DIR),../shared/data/multi30k)

backtranslate: install
	@if [ "$(BT_REVERSE)" = "$(BT_REVERSE_RUN)" ]; then \
		$(BIN)/transformer train \
			--config configs/multi30k_$(BT_TGT)_$(BT_SRC).yaml --run-dir $(BT_REVERSE) \
			--set training.max_steps=$(BT_REVERSE_STEPS) $(EVAL_SET_FLAGS) \
			$$([ -f $(BT_REVERSE)/checkpoints/last.pt ] && echo --resume) || exit $$?; \
	elif [ ! -f $(BT_REVERSE)/checkpoints/best.pt ]; then \
		echo "backtranslate: BT_REVERSE=$(BT_REVERSE) has no checkpoints/best.pt (a finished $(BT_TGT)->$(BT_SRC) run)"; exit 2; fi
	@[ -f $(BT_CORPUS)/origin.json ] || $(BIN)/transformer synthesize --checkpoint $(BT_REVERSE)/checkpoints/best.pt \
		--input $(foreach i,1 2 3 4 5,$(TASK2_DIR)/train.$(i).$(BT_TGT).gz) --output $(BT_CORPUS) \
		--exclude $(PARALLEL_DIR)/train.$(BT_TGT).gz $(BT_SEARCH)
	$(MAKE) --no-print-directory train CONFIG=configs/multi30k_$(BT)_bt.yaml \
		$$([ -f runs/multi30k_$(BT)_bt/checkpoints/last.pt ] && echo RESUME=1)

# Sequence-level knowledge distillation (Kim & Rush 2016; configs/multi30k_de_en_student.yaml, en_de_student.yaml;
# DISTILL=de_en or en_de): the teacher (TEACHER: one checkpoint or several, an ensemble; by default the bilingual
# recipe's best.pt, trained and evaluated with `make train` first if runs/multi30k_SRC_TGT has no test scores yet)
# translates with DISTILL_SEARCH the parallel training sources into runs/distilled/train_SRC_TGT and task 2's
# captions in the source language (less those lines) into runs/distilled/task2_SRC_TGT (`transformer synthesize`;
# each goes on where it stopped), then the student recipe is trained on both (resumed if it stopped) and evaluated.
DISTILL ?= de_en
DISTILL_SEARCH ?= --beam-size 4
DISTILL_SRC := $(word 1,$(subst _, ,$(DISTILL)))
TEACHER_RUN := runs/multi30k_$(DISTILL)
TEACHER ?= $(TEACHER_RUN)/checkpoints/best.pt
DISTILLED := runs/distilled/train_$(DISTILL)
DISTILLED_TASK2 := runs/distilled/task2_$(DISTILL)

distill: install
	@if [ "$(TEACHER)" = "$(TEACHER_RUN)/checkpoints/best.pt" ]; then \
		[ -f $(TEACHER_RUN)/eval_test_best_beam.json ] || $(MAKE) --no-print-directory train \
			CONFIG=configs/multi30k_$(DISTILL).yaml $$([ -f $(TEACHER_RUN)/checkpoints/last.pt ] && echo RESUME=1) \
			|| exit $$?; \
	else for c in $(TEACHER); do [ -e $$c ] || { echo "distill: TEACHER: $$c not found"; exit 2; }; done; fi
	@$(MAKE) --no-print-directory distilled-corpora DISTILL=$(DISTILL) TEACHER="$(TEACHER)"
	$(MAKE) --no-print-directory train CONFIG=configs/multi30k_$(DISTILL)_student.yaml \
		$$([ -f runs/multi30k_$(DISTILL)_student/checkpoints/last.pt ] && echo RESUME=1)

# The teacher's translations (TEACHER, of DISTILL's source language) of the parallel training sources and of task 2's
# captions less those lines: runs/distilled/train_SRC_TGT and task2_SRC_TGT, each written unless it is there already.
distilled-corpora: install
	@[ -f $(DISTILLED)/origin.json ] || $(BIN)/transformer synthesize $(foreach c,$(TEACHER),--checkpoint $(c)) \
		--input $(PARALLEL_DIR)/train.$(DISTILL_SRC).gz --output $(DISTILLED) $(DISTILL_SEARCH)
	@[ -f $(DISTILLED_TASK2)/origin.json ] || $(BIN)/transformer synthesize $(foreach c,$(TEACHER),--checkpoint $(c)) \
		--input $(foreach i,1 2 3 4 5,$(TASK2_DIR)/train.$(i).$(DISTILL_SRC).gz) --output $(DISTILLED_TASK2) \
		--exclude $(PARALLEL_DIR)/train.$(DISTILL_SRC).gz $(DISTILL_SEARCH)

# One multilingual model distilled from bilingual teachers, in two stages. The de->en and en->de back-translation
# models (ML_TEACHERS; `make backtranslate BT=de_en` and `BT=en_de` train them) translate the training sources and task
# 2's captions (`make distilled-corpora`: what is there already is kept); configs/multi30k_multilingual_student.yaml
# trains on the first beside the references of its eight directions, then
# configs/multi30k_multilingual_student_task2.yaml goes on from its best.pt with task 2's translations added. Each
# stage is evaluated; an interrupted stage is resumed, a finished one (its scores.md written) skipped.
ML_TEACHERS ?= de_en:runs/multi30k_de_en_bt/checkpoints/best.pt en_de:runs/multi30k_en_de_bt/checkpoints/best.pt
ML_STAGE1 := runs/multi30k_multilingual_student
ML_STAGE2 := runs/multi30k_multilingual_student_task2

distill-multilingual: install
	@for t in $(ML_TEACHERS); do d=$${t%%:*}; c=$${t#*:}; \
		[ -f runs/distilled/train_$$d/origin.json ] && [ -f runs/distilled/task2_$$d/origin.json ] && continue; \
		[ -f $$c ] || { echo "distill-multilingual: ML_TEACHERS: $$c not found (make backtranslate BT=$$d trains it)"; exit 2; }; \
		$(MAKE) --no-print-directory distilled-corpora DISTILL=$$d TEACHER=$$c || exit $$?; done
	@[ -f $(ML_STAGE1)/scores.md ] || $(MAKE) --no-print-directory train \
		CONFIG=configs/multi30k_multilingual_student.yaml $$([ -f $(ML_STAGE1)/checkpoints/last.pt ] && echo RESUME=1)
	@[ -f $(ML_STAGE2)/scores.md ] || $(MAKE) --no-print-directory train \
		CONFIG=configs/multi30k_multilingual_student_task2.yaml INIT_FROM=$(ML_STAGE1)/checkpoints/best.pt \
		$$([ -f $(ML_STAGE2)/checkpoints/last.pt ] && echo RESUME=1)

# Opens the teaching notebook in JupyterLab, on the venv's kernel (notebooks/learn_the_transformer.ipynb); as root
# (a container) Jupyter wants --allow-root.
notebook: install
	$(BIN)/jupyter lab notebooks/learn_the_transformer.ipynb $(if $(filter 0,$(shell id -u)),--allow-root,)

# Executes the notebook headless on the venv's kernel and saves it with its outputs, as committed; section 7 reads the
# model the notebook finds (TRANSFORMER_NOTEBOOK_DE_EN=CHECKPOINT make notebook-run names one).
notebook-run: install
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=900 \
		--ExecutePreprocessor.kernel_name=python3 notebooks/learn_the_transformer.ipynb

bench-decode: install
	$(BIN)/python scripts/benchmark_decode.py --checkpoint $(RUN_DIR)/checkpoints/best.pt

# Starts `transformer serve` on RUN_DIR's best.pt, runs the load test (8 clients, 400 requests) against it, stops it.
SERVE_PORT ?= 8765
bench-serve: install
	$(BIN)/transformer serve --checkpoint $(RUN_DIR)/checkpoints/best.pt --port $(SERVE_PORT) --no-access-log & pid=$$!; \
	for i in $$(seq 120); do curl -sf http://127.0.0.1:$(SERVE_PORT)/health >/dev/null && break; sleep 1; done; \
	$(BIN)/python scripts/load_test_serve.py --url http://127.0.0.1:$(SERVE_PORT) \
		--source $(or $(DATA_DIR),../shared/data/multi30k)/test_2016_flickr.de.gz --clients 8 --requests 400; status=$$?; \
	kill $$pid; exit $$status

bench-train: install
	$(BIN)/python scripts/benchmark_train.py --config $(CONFIG) $(SET_FLAGS)

# On a CUDA machine, with the Python and torch found there (no virtual environment, no network): environment,
# `pytest -m cuda`, training and decoding speed, torchrun with nccl; one JSON line (scripts/gpu_check.py).
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
