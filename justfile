# triollm tasks. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

# serve the built-in demo model (or MODEL_DIR) on http://127.0.0.1:8000
serve *ARGS:
    triollm serve {{ARGS}}

# the whole test suite: unit, integration and property tests (bounded example counts)
test *ARGS:
    python -m pytest -q {{ARGS}}

# property tests only, at CI's example count
prop *ARGS:
    python -m pytest -q property_tests {{ARGS}}

# a long property search (thousands of examples per state machine)
prop-long:
    HYPOTHESIS_PROFILE=long python -m pytest -q property_tests

# lint, format check and types
lint:
    ruff check src tests property_tests tools bench
    ruff format --check src tests property_tests tools bench
    mypy

# decode/prefill throughput of a SmolLM2-135M-shaped random model, f32 and bf16
bench-engine *ARGS:
    python bench/bench_engine.py {{ARGS}}

# load any OpenAI-compatible server: `just bench-serve --url http://127.0.0.1:8000 --concurrency 1,4`
bench-serve *ARGS:
    triollm bench serve {{ARGS}}

# N replicas of the demo model (or MODEL_DIR) behind Envoy on http://127.0.0.1:8080 (needs the
# `cluster` extra): `just cluster --replicas 2 --threads 1`; Ctrl-C drains them
cluster *ARGS:
    triollm cluster {{ARGS}}

# replicas behind Envoy measured: scaling, SIGTERM/SIGKILL of a replica mid-load, prefix routing
bench-cluster *ARGS:
    python bench/bench_cluster.py {{ARGS}}

# Steps: build models ready guard run tables all (default: all). A subset: `just bench-peers
# run --models qwen1.5b --parts decode,serve`, then `just bench-peers tables`.
# triollm vs llama.cpp, 3 guarded alternating rounds, writes performance.md (~35 min, not CI)
bench-peers *ARGS:
    python tools/bench_peers.py {{ARGS}}

# the seed's batching scenario under every policy (add --html FILE for the stepper page)
simulate *ARGS:
    triollm simulate {{ARGS}}

# remake the tiny reference checkpoints and transformers' outputs (needs the `fixtures` extra)
fixtures:
    python tools/make_fixtures.py

# retrain the built-in demo model from scratch (needs the `fixtures` extra; see docs/demo-model.md for the time)
train-demo:
    python tools/train_demo.py

# build the docs site strictly (broken links fail) into site/; `just docs serve` previews it
docs *ARGS="build":
    # KaTeX renders the formulas; fetched from npm once into docs/vendor (gitignored)
    test -f docs/vendor/katex/katex.min.js || { d=$(mktemp -d) && (cd "$d" && npm pack katex@0.16 --silent >/dev/null && tar xzf katex-*.tgz) && mkdir -p docs/vendor && rm -rf docs/vendor/katex && cp -r "$d/package/dist" docs/vendor/katex && rm docs/vendor/katex/README.md; }
    NO_MKDOCS_2_WARNING=1 mkdocs {{ARGS}} --strict

# redraw the teaching pictures in docs/img from real scheduler runs (needs matplotlib: the `fixtures` extra)
figures:
    python tools/figures.py

# a soak: mixed, careless and hostile clients for 5 minutes, then every promise checked at rest
soak *ARGS:
    python bench/soak.py {{ARGS}}

# an open-loop overload at 4x capacity for a minute: bounded queue, 429 + Retry-After, waits in budget
overload *ARGS:
    python bench/overload.py {{ARGS}}
