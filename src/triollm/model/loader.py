"""``load_model(path)``: a Hugging Face model directory, or a GGUF file, to a runnable model.

The directory is used as downloaded, unmodified: ``config.json``, the
safetensors weights (one file or shards with an index), ``tokenizer.json`` and
``tokenizer_config.json``. Every problem the user can fix (a missing file, bad
JSON, an unsupported ``model_type``, a missing or mis-shaped tensor) is a
:class:`~triollm.errors.ModelLoadError` naming the file and the field; the CLI
prints it as one line.

A path to a ``.gguf`` file (recognised by its magic bytes, not its name) is
read by :mod:`triollm.model.gguf` instead: config, tokenizer and weights all
come from the one file, quantized weights stay quantized.
``quantize="q8_0"`` (or ``"q4_0"``) quantizes a directory's weight matrices
at load with the ``gguf`` package's own quantizer (:mod:`triollm.model.quant`).

Trap: loading compiles the numba kernels, the weight products' included (or
loads them from numba's on-disk cache) so the first request does not pay for
it; the first load on a fresh checkout therefore takes some seconds (tens, on
a busy machine) longer than later ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from triollm.errors import ModelLoadError
from triollm.model import kernels, matmul
from triollm.model.config import ModelConfig
from triollm.model.llama import LlamaModel
from triollm.model.weights import Checkpoint

if TYPE_CHECKING:
    from triollm.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """Everything a Batch, the CLI and the server need from one model directory."""

    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    weight_bytes: int  # parameters as held in memory (what a decode step streams)
    model_dir: Path  # the directory, or the GGUF file


def load_model(
    model_dir: str | os.PathLike[str],
    *,
    quantize: str | None = None,
    exact_activations: bool = False,
) -> LoadedModel:
    """Load config, weights and tokenizer from ``model_dir`` (a directory or a GGUF file).

    Weights are read tensor by tensor and prepared as they come, so peak memory
    is the prepared model plus one raw tensor. Quantized weights multiply
    int8-quantized activations unless ``exact_activations`` (then float32
    activations: transformers' numbers, slower; see ``quant.ExactActivationsSource``).
    """
    path = Path(model_dir)
    from triollm.model.gguf import is_gguf

    if is_gguf(path):
        if quantize is not None:
            raise ModelLoadError(
                f"{path}: --quantize applies to a model directory, not a GGUF file"
            )
        return _load_gguf(path, exact_activations)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory (expected a Hugging Face model directory)")
    config = ModelConfig.from_dir(path)
    # Imported here, not at the top: the tokenizer module is another layer's, and
    # config/weights stay importable without it.
    from triollm.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    with Checkpoint(path) as checkpoint:
        if quantize is None:
            model = LlamaModel(config, checkpoint)
        else:
            from triollm.model.quant import QuantizingSource

            source = QuantizingSource(checkpoint, quantize)
            if exact_activations:
                from triollm.model.quant import ExactActivationsSource

                source = ExactActivationsSource(source)  # type: ignore[assignment]
            model = LlamaModel(config, source)
    return _finish(config, model, tokenizer, path, quantized=quantize is not None)


def _load_gguf(path: Path, exact_activations: bool) -> LoadedModel:
    from triollm.model.gguf import GGUFFile, GGUFSource
    from triollm.model.gguf_tokenizer import tokenizer_from_gguf

    file = GGUFFile(path)
    config = file.config()
    tokenizer = tokenizer_from_gguf(file)
    source = GGUFSource(file, config)
    if exact_activations:
        from triollm.model.quant import ExactActivationsSource

        source = ExactActivationsSource(source)  # type: ignore[assignment]
    model = LlamaModel(config, source)
    return _finish(config, model, tokenizer, path, quantized=True)


def _finish(
    config: ModelConfig, model: LlamaModel, tokenizer: Tokenizer, path: Path, *, quantized: bool
) -> LoadedModel:
    # Compile (or load from numba's disk cache) every kernel now, weight products
    # included, so the first request's forward does not pay seconds for it.
    matmul.warm_up()
    kernels.warm_up()
    if quantized:
        from triollm.model import quant

        quant.warm_up()
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        weight_bytes=model.weight_bytes,
        model_dir=path,
    )
