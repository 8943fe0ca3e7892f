# Two commands do everything on a fresh machine:
#   make book   -> virtual environment, install, build the HTML book (every chapter executed, -W)
#   make test   -> virtual environment, install, unit tests + nbval over every chapter +
#                  the doctests of the library and the studies (-p no:python: a module's
#                  imported test_* names are not tests)
#   make test-portable -> the tests that pin float results again on the CPU's plain code path
#                         (no vector instructions), as another machine computes them
# and three more serve the reader and CI:
#   make check-book -> build the book, open every page in headless Chromium offline at 1440,
#                      1280 and 390 px, fail on raw TeX, broken images/links, pipe tables,
#                      console errors, equations or tables wider than their box, wide
#                      pages, long code cells, missing figures, figure text below 7 px,
#                      empty axes, shifted screenshots, a table's named answer columns
#                      off screen; count what scrolls on a phone
#   make notebooks  -> the chapters as paired .ipynb notebooks in notebooks/ (ignored by git)
#   make lab        -> JupyterLab in which the book/*.md chapters open as notebooks
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test test-portable install lint clean bench mathjax check-book lab notebooks chromium

# MathJax is served from the built book (no CDN): a pinned release from the npm registry,
# checked against its sha1 (the registry's own checksum), unpacked into .mathjax/ (ignored),
# which _config.yml lists in html_static_path.
MATHJAX_VERSION := 3.2.2
MATHJAX_SHA1    := c754d7b46a679d7f3fa03543d6b8bf124ddf9f6b
MATHJAX         := .mathjax/mathjax/tex-chtml.js

# --retries 1: where the PyTorch CPU index named in requirements.txt cannot be reached
# (a machine behind a mirror that holds the wheel), each package costs one failed lookup
# instead of five with back-off.
$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip -q
	$(BIN)/python -m pip install -q --retries 1 -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -c "import os, sysconfig; open(os.path.join(sysconfig.get_paths()['purelib'], 'kwng_studies.pth'), 'w').write(os.getcwd() + chr(10))"
	touch $(STAMP)

install: $(STAMP)

$(MATHJAX):
	@command -v npm >/dev/null || { echo "make mathjax needs npm (Debian: apt-get install npm)"; exit 1; }
	rm -rf .mathjax && mkdir -p .mathjax/tmp
	cd .mathjax/tmp && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null
	echo "$(MATHJAX_SHA1)  .mathjax/tmp/mathjax-$(MATHJAX_VERSION).tgz" | sha1sum -c --quiet -
	tar -xzf .mathjax/tmp/mathjax-$(MATHJAX_VERSION).tgz -C .mathjax/tmp
	mv .mathjax/tmp/package/es5 .mathjax/mathjax && rm -rf .mathjax/tmp

mathjax: $(MATHJAX)

# The browser check: Playwright drives Debian's Chromium (no browser download).
PLAYWRIGHT := $(VENV)/.playwright
CHROMIUM   ?= $(shell command -v chromium || command -v chromium-browser)

$(PLAYWRIGHT): $(STAMP)
	$(BIN)/python -m pip install -q "playwright==1.65.2"
	touch $@

chromium:
	@if [ -z "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "make check-book needs Chromium: apt-get install chromium, or CHROMIUM=/path/to/chrome"; \
	    exit 1; \
	  fi; \
	fi

# Known defects owned by other work in progress: reported as "ALLOWED, NOT FIXED" but not
# failing. Empty this list once the CIFAR chapter and the step-cost benchmark cells of the
# deep-learning chapter are wrapped at 88 columns.
CHECK_BOOK_ALLOW ?=

check-book: $(STAMP) $(MATHJAX) $(PLAYWRIGHT) chromium
	KWNG_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests/test_book_check.py -q -p no:cacheprovider
	$(BIN)/jupyter-book build . -W -n --keep-going
	$(BIN)/python tools/check_book.py _build/html --screenshots _build/screenshots \
	  $(foreach a,$(CHECK_BOOK_ALLOW),--allow $(a))

# Chapters as notebooks. jupytext pairs book/X.md with notebooks/X.ipynb (outputs are not
# stored in the .md files: run the notebook to see them).
CHAPTERS := $(filter-out book/references.md book/notation.md book/api.md,$(wildcard book/*.md))

notebooks: $(STAMP)
	mkdir -p notebooks
	for f in $(CHAPTERS); do \
	  $(BIN)/jupytext --quiet --to ipynb -o notebooks/$$(basename $$f .md).ipynb $$f || exit 1; \
	done
	@echo "notebooks in notebooks/ (open with: make lab, or $(BIN)/jupyter lab notebooks)"

LAB := $(VENV)/.lab
$(LAB): $(STAMP)
	$(BIN)/python -m pip install -q "jupyterlab>=4,<5"
	mkdir -p $(VENV)/share/jupyter/lab/settings
	printf '%s\n' '{"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}}' \
	  > $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $@

lab: $(LAB)
	cd book && ../$(BIN)/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root)

book: $(STAMP) $(MATHJAX)
	$(BIN)/jupyter-book build . -W -n --keep-going

test: $(STAMP)
	$(BIN)/ruff check kwng studies tests tools book/_ext examples
	$(BIN)/python -m pytest tests book -p no:cacheprovider -q
	$(BIN)/python -m pytest --doctest-modules -p no:python kwng studies -p no:cacheprovider -q

# The tests that pin numbers trained or recomputed in floating point (the trainer's
# fixture, committed sweep points recomputed, comparisons of two summation orders, the
# chapters whose asserts read live training or near-singular solves), run under
# ATEN_CPU_CAPABILITY=default: PyTorch's scalar kernels round float32 draws, reductions
# and convolutions differently from its AVX2/AVX-512 ones, as another CPU would, so a
# pinned number that holds on one CPU only fails here.
PORTABLE_TESTS := tests/test_repro_tiny.py \
  tests/test_synthetic.py::test_committed_sweep_points_reproduce \
  tests/test_precond.py::test_diagonal_only_is_D_inverse_g \
  tests/test_step_direction.py::test_the_compiled_functions_trace_into_one_graph \
  book/legendre_duality.md book/deep_learning.md book/gpu_internals.md

test-portable: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest $(PORTABLE_TESTS) -p no:cacheprovider -q

lint: $(STAMP)
	$(BIN)/ruff check kwng studies tests tools book/_ext examples

bench: $(STAMP)
	$(BIN)/python -m studies.bench.estimator_time

clean:
	rm -rf _build notebooks
