"""docs/performance.md's side-by-side section and its plots, from `bench_peers.py run`'s JSON.

    python tools/bench_peers.py tables [--results DIR]

reads ``DIR/engine.jsonl``, ``DIR/serve.jsonl`` and ``DIR/meta.json`` (default: the
latest run under ~/.cache/triollm/peers/results), prints the ratio tables, replaces
the text between the ``bench-peers`` markers in docs/performance.md and draws
docs/img/peers-serve.png and docs/img/peers-decode.png (matplotlib: the ``plots``
extra). Every figure in the tables is a median over the alternating rounds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from triollm.bench.compare import ENGINE_METRICS, SERVE_METRICS, ratio_table

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "performance.md"
IMG = REPO / "docs" / "img"
BEGIN = "<!-- bench-peers:begin (written by tools/bench_peers.py tables; edit the tool) -->"
END = "<!-- bench-peers:end -->"
BUSY_BEGIN = "<!-- bench-peers-busy:begin (written by tools/bench_peers.py tables) -->"
BUSY_END = "<!-- bench-peers-busy:end -->"

# SmolLM2-135M's shape (docs/performance.md, "The floor"): the weights a decode step
# reads, and the K/V bytes one sequence reads per position of context (float32 K/V).
HIDDEN, INTER, LAYERS, KV_DIM, VOCAB = 576, 1536, 30, 192, 49152
WEIGHTS = LAYERS * (2 * HIDDEN * HIDDEN + 2 * KV_DIM * HIDDEN + 3 * INTER * HIDDEN) + VOCAB * HIDDEN
KV_BYTES_PER_POSITION = LAYERS * KV_DIM * 4 * 2
COLORS = {"32-bit": "tab:blue", "16-bit": "tab:orange"}


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _loads(records: list[dict[str, Any]]) -> str:
    vals = [r["load_avg"][0] for r in records if r.get("load_avg")]
    vals += [r["machine"]["load_avg"][0] for r in records if r.get("machine")]
    vals += [r["load_avg_end"][0] for r in records if r.get("load_avg_end")]
    return f"{min(vals):.1f}-{max(vals):.1f}" if vals else "n/a"


def engine_section(engine: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    if not engine:
        return []
    new = meta.get("new_tokens", 128)
    out = [
        "### Engine: `bench_engine.py` vs `llama-batched-bench` / `llama-bench`",
        "",
        f"Decode: a 32-token prompt then {new} tokens per sequence (llama.cpp's S_TG; "
        f"bench-engine's ragged steps at the same mean context, {32 + new // 2}, on random "
        "weights of "
        "the same shape: the speed of a step does not depend on the values)."
        + (
            " Prefill: one 512-token prompt (`llama-bench -p 512 -n 0`)."
            if any(r.get("step") == "prefill" for r in engine)
            else ""
        ),
        "",
    ]
    for width in ("32-bit", "16-bit"):
        ours = [r for r in engine if r["system"] == "triollm" and r["row"].endswith(width)]
        peer = [r for r in engine if r["system"] == "llama.cpp" and r["row"].endswith(width)]
        if not ours or not peer:
            continue
        names = f"triollm {ours[0]['dtype']} vs llama.cpp {peer[0]['dtype']}"
        out += [f"**{width} weights ({names}), tok/s, load average {_loads(ours + peer)}**", ""]
        out += [ratio_table(ours, peer, ENGINE_METRICS, ours_name="triollm", peer_name="llama.cpp")]
        out += [""]
    return out


def serve_section(serve: list[dict[str, Any]]) -> list[str]:
    if not serve:
        return []
    out = [
        "### Server: `triollm serve --slots 16` vs `llama-server -np 16 -cb`",
        "",
        "`triollm bench serve --concurrency 1,4,8,16 --requests-per-stream 2 "
        "--prompt-tokens 32 --max-tokens 128` against each (token-id prompts, streaming, "
        "ignore_eos), SmolLM2-135M-Instruct, 512 positions per slot on both.",
        "",
    ]
    for width in ("32-bit", "16-bit"):
        ours = [r for r in serve if r["system"] == "triollm" and r.get("weights") == width]
        peer = [r for r in serve if r["system"] == "llama.cpp" and r.get("weights") == width]
        if not ours or not peer:
            continue
        names = f"`triollm serve` {ours[0]['dtype']} vs `llama-server` {peer[0]['dtype']}"
        out += [f"**{width} weights ({names}), load average {_loads(ours + peer)}**", ""]
        out += [ratio_table(ours, peer, SERVE_METRICS, ours_name="triollm", peer_name="llama")]
        bad = [
            f"{r['system']} {r['row']} round {r['round']}: {r['by_outcome']} {r['problems']}"
            for r in ours + peer
            if r["ok"] != r["requests"] or r["problems"]
        ]
        out += ["", "Requests not completed cleanly: " + ("; ".join(bad) if bad else "none."), ""]
    return out


def busy_section(busy: list[dict[str, Any]]) -> list[str]:
    """Decode tok/s quiet and with one core taken, and how far each system falls."""
    if not busy:
        return []
    out = [
        "### A busy machine: one core taken by a competing process",
        "",
        "The decode runs of the side-by-side section (`--parts busy`), each round quiet "
        f"and then with `python -c '{busy[0]['competitor']}'` spinning beside it for the "
        "whole run. The fall is "
        "quiet / busy tok/s (1.00x: no loss; 2.00x: half the speed); the last column is "
        "triollm's fall / llama.cpp's (at or below 1.00x: triollm falls no further).",
        "",
        "| weights | batch | triollm quiet | triollm busy | triollm fall "
        "| llama.cpp quiet | llama.cpp busy | llama.cpp fall | fall ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for width in ("32-bit", "16-bit"):
        for batch in sorted({r["batch"] for r in busy}):

            def tok_s(system: str, b: int, width: str = width, batch: int = batch) -> float | None:
                return _med(
                    [
                        r["tok_s"]
                        for r in busy
                        if r["system"] == system
                        and r["busy"] == b
                        and r["batch"] == batch
                        and r["row"].endswith(width)
                        and r.get("step", "decode") == "decode"
                    ]
                )

            ours = (tok_s("triollm", 0), tok_s("triollm", 1))
            peer = (tok_s("llama.cpp", 0), tok_s("llama.cpp", 1))
            if None in ours or None in peer:
                continue
            fall_ours, fall_peer = ours[0] / ours[1], peer[0] / peer[1]
            out.append(
                f"| {width} | {batch} | {ours[0]:.1f} | {ours[1]:.1f} | {fall_ours:.2f}x "
                f"| {peer[0]:.1f} | {peer[1]:.1f} | {fall_peer:.2f}x "
                f"| {fall_ours / fall_peer:.2f}x |"
            )
    out += ["", f"Load average over these runs: {_loads(busy)}.", ""]
    return out


def _header(
    meta: dict[str, Any], records: list[dict[str, Any]], results: Path, bw: float | None
) -> str:
    rounds = sorted({r["round"] for r in records if "round" in r})
    end = meta.get("date_end") or max((r.get("date", "") for r in records), default="?")
    return (
        f"Command: `{meta.get('command') or 'python tools/bench_peers.py run'}` then "
        f"`python tools/bench_peers.py tables`, "
        f"{meta['date']} to {end}; {len(rounds)} of {meta['rounds']} round(s) completed. Machine: "
        f"{meta['cpu']}, {meta['cores']} cores"
        + (
            f", measured bandwidth {bw:.1f} GB/s (bench-engine's streaming read, median of "
            "the rounds' best)"
            if bw
            else ""
        )
        + (
            f", sgemm {meta['sgemm_gflops']:.0f} GFLOP/s at the start"
            if meta.get("sgemm_gflops")
            else ""
        )
        + f"; load average {meta['load_avg_start'][0]:.1f} at the start, "
        f"{_loads(records)} over the measurements (1-minute figures at each one's start and "
        "end: the machine was shared). Every system gets 2 threads; ratios are "
        "triollm / llama.cpp, medians over the rounds (for latencies, below "
        "1.00x is triollm faster). Results: `~/.cache/triollm/peers/results/"
        f"{results.name}/`."
    )


def _replace(text: str, begin: str, end: str, section: str, heading: str) -> str:
    """``text`` with the part between the markers replaced (appended under ``heading``)."""
    if begin in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        return head + section + tail
    return text.rstrip("\n") + f"\n\n{heading}\n\n" + section + "\n"


def write_report(results: Path) -> None:
    """Rewrite the section of each part the run measured; a run of one part leaves the
    other section alone (the busy-machine comparison is a run of its own)."""
    engine, serve = read(results / "engine.jsonl"), read(results / "serve.jsonl")
    busy = read(results / "busy.jsonl")
    meta = json.loads((results / "meta.json").read_text())
    text = DOC.read_text()
    if engine or serve:
        bw = _med([r["bandwidth_gbs"] for r in engine if r.get("bandwidth_gbs")])
        drawn = plots(engine, serve, meta, bw)
        lines = [
            BEGIN,
            "",
            _header(meta, engine + serve, results, bw),
            "",
            *engine_section(engine, meta),
            *serve_section(serve),
            *[f"![{alt}](img/{name})\n" for name, alt in drawn],
            END,
        ]
        print("\n".join(lines))
        text = _replace(text, BEGIN, END, "\n".join(lines), "## Side by side with llama.cpp")
    if busy:
        bw = _med([r["bandwidth_gbs"] for r in busy if r.get("bandwidth_gbs")])
        lines = [
            BUSY_BEGIN,
            "",
            _header(meta, busy, results, bw),
            "",
            *busy_section(busy),
            BUSY_END,
        ]
        print("\n".join(lines))
        text = _replace(text, BUSY_BEGIN, BUSY_END, "\n".join(lines), "## On a busy machine")
    DOC.write_text(text)


def _series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts: dict[float, list[float]] = {}
    for r in records:
        v: Any = r
        for part in y.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is not None and r.get(x) is not None:
            pts.setdefault(r[x], []).append(v)
    xs = sorted(pts)
    return xs, [statistics.median(pts[k]) for k in xs]


def plots(
    engine: list[dict], serve: list[dict], meta: dict, bw: float | None
) -> list[tuple[str, str]]:
    """Draw what the results hold; (file name, alt text) of each picture drawn."""
    drawn: list[tuple[str, str]] = []
    try:
        import matplotlib
    except ImportError:
        print("(no plots: matplotlib is in the `plots` extra)")
        return drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    styles = {"triollm": "-o", "llama.cpp": "--s"}  # colour = weight width, line = system
    if serve:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
        for system in ("triollm", "llama.cpp"):
            for width in ("32-bit", "16-bit"):
                rs = [r for r in serve if r["system"] == system and r.get("weights") == width]
                if not rs:
                    continue
                label = f"{system} {rs[0]['dtype']}"
                kw = {"color": COLORS[width], "label": label}
                a.plot(*_series(rs, "concurrency", "aggregate_tok_s"), styles[system], **kw)
                b.plot(*_series(rs, "concurrency", "ttft_ms.p50"), styles[system], **kw)
        a.set(
            xlabel="concurrent streams",
            ylabel="aggregate output tok/s",
            xscale="log",
            title="throughput",
        )
        b.set(
            xlabel="concurrent streams",
            ylabel="TTFT p50 (ms)",
            xscale="log",
            yscale="log",
            title="time to first token",
        )
        for ax in (a, b):
            ax.set_xticks([1, 4, 8, 16], ["1", "4", "8", "16"])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"SmolLM2-135M, 32-token prompts, 128 tokens, 2 threads, {meta['date'][:10]}")
        fig.tight_layout()
        fig.savefig(IMG / "peers-serve.png", dpi=110)
        plt.close(fig)
        drawn.append(("peers-serve.png", "aggregate tok/s and TTFT p50 against concurrency"))
    if engine:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for system in ("triollm", "llama.cpp"):
            for width in ("32-bit", "16-bit"):
                rs = [
                    r
                    for r in engine
                    if r["system"] == system
                    and r.get("step") == "decode"
                    and r["row"].endswith(width)
                ]
                if rs:
                    ax.plot(
                        *_series(rs, "batch", "tok_s"),
                        styles[system],
                        color=COLORS[width],
                        label=f"{system} {rs[0]['dtype']}",
                    )
        batches = [1, 2, 4, 8, 12, 16]
        context = 32 + meta.get("new_tokens", 128) // 2
        if bw:
            present = {r["row"].rsplit(" ", 1)[-1] for r in engine}
            for width, bytes_per in (("32-bit", 4), ("16-bit", 2)):
                if width not in present:
                    continue
                w = WEIGHTS * bytes_per
                floor = [
                    b / ((w + b * KV_BYTES_PER_POSITION * context) / (bw * 1e9)) for b in batches
                ]
                ax.plot(
                    batches,
                    floor,
                    ":",
                    color=COLORS[width],
                    label=f"bandwidth bound {width}, (W + B·A)/β, β={bw:.0f} GB/s",
                )
        sgemm = meta.get("sgemm_gflops")
        if sgemm:
            ax.axhline(
                sgemm * 1e9 / (2 * WEIGHTS),
                color="gray",
                ls="-.",
                lw=1,
                label=f"arithmetic ceiling: the run's measured sgemm, {sgemm:.0f} GFLOP/s, "
                "/ 2 FLOP per weight",
            )
        ax.set(
            xlabel="batch (sequences decoding together)",
            ylabel="decode tok/s",
            xscale="log",
            yscale="log",
            title="decode throughput against the bounds",
        )
        ax.set_xticks([1, 4, 8, 16], ["1", "4", "8", "16"])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(IMG / "peers-decode.png", dpi=110)
        plt.close(fig)
        drawn.append(("peers-decode.png", "decode tok/s against batch, with the two bounds"))
    return drawn
