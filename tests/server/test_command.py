"""``triollm serve``: flags refused with reasons, the memory arithmetic, SIGTERM exits 0."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
from serverkit import MODEL_DIR, MODEL_ID, stack_for

from triollm import cli
from triollm.errors import UserError
from triollm.model.kvstore import DEFAULT_KV_DTYPE, KVDtype, kv_bytes_per_position
from triollm.policies import Policy
from triollm.server.command import parse_policy, parse_size, row_weights
from triollm.sizing import DEFAULT_KV_MEMORY_BYTES


def run_cli(*args: str) -> int:
    return cli.main(["serve", *args])


def test_a_non_loopback_bind_needs_public(capsys):
    assert run_cli(str(MODEL_DIR), "--host", "0.0.0.0") == 2
    err = capsys.readouterr().err
    assert "--public" in err and "no authentication" in err


@pytest.mark.parametrize("policy", [Policy.STATIC, Policy.FREE_SLOT])
def test_teaching_policies_are_refused_with_the_reason(loaded, policy, capsys):
    with pytest.raises(UserError, match="teaching only"):
        stack_for(loaded, policy=policy)
    assert run_cli(str(MODEL_DIR), "--policy", policy.value) == 2
    assert "teaching only" in capsys.readouterr().err


def test_a_users_policy_is_served_only_if_it_claims_no_deadlock(loaded, tmp_path, capsys):
    spec = "triollm.policy_examples.priority:PriorityWithAging"
    mine = parse_policy(spec)
    assert mine.name == "priority"
    stack = stack_for(loaded, policy=mine)
    assert stack.service.scheduler.policy is mine
    assert "policy priority" in "\n".join(stack.report.lines)
    f = tmp_path / "hopeful.py"
    f.write_text(
        "from triollm.policies import FreeSlot\nclass Hopeful(FreeSlot):\n    name = 'hopeful'\n"
    )
    with pytest.raises(UserError, match="does not claim no-deadlock") as err:
        parse_policy(f"{f}:Hopeful")
    assert "triollm check-policy" in str(err.value)
    assert run_cli(str(MODEL_DIR), "--policy", "no_such_module:Mine") == 2
    assert "cannot import no_such_module" in capsys.readouterr().err


def test_an_unknown_policy_and_bad_numbers_are_refused(loaded, capsys):
    assert run_cli(str(MODEL_DIR), "--policy", "fastest") == 2
    assert "reserve or preempt" in capsys.readouterr().err
    with pytest.raises(UserError, match="--step-rows") as info:
        stack_for(loaded, slots=8, step_rows=4)
    assert "step_rows" not in str(info.value) and "--slots" in str(info.value)
    for field, flag, kwargs in (
        ("num_blocks", "--kv-blocks", {"num_blocks": 0}),
        ("slots ", "--slots", {"slots": 0}),
        ("block_size", "--block-size", {"block_size": 0}),
        ("chunk_tokens", "--chunk", {"chunk_tokens": 0}),
    ):
        with pytest.raises(UserError, match=flag) as info:
            stack_for(loaded, **kwargs)
        assert not str(info.value).startswith(field)
    with pytest.raises(UserError, match="max_position_embeddings"):
        stack_for(loaded, context_tokens=10**6)
    with pytest.raises(UserError, match="holds no block") as info:
        stack_for(loaded, kv_memory_bytes=100)
    assert "--kv-memory" in str(info.value)


@pytest.mark.parametrize(
    ("field", "flag", "value"),
    [
        ("queue_wait_s", "--queue-wait", "-1"),
        ("max_tokens_default", "--max-tokens-default", "0"),
        ("stream_buffer_steps", "--stream-buffer", "0"),
        ("queue_depth_per_slot", "--queue-depth-per-slot", "0"),
    ],
)
def test_a_bad_queue_knob_is_refused_naming_the_flag_before_the_model_loads(
    field, flag, value, capsys, tmp_path
):
    # tmp_path holds no model: the flag is refused before anything is loaded.
    assert run_cli(str(tmp_path), flag, value) == 2
    err = capsys.readouterr().err
    assert flag in err and field not in err


def test_sizes():
    assert parse_size("256MiB") == 256 * 1024**2
    assert parse_size("2G") == 2 * 1024**3
    assert parse_size("1048576") == 1048576
    with pytest.raises(UserError):
        parse_size("lots")


def test_the_startup_report_is_the_memory_arithmetic(loaded):
    stack = stack_for(loaded, slots=2, block_size=16, context_tokens=128, kv_memory_bytes=2**20)
    per_position = kv_bytes_per_position(loaded.config, DEFAULT_KV_DTYPE)
    blocks = 2**20 // (per_position * 16)
    text = stack.report.describe()
    assert f"{per_position} bytes per position ({DEFAULT_KV_DTYPE.value} K+V" in text
    assert f"pool: {blocks} blocks x 16 positions = {blocks * 16} positions" in text
    assert f"prompt + max_tokens <= {min(128, blocks * 16)} positions" in text
    assert stack.service.scheduler.config.num_blocks == blocks
    # the budget follows the element type: a q8_0 cache fits about twice the f16 blocks
    q8 = stack_for(
        loaded,
        slots=2,
        block_size=16,
        context_tokens=128,
        kv_memory_bytes=2**20,
        kv_dtype=KVDtype.Q8_0,
    )
    q8_position = kv_bytes_per_position(loaded.config, KVDtype.Q8_0)
    assert q8.service.scheduler.config.num_blocks == 2**20 // (q8_position * 16)
    assert f"{q8_position} bytes per position (q8_0 K+V" in q8.report.describe()


def test_a_missing_model_directory_is_one_clear_line(capsys, tmp_path):
    assert run_cli(str(tmp_path / "nope")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("triollm:") and "nope" in err and "\n" not in err


def test_without_a_model_dir_or_the_demo_data_serve_says_so_in_one_line(
    capsys, tmp_path, monkeypatch
):
    import triollm.demo

    monkeypatch.setattr(triollm.demo, "default_model_dir", lambda: tmp_path / "model")
    assert run_cli() == 2
    err = capsys.readouterr().err.strip()
    assert "no MODEL_DIR given" in err and "\n" not in err


@pytest.mark.slow
def test_sigterm_drains_and_exits_zero():
    proc = subprocess.Popen(
        [sys.executable, "-m", "triollm.cli", "serve", str(MODEL_DIR), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        url = None
        assert proc.stderr is not None
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
        reader.start()
        seen: list[str] = []
        deadline = time.monotonic() + 120  # a hang guard for a server that never starts
        while url is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if not reader.is_alive():
                    break  # the process died: the assert below shows what it said
                continue
            seen.append(line)
            if "(ready)" in line:
                url = line.split(" on ")[1].split(" ")[0]
        assert url, "the server never said it was ready:\n" + "".join(seen)
        body = json.dumps(
            {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(
            url + "/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=10)
        rest = "".join(seen) + "".join(lines.get() for _ in range(lines.qsize()))
        assert "shut down cleanly" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_long_context_model_gets_its_context_a_bounded_pool_and_a_pool_too_big_is_a_user_error(
    loaded,
):
    from dataclasses import replace

    long = replace(loaded, config=replace(loaded.config, max_position_embeddings=1 << 24))
    stack = stack_for(long, slots=2)
    assert stack.report.scheduler.context_tokens == 1 << 24  # the model's own
    per_position = stack.report.kv_bytes_per_position
    assert stack.report.pool_positions * per_position <= DEFAULT_KV_MEMORY_BYTES
    assert "whole contexts" in stack.report.describe()
    with pytest.raises(UserError, match="--kv-memory") as info:
        stack_for(loaded, num_blocks=10**12)
    assert "GiB" in str(info.value) and "--context" in str(info.value)


def test_a_port_in_use_is_one_line_and_a_nonzero_exit(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_cli(str(MODEL_DIR), "--port", str(port)) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert "Traceback" not in err and "ExceptionGroup" not in err


@pytest.mark.parametrize("flag", ["--write-timeout", "--grace"])
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_timeout_or_grace_is_refused_naming_the_flag(capsys, flag, value):
    assert run_cli(str(MODEL_DIR), flag, value) == 2
    err = capsys.readouterr().err
    assert flag in err and ">= 0" in err


@pytest.mark.parametrize("context", [0, -5])
def test_a_zero_or_negative_context_is_refused_naming_the_flag(loaded, context):
    # `--context 0` used to mean "the default" (an `or` where `is None` belongs).
    with pytest.raises(UserError, match="--context must be >= 2") as info:
        stack_for(loaded, context_tokens=context)
    assert "context_tokens" not in str(info.value)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--context", "0"], "--context must be >= 2"),
        (["--kv-blocks", "0"], "--kv-blocks"),
        (["--kv-memory", "0"], "--kv-memory"),
        (["--kv-memory", ""], "--kv-memory: cannot read ''"),
        (["--step-rows", "0"], "--step-rows"),
        (["--chunk", "-1"], "--chunk"),
        (["--slots", "0"], "--slots"),
        (["--block-size", "0"], "--block-size"),
        (["--max-tokens-default", "-3"], "--max-tokens-default"),
        (["--model-name", ""], "--model-name must not be empty"),
        (["--model", ""], "must not be empty"),
    ],
)
def test_a_zero_or_empty_flag_never_silently_means_its_default(flags, needle, capsys, monkeypatch):
    from triollm.server import command

    async def would_serve(*args: object) -> None:
        raise AssertionError(f"{flags} was accepted: the server would have started")

    monkeypatch.setattr(command, "_main", would_serve)  # a regression fails, never hangs
    model = [] if flags[0] == "--model" else [str(MODEL_DIR)]
    assert run_cli(*model, *flags) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_an_empty_api_key_refuses_to_start(capsys, monkeypatch):
    # It ran with no authentication and no word about it (issue 28, N10).
    assert run_cli(str(MODEL_DIR), "--api-key", "") == 2
    assert "API key is empty" in capsys.readouterr().err


def test_the_default_chunk_follows_the_models_weights(loaded):
    smollm2 = SimpleNamespace(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        moe=None,
    )
    assert row_weights(smollm2) == 106_168_320  # the model the 128 was measured on
    qwen = SimpleNamespace(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        moe=None,
    )
    assert row_weights(qwen) == 1_310_195_712
    # the tiny fixture keeps the measured 128; --chunk still wins over the default
    assert stack_for(loaded).service.scheduler.config.chunk_tokens == 128
    assert stack_for(loaded, chunk_tokens=48).service.scheduler.config.chunk_tokens == 48


def test_the_stall_budget_follows_the_model_and_the_flag_wins(loaded):
    from triollm.scheduler import serving_stall_rows
    from triollm.server.command import row_weights

    stack = stack_for(loaded)
    config = stack.service.scheduler.config
    derived = serving_stall_rows(row_weights(loaded.config), loaded.weight_bytes, 128)
    assert config.stall_rows == derived <= config.chunk_tokens
    assert f"{derived} rows a step while any sequence decodes" in stack.report.describe()
    assert stack_for(loaded, stall_rows=5).service.scheduler.config.stall_rows == 5
    with pytest.raises(UserError, match=r"--stall-rows \(64\) must be <= --chunk \(32\)"):
        stack_for(loaded, chunk_tokens=32, stall_rows=64)
