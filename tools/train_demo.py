"""Train triollm's built-in demo model from nothing but this repository (`just train-demo`).

The pipeline, each stage a function below:

1. corpus:    `triollm.demo.corpus.documents(seed)`, stories and ChatML chats from our grammar
2. tokenizer: byte-level BPE trained on the first documents with the `tokenizers` library
3. training:  transformers' `LlamaForCausalLM` (GQA, tied embeddings), a fixed number of steps
              on freshly generated documents, so no document is seen twice; a held-out set from
              another seed is scored along the way
4. export:    the Hugging Face layout (config.json, model.safetensors in bf16, tokenizer.json,
              tokenizer_config.json with the ChatML template, generation_config.json) into
              src/triollm/demo/model/, plus training.json with the figures the docs quote
5. reference: transformers' greedy token ids for a few prompts, from the exported weights, into
              tests/demo/reference.json; our engine must reproduce them exactly
6. plot:      the loss curve, docs/img/demo-loss.png

Needs the `fixtures` extra (torch==2.13.0, transformers, matplotlib); serving never does.
Everything is seeded: rerunning gives the same corpus and tokenizer, and the same model up to
the run-to-run noise of threaded float arithmetic.

Hazard: the reference is recorded from the weights *after* rounding to bf16 and reading them
back as float32, which is exactly what the engine computes with. Recording from the float32
training weights would make the fixture disagree with every faithful engine.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from triollm.demo import corpus, grammar  # noqa: E402

TRAIN_SEED = 1  # corpus seed of the training stream
HELD_OUT_SEED = 2  # a different stream: its documents are not the training ones
TORCH_SEED = 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (the budget)")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=40, help="linear warm-up steps")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=2048, help="BPE target vocabulary")
    p.add_argument("--steps2", type=int, default=400, help="phase-2 steps (one document a row)")
    p.add_argument("--batch2", type=int, default=24, help="phase-2 rows per step")
    p.add_argument(
        "--seq2", type=int, default=160, help="phase-2 row length (a document + padding)"
    )
    p.add_argument("--lr2", type=float, default=2e-3, help="phase-2 peak learning rate")
    p.add_argument("--chat-share2", type=float, default=0.8, help="phase-2 share of chats")
    p.add_argument(
        "--phase1-from",
        type=Path,
        default=None,
        help="skip phase 1: start phase 2 from this exported phase-1 model (+ its -log.json)",
    )
    p.add_argument("--rounds2", type=int, default=3, help="phase-2 rounds (fresh optimizer each)")
    p.add_argument(
        "--start-round",
        type=int,
        default=0,
        help="with --phase1-from: how many phase-2 rounds that model has already had",
    )
    p.add_argument("--copy-weight", type=float, default=10.0, help="phase-2 copy-token weight")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--held-out-rows", type=int, default=32)
    p.add_argument("--tokenizer-docs", type=int, default=20_000)
    p.add_argument("--out", type=Path, default=ROOT / "src/triollm/demo/model")
    p.add_argument("--reference", type=Path, default=ROOT / "tests/demo/reference.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/img/demo-loss.png")
    p.add_argument(
        "--reference-only",
        action="store_true",
        help="skip training: re-record the reference and plot from the exported model and log",
    )
    return p.parse_args()


# --- 2. tokenizer ---------------------------------------------------------------------------


def build_tokenizer(vocab_size: int, n_docs: int) -> Tokenizer:
    """Byte-level BPE over the first `n_docs` training documents, ChatML specials first.

    The pre-tokenizer splits at word boundaries, so no token spans two words: a prompt that
    stops mid-phrase ("Once upon a time") then ends on a token boundary the model was trained
    on. The grammar has a few hundred words, so BPE runs out of merges below `vocab_size`;
    the real vocabulary is whatever it reaches.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(corpus.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = itertools.islice(corpus.documents(TRAIN_SEED), n_docs)
    tok.train_from_iterator(docs, trainer)
    return tok


# --- 3. training ----------------------------------------------------------------------------


def rows(tok: Tokenizer, seed: int, seq: int) -> Iterator[list[int]]:
    """Phase-1 rows of `seq` token ids, each starting at a document's first token.

    Whole documents are packed one after another; the one that overflows is cut at the row's
    end and its rest dropped. Starting every row at a document start matters: at serving time
    the prompt sits at position 0 with nothing before it, and that is what the model sees here.
    """
    docs = corpus.documents(seed)
    while True:
        row: list[int] = []
        while len(row) < seq:
            row.extend(tok.encode(next(docs)).ids)
        yield row[:seq]


def single_rows(
    tok: Tokenizer, seed: int, seq: int, chat_share: float
) -> Iterator[tuple[list[int], int]]:
    """Phase-2 rows: one document, then `<|endoftext|>` padding to `seq`; and the document's length.

    Why phase 2 exists: with several documents packed in a row, the animals, places and things
    of earlier documents are in view when the model must name the one the user asked for, and
    600 packed steps taught it the plot but not to copy the topic (its guess for "a story about
    a fox" was uniform over all animals). With one document a row, the topic is the only such
    word in view. The padding is trained on too (EOS is followed by EOS), so an engine asked to
    ignore EOS continues with confident, comparable tokens rather than untrained ones.
    """
    pad = tok.token_to_id(corpus.END_OF_TEXT)
    for doc in corpus.documents(seed, chat_share):
        ids = tok.encode(doc).ids[:seq]
        yield ids + [pad] * (seq - len(ids)), len(ids)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_model(args: argparse.Namespace, tok: Tokenizer) -> LlamaForCausalLM:
    special = {t: tok.token_to_id(t) for t in corpus.SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[special[corpus.IM_END], special[corpus.END_OF_TEXT]],
        pad_token_id=special[corpus.END_OF_TEXT],
    )
    torch.manual_seed(TORCH_SEED)
    return LlamaForCausalLM(config)


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean cross-entropy per predicted token over the held-out rows (-100 labels skipped)."""
    model.eval()
    total = count = 0.0
    for x, y in zip(inputs.split(8), labels.split(8), strict=True):
        n = (y[:, 1:] != -100).sum().item()
        total += model(input_ids=x, labels=y).loss.item() * n
        count += n
    model.train()
    return total / count


def run_phase(
    model: LlamaForCausalLM,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    held_out: tuple[torch.Tensor, torch.Tensor],
    *,
    steps: int,
    peak_lr: float,
    warmup: int,
    eval_every: int,
    log: dict,
    name: str,
    copy_weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """AdamW (fresh state) for `steps` steps; appends to `log` with steps counted on from it."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    offset = log["step"][-1] if log["step"] else 0
    start = time.monotonic()
    for step in range(steps):
        inputs, labels = next(batches)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup)
        if copy_weight is None:
            loss = model(input_ids=inputs, labels=labels).loss
        else:
            loss = weighted_loss(model, inputs, copy_weight(inputs))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["step"].append(offset + step + 1)
        log["train_loss"].append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            h = held_out_loss(model, *held_out)
            log["eval_step"].append(offset + step + 1)
            log["held_out_loss"].append(h)
            print(
                f"{name} step {step + 1}/{steps} train {loss.item():.4f} held-out {h:.4f} "
                f"{time.monotonic() - start:.0f}s",
                flush=True,
            )
    log.setdefault("phase_seconds", []).append(round(time.monotonic() - start, 1))
    log.setdefault("phase_ends", []).append(offset + steps)


def packed_batches(
    tok: Tokenizer, args: argparse.Namespace
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    source = rows(tok, TRAIN_SEED, args.seq)
    while True:
        batch = torch.tensor(list(itertools.islice(source, args.batch)))
        yield batch, batch


def copy_weights(tok: Tokenizer, inputs: torch.Tensor, weight: float) -> torch.Tensor:
    """Per-label loss weights: `weight` where the label repeats an earlier animal/place/thing.

    Those are the tokens that can only be right by copying (the topic the user named, the
    thing the hero found two sentences ago); everywhere else the weight is 1. Without this the
    copy is a few tokens in a hundred and the model settles for guessing uniformly.
    """
    words = grammar.ANIMALS + grammar.PLACES + grammar.THINGS
    topical = {tok.token_to_id("\u0120" + w) for w in words} - {None}
    weights = torch.ones(inputs.shape, dtype=torch.float32)
    for row in range(inputs.shape[0]):
        seen: set[int] = set()
        ids = inputs[row].tolist()
        for pos in range(1, len(ids)):
            if ids[pos] in topical:
                if ids[pos] in seen:
                    weights[row, pos] = weight
                seen.add(ids[pos])
    return weights


def single_batches(
    tok: Tokenizer, seed: int, args: argparse.Namespace, n_rows: int, *, mask_padding: bool
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    source = single_rows(tok, seed, args.seq2, args.chat_share2)
    while True:
        picked = list(itertools.islice(source, n_rows))
        inputs = torch.tensor([ids for ids, _ in picked])
        labels = inputs.clone()
        if mask_padding:  # held-out figures count the documents' own tokens only
            for row, (_, length) in enumerate(picked):
                labels[row, length:] = -100
        yield inputs, labels


def weighted_loss(
    model: LlamaForCausalLM, inputs: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Next-token cross-entropy, each label's term scaled by `weights`, over the weight sum."""
    logits = model(input_ids=inputs).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), inputs[:, 1:].reshape(-1), reduction="none"
    )
    w = weights[:, 1:].reshape(-1)
    return (ce * w).sum() / w.sum()


def round_to_bf16(model: LlamaForCausalLM) -> None:
    """What saving a bf16 checkpoint between the phases and loading it back does."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def train(args: argparse.Namespace, tok: Tokenizer) -> tuple[LlamaForCausalLM, dict]:
    """Phase 1 (packed rows: the grammar) then phase 2 (one document a row: the topic)."""
    log: dict = {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []}
    if args.phase1_from is None:
        model = make_model(args, tok)
        packed = torch.tensor(
            list(itertools.islice(rows(tok, HELD_OUT_SEED, args.seq), args.held_out_rows))
        )
        run_phase(
            model,
            packed_batches(tok, args),
            (packed, packed),
            steps=args.steps,
            peak_lr=args.lr,
            warmup=args.warmup,
            eval_every=args.eval_every,
            log=log,
            name="phase 1",
        )
    else:
        model = LlamaForCausalLM.from_pretrained(args.phase1_from, dtype=torch.float32)
        log = json.loads(Path(str(args.phase1_from) + "-log.json").read_text())["log"]
        log.setdefault(
            "phase_seconds",
            [json.loads((args.phase1_from / "training.json").read_text())["training_seconds"]],
        )
        log.setdefault("phase_ends", [log["step"][-1]])
    n_params = sum(p.numel() for p in model.parameters())
    held_out = next(single_batches(tok, HELD_OUT_SEED, args, 64, mask_padding=True))
    # Each round starts from bf16-rounded weights with a fresh optimizer and a new stream of
    # documents, exactly as if the previous round had been exported and loaded back.
    for round_ in range(args.start_round, args.rounds2):
        round_to_bf16(model)
        torch.manual_seed(TORCH_SEED + 1 + round_)
        run_phase(
            model,
            single_batches(tok, TRAIN_SEED + 100 + round_, args, args.batch2, mask_padding=False),
            held_out,
            steps=args.steps2,
            peak_lr=args.lr2,
            warmup=20,
            eval_every=args.eval_every // 2,
            log=log,
            name=f"phase 2 round {round_ + 1}",
            copy_weight=lambda inputs: copy_weights(tok, inputs, args.copy_weight),
        )
    summary = {
        "parameters": n_params,
        "phase1_steps": args.steps,
        "phase1_rows": f"{args.batch} x {args.seq} tokens, documents packed",
        "phase2_steps": args.steps2,
        "phase2_rounds": args.rounds2,
        "phase2_rows": f"{args.batch2} x {args.seq2} tokens, one document each",
        "tokens_seen": args.steps * args.batch * args.seq
        + args.rounds2 * args.steps2 * args.batch2 * args.seq2,
        "training_seconds": round(sum(log["phase_seconds"]), 1),
        "phase_seconds": log["phase_seconds"],
        "phase2_copy_weight": args.copy_weight,
        "phase2_chat_share": args.chat_share2,
        "threads": args.threads,
        "held_out_loss": round(log["held_out_loss"][-1], 4),
        "held_out": "64 documents of the held-out seed, one a row, padding not counted",
        "corpus_seed": TRAIN_SEED,
        "phase2_corpus_seeds": [TRAIN_SEED + 100 + r for r in range(args.rounds2)],
        "held_out_seed": HELD_OUT_SEED,
        "torch_seed": TORCH_SEED,
        "torch": torch.__version__,
    }
    return model, {"summary": summary, "log": log}


# --- 4. export ------------------------------------------------------------------------------


def export(model: LlamaForCausalLM, tok: Tokenizer, out: Path, summary: dict) -> None:
    """Write the Hugging Face layout, weights in bf16, into `out` (replacing what was there)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    # transformers 5 writes "dtype"; older readers and other engines look for "torch_dtype".
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        "do_sample": False,
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": corpus.IM_END,
        "pad_token": corpus.END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": corpus.CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    assert not [p for p in out.iterdir() if p.is_dir()], "package data must be flat"


# --- 5. reference ---------------------------------------------------------------------------

REFERENCE_PROMPTS = (
    {"name": "once_upon_a_time", "text": "Once upon a time"},
    {"name": "owl_named", "text": "Once upon a time, there was a little owl named"},
    {"name": "chat_fox", "messages": [{"role": "user", "content": "Tell me a story about a fox"}]},
    {
        "name": "chat_forest",
        "messages": [{"role": "user", "content": "Can you tell me a story about the forest?"}],
    },
    {"name": "chat_kite", "messages": [{"role": "user", "content": "Write a story about a kite."}]},
    {"name": "chat_hello", "messages": [{"role": "user", "content": "Hello"}]},
)
MAX_NEW_TOKENS = 200
IGNORE_EOS_EXTRA = 32  # tokens generated past the first EOS in the ignore-EOS variant


@torch.no_grad()
def greedy(
    model: LlamaForCausalLM, prompt: list[int], max_new: int, stop: set[int]
) -> tuple[list[int], float]:
    """Greedy ids (argmax of each step's logits, KV cache on), and the smallest top-1/top-2 gap.

    The gap tells how fragile the fixture is: an engine whose float32 sums differ in the last
    bits can only flip a token whose gap is of that order.
    """
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    ids: list[int] = []
    min_gap = math.inf
    for _ in range(max_new):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        min_gap = min(min_gap, (top2[0] - top2[1]).item())
        nxt = int(torch.argmax(logits))
        ids.append(nxt)
        if nxt in stop:
            break
        out = model(
            input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True
        )
    return ids, min_gap


def record_reference(model_dir: Path, tok: Tokenizer, path: Path) -> list[dict]:
    """Load the exported checkpoint with transformers and record greedy outputs."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    config = json.loads((model_dir / "config.json").read_text())
    eos = set(config["eos_token_id"])
    template = ImmutableSandboxedEnvironment().from_string(corpus.CHAT_TEMPLATE)
    entries = []
    for spec in REFERENCE_PROMPTS:
        if "messages" in spec:
            text = template.render(messages=spec["messages"], add_generation_prompt=True)
        else:
            text = spec["text"]
        prompt_ids = tok.encode(text).ids
        ids, gap = greedy(model, prompt_ids, MAX_NEW_TOKENS, eos)
        # transformers' own generate() must agree with the plain argmax loop above.
        generated = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )[0, len(prompt_ids) :].tolist()
        assert generated == ids, (spec["name"], generated, ids)
        ignore_len = max(32, len(ids) + IGNORE_EOS_EXTRA)
        ignore_len = min(ignore_len, config["max_position_embeddings"] - len(prompt_ids))
        ignored, ignored_gap = greedy(model, prompt_ids, ignore_len, set())
        entries.append(
            {
                **spec,
                "prompt_text": text,
                "prompt_ids": prompt_ids,
                "greedy_ids": ids,
                "greedy_text": tok.decode(ids, skip_special_tokens=True),
                "stopped_on_eos": bool(ids and ids[-1] in eos),
                "min_logit_gap": round(gap, 4),
                "ignore_eos_ids": ignored,
                "ignore_eos_min_logit_gap": round(ignored_gap, 4),
            }
        )
        print(f"{spec['name']}: {entries[-1]['greedy_text']!r} (gap {gap:.3f})", flush=True)
    weights = (model_dir / "model.safetensors").read_bytes()
    reference = {
        "comment": "transformers greedy outputs for the demo model; remade by tools/train_demo.py",
        "model_sha256": hashlib.sha256(weights).hexdigest(),
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_ids": sorted(eos),
        "prompts": entries,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reference, indent=1) + "\n")
    return entries


# --- 6. plot --------------------------------------------------------------------------------


def plot(log: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(
        log["step"],
        log["train_loss"],
        lw=0.8,
        alpha=0.6,
        label="training batch (phase 2: copy tokens weighted 10x)",
    )
    boundary = log["phase_ends"][0]
    evals = list(zip(log["eval_step"], log["held_out_loss"], strict=True))
    for phase, picked, style in (
        ("held-out, phase 1 (packed rows)", [e for e in evals if e[0] <= boundary], "o-"),
        ("held-out, phase 2 (one document a row)", [e for e in evals if e[0] > boundary], "s-"),
    ):
        if picked:
            ax.plot(*zip(*picked, strict=True), style, ms=3, label=phase)
    for end in log["phase_ends"][:-1]:  # where a phase or a phase-2 round starts afresh
        ax.axvline(end, color="gray", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token, log scale)")
    ax.set_title(
        f"demo model: {summary['parameters'] / 1e6:.2f} M params, "
        f"{summary['tokens_seen'] / 1e6:.1f} M tokens, held-out {summary['held_out_loss']:.3f}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    log_path = args.plot.with_suffix(".json")  # the numbers behind the plot
    t0 = time.monotonic()
    if args.reference_only:
        tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
        result = json.loads(log_path.read_text())
    else:
        if args.phase1_from is not None:
            tok = Tokenizer.from_file(str(args.phase1_from / "tokenizer.json"))
        else:
            tok = build_tokenizer(args.vocab, args.tokenizer_docs)
        print(f"tokenizer: {tok.get_vocab_size()} tokens ({time.monotonic() - t0:.0f}s)")
        model, result = train(args, tok)
        export(model, tok, args.out, result["summary"])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(result) + "\n")
    summary = result["summary"]
    record_reference(args.out, tok, args.reference)
    plot(result["log"], summary, args.plot)
    print(json.dumps(summary, indent=2))
    print(f"total {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
