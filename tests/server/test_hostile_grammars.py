"""Hostile grammars, schemas, tools and prompts against a live server (issue 28, N1-N3).

bench/hostile.py's generator at sizes just past each limit: every probe gets a shaped
4xx naming its field (or a 200 for the legitimate shapes: a recursive tree, a wide
object), the server still answers /health, and a neighbour stream running beside
each probe gets its usual greedy text. Before the fixes the first probe killed the
process (SIGSEGV), so the server here runs in a subprocess-free trio run only because
the fixes hold; tests/model/test_grammar_limits.py is the crash test in a subprocess.

No timing is asserted beyond a liveness bound (bench/hostile.LIVENESS_S); the
neighbour's largest gap is printed, and the soak reports it at full size.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hostile
from loadkit import running_server


async def test_hostile_constraints_and_prompts_are_refused_by_name_and_the_neighbour_streams_on():
    async with running_server(slots=2) as stack:
        results = await hostile.run_all(stack.port, stack.served.id, full=False)
    out = io.StringIO()
    wrong = hostile.report(results, out)
    print(out.getvalue())
    assert wrong == [], out.getvalue()
    names = {r.probe.name for r in results}
    assert {"schema: $ref chain", "grammar: rule chain", "tools: $ref chain"} <= names
    assert {"prompt: empty messages", "schema: allOf of patterns"} <= names
    fields = {r.probe.name: (r.error or {}).get("param") for r in results}
    assert fields["schema: $ref chain"] == "response_format.json_schema.schema"
    assert fields["grammar: rule chain"] == "guided_grammar"
    assert fields["prompt: empty messages"] == "messages"
    # A chain whose pointers resolve only inside the forced call's grammar: found there.
    assert fields["tools: $ref chain"] == "tools"
    assert fields["tools: nested parameters"] == "tools[0].function.parameters"


async def test_a_large_body_is_parsed_off_the_event_loop(monkeypatch):
    # 20,000 empty messages (660 KB) took 0.3-0.7 s to parse, on the loop: every stream
    # froze meanwhile (the largest neighbour gap of the hostile probes).
    import threading

    import httpx
    import trio

    from triollm.server import app as app_module

    threads: list[str] = []
    parse = app_module.parse_chat

    def recording(raw: bytes) -> object:
        threads.append(threading.current_thread().name)
        return parse(raw)

    monkeypatch.setattr(app_module, "parse_chat", recording)
    async with running_server(slots=2) as stack:
        body = {
            "model": stack.served.id,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": ""}] * 3000,
        }
        url = f"http://127.0.0.1:{stack.port}/v1/chat/completions"
        r = await trio.to_thread.run_sync(lambda: httpx.post(url, json=body, timeout=60))
        assert r.status_code == 400
        small = body | {"messages": [{"role": "user", "content": "hi"}]}
        r = await trio.to_thread.run_sync(lambda: httpx.post(url, json=small, timeout=60))
        assert r.status_code == 200
    main = threading.main_thread().name
    assert threads[0] != main  # the large body: a worker thread
    assert threads[1] == main  # a small one: not worth a thread
