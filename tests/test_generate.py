"""``triollm generate`` prints transformers' greedy continuation, streams the same text it
reports in --json, honours stop strings, and answers every user mistake with one line and
exit status 2."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import triollm.demo
from triollm.cli import main
from triollm.model.sampling import SamplingParams
from triollm.spec import GenerationSpec

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = sorted(p.stem for p in (FIXTURES / "reference").glob("*.json"))
LLAMA = FIXTURES / "models" / "llama-gqa-f32"


def reference(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / "reference" / f"{name}.json").read_text()))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "triollm.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["generate", *args, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def greedy_args(prompt: dict[str, Any]) -> list[str]:
    ids = ",".join(map(str, prompt["prompt_ids"]))
    n = str(len(prompt["greedy_ids"]))
    # the f32 KV cache: token-exact against transformers is a claim about the arithmetic
    exact = ["--kv-cache-dtype", "f32"]
    return ["--prompt-ids", ids, "--temperature", "0", "--ignore-eos", "--max-tokens", n, *exact]


def test_the_command_prints_transformers_greedy_ids_as_json() -> None:
    prompt = reference("llama-gqa-f32")["prompts"][0]
    proc = cli(str(LLAMA), *greedy_args(prompt), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == prompt["greedy_ids"]
    assert out["prompt_token_ids"] == prompt["prompt_ids"]
    assert out["finish_reason"] == "length"
    timings = out["timings"]
    assert timings["prompt_tokens"] == len(prompt["prompt_ids"])
    assert timings["completion_tokens"] == len(prompt["greedy_ids"])
    assert timings["time_to_first_token_s"] >= 0 and timings["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("name", MODELS)
def test_every_fixture_model_generates_its_reference(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for prompt in reference(name)["prompts"][:2]:
        out = run_json(capsys, str(FIXTURES / "models" / name), *greedy_args(prompt))
        assert out["token_ids"] == prompt["greedy_ids"]


def test_prompt_text_is_tokenized_like_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = reference("llama-gqa-f32")["prompts"][1]
    out = run_json(capsys, str(LLAMA), "--prompt", prompt["text"], "--max-tokens", "2")
    assert out["prompt_token_ids"] == prompt["prompt_ids"]


def test_streamed_text_equals_the_json_text(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        str(LLAMA),
        "--prompt",
        "The river",
        "--seed",
        "5",
        "--max-tokens",
        "40",
        "--ignore-eos",
    ]
    assert main(["generate", *args]) == 0
    streamed = capsys.readouterr().out
    out = run_json(capsys, *args)
    assert streamed == out["text"] + "\n"
    assert len(out["token_ids"]) == 40


class RecordingStdout(io.StringIO):
    """Records what was written between flushes."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []
        self._mark = 0

    def flush(self) -> None:
        text = self.getvalue()
        if len(text) > self._mark:
            self.flushed.append(text[self._mark :])
            self._mark = len(text)


def test_text_is_flushed_piece_by_piece_as_it_is_generated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", out)
    prompt = reference("llama-gqa-f32")["prompts"][0]
    assert main(["generate", str(LLAMA), *greedy_args(prompt)]) == 0
    pieces = out.flushed
    assert len(pieces) > 10  # one flush per piece, not one at the end
    assert "".join(pieces) == out.getvalue() and out.getvalue().endswith("\n")


def test_chat_wraps_the_prompt_in_the_template(capsys: pytest.CaptureFixture[str]) -> None:
    from triollm.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(LLAMA)
    out = run_json(capsys, str(LLAMA), "--prompt", "hello", "--chat", "--max-tokens", "1")
    assert out["prompt_token_ids"] == tok.encode_chat([{"role": "user", "content": "hello"}])
    assert tok.decode(out["prompt_token_ids"], skip_special_tokens=False).startswith(
        "<s><|im_start|>user\nhello"
    )


def test_a_stop_string_cuts_the_text_and_reports_stop(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = reference("llama-gqa-f32")["prompts"][0]
    full = run_json(capsys, str(LLAMA), *greedy_args(prompt))
    text = full["text"]
    stop = text[10:13]
    cut = run_json(capsys, str(LLAMA), *greedy_args(prompt), "--stop", stop)
    assert cut["text"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"
    assert len(cut["token_ids"]) < len(full["token_ids"])


def test_several_stop_strings_may_come_before_the_model_dir(
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompt = reference("llama-gqa-f32")["prompts"][0]
    text = run_json(capsys, str(LLAMA), *greedy_args(prompt))["text"]
    stops = [text[20:22], text[8:11]]
    cut = run_json(capsys, "--stop", stops[0], "--stop", stops[1], str(LLAMA), *greedy_args(prompt))
    assert cut["text"] == text[: min(text.index(s) for s in stops)]


def test_logprobs_are_reported_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, str(LLAMA), "--prompt", "The", "--temperature", "0", "--max-tokens", "3",
        "--logprobs", "2",
    )  # fmt: skip
    assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"]
    assert all(len(lp["top_logprobs"]) == 2 for lp in out["logprobs"])


def test_without_model_dir_the_demo_model_is_used(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(triollm.demo, "default_model_dir", lambda: LLAMA, raising=False)
    prompt = reference("llama-gqa-f32")["prompts"][0]
    out = run_json(capsys, *greedy_args(prompt))
    assert out["token_ids"] == prompt["greedy_ids"]


def test_without_model_dir_or_demo_model_the_message_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A trimmed install: the package data is not there.
    monkeypatch.setattr(triollm.demo, "default_model_dir", lambda: tmp_path / "model")
    assert main(["generate", "--prompt", "hi"]) == 2
    assert "no MODEL_DIR given" in capsys.readouterr().err


# -- user mistakes: one line, exit 2, no traceback --------------------------------------


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr


def test_a_missing_model_directory_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(cli(str(tmp_path / "nope"), "--prompt", "hi"), "nope")


def test_a_broken_config_names_the_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(LLAMA, model)
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    assert_one_line_error(cli(str(model), "--prompt", "hi"), "config.json")


def test_a_broken_tokenizer_config_names_the_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(LLAMA, model)
    (model / "tokenizer_config.json").write_text("{not json")
    assert_one_line_error(cli(str(model), "--prompt", "hi"), "tokenizer_config.json")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt", "hi", "--temperature", "3"], "--temperature"),
        (["--prompt", "hi", "--top-p", "0"], "--top-p"),
        (["--prompt", "hi", "--top-k", "-2"], "--top-k"),
        (["--prompt-ids", "1,x"], "--prompt-ids"),
        (["--prompt-ids", "1,99999"], "--prompt-ids"),
        (["--prompt-ids", "1,2", "--chat"], "--chat"),
        (["--prompt", "hi", "--max-tokens", "100000"], "--max-tokens"),
        (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["--prompt", "hi", "--stop", ""], "--stop"),
        (["--prompt", "hi", "--context", "1"], "--context"),
        (["--prompt", "hi", "--context", "100000"], "--context"),
        (["--prompt", "hi", "--context", "0"], "--context: context_tokens must be >= 2"),
        (["--prompt", "hi", "--context", "-4"], "--context: context_tokens must be >= 2"),
        (["--prompt", "hi", "--context", "16", "--max-tokens", "20"], "--max-tokens"),
        (["--prompt-ids", ",".join(["5"] * 600)], "prompt (600 tokens)"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", str(LLAMA), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


# -- stop strings ---------------------------------------------------------------------------


def test_a_stop_string_completed_by_the_detokenizers_tail_finishes_with_stop(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last text of a sequence comes from ``flush()`` (held-back bytes); a stop
    string completed there cuts the text and makes the finish reason "stop", not
    the generation's own "length"."""
    import argparse

    import triollm.model.tokenizer as tokenizer_module
    from triollm.generate import _drive
    from triollm.plan import FinishReason, SampledToken

    class HoldingDetok:  # everything is held back until the end, like half a character
        def __init__(self, tok: Any, prompt_ids: Any) -> None:
            pass

        def push(self, token_id: int) -> str:
            return ""

        def flush(self) -> str:
            return "abcEND tail"

    class Generation:
        finish_reason = FinishReason.LENGTH

        def __enter__(self) -> Generation:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def __iter__(self) -> Any:
            return iter([SampledToken(0, 7), SampledToken(0, 8)])

    monkeypatch.setattr(tokenizer_module, "IncrementalDetokenizer", HoldingDetok)
    args = argparse.Namespace(json=True)
    spec = GenerationSpec([1], SamplingParams(), stop=("END",))
    assert _drive(Generation(), args, None, spec, 0.0) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "abc"
    assert out["finish_reason"] == "stop"
