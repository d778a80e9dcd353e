"""triollm: a teaching-grade LLM server on trio — continuous batching, a paged KV cache,
admission that cannot deadlock, chunked prefill, and SSE streaming with backpressure."""

__version__ = "0.1.0"
