"""The model's shape, read from a Hugging Face ``config.json``.

One frozen :class:`ModelConfig` covers the four Llama-family layouts we run: they
share the decoder block (RMSNorm, RoPE attention with GQA, SwiGLU MLP) and differ
in a handful of switches, each a field here:

- ``llama``: optional ``attention_bias`` (q/k/v/o), ``rope_scaling`` of type
  ``llama3`` or ``linear``, tied or untied output head;
- ``mistral``: llama plus ``sliding_window`` (attention sees only the last W
  positions);
- ``qwen2``: q/k/v biases always on, o_proj without bias;
- ``qwen3``: per-head RMSNorm on q and k before RoPE, explicit ``head_dim``;
- ``qwen3_moe``: qwen3 attention, and a mixture of experts in place of the MLP
  in the layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick
  (:class:`MoeConfig`, ``model/moe.py``);
- ``mixtral``: mistral attention, a mixture of experts in every layer;
- ``gemma3_text`` (Gemma 3, text only): sandwich norms, GeGLU, sliding and full
  layers with their own RoPE bases (:class:`~triollm.model.gemma.GemmaConfig`,
  ``model/gemma.py``);
- ``phi3`` (Phi-3, Phi-3.5, Phi-4-mini): q/k/v and gate/up stored fused, partial
  rotary (``partial_rotary_factor``), LongRoPE scaling (``longrope``, older ``su``)
  and an optional sliding window (``model/phi3.py``).

Two spellings of RoPE coexist in the wild: checkpoints saved before transformers
5 carry ``rope_theta`` and ``rope_scaling`` at the top level; transformers 5
writes one ``rope_parameters`` object holding both. Both are read here.

Trap: every error is a :class:`~triollm.errors.ModelLoadError` naming the file
(``source``) and the field, because the person reading it is looking at that file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triollm.errors import ModelLoadError

if TYPE_CHECKING:
    from triollm.model.gemma import GemmaConfig

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma3_text",
    "phi3",
)
# "su" is the name Phi-3's first 128k configs gave LongRoPE; transformers reads it so too
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How RoPE frequencies are stretched for a longer context than training's.

    ``rope_type`` ``linear`` divides every frequency by ``factor``. ``llama3``
    divides only the low frequencies (wavelength beyond
    ``original_max_position_embeddings / low_freq_factor``), keeps the high ones,
    and blends in between. ``factors`` divides frequency ``i`` by
    ``frequency_factors[i]`` (a GGUF file's llama3 scaling, precomputed).
    """

    rope_type: str  # "linear" | "llama3" | "factors"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only
    # "factors" (GGUF files only): each frequency divided by its own factor, as the
    # file's ``rope_freqs.weight`` tensor gives them (llama.cpp's converter writes
    # llama3 scaling this way, computed from the four numbers above)
    frequency_factors: tuple[float, ...] = ()
    # "longrope": one divisor per rotated frequency for contexts within the original
    # length (short) and beyond it (long), and cos/sin's multiplier
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture of experts in place of the dense MLP (qwen3_moe, mixtral).

    Each row's router picks ``top_k`` of ``num_experts`` SwiGLU experts (each
    ``intermediate_size`` wide); their outputs are summed, weighted by the
    router's softmax probabilities, renormalised over the chosen ``top_k`` when
    ``norm_topk_prob`` (always for Mixtral; a config field for Qwen3-MoE).
    ``sparse_layers`` are the layers that carry experts; the others keep a dense
    MLP of the model's ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of one checkpoint, validated.

    Build it with :meth:`from_dir` (a model directory) or :meth:`from_dict` (a
    parsed ``config.json``, e.g. for a random benchmark model).
    """

    model_type: str  # one of SUPPORTED_MODEL_TYPES
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means GQA
    head_dim: int  # explicit in qwen3; hidden_size // num_attention_heads otherwise
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool  # True: lm_head is embed_tokens (no lm_head.weight tensor)
    attention_bias: bool  # q/k/v projections carry a bias (qwen2 always; llama/qwen3 when set)
    o_proj_bias: bool  # the output projection carries a bias too (llama/qwen3 attention_bias)
    qk_norm: bool  # qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int | None  # mistral: attend to at most this many latest positions
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    torch_dtype: str  # the checkpoint's stated dtype ("float32", "bfloat16", ...)
    moe: MoeConfig | None = None  # qwen3_moe, mixtral: experts in place of the MLP
    gemma: GemmaConfig | None = None  # gemma3_text: norms, GeGLU, per-layer windows (gemma.py)
    # phi3 partial rotary: RoPE turns the first rotary_dim dimensions of each head and
    # passes the rest through; None: all head_dim of them (every other family)
    rotary_dim: int | None = None

    @property
    def kv_group_size(self) -> int:
        """Query heads per KV head (1 without GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_dim(self) -> int:
        """How many dimensions of each q/k head RoPE rotates (even; head_dim unless partial)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        """Read ``model_dir/config.json``; ModelLoadError if missing or invalid."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (a model directory needs config.json)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, d: Any, source: str = "config.json") -> ModelConfig:
        """Validate a parsed ``config.json``. ``source`` names the file in errors."""
        if not isinstance(d, Mapping):
            raise ModelLoadError(f"{source}: expected a JSON object, got {type(d).__name__}")
        r = _Reader(d, source)
        model_type = r.string("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden_size = r.positive_int("hidden_size")
        n_heads = r.positive_int("num_attention_heads")
        n_kv = r.positive_int("num_key_value_heads", default=n_heads)
        if n_heads % n_kv:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({n_heads}) must be a multiple of "
                f"num_key_value_heads ({n_kv})"
            )
        head_dim = r.positive_int("head_dim", default=None)
        if head_dim is None:
            if hidden_size % n_heads:
                raise ModelLoadError(
                    f"{source}: hidden_size ({hidden_size}) is not a multiple of "
                    f"num_attention_heads ({n_heads}) and head_dim is not given"
                )
            head_dim = hidden_size // n_heads
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim must be even for RoPE, got {head_dim}")

        for flag in ("mlp_bias",):
            if r.boolean(flag, default=False):
                raise ModelLoadError(f"{source}: {flag}=true is not supported")
        if model_type != "gemma3_text" and r.string("hidden_act", default="silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act must be 'silu' (SwiGLU)")

        if model_type == "qwen2":
            attention_bias, o_proj_bias = True, False
        elif model_type in ("mistral", "mixtral", "phi3"):  # phi3: bias=False in transformers
            attention_bias = o_proj_bias = False
        else:
            attention_bias = o_proj_bias = r.boolean("attention_bias", default=False)

        sliding_window: int | None = None
        if model_type in ("mistral", "mixtral", "phi3"):
            sliding_window = r.positive_int("sliding_window", default=None)
        elif r.boolean("use_sliding_window", default=False):
            raise ModelLoadError(
                f"{source}: use_sliding_window=true is not supported for {model_type}"
            )

        max_pos = r.positive_int("max_position_embeddings")
        rotary_dim = _read_rotary_dim(d, source, model_type, head_dim)
        gemma = None
        if model_type == "gemma3_text":
            from triollm.model.gemma import read_gemma

            gemma, theta, scaling = read_gemma(r, d, r.positive_int("num_hidden_layers"))
            rope_theta, rope_scaling = _read_rope(
                {"rope_theta": theta, "rope_scaling": scaling}, source
            )
        else:
            rope_theta, rope_scaling = _read_rope(
                d, source, max_positions=max_pos, rope_dim=rotary_dim or head_dim
            )
        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: frozenset[int] = frozenset()
        elif _is_int(eos):
            eos_ids = frozenset([int(eos)])
        elif isinstance(eos, list) and all(_is_int(e) for e in eos):
            eos_ids = frozenset(int(e) for e in eos)
        else:
            raise ModelLoadError(
                f"{source}: eos_token_id must be an integer or a list of integers, got {eos!r}"
            )
        dtype = d.get("torch_dtype", d.get("dtype", "float32"))
        n_layers = r.positive_int("num_hidden_layers")
        moe = _read_moe(r, model_type, n_layers) if model_type in ("qwen3_moe", "mixtral") else None
        return cls(
            model_type=model_type,
            hidden_size=hidden_size,
            intermediate_size=r.positive_int("intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            vocab_size=r.positive_int("vocab_size"),
            max_position_embeddings=max_pos,
            rms_norm_eps=r.positive_float("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=r.boolean("tie_word_embeddings", default=False),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=sliding_window,
            bos_token_id=r.nonnegative_int("bos_token_id", default=None),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype) if dtype is not None else "float32",
            moe=moe,
            gemma=gemma,
            rotary_dim=rotary_dim,
        )


def _read_moe(r: _Reader, model_type: str, n_layers: int) -> MoeConfig:
    """The experts of a qwen3_moe or mixtral config (see :class:`MoeConfig`).

    Qwen3-MoE checkpoints on the hub spell the expert count ``num_experts``;
    transformers 5 saves it as ``num_local_experts`` (Mixtral's name): both read.
    """
    src = r.source
    if model_type == "mixtral":
        n_experts = r.positive_int("num_local_experts")
        width = r.positive_int("intermediate_size")
        norm = True  # Mixtral always renormalises its top-k weights
        sparse = frozenset(range(n_layers))
    else:
        key = "num_experts" if r.d.get("num_experts") is not None else "num_local_experts"
        n_experts = r.positive_int(key)
        width = r.positive_int("moe_intermediate_size")
        norm = r.boolean("norm_topk_prob", default=False)
        step = r.positive_int("decoder_sparse_step", default=1)
        dense = r.d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(_is_int(i) and 0 <= i < n_layers for i in dense):
            raise ModelLoadError(
                f"{src}: field 'mlp_only_layers' must be a list of layer indices "
                f"0..{n_layers - 1}, got {dense!r}"
            )
        sparse = frozenset(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
    top_k = r.positive_int("num_experts_per_tok")
    if top_k > n_experts:
        raise ModelLoadError(
            f"{src}: num_experts_per_tok ({top_k}) exceeds the number of experts ({n_experts})"
        )
    return MoeConfig(n_experts, top_k, width, norm, sparse)


def _is_int(v: object) -> bool:
    # JSON true/false arrive as bool, a subclass of int: never accept them as counts.
    return isinstance(v, int) and not isinstance(v, bool)


_MISSING: Any = object()  # sentinel: the field has no default and is required


class _Reader:
    """Typed field access with errors that name the file and the field."""

    def __init__(self, d: Mapping[str, Any], source: str) -> None:
        self.d = d
        self.source = source

    def _get(self, key: str, default: Any) -> Any:
        # JSON null counts as absent: HF writes ``"head_dim": null`` for "derive it".
        v = self.d.get(key)
        if v is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.source}: required field {key!r} is missing")
            return default
        return v

    def string(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is not default and not isinstance(v, str):
            raise ModelLoadError(f"{self.source}: field {key!r} must be a string, got {v!r}")
        return v

    def positive_int(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is not default and (not _is_int(v) or v <= 0):
            raise ModelLoadError(
                f"{self.source}: field {key!r} must be a positive integer, got {v!r}"
            )
        return v

    def nonnegative_int(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is not default and (not _is_int(v) or v < 0):
            raise ModelLoadError(
                f"{self.source}: field {key!r} must be a non-negative integer, got {v!r}"
            )
        return v

    def positive_float(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is default:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ModelLoadError(
                f"{self.source}: field {key!r} must be a positive number, got {v!r}"
            )
        return float(v)

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default)
        if v is not default and not isinstance(v, bool):
            raise ModelLoadError(f"{self.source}: field {key!r} must be true or false, got {v!r}")
        return v


def _read_rotary_dim(
    d: Mapping[str, Any], source: str, model_type: str, head_dim: int
) -> int | None:
    """Phi-3's partial rotary: ``int(head_dim * partial_rotary_factor)`` dimensions, or
    None for all of them. transformers 5 keeps the factor in ``rope_parameters``; hub
    checkpoints (Phi-4-mini: 0.75) at the top level."""
    params = d.get("rope_parameters")
    held = params if isinstance(params, Mapping) else {}
    field = "rope_parameters.partial_rotary_factor"
    factor = held.get("partial_rotary_factor")
    if factor is None:
        field, factor = "partial_rotary_factor", d.get("partial_rotary_factor")
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise ModelLoadError(
            f"{source}: field {field!r} must be a number in (0, 1], got {factor!r}"
        )
    exact = head_dim * factor
    # transformers truncates (int()); a decimal factor times head_dim may land a hair
    # under the integer it means in binary, and truncating that would lose a dimension,
    # so a product within 1e-9 of an integer is that integer
    dims = round(exact) if abs(exact - round(exact)) < 1e-9 else int(exact)
    if dims == head_dim:
        return None
    if model_type != "phi3":
        raise ModelLoadError(
            f"{source}: field {field!r} < 1 (partial rotary) is supported for phi3 only"
        )
    if dims < 2 or dims % 2:
        raise ModelLoadError(
            f"{source}: field {field!r} ({factor}) gives {dims} rotary dimensions of "
            f"head_dim {head_dim}; RoPE needs an even number, at least 2"
        )
    return dims


def _read_rope(
    d: Mapping[str, Any], source: str, *, max_positions: int = 0, rope_dim: int = 0
) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either spelling (see the module docstring).

    ``max_positions`` and ``rope_dim`` are LongRoPE's (its attention factor and the
    length of its factor lists); the other types do not read them."""
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise ModelLoadError(f"{source}: field 'rope_parameters' must be an object")
        field = "rope_parameters"
        theta_src: Mapping[str, Any] = params
        scaling: Any = params
    else:
        field = "rope_scaling"
        theta_src = d
        scaling = d.get("rope_scaling")
    theta = _Reader(theta_src, source).positive_float("rope_theta", default=10000.0)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise ModelLoadError(f"{source}: field {field!r} must be an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: {field}.rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("longrope", "su"):
        from triollm.model.phi3 import read_longrope

        return theta, read_longrope(scaling, d, f"{source} ({field})", max_positions, rope_dim)
    r = _Reader(scaling, f"{source} ({field})")
    factor = r.positive_float("factor")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    low = r.positive_float("low_freq_factor")
    high = r.positive_float("high_freq_factor")
    if high <= low:
        raise ModelLoadError(
            f"{source}: {field}.high_freq_factor ({high}) must exceed low_freq_factor ({low})"
        )
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=r.positive_int("original_max_position_embeddings"),
    )
