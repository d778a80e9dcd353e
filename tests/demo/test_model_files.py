"""The shipped demo checkpoint: the files, their size, the architecture the issue asks for.

These read the files directly (JSON and the safetensors header), so they need neither torch
nor the engine, and they fail if a retrain exports something other than what the docs say.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

from triollm.demo import corpus, default_model_dir

MODEL = default_model_dir()
REFERENCE = Path(__file__).parent / "reference.json"
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "training.json",
}


def read_json(name: str) -> Any:
    return json.loads((MODEL / name).read_text())


def safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def test_the_model_directory_is_flat_and_complete() -> None:
    # pyproject's package-data glob is demo/model/*: a subdirectory would not be installed.
    entries = {p.name for p in MODEL.iterdir()}
    assert entries == FILES
    assert not [p for p in MODEL.iterdir() if p.is_dir()]


def test_the_whole_model_directory_is_at_most_ten_megabytes() -> None:
    assert sum(p.stat().st_size for p in MODEL.iterdir()) <= 10 * 1024 * 1024


def test_the_config_is_a_small_llama_with_grouped_query_attention() -> None:
    config = read_json("config.json")
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"


def test_the_weights_hold_one_to_five_million_parameters_in_bf16() -> None:
    header = safetensors_header(MODEL / "model.safetensors")
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    n_params = sum(math.prod(t["shape"]) for t in header.values())
    assert 1_000_000 <= n_params <= 5_000_000
    assert n_params == read_json("training.json")["parameters"]
    config = read_json("config.json")
    embed = header["model.embed_tokens.weight"]["shape"]
    assert embed == [config["vocab_size"], config["hidden_size"]]
    assert "lm_head.weight" not in header  # tied: the output layer reads the embedding


def test_the_tokenizer_has_the_chatml_specials_and_template() -> None:
    tokenizer = json.loads((MODEL / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    assert set(specials) == set(corpus.SPECIAL_TOKENS)
    assert tokenizer["model"]["type"] == "BPE"
    assert tokenizer["pre_tokenizer"]["type"] == "ByteLevel"
    vocab = len(tokenizer["model"]["vocab"])
    assert vocab == read_json("config.json")["vocab_size"]
    tokenizer_config = read_json("tokenizer_config.json")
    assert tokenizer_config["chat_template"] == corpus.CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == corpus.IM_END
    assert tokenizer_config["bos_token"] is None
    eos = {specials[corpus.IM_END], specials[corpus.END_OF_TEXT]}
    assert set(read_json("config.json")["eos_token_id"]) == eos
    assert set(read_json("generation_config.json")["eos_token_id"]) == eos


def test_the_reference_fixture_was_recorded_from_the_shipped_weights() -> None:
    reference = json.loads(REFERENCE.read_text())
    digest = hashlib.sha256((MODEL / "model.safetensors").read_bytes()).hexdigest()
    assert reference["model_sha256"] == digest
    names = {p["name"] for p in reference["prompts"]}
    assert {"once_upon_a_time", "chat_fox"} <= names
    for prompt in reference["prompts"]:
        assert prompt["stopped_on_eos"], prompt["name"]
        assert len(prompt["ignore_eos_ids"]) >= 32
        assert len(prompt["ignore_eos_ids"]) > len(prompt["greedy_ids"])


def test_the_training_summary_reports_a_held_out_loss() -> None:
    summary = read_json("training.json")
    assert summary["held_out_seed"] != summary["corpus_seed"]
    assert 0 < summary["held_out_loss"] < 1.0
