# Two commands do everything on a fresh machine:
#   make book   -> virtual environment, install, build the HTML book (every chapter executed, -W)
#   make test   -> virtual environment, install, unit tests + nbval over every chapter
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test install lint clean bench

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip -q
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going

test: $(STAMP)
	$(BIN)/ruff check kwng tests benchmarks
	$(BIN)/python -m pytest tests book -p no:cacheprovider -q

lint: $(STAMP)
	$(BIN)/ruff check kwng tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/estimator_time.py

clean:
	rm -rf _build
