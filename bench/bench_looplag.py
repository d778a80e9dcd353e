"""Measure how long the event loop stalls while the batch computes (a benchmark, not a test).

``python bench/bench_looplag.py`` builds a SmolLM2-135M-shaped model with random
weights (no download), runs ``--streams`` concurrent greedy requests through a real
:class:`~triollm.service.Service`, and meanwhile a probe task asks the loop to
wake it every 5 ms and records how late each wake-up is. It does this twice:

- ``thread``: the step runs in a worker thread (``trio.to_thread.run_sync``), as
  the server does; with GIL-free kernels the loop stays responsive;
- ``inline``: the step runs on the event loop itself; every wake-up waits for a
  whole forward pass, which is what a client sees as a stalled stream.

Figures vary with the machine and its load: compare the two lines of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import trio
from bench_engine import SMOLLM2_135M, random_weights


class _Detok:
    def __init__(self, prompt: Sequence[int]) -> None:
        pass

    def push(self, token_id: int) -> str:
        return f" {token_id}"

    def flush(self) -> str:
        return ""


def build_model(layers: int) -> Any:
    from triollm.model import kernels
    from triollm.model.config import ModelConfig
    from triollm.model.llama import LlamaModel

    config = ModelConfig.from_dict(SMOLLM2_135M | {"num_hidden_layers": layers}, "looplag")
    kernels.warm_up()  # compile (or load) the kernels before anything is timed
    return LlamaModel(config, random_weights(config, "f32"))


async def measure(model: Any, mode: str, streams: int, tokens: int) -> dict[str, float]:
    from triollm.batch import Batch
    from triollm.model.sampling import SamplingParams
    from triollm.plan import StepPlan, StepResult
    from triollm.scheduler import Scheduler, SchedulerConfig
    from triollm.service import Service
    from triollm.spec import GenerationSpec

    block = 32
    blocks = streams * ((64 + tokens) // block + 2)
    batch = Batch(model, num_blocks=blocks, block_size=block)

    async def inline(plan: StepPlan) -> StepResult:
        return batch.run(plan)  # on the event loop: what the worker thread avoids

    service = Service(
        Scheduler(
            SchedulerConfig(num_blocks=blocks, block_size=block, slots=streams, context_tokens=2048)
        ),
        batch,
        detokenizer=_Detok,
        step_runner=inline if mode == "inline" else None,
    )
    lags: list[float] = []
    done = trio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = trio.current_time()
            await trio.sleep(0.005)
            lags.append(trio.current_time() - t - 0.005)

    async def stream(i: int) -> None:
        s = await service.submit(
            GenerationSpec([1 + i] * 48, SamplingParams(temperature=0.0), tokens)
        )
        async for _ in s:
            pass
        s.close()

    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await service.warm_up([1, 2, 3], SamplingParams(temperature=0.0))
        nursery.start_soon(probe)
        t0 = time.perf_counter()
        async with trio.open_nursery() as clients:
            for i in range(streams):
                clients.start_soon(stream, i)
        elapsed = time.perf_counter() - t0
        done.set()
        nursery.cancel_scope.cancel()
    steps = service.recorder.records
    step_s = [r.seconds for r in steps]
    return {
        "steps": len(steps),
        "step_median_ms": 1000 * statistics.median(step_s),
        "lag_median_ms": 1000 * statistics.median(lags),
        "lag_max_ms": 1000 * max(lags),
        "tokens_per_s": streams * tokens / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_looplag.py")
    parser.add_argument("--layers", type=int, default=30, help="model depth (30 = SmolLM2-135M)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args(argv)
    model = build_model(args.layers)
    print(
        f"SmolLM2-135M shape, {args.layers} layers, {args.streams} streams x {args.tokens} tokens"
    )
    for mode in ("thread", "inline"):
        r = trio.run(measure, model, mode, args.streams, args.tokens)
        print(
            f"{mode:>6}: {r['steps']} steps, step median {r['step_median_ms']:.1f} ms; "
            f"loop wake-up lag median {r['lag_median_ms']:.1f} ms, max {r['lag_max_ms']:.1f} ms; "
            f"{r['tokens_per_s']:.0f} tokens/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
