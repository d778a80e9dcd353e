"""One bad request must not cost anyone else: a token id the tokenizer knows but the
model does not (an added token past config.vocab_size) is refused at the door."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio
from serverkit import MODEL_DIR, StepGate, live_server, raw_post, read_until

from triollm.outcomes import EndCode

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


async def test_past_the_door_the_batch_refuses_only_the_poisoned_request(tmp_path):
    """Second line of defence: with the door's check off, the id reaches Batch.run,
    which refuses that sequence by name before the forward pass; the stream that
    shares its steps completes."""
    from triollm.model.loader import load_model

    loaded = load_model(model_with_an_added_token(tmp_path))
    vocab = loaded.config.vocab_size
    async with live_server(loaded) as live:
        live.stack.served.model_vocab_size = None  # the door trusts the tokenizer (401 ids)
        gate = StepGate(live.service)
        body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
        running = await raw_post(live.port, "/v1/completions", body)
        await live.service.wait_until(lambda: gate.parked)
        gate.allow(1)  # the stream is decoding when the poisoned request arrives

        async def poisoned(out: list[httpx.Response]) -> None:
            out.append(
                await post(live.url + "/v1/completions", {"prompt": [5, vocab], "max_tokens": 3})
            )

        out: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poisoned, out)
            await live.service.wait_until(lambda: live.service.live_requests == 2)
            gate.open()
        assert out[0].status_code == 500
        assert out[0].json()["error"]["code"] == "internal"
        assert str(vocab) in out[0].json()["error"]["message"]
        buf = bytearray()
        assert await read_until(running, b"data: [DONE]", buf)
        assert b'"finish_reason":"length"' in buf and b'"error"' not in buf
        await running.aclose()
        assert live.stack.metrics.rejection_count(EndCode.INTERNAL) == 1
