# Entry points. `make train` trains and evaluates the Multi30k de->en recipe; `make test` runs every test (as CI does),
# `make test-fast` the quick ones (not marked slow).
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
TORCH       ?= torch==2.13.0
# Where pip also looks for torch: PyTorch's CPU-only builds (on Linux PyPI's torch is a CUDA build of several GB).
# For a CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cu128, or TORCH_INDEX= for PyPI's. Where the index
# cannot be reached (no DNS for its host), `make install` says so once and uses the default index alone.
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

.PHONY: install browser test test-fast lint train evaluate chain backtranslate distill distill-multilingual notebook notebook-run bench-decode bench-train bench-serve gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned torch first, so that no dependency pulls a multi-GB CUDA build on a CPU machine. TORCH_INDEX is
	# asked only when its host resolves (else one note, and pip's default index alone, without a retry per package).
	idx="$(TORCH_INDEX)"; if [ -n "$$idx" ] && ! $(BIN)/python -c "import socket, sys, urllib.parse; \
		socket.getaddrinfo(urllib.parse.urlparse(sys.argv[1]).hostname, 443)" "$$idx" 2>/dev/null; then \
		echo "note: $$idx cannot be reached; torch from the default package index"; idx=; fi; \
	$(BIN)/pip install -q --retries 1 --timeout 30 $${idx:+--extra-index-url $$idx} "$(TORCH)"
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
# RESUME=1 without CONFIG continues RUN_DIR with its own config.yaml (as its first command resolved it, --set included).
TRAIN_CONFIG = $(if $(and $(RESUME),$(filter file,$(origin CONFIG))),,--config $(CONFIG))
train: install
	$(BIN)/transformer train $(TRAIN_CONFIG) --run-dir $(RUN_DIR) $(SET_FLAGS) $(if $(RESUME),--resume,) \
		$(if $(INIT_FROM),$(if $(RESUME),,--init-from $(INIT_FROM)),)
	$(BIN)/transformer plot --run-dir $(RUN_DIR) --out $(RUN_DIR)/curves.png
	$(MAKE) --no-print-directory evaluate

AVERAGE_LAST ?= 5
# A multilingual run's directions never trained, scored directly and through English (pairs whose languages the run
# lacks are skipped, saying why).
ZERO_SHOT ?= de-fr fr-de

# Scores RUN_DIR (transformer evaluate --run-dir, transformer/run_scores.py): best.pt and the average of the last
# AVERAGE_LAST step checkpoints on the test split of each direction, greedy and with the recipe's beam search, a
# multilingual run's ZERO_SHOT pairs, and every score in RUN_DIR/scores.md.
evaluate: install
	$(BIN)/transformer evaluate --run-dir $(RUN_DIR) --average-last $(AVERAGE_LAST) --zero-shot $(ZERO_SHOT) \
		$(EVAL_SET_FLAGS)

# Chains (transformer chain, transformer/chain.py): a recipe and everything it needs (reverse models, teachers,
# their synthetic corpora, as its data.synthetic[].made_by and training.init_from say), each step skipped when done
# and resumed when stopped, every trained run evaluated. `make chain CONFIG=configs/multi30k_fr_en_bt.yaml` runs any
# recipe's; PLAN=1 prints the plan only.
PLAN ?=
chain: install
	$(BIN)/transformer chain --config $(CONFIG) $(EVAL_SET_FLAGS) $(if $(PLAN),--plan,)

# Back-translation (BT=de_en or en_de): configs/multi30k_BT_bt.yaml's chain.
BT ?= de_en
backtranslate: install
	$(BIN)/transformer chain --config configs/multi30k_$(BT)_bt.yaml $(EVAL_SET_FLAGS)

# Distilled students (DISTILL=de_en or en_de): configs/multi30k_DISTILL_student.yaml's chain (its teacher is the
# back-translation model, trained first if it is not there).
DISTILL ?= de_en
distill: install
	$(BIN)/transformer chain --config configs/multi30k_$(DISTILL)_student.yaml $(EVAL_SET_FLAGS)

# The eight-direction multilingual student in two stages, with its two back-translation teachers.
distill-multilingual: install
	$(BIN)/transformer chain --config configs/multi30k_multilingual_student_task2.yaml $(EVAL_SET_FLAGS)

# Opens the teaching notebook in JupyterLab, on the venv's kernel (notebooks/learn_the_transformer.ipynb); as root
# (a container) Jupyter wants --allow-root.
notebook: install
	$(BIN)/jupyter lab notebooks/learn_the_transformer.ipynb $(if $(filter 0,$(shell id -u)),--allow-root,)

# Executes the notebook headless on the venv's kernel into runs/notebooks/ (the tracked notebook is left as it is;
# IN_PLACE=1 saves the outputs into it, as committed); section 7 reads the model the notebook finds
# (TRANSFORMER_NOTEBOOK_DE_EN=CHECKPOINT make notebook-run names one).
IN_PLACE ?=
notebook-run: install
	$(BIN)/jupyter nbconvert --to notebook --execute $(if $(IN_PLACE),--inplace,--output-dir runs/notebooks) \
		--ExecutePreprocessor.timeout=900 --ExecutePreprocessor.kernel_name=python3 notebooks/learn_the_transformer.ipynb

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
