# make demo: set up, then serve the embedded tiny model and synthesize a sentence.
# make test: set up, then run every test.
PY := .venv/bin/python

.PHONY: setup demo test bench lint clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m omni_cpu_fastpath.cli demo

# The benchmarks run too, once each at tiny dimensions (a smoke test: nothing is timed).
# --durations: the slowest tests in the log, to keep the whole run inside CI's time on 2 cores.
# -n 2 --dist loadfile: two test files at a time (pytest-xdist), each file whole in one process so
# that its module fixtures (live servers) start once; much of a test's time is single-threaded
# (imports, server start-up, compiles), so two files overlap well even on 2 cores.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=40 tests
	OMNI_BENCH_DIMS=tiny $(PY) -m pytest -q --durations=10 benchmarks

bench: setup
	$(PY) -m pytest -q benchmarks --benchmark-enable

lint: setup
	.venv/bin/ruff check omni_cpu_fastpath tests benchmarks
	.venv/bin/ruff format --check omni_cpu_fastpath tests benchmarks

clean:
	rm -rf .venv .venv-ref .demo
