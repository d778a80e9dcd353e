"""Make the tiny reference checkpoints and record what transformers computes on them.

Run with the `fixtures` extra installed (torch==2.13.0, transformers):

    python tools/make_fixtures.py            # or: just fixtures

It writes, deterministically (fixed seeds):

- ``tests/fixtures/models/<name>/``: complete Hugging Face model
  directories (config.json, safetensors weights, tokenizer.json,
  tokenizer_config.json with a chat template), one per family and dtype the
  engine supports. They are small (hidden 64, 2 layers, vocab 400) and random,
  but shaped like the real thing: GQA, tied and untied heads, llama3 RoPE
  scaling, qwen2 biases, qwen3 q/k norms with an explicit head_dim, a mistral
  sliding window shorter than the long prompt, one checkpoint sharded.
- ``tests/fixtures/reference/<name>.json``: the prompts (as token ids), the
  greedy continuation transformers produces (32 tokens, EOS ignored) and the
  smallest top-1/top-2 logit gap seen on the way (LongRoPE fixtures: with the long
  factors, and, for a prompt that stays within the training length, also with the
  short ones as ``short_greedy_ids`` / ``short_first_<i>``).
- ``tests/fixtures/reference/<name>.npz``: transformers' logits at the last
  prompt position (``first_<i>``) and at the last generated position
  (``last_<i>``), computed in float32 from the stored weights (bf16/f16 are
  widened exactly, so this is what our float32 engine must match), plus for
  bf16/f16 checkpoints the logits transformers computes in the checkpoint's own
  dtype (``native_first_<i>``), to measure how far native half-precision
  arithmetic drifts.

The weights are drawn with a larger spread than a real initialisation (and the
norm weights and biases are randomised, so a loader that skipped them would
fail) so that greedy decoding has clear margins: a difference in float32
rounding must not flip an argmax.

The tokenizer is a byte-level BPE trained here on a small text written for it,
so the fixtures also serve ``triollm generate --prompt`` and the server tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"
REFERENCE = ROOT / "tests" / "fixtures" / "reference"
VOCAB_SIZE = 400
GREEDY_TOKENS = 32
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
PAD, BOS, EOS, IM_START, IM_END = range(5)

CORPUS = """\
The river runs past the old mill, and the mill wheel turns slowly in the morning light.
A small boat waits at the bank. The boatman counts his coins and looks at the sky.
Rain is coming from the west; the wind carries the smell of wet grass and smoke.
In the town, the baker opens his shop at five. Bread, rolls and a cake with plums.
Children run to school with their books, and a dog follows them to the gate.
The teacher writes numbers on the board: one, two, three, four, five, six, seven.
"What is the sum of three and four?" she asks. "Seven," says a girl at the back.
The library keeps maps of every street, and an atlas of the stars above the hills.
At noon the market is full: apples, pears, cheese, honey, fish and fresh eggs.
A traveller from Zürich buys a map; a student from Tokyo (東京) asks for the café.
She is naïve about the prices but learns fast. The café sells tea and coffee.
Servers answer requests, one token at a time, and a queue holds those who wait.
A scheduler decides who runs next; a batch computes many rows in one pass.
Memory is kept in blocks of thirty-two positions; a table says where each one lives.
When a client leaves, its blocks go back to the pool and another request may start.
The evening is quiet. Lamps are lit along the river, and the mill wheel stops.
Stars appear over the hills: the plough, the hunter, and the long river of light.
Good night, says the boatman, and rows home across the dark water. 🙂
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA_TEMPLATE = "{{ bos_token }}" + CHATML_TEMPLATE

PROMPTS = [
    "The river",
    "A scheduler decides who runs next; the baker opens his shop at",
    # the long one (> 150 tokens): several lines of the corpus and some new text
    " ".join(CORPUS.splitlines()[2:9]) + " And then, at last, the",
]


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    return tok


def write_tokenizer(tok: Tokenizer, out: Path, style: str) -> None:
    """llama style: BOS added by the post-processor; qwen style: no BOS, ChatML EOS."""
    tok = Tokenizer.from_str(tok.to_str())
    if style == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
        )
        config = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": None,
            "chat_template": LLAMA_TEMPLATE,
        }
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {
            "add_bos_token": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<pad>",
            "unk_token": None,
            "chat_template": CHATML_TEMPLATE,
        }
    config |= {
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "pad_token_id": PAD,
}

# name -> (config, save dtype, tokenizer style, shard?, config.json rewrite to the pre-v5 spelling?)
SPECS: dict[str, tuple[Any, torch.dtype, str, bool, bool]] = {
    "llama-gqa-f32": (
        LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False,
                    bos_token_id=BOS, eos_token_id=EOS),
        torch.float32, "llama", True, False,
    ),
    "llama-tied-llama3-bf16": (
        LlamaConfig(
            **COMMON, num_key_value_heads=2, tie_word_embeddings=True,
            bos_token_id=BOS, eos_token_id=EOS,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        torch.bfloat16, "llama", False, True,
    ),
    "qwen2-bias-f32": (
        Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False,
                    bos_token_id=None, eos_token_id=IM_END,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        torch.float32, "qwen", False, False,
    ),
    "qwen3-headdim-f16": (
        Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                    bos_token_id=None, eos_token_id=[IM_END, EOS]),
        torch.float16, "qwen", False, False,
    ),
    "mistral-window-f32": (
        MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=48,
                      tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS),
        torch.float32, "llama", False, False,
    ),
    # mixtures of experts (model/moe.py): qwen3_moe with a dense layer between two
    # sparse ones (mlp_only_layers) and renormalised top-4 of 12; mixtral top-2 of 8
    "qwen3-moe-f32": (
        Qwen3MoeConfig(**(COMMON | {"num_hidden_layers": 3}), num_key_value_heads=2, head_dim=16,
                       num_experts=12, num_experts_per_tok=4, moe_intermediate_size=32,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=IM_END),
        torch.float32, "qwen", False, False,
    ),
    "qwen3-moe-bf16": (
        Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=False, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=IM_END),
        torch.bfloat16, "qwen", False, False,
    ),
    "mixtral-f32": (
        MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=8,
                      num_experts_per_tok=2, tie_word_embeddings=False,
                      bos_token_id=BOS, eos_token_id=EOS),
        torch.float32, "llama", False, False,
    ),
    "mixtral-f16": (
        MixtralConfig(**COMMON, num_key_value_heads=1, num_local_experts=4,
                      num_experts_per_tok=2, tie_word_embeddings=False,
                      bos_token_id=BOS, eos_token_id=EOS),
        torch.float16, "llama", False, False,
    ),
    # Gemma 3 (model/gemma.py): sliding layers (window 16, far shorter than the long
    # prompt) around a full one, query_pre_attn_scalar != head_dim, final soft-capping
    "gemma3-window-f32": (
        Gemma3TextConfig(**COMMON, num_key_value_heads=1, head_dim=32, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                         bos_token_id=BOS, eos_token_id=EOS),
        torch.float32, "llama", False, False,
    ),
    "gemma3-bf16": (
        Gemma3TextConfig(**(COMMON | {"num_hidden_layers": 4}), num_key_value_heads=2,
                         head_dim=16, sliding_window=24, sliding_window_pattern=3,
                         query_pre_attn_scalar=16, bos_token_id=BOS, eos_token_id=EOS),
        torch.bfloat16, "llama", False, False,
    ),
    # Phi-3 (model/phi3.py): qkv_proj and gate_up_proj fused in the checkpoint.
    # LongRoPE with half of each head rotated, its training length (36) between the
    # short prompt's greedy run (35 positions) and the others: the reference turns with
    # the long factors, as a server whose context exceeds 36 does, and the short
    # prompt is also recorded with the short ones (see force_long_rope)
    "phi3-longrope-f32": (
        Phi3Config(**COMMON, num_key_value_heads=2, original_max_position_embeddings=36,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5,
                                    "short_factor": [1.0, 1.3, 1.9, 2.6],
                                    "long_factor": [1.1, 2.5, 5.0, 9.0]},
                   tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS),
        torch.float32, "llama", False, False,
    ),
    # Phi-4-mini's shape: 3/4 of each head rotated, tied head; no GQA, as Phi-3-mini;
    # a sliding window (Phi-3-mini-4k has one) far shorter than the long prompt
    "phi3-window-bf16": (
        Phi3Config(**COMMON, num_key_value_heads=4, sliding_window=48,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.75},
                   tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS),
        torch.bfloat16, "llama", False, False,
    ),
}  # fmt: skip


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Wide random weights, random norms and biases (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    # Gemma multiplies the embedding by sqrt(hidden) = 8 and norms every layer's
    # output: unit-spread embeddings would swamp the layers in the residual, and with
    # the tied head greedy would repeat its input token; a small spread does not
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # gemma: 1 + w is about 2, layers' outputs about twice a unit norm
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif gemma and "embed_tokens" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]  # experts are 3-D in memory: (experts, out, in)
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / fan_in**0.5))


def to_classic_config(path: Path) -> None:
    """Rewrite a transformers-5 config.json in the spelling most hub checkpoints use:
    ``rope_theta`` and ``rope_scaling`` at the top level, ``torch_dtype``."""
    d = json.loads(path.read_text())
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def is_longrope(model: Any) -> bool:
    return (model.config.rope_parameters or {}).get("rope_type") == "longrope"


@torch.no_grad()
def force_long_rope(model: Any) -> None:
    """Make transformers turn every sequence with LongRoPE's long factors.

    transformers picks the list per forward call, by the longest position in it;
    the engine picks once per model, by its context (model/phi3.py). The fixture's
    reference is what transformers computes with the list the engine's default
    context (the model's max_position_embeddings, > the training length) selects:
    transformers' own long frequencies, put in place of its short ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.model.rotary_emb
    orig = model.config.rope_parameters["original_max_position_embeddings"]
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, seq_len=orig + 1)
    rotary.original_inv_freq.copy_(long)
    rotary.inv_freq.copy_(long)


@torch.no_grad()
def greedy(model: Any, prompt: list[int]) -> tuple[list[int], float, np.ndarray, np.ndarray]:
    """Greedy continuation by full recomputation (no KV cache: the plainest reference)."""
    ids = list(prompt)
    gaps = []
    first = last = None
    for _ in range(GREEDY_TOKENS):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        if first is None:
            first = logits.numpy().copy()
        last = logits.numpy().copy()
        ids.append(int(torch.argmax(logits)))
    assert first is not None and last is not None
    return ids[len(prompt) :], min(gaps), first, last


def make(name: str, tok: Tokenizer, seed: int) -> dict[str, Any]:
    config, dtype, style, shard, classic = SPECS[name]
    out = MODELS / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, seed)
    model = model.to(dtype)
    model.save_pretrained(out, max_shard_size="200KB" if shard else "50GB")
    if classic:
        to_classic_config(out / "config.json")
    write_tokenizer(tok, out, style)
    (out / "generation_config.json").unlink(missing_ok=True)

    # The reference reads back what was written, exactly as the engine will.
    ref = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    ref.eval()
    native = None
    if dtype != torch.float32:
        native = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation="eager")
        native.eval()
    short = None  # LongRoPE: transformers as it is, short factors while within the training length
    if is_longrope(ref):
        short = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager"
        )
        short.eval()
        for m in (ref, native):
            if m is not None:
                force_long_rope(m)
    encoder = Tokenizer.from_file(str(out / "tokenizer.json"))
    records = []
    arrays: dict[str, np.ndarray] = {}
    for i, text in enumerate(PROMPTS):
        prompt = encoder.encode(text).ids
        ids, gap, first, last = greedy(ref, prompt)
        records.append({"text": text, "prompt_ids": prompt, "greedy_ids": ids, "min_gap": gap})
        arrays[f"first_{i}"] = first.astype(np.float32)
        arrays[f"last_{i}"] = last.astype(np.float32)
        orig = short.config.rope_parameters["original_max_position_embeddings"] if short else 0
        if short is not None and len(prompt) + GREEDY_TOKENS - 1 <= orig:
            # every step's sequence within the training length: the short list throughout
            s_ids, s_gap, s_first, _ = greedy(short, prompt)
            records[-1] |= {"short_greedy_ids": s_ids, "short_min_gap": s_gap}
            arrays[f"short_first_{i}"] = s_first.astype(np.float32)
        if native is not None:
            with torch.no_grad():
                nl = native(torch.tensor([prompt])).logits[0, -1].float().numpy()
            arrays[f"native_first_{i}"] = nl.astype(np.float32)
    REFERENCE.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(REFERENCE / f"{name}.npz", **arrays)
    summary = {
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "greedy_tokens": GREEDY_TOKENS,
        "min_gap": min(r["min_gap"] for r in records),
        "prompts": records,
    }
    (REFERENCE / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    import sys

    # `make_fixtures.py NAME ...` remakes only those (the others stay byte for byte)
    only = set(sys.argv[1:])
    unknown = only - set(SPECS)
    if unknown:
        raise SystemExit(f"unknown fixture(s): {', '.join(sorted(unknown))}")
    torch.set_num_threads(2)
    tok = train_tokenizer()
    for seed, name in enumerate(SPECS):
        if only and name not in only:
            continue
        s = make(name, tok, seed=1000 + seed)
        lens = [len(p["prompt_ids"]) for p in s["prompts"]]
        print(f"{name:26s} prompts {lens}  smallest top-1/top-2 gap {s['min_gap']:.4f}")


if __name__ == "__main__":
    main()
