"""Reading checkpoint tensors from safetensors files, one tensor at a time.

A model directory holds either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor key: shard file}}``).
:class:`Checkpoint` opens them through the ``safetensors`` library and hands out
one tensor per :meth:`Checkpoint.get_tensor` call, so the caller can prepare it
for the forward pass and let the raw copy go before reading the next: loading
never holds two copies of the model.

dtypes: float32 and float16 come back as numpy arrays of that dtype. numpy has
no bfloat16, and ``safe_open(..., framework="np")`` refuses to read one, so a
BF16 tensor is read as its raw bits (``uint16``) straight from the file at the
offsets its header gives. bfloat16 is the top half of a float32, so
:func:`bf16_bits_to_f32` widens it exactly with a 16-bit shift; the model keeps
the bits until the matmul layer decides how to store them.

Trap: a ``uint16`` array from :meth:`Checkpoint.get_tensor` is bf16 bits, never
integers. Checkpoints of the families we load hold no integer tensors.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from safetensors import SafetensorError, safe_open

from triollm.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_NUMPY_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bits (uint16) to float32, exactly.

    Trap: the argument must be the *bits*; a float array is rejected rather
    than reinterpreted.
    """
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bits must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the bits.

    For building random bf16 models (benchmark, tests) without torch. NaN is
    not special-cased: random weights have none.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return ((u + rounding) >> np.uint32(16)).astype(np.uint16)


class TensorSource(Protocol):
    """Where the model takes its parameters from, by checkpoint key."""

    def get_tensor(self, key: str) -> np.ndarray:
        """The tensor ``key`` (float32, float16, or uint16 bf16 bits); ModelLoadError if absent."""
        ...

    def where(self, key: str) -> str:
        """The file (or description) ``key`` comes from, for error messages."""
        ...


class MappingSource:
    """A :class:`TensorSource` over an in-memory ``{key: array}`` (benchmarks, tests)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], name: str = "<in-memory weights>"):
        self.tensors = tensors
        self.name = name

    def get_tensor(self, key: str) -> np.ndarray:
        try:
            return self.tensors[key]
        except KeyError:
            raise ModelLoadError(f"{self.name}: tensor {key!r} is missing") from None

    def where(self, key: str) -> str:
        return self.name


class CallableSource:
    """A :class:`TensorSource` over a getter ``key -> array`` (e.g. random weights made
    on demand, so a benchmark never holds the raw and the prepared model at once)."""

    def __init__(self, getter: Callable[[str], np.ndarray], name: str = "<weight getter>"):
        self.getter = getter
        self.name = name

    def get_tensor(self, key: str) -> np.ndarray:
        return self.getter(key)

    def where(self, key: str) -> str:
        return self.name


def as_source(
    weights: Mapping[str, np.ndarray] | Callable[[str], np.ndarray] | TensorSource,
) -> TensorSource:
    """Accept a mapping, a getter function, or a TensorSource (e.g. a Checkpoint)."""
    if isinstance(weights, Mapping):
        return MappingSource(weights)
    if hasattr(weights, "get_tensor") and hasattr(weights, "where"):
        return weights  # type: ignore[return-value]
    if callable(weights):
        return CallableSource(weights)
    raise TypeError(f"weights must be a mapping, a getter or a TensorSource, got {weights!r}")


class Checkpoint:
    """The safetensors files of one model directory, read lazily by tensor key.

    Opening reads only the headers (names, dtypes, shapes); tensor data is read
    by :meth:`get_tensor`. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.model_dir = Path(model_dir)
        self._key_file: dict[str, Path] = {}  # tensor key -> the file holding it
        self._handles: dict[Path, Any] = {}  # open safe_open handles, one per file
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}  # data start, header
        single = self.model_dir / SINGLE_FILE
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            files = self._read_index(index)
        elif single.is_file():
            files = {single: None}
        else:
            raise ModelLoadError(
                f"{self.model_dir}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})"
            )
        for path in files:
            self._open(path)

    def _read_index(self, index: Path) -> dict[Path, None]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{index}: not valid JSON ({exc})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: field 'weight_map' must be a non-empty object")
        files: dict[Path, None] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise ModelLoadError(f"{index}: weight_map[{key!r}] must be a file name")
            path = self.model_dir / name
            if not path.is_file():
                raise ModelLoadError(f"{index}: weight_map[{key!r}] names {path}: file not found")
            files[path] = None
        return files

    def _open(self, path: Path) -> None:
        try:
            handle = safe_open(str(path), framework="np")
            keys = list(handle.keys())
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from None
        self._handles[path] = handle
        for key in keys:
            self._key_file[key] = path

    def keys(self) -> list[str]:
        return sorted(self._key_file)

    def where(self, key: str) -> str:
        path = self._key_file.get(key)
        if path is not None:
            return str(path)
        if len(self._handles) == 1:
            return str(next(iter(self._handles)))
        return str(self.model_dir / INDEX_FILE)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name: ``F32``, ``F16``, ``BF16``, ..."""
        return str(self._slice(key).get_dtype())

    def _slice(self, key: str) -> Any:
        path = self._key_file.get(key)
        if path is None:
            raise ModelLoadError(f"{self.where(key)}: tensor {key!r} is missing")
        return self._handles[path].get_slice(key)

    def get_tensor(self, key: str) -> np.ndarray:
        """Read one tensor: float32/float16 as is, BF16 as uint16 bits (see module doc)."""
        dtype = self.dtype(key)
        path = self._key_file[key]
        if dtype in _NUMPY_DTYPES:
            return np.asarray(self._handles[path].get_tensor(key))
        if dtype == "BF16":
            return self._read_raw(path, key, np.dtype(np.uint16))
        raise ModelLoadError(f"{path}: tensor {key!r} has dtype {dtype}; supported: F32, F16, BF16")

    def _read_raw(self, path: Path, key: str, dtype: np.dtype) -> np.ndarray:
        # The safetensors layout: 8-byte little-endian header length N, N bytes
        # of JSON {key: {dtype, shape, data_offsets: [begin, end]}}, then the
        # data; offsets are relative to the end of the header.
        if path not in self._headers:
            with path.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        data_start, header = self._headers[path]
        entry = header[key]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = (end - begin) // dtype.itemsize
        arr = np.fromfile(path, dtype=dtype, count=count, offset=data_start + begin)
        return arr.reshape(shape)

    def nbytes(self) -> int:
        """Total bytes of tensor data in the checkpoint files."""
        total = 0
        for key in self._key_file:
            s = self._slice(key)
            itemsize = {"F32": 4, "F16": 2, "BF16": 2}.get(str(s.get_dtype()), 4)
            total += int(np.prod(s.get_shape(), dtype=np.int64)) * itemsize
        return total

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor key the forward pass reads, with its checkpoint shape.

    ``config`` is a :class:`~triollm.model.config.ModelConfig`. Keys mirror the
    Hugging Face names, so no renaming table exists anywhere.
    """
    c = config
    h = c.hidden_size
    q_dim = c.num_attention_heads * c.head_dim
    kv_dim = c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if c.model_type == "phi3":  # q, k, v stored as one tensor (model/phi3.py)
            shapes[p + "self_attn.qkv_proj.weight"] = (q_dim + 2 * kv_dim, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_dim, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_dim, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if c.gemma is not None:  # Gemma 3's sandwich: norms before and after the MLP too
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if c.moe is not None and i in c.moe.sparse_layers:
            from triollm.model.moe import moe_shapes  # model/moe.py imports this module

            shapes.update(moe_shapes(c, i))
            continue
        if c.model_type == "phi3":  # gate over up, one tensor
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, h)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes
