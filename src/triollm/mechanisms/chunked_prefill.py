"""Chunked prefill: a long prompt arriving while others decode, with and without chunks.

A step is one forward pass, and every running sequence waits for it. A 2,000-token
prompt prefilled in one piece makes one step of 2,000 rows: every stream that was
decoding gets no token until it is done. Cut into chunks of 128 tokens, the prompt
rides with the decode rows over sixteen steps, and each stream's longest gap between
tokens is one 128-row step. The long prompt's own first token comes at about the same
time either way: the total work is the same.

The real :class:`~triollm.scheduler.Scheduler` plans every step; the time of a step is
a cost model, so the figures are exact and repeatable: ``STEP_MS`` per step (reading
the weights once) plus ``ROW_MS`` per row, the shape measured for SmolLM2-135M on
this two-core CPU (``docs/performance.md``). ``bench/bench_step_rows.py`` measures the
same trade on the real engine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from triollm.plan import SampledToken, StepResult
from triollm.scheduler import Scheduler, SchedulerConfig
from triollm.spec import SequenceSpec

STEP_MS = 30.0  # one decode step of a 135M model: the weights read once
ROW_MS = 3.5  # each further row of a step (prefill is compute bound)
STREAMS = 3  # requests decoding when the long prompt arrives
LONG_PROMPT = 2000
ARRIVES_AT_STEP = 8


@dataclass(frozen=True)
class Outcome:
    chunk_tokens: int
    longest_gap_ms: float  # the longest wait between two tokens of any decoding stream
    long_prompt_ttft_ms: float  # from the long prompt's arrival to its first token
    steps: int


def replay(chunk_tokens: int) -> Outcome:
    config = SchedulerConfig(
        num_blocks=256,
        block_size=32,
        slots=STREAMS + 1,
        chunk_tokens=chunk_tokens,
        step_rows=chunk_tokens + STREAMS + 1,
        context_tokens=4096,
    )
    s = Scheduler(config)
    streams = [s.add(SequenceSpec([1] * 32, 400)) for _ in range(STREAMS)]
    long_seq: int | None = None
    now_ms = 0.0
    arrived_ms = 0.0
    last_token_ms: dict[int, float] = {}
    longest_gap = 0.0
    ttft = 0.0
    step = 0
    while long_seq is None or ttft == 0.0:
        if step == ARRIVES_AT_STEP:
            long_seq = s.add(SequenceSpec([1] * LONG_PROMPT, 16))
            arrived_ms = now_ms
        s.admit_waiting()
        plan = s.plan_step()
        now_ms += STEP_MS + ROW_MS * (plan.n_rows - 1)
        sampled = tuple(SampledToken(c.seq_id, 1) for c in plan.chunks if c.sample)
        for tok in sampled:
            if tok.seq_id in streams:
                if long_seq is not None and tok.seq_id in last_token_ms:
                    longest_gap = max(longest_gap, now_ms - last_token_ms[tok.seq_id])
                last_token_ms[tok.seq_id] = now_ms
            elif tok.seq_id == long_seq:
                ttft = now_ms - arrived_ms
        s.commit(StepResult(plan.step, sampled, plan.n_rows))
        step += 1
    return Outcome(chunk_tokens, longest_gap, ttft, step)


def configure(parser: argparse.ArgumentParser) -> None:
    """No options: the story is fixed so it prints the same lines every time."""


def run(args: argparse.Namespace) -> int:
    print(
        f"{STREAMS} streams decoding; a {LONG_PROMPT}-token prompt arrives at step "
        f"{ARRIVES_AT_STEP} (cost model: {STEP_MS:g} ms a step + {ROW_MS:g} ms a row)"
    )
    print(f"  {'chunk':>6}  {'longest gap between tokens':>27}  {'long prompt TTFT':>17}")
    for chunk in (128, LONG_PROMPT):
        o = replay(chunk)
        print(f"  {chunk:>6}  {o.longest_gap_ms:>24.0f} ms  {o.long_prompt_ttft_ms:>14.0f} ms")
    return 0
