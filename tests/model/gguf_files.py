"""GGUF files made by the tests, written the way llama.cpp's converter writes them.

``write_gguf`` takes a Hugging Face config, float weights by HF name and a
``tokenizer.json`` directory, and writes a GGUF with the ``gguf`` package's
writer: metadata from the config, tokenizer metadata from ``tokenizer.json``
(tokens, types, merges, special ids, the chat template), and every tensor
under its GGUF name, q/k rows permuted for the llama architecture exactly as
``convert_hf_to_gguf.py`` permutes them, quantized with ``gguf.quantize``
(or given raw blocks for the K-quants, which ``gguf`` cannot quantize).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from triollm.model.weights import Checkpoint, bf16_bits_to_f32

ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "mixtral": gguf.MODEL_ARCH.LLAMA,  # llama.cpp writes Mixtral as llama + experts
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,  # qkv_proj -> attn_qkv, gate_up_proj -> ffn_up
}
# one expert's projection, by HF key -> (the key of the layer's 3-D tensor, expert index)
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def stack_experts(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The converter's merge: each layer's per-expert 2-D weights as one 3-D tensor
    ``(experts, rows, cols)`` per projection, under the HF key without the index."""
    out: dict[str, np.ndarray] = {}
    groups: dict[str, dict[int, np.ndarray]] = {}
    for key, w in tensors.items():
        m = EXPERT.match(key)
        if m:
            groups.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
        else:
            out[key] = w
    for key, parts in groups.items():
        out[key] = np.stack([parts[e] for e in range(len(parts))])
    return out


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation (the HF rotate-half -> interleaved pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def read_checkpoint(model_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """config.json and every tensor of an HF directory, as float32."""
    config = json.loads((model_dir / "config.json").read_text())
    with Checkpoint(model_dir) as ck:
        tensors = {}
        for key in ck.keys():  # noqa: SIM118 (a Checkpoint, not a dict)
            arr = ck.get_tensor(key)
            tensors[key] = (
                bf16_bits_to_f32(arr) if arr.dtype == np.uint16 else arr.astype(np.float32)
            )
    return config, tensors


def random_blocks(
    qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator
) -> np.ndarray:
    """Raw random blocks with sane scales: for the K-quants (``gguf`` cannot quantize them).

    The super-block scales are drawn so that weights stay within about +-1
    (a random model whose activations neither vanish nor overflow).
    """
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = cols // block_values
    raw = rng.integers(0, 256, (rows, n, block_bytes), dtype=np.uint8)

    def f16(count: int, lo: float, hi: float) -> np.ndarray:
        v = rng.uniform(lo, hi, (rows, n, count)).astype(np.float16)
        return v.view(np.uint8).reshape(rows, n, 2 * count)

    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        raw[..., 0:4] = f16(2, 2e-4, 1e-3)  # d, dmin (6-bit scales, 4/5-bit values)
    elif qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., 208:210] = f16(1, 2e-5, 1e-4)  # d (int8 scales, 6-bit values)
    return raw.reshape(rows, n * block_bytes)


def encode_tensor(
    w: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, the float32 values it stands for) for one 2-D weight."""
    G = gguf.GGMLQuantizationType
    if qtype == G.F32:
        return w, w
    if qtype == G.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    if qtype == G.BF16:
        blocks = gguf.quantize(w, G.BF16)
        return blocks, gguf.dequantize(blocks, G.BF16).reshape(w.shape)
    if qtype in (G.Q4_K, G.Q5_K, G.Q6_K):
        blocks = random_blocks(qtype, w.shape[0], w.shape[1], rng)
    else:
        blocks = gguf.quantize(w, qtype)
    return blocks, gguf.dequantize(blocks, qtype).reshape(w.shape).astype(np.float32)


def _tokenizer_metadata(writer: gguf.GGUFWriter, tok_dir: Path, pre: str) -> None:
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    special = set()
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
        if added["special"]:
            special.add(added["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if i in special else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    def tid(field: str) -> int | None:
        v = cfg.get(field)
        text = v.get("content") if isinstance(v, dict) else v
        return vocab.get(text) if text is not None else None

    if (b := tid("bos_token")) is not None:
        writer.add_bos_token_id(b)
    if (e := tid("eos_token")) is not None:
        writer.add_eos_token_id(e)
    if (p := tid("pad_token")) is not None:
        writer.add_pad_token_id(p)
    writer.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    if cfg.get("chat_template"):
        writer.add_chat_template(cfg["chat_template"])


def llama3_rope_factors(config: Mapping[str, Any]) -> np.ndarray | None:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for llama3 RoPE scaling:
    per frequency, 1 (short wavelengths), ``factor`` (long ones), a blend between."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    theta = float((config.get("rope_parameters") or config).get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _phi3_rope(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _phi3_metadata(writer: gguf.GGUFWriter, config: Mapping[str, Any]) -> None:
    """What llama.cpp's converter (Phi3MiniModel) writes beside the common keys:
    the rotated dimensions, the window (0: none), the training length, and for
    LongRoPE the attention factor it computes as transformers does."""
    rope = _phi3_rope(config)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    heads = config["num_attention_heads"]
    writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // heads)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    orig = config.get("original_max_position_embeddings", config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(orig)
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        scale = config["max_position_embeddings"] / orig
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(attn)


def phi3_rope_factors(config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """LongRoPE's two factor lists as the converter's F32 tensors (none for other RoPE)."""
    rope = _phi3_rope(config) if config["model_type"] == "phi3" else {}
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return {}
    return {
        "rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32),
    }


def write_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    tok_dir: Path,
    weight_type: Callable[[str, np.ndarray], gguf.GGMLQuantizationType] | gguf.GGMLQuantizationType,
    *,
    seed: int = 0,
    pre: str = "gpt2",
) -> dict[str, np.ndarray]:
    """Write ``path``; return the float32 weights the file really holds, by HF name.

    ``weight_type(hf_key, array)`` (or one type for all) picks each 2-D
    tensor's type; 1-D tensors are written F32 as llama.cpp does.
    """
    rng = np.random.default_rng(seed)
    model_type = config["model_type"]
    arch = gguf.MODEL_ARCH_NAMES[ARCH[model_type]]
    permuted = arch == "llama"
    tensors = stack_experts(tensors)
    n_layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    names = gguf.get_tensor_name_map(ARCH[model_type], n_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config
    if model_type != "gemma3_text":  # gemma's rope_parameters has one entry per layer kind
        writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    n_experts = config.get("num_experts") or config.get("num_local_experts")
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if model_type == "qwen3_moe":
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
            writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)))
    if model_type == "gemma3_text":  # as llama.cpp's converter: window, pattern, local base
        writer.add_sliding_window(config["sliding_window"])
        types = config["layer_types"]
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        local = config["rope_parameters"]["sliding_attention"]["rope_theta"]
        writer.add_rope_freq_base_swa(float(local))
        rope = config["rope_parameters"]["full_attention"]
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if model_type == "phi3":
        _phi3_metadata(writer, config)
    _tokenizer_metadata(writer, tok_dir, pre)
    held: dict[str, np.ndarray] = {}
    for key, w in tensors.items():
        if key == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        w = np.ascontiguousarray(w, np.float32)
        if w.ndim == 1:
            data, values = w, w
            raw_dtype = gguf.GGMLQuantizationType.F32
            if model_type == "gemma3_text" and key.endswith("norm.weight"):
                data = w + np.float32(1.0)  # the converter stores Gemma's norms as 1 + w
        elif w.ndim == 3:  # experts: each encoded as a 2-D weight, then stacked
            raw_dtype = weight_type(key, w[0]) if callable(weight_type) else weight_type
            pairs = [encode_tensor(e, raw_dtype, rng) for e in w]
            data = np.stack([p[0] for p in pairs])
            for e, (_, v) in enumerate(pairs):
                head, _, proj = key.removesuffix(".weight").rpartition(".")
                held[f"{head}.{e}.{proj}.weight"] = v
        else:
            raw_dtype = weight_type(key, w) if callable(weight_type) else weight_type
            data, values = encode_tensor(w, raw_dtype, rng)
        if w.ndim != 3:
            held[key] = values
        if permuted and (".q_proj." in key or ".k_proj." in key):
            n = heads if ".q_proj." in key else kv_heads
            data = permute(data, n)  # rows are whole blocks: permuting bytes = permuting rows
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw_dtype)
    factors = llama3_rope_factors(config)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors, raw_dtype=gguf.GGMLQuantizationType.F32)
    for name, values in phi3_rope_factors(config).items():
        writer.add_tensor(name, values, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
