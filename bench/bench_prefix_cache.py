"""What the prefix cache saves a returning conversation, and what it costs when nothing hits.

Run with ``python bench/bench_prefix_cache.py`` (``--quick`` for a smoke run).

The real Scheduler and Batch, in process, on a SmolLM2-135M-shaped model with
random bf16 weights (``bench_engine.py`` builds it: nothing is downloaded). No
HTTP, no tokenizer: the time measured is the scheduling and the forward passes
that a server's time to first token is made of, and nothing else.

1. **Multi-turn.** One conversation of ``--turns`` turns. Each turn's prompt is
   the previous prompt, the previous answer and a new user message, so it grows
   to ~2,000 tokens; the answer is ``--answer`` greedy tokens. The time to first
   token (add -> the commit that samples it) of every turn is printed with the
   cache off and on, and the hit rate (prompt tokens found / looked up). Two
   shapes: ``even`` (every user message the same length) and ``document`` (a
   long first message, then short questions: a chat about a pasted text).
2. **No sharing.** ``--requests`` independent random prompts, four at a time,
   end to end; cache off and on alternate A B A B for ``--reps`` rounds and the
   medians and their ratio are printed, with the load average before and after.
   The cost of the cache when nothing hits is the hashing of each full block and
   one dictionary lookup per block.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import BLOCK_SIZE, SMOLLM2_135M, random_weights

from triollm.batch import Batch
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel
from triollm.model.sampling import SamplingParams
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.spec import GenerationSpec, SequenceSpec

GREEDY = SamplingParams(temperature=0.0)


class Loop:
    """The batch loop of the service, without the service: admit, plan, run, commit."""

    def __init__(self, model: LlamaModel, *, prefix_cache: bool, chunk: int) -> None:
        cfg = SchedulerConfig(
            num_blocks=4 * 2048 // BLOCK_SIZE,
            block_size=BLOCK_SIZE,
            slots=4,
            chunk_tokens=chunk,
            step_rows=chunk + 4,
            context_tokens=2048,
            prefix_cache=prefix_cache,
        )
        self.s = Scheduler(cfg)
        self.batch = Batch(model, num_blocks=cfg.num_blocks, block_size=BLOCK_SIZE)
        self.vocab = model.config.vocab_size

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
        """Run every prompt to the end; (time to first token of each, each answer)."""
        t0 = time.perf_counter()
        ids = [self.s.add(SequenceSpec(p, max_tokens)) for p in prompts]
        for seq in ids:
            self.batch.add(seq, GenerationSpec(prompts[ids.index(seq)], GREEDY))
        first: dict[int, float] = {}
        answers: dict[int, list[int]] = {seq: [] for seq in ids}
        live = set(ids)
        while live:
            self.s.admit_waiting()
            plan = self.s.plan_step()
            result = self.batch.run(plan)
            for tok in result.sampled:
                first.setdefault(tok.seq_id, time.perf_counter() - t0)
                answers[tok.seq_id].append(tok.token_id)
            for f in self.s.commit(result):
                live.discard(f.seq_id)
                self.batch.remove(f.seq_id)
        return [first[s] for s in ids], [answers[s] for s in ids]


def conversation(
    model: LlamaModel, *, prefix_cache: bool, messages: list[int], answer: int, chunk: int
) -> tuple[list[float], list[int], float]:
    """TTFT of each turn, each turn's prompt length, and the hit rate."""
    loop = Loop(model, prefix_cache=prefix_cache, chunk=chunk)
    rng = np.random.default_rng(1)
    history: list[int] = []
    ttfts, lengths = [], []
    for n in messages:
        history = history + [int(t) for t in rng.integers(3, loop.vocab, n)]
        (ttft,), (reply,) = loop.run([history], answer)
        ttfts.append(ttft)
        lengths.append(len(history))
        history = history + reply
    st = loop.s.statistics()
    rate = st.prefix_cache_hits_total / max(1, st.prefix_cache_queries_total)
    return ttfts, lengths, rate


def no_sharing(model: LlamaModel, *, prefix_cache: bool, n: int, length: int, seed: int) -> float:
    """Seconds to run ``n`` distinct random prompts to their ends, four at a time."""
    loop = Loop(model, prefix_cache=prefix_cache, chunk=128)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, loop.vocab, length)] for _ in range(n)]
    t = time.perf_counter()
    loop.run(prompts, 32)
    return time.perf_counter() - t


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--answer", type=int, default=16, help="tokens each turn answers (16)")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk tokens (128, serve's)")
    p.add_argument("--requests", type=int, default=8, help="no-sharing prompts per run (8)")
    p.add_argument("--reps", type=int, default=3, help="A/B rounds of the no-sharing run (3)")
    p.add_argument("--quick", action="store_true", help="3 turns, 2 reps: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.reps, args.requests = 3, 1, 4
    config = ModelConfig.from_dict(SMOLLM2_135M, source="SmolLM2-135M shape (built in)")
    model = LlamaModel(config, random_weights(config, "bf16"))
    print("# triollm prefix cache: SmolLM2-135M shape, random bf16 weights, in process")
    print(f"command: python bench/bench_prefix_cache.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"load average at start: {load_average()}")
    Loop(model, prefix_cache=False, chunk=args.chunk).run([[5] * 40], 2)  # compile + warm up

    t = args.turns
    even = [(2048 - 64 - t * args.answer) // t] * t
    document = [1100] + [max(1, (2048 - 64 - 1100 - t * args.answer) // max(1, t - 1))] * (t - 1)
    for name, messages in (("even", even), ("document", document)):
        off, lengths, _ = conversation(
            model, prefix_cache=False, messages=messages, answer=args.answer, chunk=args.chunk
        )
        on, _, rate = conversation(
            model, prefix_cache=True, messages=messages, answer=args.answer, chunk=args.chunk
        )
        print(f"\n## multi-turn, {name} messages ({messages[0]} then {messages[-1]} tokens)")
        print("| turn | prompt tokens | TTFT off (ms) | TTFT on (ms) | off / on |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for i, (n, a, b) in enumerate(zip(lengths, off, on, strict=True), 1):
            print(f"| {i} | {n} | {a * 1e3:.0f} | {b * 1e3:.0f} | {a / b:.1f}x |")
        print(f"hit rate over the conversation (tokens found / looked up): {rate:.1%}")

    print(f"\n## no sharing: {args.requests} distinct 500-token prompts, 32 answer tokens each")
    offs, ons = [], []
    for rep in range(args.reps):
        offs.append(no_sharing(model, prefix_cache=False, n=args.requests, length=500, seed=rep))
        ons.append(no_sharing(model, prefix_cache=True, n=args.requests, length=500, seed=rep))
        print(f"round {rep + 1}: off {offs[-1]:.2f} s, on {ons[-1]:.2f} s")
    m_off, m_on = statistics.median(offs), statistics.median(ons)
    print(f"median: off {m_off:.2f} s, on {m_on:.2f} s, on / off = {m_on / m_off:.3f}")
    print(f"load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
