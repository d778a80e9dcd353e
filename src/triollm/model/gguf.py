"""Reading a GGUF file: metadata to a :class:`ModelConfig`, tensors to the model.

GGUF (llama.cpp's format, also Ollama's and LM Studio's) is one file: a
header, typed metadata (``general.architecture``, ``llama.block_count``,
``tokenizer.ggml.tokens`` ...), a table of tensors (name, shape, type,
offset) and the tensor data, aligned. We read it with the ``gguf`` package,
the format's own Python reader, which maps the file into memory: a tensor's
bytes are a view of the mapping, read from disk when first touched, never
copied here. Quantized tensors stay quantized
(:class:`~triollm.model.quant.QuantizedTensor`); F32/F16/BF16 come back as
the arrays the safetensors path gives (BF16 as its uint16 bits).

The model code names tensors as Hugging Face does; :class:`GGUFSource`
answers those names with the GGUF tensors, through the ``gguf`` package's
own name table (``model.layers.0.self_attn.q_proj.weight`` is
``blk.0.attn_q.weight``), so no renaming table lives here.

Trap: llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k``
of ``llama``-architecture files (Llama, Mistral, SmolLM2, TinyLlama): within
each head it interleaves the two halves, because ggml's RoPE rotates
adjacent pairs where Hugging Face rotates the first half against the second.
We rotate the HF way, so :meth:`GGUFSource.get_tensor` undoes the
permutation (a row reordering: each row is whole blocks, so it applies to
quantized rows as they are). qwen2/qwen3 files are not permuted.
``tests/model/test_gguf.py`` proves the result equals the HF checkpoint the
file was written from.

Every problem with the file is a :class:`~triollm.errors.ModelLoadError`
naming the file and the key or tensor: a truncated file, an unknown tensor
type, a missing tensor, a metadata key of the wrong type.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from triollm.errors import ModelLoadError
from triollm.model.config import ModelConfig, RopeScaling
from triollm.model.quant import QuantizedTensor, QuantType

SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "gemma3",
    "phi3",
)  # llama + experts: Mixtral
_PERMUTED_ARCHITECTURES = ("llama",)  # q/k rows interleaved by the converter
# general.architecture -> our model_type; a "llama" file with experts is Mixtral
_MODEL_TYPE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}
# an expert's projection, by HF key: the group of experts and the projection name
_EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$"
)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def _value_kind(field: Any) -> str:
    """A metadata field's type as one word: int, float, bool, str, or array[<kind>]."""
    from gguf import GGUFValueType as T

    ints = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}

    def one(t: Any) -> str:
        if t in ints:
            return "int"
        if t in (T.FLOAT32, T.FLOAT64):
            return "float"
        if t == T.BOOL:
            return "bool"
        if t == T.STRING:
            return "str"
        return t.name.lower()

    if field.types and field.types[0] == T.ARRAY:
        return f"array[{one(field.types[1]) if len(field.types) > 1 else 'empty'}]"
    return one(field.types[0]) if field.types else "empty"


class _BadTensor(Exception):
    """A tensor the reader cannot map, with the sentence that names it."""


def _reader_class() -> Any:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Reader(GGUFReader):  # type: ignore[misc]
        # The package's reader slices its np.memmap once per value it parses, and a
        # memmap slice costs ~20 us of subclass bookkeeping: a Llama 3 vocabulary
        # (128k tokens, 280k merges, ~1M slices) took 28 s to open. A plain ndarray
        # view of the same mapping slices in under 1 us; nothing is copied.
        @property  # type: ignore[override]  # a plain view of the memmap, on purpose
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)

        # The package's reader maps every tensor as it opens the file and fails
        # with a bare numpy error ("cannot reshape array ...") for a truncated
        # file or an unknown type id; checking each entry of the tensor table
        # first lets the error name the tensor.
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise _BadTensor(
                        f"tensor {name!r} has type id {int(raw_dtype[0])}, unknown to GGUF"
                    ) from None
                block_values, block_bytes = GGML_QUANT_SIZES[kind]
                count = int(np.prod(dims, dtype=np.int64))
                if dims.size and int(dims[0]) % block_values:
                    raise _BadTensor(
                        f"tensor {name!r} ({kind.name}) has rows of {int(dims[0])} values, "
                        f"not whole blocks of {block_values}"
                    )
                end = int(start_offs + offset[0]) + count // block_values * block_bytes
                if end > size:
                    raise _BadTensor(
                        f"tensor {name!r} ends at byte {end}, past the end of the file "
                        f"({size} bytes): the file is truncated"
                    )
            super()._build_tensors(start_offs, fields)

    return Reader


class GGUFFile:
    """One GGUF file, opened: typed metadata and the tensor table (data mapped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            # "c": a copy-on-write mapping; the file is never written, and the
            # arrays are writable, so the kernels are compiled for one array type
            self.reader = _reader_class()(self.path, "c")
        except _BadTensor as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from None
        except Exception as exc:  # a header cut short or corrupt: assorted errors
            raise ModelLoadError(
                f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                "truncated or corrupt?"
            ) from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    # -- metadata ----------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, kind: str, default: Any = ...) -> Any:
        """Metadata ``key`` as ``kind`` (int, float, bool, str, array[str], ...).

        ModelLoadError naming the key when it is missing (and no default is given)
        or holds another type; an int is accepted where a float is asked.
        """
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
            return default
        have = _value_kind(field)
        if have != kind and not (kind == "float" and have == "int"):
            raise ModelLoadError(f"{self.path}: metadata key {key!r} must be {kind}, got {have}")
        value = field.contents()
        if kind == "float":
            return float(value)
        if kind == "int":
            return int(value)
        return value

    @property
    def architecture(self) -> str:
        arch = str(self.get("general.architecture", "str"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: general.architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return arch

    def config(self) -> ModelConfig:
        """The model's shape from ``{arch}.*`` metadata, validated by :class:`ModelConfig`."""
        arch = self.architecture
        g = self.get
        heads = g(f"{arch}.attention.head_count", "int")
        d: dict[str, Any] = {
            "model_type": _MODEL_TYPE[arch],
            "hidden_size": g(f"{arch}.embedding_length", "int"),
            "intermediate_size": g(f"{arch}.feed_forward_length", "int"),
            "num_hidden_layers": g(f"{arch}.block_count", "int"),
            "num_attention_heads": heads,
            "num_key_value_heads": g(f"{arch}.attention.head_count_kv", "int", heads),
            "head_dim": g(f"{arch}.attention.key_length", "int", None),
            "max_position_embeddings": g(f"{arch}.context_length", "int"),
            "rms_norm_eps": g(f"{arch}.attention.layer_norm_rms_epsilon", "float"),
            "rope_theta": g(f"{arch}.rope.freq_base", "float", 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": g("tokenizer.ggml.bos_token_id", "int", None),
            "eos_token_id": g("tokenizer.ggml.eos_token_id", "int", None),
            "torch_dtype": self.weight_type(),
        }
        if arch == "gemma3":
            d |= self._gemma3(d["num_hidden_layers"], d["head_dim"])
        if arch == "phi3":
            d |= self._phi3(d["head_dim"] or d["hidden_size"] // heads)
        experts = g(f"{arch}.expert_count", "int", 0)
        if experts:
            d |= self._moe(arch, experts, d["num_hidden_layers"])
        scaling = g(f"{arch}.rope.scaling.type", "str", "none")
        if scaling == "linear":
            d["rope_scaling"] = {
                "rope_type": "linear",
                "factor": g(f"{arch}.rope.scaling.factor", "float"),
            }
        elif scaling != "none" and "rope_scaling" not in d:  # phi3: LongRoPE read above
            raise ModelLoadError(
                f"{self.path}: {arch}.rope.scaling.type {scaling!r} is not supported "
                "(supported: none, linear)"
            )
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelLoadError(f"{self.path}: tensor 'token_embd.weight' is missing")
        vocab = g(f"{arch}.vocab_size", "int", None)
        d["vocab_size"] = vocab if vocab is not None else int(embd.shape[-1])
        config = ModelConfig.from_dict(d, source=str(self.path))
        if "rope_freqs.weight" in self.tensors:
            config = self._with_frequency_factors(config)
        return config

    def _gemma3(self, n_layers: int, head_dim: int | None) -> dict[str, Any]:
        """Gemma 3's fields, as llama.cpp reads them from a gemma3 file.

        The sliding layers' RoPE base is ``rope.freq_base_swa`` (10 000 when absent,
        llama.cpp's constant); the pattern is ``attention.sliding_window_pattern``
        (a period, or a bool per layer) or every sixth layer full; attention scales
        by ``head_dim ** -0.5``, llama.cpp's choice for every size but 27B, which
        scales by ``hidden / heads`` instead: GGUF does not record it, so a 62-layer
        file (the 27B) is refused rather than misread.
        """
        g = self.get
        if n_layers == 62:
            raise ModelLoadError(
                f"{self.path}: a 62-layer gemma3 file is Gemma 3 27B, whose attention scale "
                "(query_pre_attn_scalar = hidden / heads) GGUF does not record; not supported"
            )
        d: dict[str, Any] = {
            "sliding_window": g("gemma3.attention.sliding_window", "int"),
            "rope_local_base_freq": g("gemma3.rope.freq_base_swa", "float", 10000.0),
            "final_logit_softcapping": g("gemma3.final_logit_softcapping", "float", None),
        }
        if head_dim is not None:
            d["query_pre_attn_scalar"] = head_dim
        key = "gemma3.attention.sliding_window_pattern"
        if self.has(key) and _value_kind(self.reader.fields[key]).startswith("array"):
            pattern = [bool(b) for b in self.get(key, "array[bool]")]
            d["layer_types"] = ["sliding_attention" if b else "full_attention" for b in pattern]
        else:
            d["sliding_window_pattern"] = g(key, "int", 6)
        return d

    def _phi3(self, head_dim: int) -> dict[str, Any]:
        """Phi-3's fields, as llama.cpp's converter writes them (``model/phi3.py``).

        Partial rotary is ``rope.dimension_count`` (the rotated dimensions); a
        window is ``attention.sliding_window`` (0: none); LongRoPE is the pair of
        tensors ``rope_factors_short`` / ``rope_factors_long``, the training length
        ``rope.scaling.original_context_length`` and the converter's attention factor
        ``rope.scaling.attn_factor`` (computed as transformers does).
        """
        g = self.get
        rotary = g("phi3.rope.dimension_count", "int", head_dim)
        d: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim}
        window = g("phi3.attention.sliding_window", "int", 0)
        if window:
            d["sliding_window"] = window
        names = ("rope_factors_short.weight", "rope_factors_long.weight")
        present = [n for n in names if n in self.tensors]
        if not present:
            return d
        if len(present) == 1:
            missing = next(n for n in names if n not in present)
            raise ModelLoadError(
                f"{self.path}: tensor {missing!r} is missing (LongRoPE needs both lists)"
            )
        lists = []
        for name in names:
            t = self.tensor(name)
            if not isinstance(t, np.ndarray) or t.dtype != np.float32 or t.shape != (rotary // 2,):
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} must be F32 with {rotary // 2} factors "
                    f"(rope.dimension_count / 2), got shape {getattr(t, 'shape', '?')}"
                )
            lists.append([float(f) for f in t])
        d["original_max_position_embeddings"] = g(
            "phi3.rope.scaling.original_context_length", "int"
        )
        d["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": lists[0],
            "long_factor": lists[1],
        }
        attn = g("phi3.rope.scaling.attn_factor", "float", None)
        if attn is not None:
            d["rope_scaling"]["attention_factor"] = attn
        return d

    def _moe(self, arch: str, experts: int, n_layers: int) -> dict[str, Any]:
        """The config fields of a mixture of experts (``{arch}.expert_*`` keys).

        A "llama" file with experts is Mixtral (llama.cpp writes Mixtral so). GGUF
        has no ``mlp_only_layers``: a layer is sparse when it has a router tensor
        (``blk.N.ffn_gate_inp``). llama.cpp renormalises qwen3moe's top-k weights
        unless ``expert_weights_norm`` says otherwise, and always Mixtral's.
        """
        g = self.get
        sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in self.tensors]
        used = g(f"{arch}.expert_used_count", "int")
        if arch == "llama":
            return {
                "model_type": "mixtral",
                "num_local_experts": experts,
                "num_experts_per_tok": used,
            }
        return {
            "num_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": g(f"{arch}.expert_feed_forward_length", "int"),
            "norm_topk_prob": g(f"{arch}.expert_weights_norm", "bool", True),
            "mlp_only_layers": [i for i in range(n_layers) if i not in sparse],
        }

    def _with_frequency_factors(self, config: ModelConfig) -> ModelConfig:
        """Llama 3.1+ files: RoPE frequency ``i`` divided by ``rope_freqs.weight[i]``
        (llama.cpp's converter computes the llama3 scaling into this tensor)."""
        if config.rope_scaling is not None:
            raise ModelLoadError(
                f"{self.path}: tensor 'rope_freqs.weight' and "
                f"'rope.scaling.type' {config.rope_scaling.rope_type!r} both scale RoPE; "
                "a file may use one"
            )
        factors = self.tensor("rope_freqs.weight")
        half = config.head_dim // 2
        if not isinstance(factors, np.ndarray) or factors.dtype != np.float32:
            raise ModelLoadError(f"{self.path}: tensor 'rope_freqs.weight' must be F32")
        if factors.shape != (half,) or not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelLoadError(
                f"{self.path}: tensor 'rope_freqs.weight' must hold {half} positive factors "
                f"(head_dim / 2), got shape {factors.shape}"
            )
        scaling = RopeScaling(
            "factors", factor=1.0, frequency_factors=tuple(float(f) for f in factors)
        )
        return dataclasses.replace(config, rope_scaling=scaling)

    def weight_type(self) -> str:
        """The type most weight bytes are in (``Q4_1``, ``Q8_0``, ``F16`` ...)."""
        sizes: dict[str, int] = {}
        for t in self.reader.tensors:
            sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
        return max(sizes, key=lambda k: sizes[k]) if sizes else "F32"

    def tensor(self, name: str) -> np.ndarray | QuantizedTensor:
        """The tensor ``name`` in our layout (see the module docstring); no copy."""
        from gguf import GGMLQuantizationType as G

        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml lists ne[0] first
        data = np.asarray(t.data)
        kind = t.tensor_type
        if kind in (G.F32, G.F16):
            return data.reshape(shape)
        if kind == G.BF16:
            return data.view(np.uint16).reshape(shape)
        try:
            qtype = QuantType(int(kind))
        except ValueError:
            supported = ", ".join(["F32", "F16", "BF16", *(q.name for q in QuantType)])
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has type {kind.name}, which is not supported "
                f"(supported: {supported})"
            ) from None
        if len(shape) != 2:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} is {kind.name} with shape {shape}; "
                "quantized tensors must be 2-D"
            )
        return QuantizedTensor(qtype, (shape[0], shape[1]), data.reshape(shape[0], -1))

    def expert(self, name: str, index: int) -> np.ndarray | QuantizedTensor:
        """Expert ``index`` of the 3-D tensor ``name`` (``blk.N.ffn_gate_exps`` ...).

        llama.cpp stores a layer's experts as one ``(experts, rows, cols)`` tensor
        per projection; expert ``e`` is the ``e``-th run of whole rows, so a
        quantized expert is a view of its blocks, like any 2-D weight (no copy).
        """
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if len(shape) != 3 or not 0 <= index < shape[0]:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has shape {shape}; expected 3-D "
                f"(experts, rows, cols) with an expert {index}"
            )
        n, rows, cols = shape
        data = np.asarray(t.data)
        from gguf import GGMLQuantizationType as G

        if t.tensor_type in (G.F32, G.F16):
            return data.reshape(shape)[index]
        if t.tensor_type == G.BF16:
            return data.view(np.uint16).reshape(shape)[index]
        try:
            qtype = QuantType(int(t.tensor_type))
        except ValueError:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, "
                "which is not supported"
            ) from None
        return QuantizedTensor(qtype, (rows, cols), data.reshape(n, rows, -1)[index])


class GGUFSource:
    """A :class:`~triollm.model.weights.TensorSource` over a GGUF file, by HF tensor names."""

    def __init__(self, file: GGUFFile, config: ModelConfig) -> None:
        import gguf

        self.file = file
        self.config = config
        arch = {
            "llama": gguf.MODEL_ARCH.LLAMA,
            "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3,
            "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
            "gemma3": gguf.MODEL_ARCH.GEMMA3,
            "phi3": gguf.MODEL_ARCH.PHI3,
        }[file.architecture]
        # llama.cpp's converter writes Gemma's norm weights as 1 + w; the model adds
        # the 1 itself (gemma.py), so it is taken off again here, as transformers'
        # GGUF loader does, in float32
        self._norm_plus_one = file.architecture == "gemma3"
        self._names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
        self._permuted = file.architecture in _PERMUTED_ARCHITECTURES

    def gguf_name(self, key: str) -> str:
        expert = _EXPERT_KEY.match(key)
        if expert:  # one expert of a layer's 3-D tensor: named without the index
            key = f"{expert[1]}.{expert[3]}.weight"
        name = self._names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ModelLoadError(f"{self.file.path}: no GGUF tensor corresponds to {key!r}")
        return name

    def where(self, key: str) -> str:
        return f"{self.file.path} ({self.gguf_name(key)})"

    def get_tensor(self, key: str) -> Any:
        """An ndarray (F32, F16, BF16 bits) or a :class:`QuantizedTensor`, by HF key."""
        name = self.gguf_name(key)
        if name not in self.file.tensors:
            raise ModelLoadError(f"{self.file.path}: tensor {name!r} (for {key!r}) is missing")
        expert = _EXPERT_KEY.match(key)
        if expert:
            return self.file.expert(name, int(expert[2]))
        t = self.file.tensor(name)
        if self._norm_plus_one and key.endswith("norm.weight") and isinstance(t, np.ndarray):
            return (t.astype(np.float32) - np.float32(1.0)).astype(np.float32)
        if self._permuted and (".attn_q." in name or ".attn_k." in name):
            c = self.config
            heads = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            order = unpermute_order(t.shape[0], heads)
            if isinstance(t, QuantizedTensor):
                return t.take_rows(order)
            return np.ascontiguousarray(t[order])
        return t


def unpermute_order(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation: ``hf = gguf[order]``.

    The converter writes, for each head, HF row ``j * head_dim/2 + i`` (half
    ``j`` of 2, index ``i``) at position ``2 * i + j``; this is its inverse.
    """
    if rows % heads or (rows // heads) % 2:
        raise ModelLoadError(f"{rows} q/k rows do not split into {heads} heads of even size")
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)
