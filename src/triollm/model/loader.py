"""``load_model(dir)``: a Hugging Face model directory to a runnable model.

The directory is used as downloaded, unmodified: ``config.json``, the
safetensors weights (one file or shards with an index), ``tokenizer.json`` and
``tokenizer_config.json``. Every problem the user can fix (a missing file, bad
JSON, an unsupported ``model_type``, a missing or mis-shaped tensor) is a
:class:`~triollm.errors.ModelLoadError` naming the file and the field; the CLI
prints it as one line.

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
    model_dir: Path


def load_model(model_dir: str | os.PathLike[str]) -> LoadedModel:
    """Load config, weights and tokenizer from ``model_dir``.

    Weights are read tensor by tensor and prepared as they come, so peak memory
    is the prepared model plus one raw tensor.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory (expected a Hugging Face model directory)")
    config = ModelConfig.from_dir(path)
    # Imported here, not at the top: the tokenizer module is another layer's, and
    # config/weights stay importable without it.
    from triollm.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    with Checkpoint(path) as checkpoint:
        model = LlamaModel(config, checkpoint)
    # Compile (or load from numba's disk cache) every kernel now, weight products
    # included, so the first request's forward does not pay seconds for it.
    matmul.warm_up()
    kernels.warm_up()
    return LoadedModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        weight_bytes=model.weight_bytes,
        model_dir=path,
    )
