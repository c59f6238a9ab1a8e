# make demo: set up, then serve the embedded tiny model and synthesize a sentence.
# make test: set up, then run every test.
PY := .venv/bin/python

.PHONY: setup demo test bench lint clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m omni_cpu_fastpath.cli demo

# The benchmarks run too, once each at tiny dimensions (a smoke test: nothing is timed).
test: setup
	$(PY) -m pytest -q tests
	OMNI_BENCH_DIMS=tiny $(PY) -m pytest -q benchmarks

bench: setup
	$(PY) -m pytest -q benchmarks --benchmark-enable

lint: setup
	.venv/bin/ruff check omni_cpu_fastpath tests benchmarks
	.venv/bin/ruff format --check omni_cpu_fastpath tests benchmarks

clean:
	rm -rf .venv .venv-ref .demo
