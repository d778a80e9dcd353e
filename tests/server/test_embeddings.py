"""``POST /v1/embeddings``: pooled final hidden states, held to transformers.

On the Qwen3 fixture (Qwen3-Embedding's layout), the ``openai`` client's embeddings
(``float`` and its default ``base64``) are compared with transformers'
``last_hidden_state`` pooled the same way (the last token's row, or the mean of all)
and L2-normalized, which is what sentence-transformers computes for these models.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import trio
import trio.testing
from serverkit import live_server

from triollm.admission import QueueFull, QueueTimeout
from triollm.model.embed import Embedder, Pooling
from triollm.server.embeddings import EmbeddingQueue
from triollm.sizing import KVDtype

QWEN3 = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3-headdim-f16"
IDS = [
    [int(t) for t in np.random.default_rng(seed).integers(5, 390, n)]
    for seed, n in ((1, 9), (2, 40))
]
TOL = 1e-4
HANG_S = 60


@pytest.fixture(scope="module")
def qwen3():
    from triollm.model.loader import load_model

    return load_model(QWEN3)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(ids: list[int], pooling: Pooling) -> np.ndarray:
    torch = pytest.importorskip(
        "torch", reason="transformers' reference needs torch (fixtures extra)"
    )
    transformers = pytest.importorskip("transformers", reason="the fixtures extra is not installed")
    model = transformers.AutoModel.from_pretrained(QWEN3, torch_dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # (n, hidden) float32
    pooled = hidden[-1] if pooling is Pooling.LAST else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


@pytest.mark.parametrize("pooling", list(Pooling))
async def test_embeddings_match_transformers_pooled_the_same_way(qwen3, pooling):
    want = [reference(ids, pooling) for ids in IDS]
    async with live_server(qwen3, pooling=pooling, kv_dtype=KVDtype.F32) as live:
        c = client(live.url)
        floats = await trio.to_thread.run_sync(
            lambda: c.embeddings.create(model=QWEN3.name, input=IDS, encoding_format="float")
        )
        # The client's default asks for base64 and decodes it itself.
        decoded = await trio.to_thread.run_sync(
            lambda: c.embeddings.create(model=QWEN3.name, input=IDS)
        )
    assert [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == sum(len(ids) for ids in IDS)
    for got, again, expected in zip(floats.data, decoded.data, want, strict=True):
        np.testing.assert_allclose(got.embedding, expected, rtol=0, atol=TOL)
        np.testing.assert_allclose(again.embedding, got.embedding, rtol=0, atol=1e-7)


def test_a_text_in_small_chunks_pools_to_the_same_vector(qwen3):
    # The chunks exist so an embedding holds the model no longer than a prefill chunk:
    # cutting the text must not change the vector.
    for pooling in Pooling:
        whole = Embedder(qwen3.model, pooling=pooling, chunk_tokens=128).embed(IDS[1])
        cut = Embedder(qwen3.model, pooling=pooling, chunk_tokens=7).embed(IDS[1])
        np.testing.assert_allclose(cut, whole, rtol=0, atol=1e-5)
        assert abs(float(np.linalg.norm(whole)) - 1.0) < 1e-5


async def test_dimensions_gives_the_normalized_prefix_and_text_is_tokenized(qwen3):
    async with live_server(qwen3, kv_dtype=KVDtype.F32) as live:
        c = client(live.url)
        full = await trio.to_thread.run_sync(
            lambda: c.embeddings.create(
                model=QWEN3.name, input="Hello there", encoding_format="float"
            )
        )
        short = await trio.to_thread.run_sync(
            lambda: c.embeddings.create(
                model=QWEN3.name, input=["Hello there"], dimensions=16, encoding_format="float"
            )
        )
        async with httpx.AsyncClient(base_url=live.url) as http:
            ids = (await http.post("/tokenize", json={"prompt": "Hello there"})).json()["tokens"]
            by_ids = (await http.post("/v1/embeddings", json={"input": ids})).json()
    prefix = np.asarray(full.data[0].embedding[:16])
    np.testing.assert_allclose(short.data[0].embedding, prefix / np.linalg.norm(prefix), atol=1e-6)
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], full.data[0].embedding, atol=1e-7)
    assert full.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input[0]"),
        ({"input": ["a", 3]}, "input[1]"),
        ({"input": [[1, 10**6]]}, "input[0]"),  # past the vocabulary
        ({"input": [list(range(5, 300)) * 3]}, "input[0]"),  # past the context
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 65}, "dimensions"),  # the model's hidden size is 64
        ({"input": "hi", "model": "text-embedding-3-small"}, "model"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(qwen3, body, param):
    async with live_server(qwen3) as live, httpx.AsyncClient(base_url=live.url) as http:
        r = await http.post("/v1/embeddings", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


async def test_an_embeddings_flood_waits_in_a_bounded_queue_and_is_refused_past_it(
    loaded, monkeypatch
):
    """One embedding runs, ``queue_depth_per_slot`` (here 1) wait; the next is a 429 at
    once, as generation's queue answers, and the held ones finish once released."""
    entered, release = threading.Event(), threading.Event()
    embed = Embedder.embed

    def held(self, ids, dimensions=None):
        entered.set()
        release.wait(HANG_S)
        return embed(self, ids, dimensions)

    monkeypatch.setattr(Embedder, "embed", held)
    answers: dict[str, httpx.Response] = {}
    refused = trio.Event()
    async with live_server(loaded, queue_depth_per_slot=1) as live:

        async def send(name: str) -> None:
            answers[name] = await trio.to_thread.run_sync(
                lambda: httpx.post(live.url + "/v1/embeddings", json={"input": name}, timeout=60)
            )
            if answers[name].status_code == 429:
                refused.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, "first")
                await trio.to_thread.run_sync(entered.wait, HANG_S)
                nursery.start_soon(send, "second")  # these two arrive while the first runs:
                nursery.start_soon(send, "third")  # one waits, the other is refused at once
                with trio.fail_after(HANG_S):  # a hang guard, not a timing assertion
                    await refused.wait()
                release.set()
        finally:
            release.set()
    assert answers["first"].status_code == 200
    statuses = sorted(answers[k].status_code for k in ("second", "third"))
    assert statuses == [200, 429]
    no = next(r for r in answers.values() if r.status_code == 429)
    assert no.headers["Retry-After"] == "30" and no.json()["error"]["code"] == "queue_full"


async def test_a_wait_past_the_budget_is_a_queue_timeout(autojump_clock):
    queue = EmbeddingQueue(max_waiters=1, wait_s=5)
    done = trio.Event()

    async def hold() -> None:
        async with queue.place():
            await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueTimeout):
            async with queue.place():
                pass  # pragma: no cover (never admitted)
        assert queue.waiting == 0  # the place was given back
        nursery.start_soon(_enter, queue)  # one waits behind the holder ...
        await trio.testing.wait_all_tasks_blocked()
        assert queue.waiting == 1
        with pytest.raises(QueueFull):  # ... so the next is refused at once
            async with queue.place():
                pass  # pragma: no cover
        done.set()


async def _enter(queue: EmbeddingQueue) -> None:
    async with queue.place():
        pass
