"""One bad request must not cost anyone else: a token id the tokenizer knows but the
model does not (an added token past config.vocab_size) is refused at the door."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio
from serverkit import MODEL_DIR, StepGate, live_server, raw_post, read_until

EXTRA = "<|extra|>"


def model_with_an_added_token(tmp_path: Path) -> Path:
    """The fixture checkpoint whose tokenizer has one added token, id == vocab_size."""
    out = tmp_path / "model"
    out.mkdir()
    for f in MODEL_DIR.iterdir():
        if f.name != "tokenizer.json":
            (out / f.name).symlink_to(f)
    tok = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    vocab = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    tok["added_tokens"].append(
        {
            "id": vocab,
            "content": EXTRA,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


async def post(url: str, body: dict) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.post(url, json=body, timeout=30))


async def test_an_added_token_past_the_models_vocab_is_refused_and_the_stream_runs_on(tmp_path):
    from triollm.model.loader import load_model

    loaded = load_model(model_with_an_added_token(tmp_path))
    vocab = loaded.config.vocab_size
    assert loaded.tokenizer.vocab_size == vocab + 1  # the copy really has the extra id
    async with live_server(loaded) as live:
        gate = StepGate(live.service)
        body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
        running = await raw_post(live.port, "/v1/completions", body)
        await live.service.wait_until(lambda: gate.parked)
        url = live.url + "/v1/completions"
        for poisoned in (
            {"prompt": [5, vocab], "max_tokens": 3},
            {"prompt": f"a {EXTRA} b", "max_tokens": 3},
        ):
            r = await post(url, poisoned)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "prompt" and str(vocab) in err["message"]
        gate.open()
        buf = bytearray()
        assert await read_until(running, b"data: [DONE]", buf)
        assert b'"finish_reason":"length"' in buf
        await running.aclose()
