"""``triollm bench``: the instrument every performance claim of this project goes through.

- ``triollm bench serve`` loads any OpenAI-compatible server (triollm, llama-server,
  vLLM ...) with streaming requests and reports throughput, TTFT, inter-token latency,
  end-to-end latency and requests by status, as a table and as JSON lines. It is the
  server's client as much as its benchmark: a stream without ``[DONE]``, an error event
  or a ``usage`` that disagrees with the tokens that arrived is counted and reported.
- ``triollm bench compare OURS.jsonl PEER.jsonl`` prints the side-by-side ratios of
  two result files (``bench/bench_engine.py --json`` writes the same records).

The modules, pure first:

- ``stats.py``   one request's record, and the summary of a level (percentiles etc.)
- ``workload.py`` what to send: token-id prompts, mixed lengths, multi-turn chats
- ``compare.py`` ratios between two result files
- ``client.py``  one streamed request over httpx, validated (the edge)
- ``load.py``    closed loop at a concurrency, open loop at a Poisson rate (trio)
- ``command.py`` the CLI
- ``realmodels.py`` the real GGUF models (Qwen2.5-Coder Q4_K_M) from PyPI split parts
"""
