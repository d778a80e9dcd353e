"""docs/results.md's side-by-side section and its plots, from one or more `bench_peers.py run`s.

    python tools/bench_peers.py tables [--results DIR[,DIR...]] [--no-doc]

reads ``DIR/records.jsonl``, ``DIR/rounds.jsonl`` and ``DIR/meta.json`` (default: the
latest run under ~/.cache/triollm/peers/results), writes ``DIR/summary.json``, prints
the tables, replaces the text between the ``bench-peers`` markers in
docs/results.md and draws docs/img/peers-decode.png and docs/img/peers-serve.png
(matplotlib: the ``plots`` extra). Several runs (one model re-measured after a change,
the others from an earlier quiet run) give one part per run, each with its own header: its
date, command, load and triollm commit, so no figure is read as newer than it is; the plots
take each model from the last run that measured it. The section holds nothing but what the runs
measured: every ratio with its per-round values, busy rounds marked, the verdict
"not established" where the quiet rounds disagree (``triollm.bench.rounds``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from triollm.bench.compare import Metric
from triollm.bench.rounds import TABLE_HEAD, Summary, fmt, pair_rounds, table_row

REPO = Path(__file__).resolve().parents[1]
# The results page, apart from the teaching one (docs/performance.md explains what these
# figures measure; a reader should not scroll past dated runs to learn the floor).
DOC = REPO / "docs" / "results.md"
IMG = REPO / "docs" / "img"
BEGIN = "<!-- bench-peers:begin (written by tools/bench_peers.py tables; edit the tool) -->"
END = "<!-- bench-peers:end -->"

# docs/performance.md's long-context table (the teaching page keeps its own generated
# part: prefill and decode at depth against the bandwidth floor).
PERF = REPO / "docs" / "performance.md"
LONG_BEGIN = "<!-- long-context:begin (written by tools/bench_peers.py tables; edit the tool) -->"
LONG_END = "<!-- long-context:end -->"
# A cache of what a GGUF file's header says a decode step reads (opening 1 GB files
# with gguf.GGUFReader takes seconds each), keyed by name, size and mtime.
BYTES_CACHE = Path.home() / ".cache" / "triollm" / "peers" / "bytes-per-token.json"

ENGINE = (Metric("tok_s", "tok/s", True),)
SERVE = (
    Metric("aggregate_tok_s", "aggregate tok/s", True),
    Metric("ttft_ms.p50", "TTFT p50 ms", False),
    Metric("tpot_ms.p50", "TPOT p50 ms", False),
    Metric("itl_ms.p50", "ITL p50 ms", False),
    Metric("itl_ms.p99", "ITL p99 ms", False),
)
# Runs before the client timed tokens (no "itl_definition" in their lines) hold the
# gaps between text chunks under "itl_ms": a chunk could carry 2-3 tokens (a CJK
# character of byte tokens), so those rows are labelled as what they measured.
CHUNK_GAP_LABELS = {"ITL p50 ms": "chunk gap p50 ms", "ITL p99 ms": "chunk gap p99 ms"}
PART_TITLES = {
    "decode": "Decode (`llama-batched-bench` vs `bench_gguf.py --workload decode`)",
    "prefill": "Prefill (`llama-bench -p` vs `bench_gguf.py --workload prefill`)",
    "depth": "Decode after a long context (`llama-bench -d` vs `bench_gguf.py --workload depth`)",
    "serve": "Server (`llama-server` vs `triollm serve`, loaded by `triollm bench serve`)",
}


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _row_order(row: str) -> tuple:
    """decode b=1 < b=4 < b=16; c=1 < c=8; prefill 512 < 2048."""
    num = "".join(ch if ch.isdigit() else " " for ch in row).split()
    return (row.split(" ")[0].split("=")[0], [int(n) for n in num])


def summaries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per model, part, row and metric: the rounds paired (``rounds.Summary``)."""
    ok = [r for r in records if "error" not in r]
    busy = {(r["model"], r["part"], r["round"]) for r in ok if r.get("busy")}
    out = []
    keys = sorted({(r["model"], r["part"], r["row"]) for r in ok}, key=lambda k: k[:2])
    for key in keys:
        model, part, row = key
        for metric in SERVE if part == "serve" else ENGINE:
            side: dict[str, dict[int, float]] = {"triollm": {}, "llama.cpp": {}}
            for r in ok:
                if (r["model"], r["part"], r["row"]) == (model, part, row):
                    v = metric.of(r)
                    if v is not None and r["system"] in side:
                        side[r["system"]][r["round"]] = v
            rounds = pair_rounds(
                side["triollm"],
                side["llama.cpp"],
                {rnd for (m, p, rnd) in busy if (m, p) == (model, part)},
            )
            if rounds:
                s = Summary(rounds, metric.higher_is_better)
                label = metric.label
                rows_here = [r for r in ok if (r["model"], r["part"], r["row"]) == key]
                if label in CHUNK_GAP_LABELS and not all(
                    r.get("itl_definition") == "per token" for r in rows_here
                ):
                    label = CHUNK_GAP_LABELS[label]
                out.append({"model": model, "part": part, "row": row, "metric": label, "s": s})
    return out


def rejudge(
    records: list[dict[str, Any]], rounds: list[dict[str, Any]], threshold: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The busy marks judged again at ``threshold`` cores from the figures the guard
    recorded (before and during each round): a run's marks can be re-read at another
    threshold without measuring again; the header says which threshold was used."""
    busy: dict[tuple[str, str, int], bool] = {}
    new_rounds = []
    for r in rounds:
        b = max(r.get("others_cores_before", 0), r.get("others_cores_during", 0)) >= threshold
        for part in r.get("group", []):
            busy[(r["model"], part, r["round"])] = b
        new_rounds.append(r | {"busy": b})
    new_records = [
        r | {"busy": busy.get((r["model"], r.get("part", ""), r["round"]), r.get("busy"))}
        for r in records
    ]
    return new_records, new_rounds


def _part_table(entries: list[dict[str, Any]]) -> list[str]:
    lines = [TABLE_HEAD]
    for e in sorted(entries, key=lambda e: _row_order(e["row"])):
        label = e["row"] if e["metric"] == "tok/s" else f"{e['row']} {e['metric']}"
        if e["metric"] == "tok/s":
            label += " tok/s"
        lines.append(table_row(label, e["s"]))
    return lines


def _errors(records: list[dict[str, Any]], model: str) -> list[str]:
    bad = [r for r in records if r["model"] == model and "error" in r]
    failed = [r for r in records if r["model"] == model and r.get("part") == "serve" and "ok" in r]
    lines = [f"- round {r['round'] + 1}, {r['system']}: failed: `{r['error'][:300]}`" for r in bad]
    lines += [
        f"- round {r['round'] + 1}, {r['system']} {r['row']}: {r['ok']} of {r['requests']} "
        f"requests completed ({r['by_outcome']}, problems {r['problems']})"
        for r in failed
        if r["ok"] != r["requests"] or r.get("problems")
    ]
    return lines


def _commands(records: list[dict[str, Any]], model: str) -> list[str]:
    seen: dict[tuple[str, str], list[str]] = {}  # (system, command) -> its parts
    for r in records:
        if r["model"] != model or "error" in r:
            continue
        cmd = r.get("command") or r.get("server_command")
        parts = seen.setdefault((r["system"], cmd), []) if cmd else []
        if cmd and r["part"] not in parts:
            parts.append(r["part"])
    return [f"- {sys} {', '.join(parts)}: `{cmd}`" for (sys, cmd), parts in seen.items()]


def _header(
    meta: dict[str, Any], rounds: list[dict[str, Any]], results: Path, rejudged: float | None
) -> list[str]:
    n_busy = sum(1 for r in rounds if r["busy"])
    g = meta["guard"]
    judged = (
        f" The busy marks were judged again at {rejudged} cores from the guard's recorded "
        "figures (`tables --quiet-threshold`)."
        if rejudged is not None
        else ""
    )
    others = [r["others_cores_during"] for r in rounds]
    w = meta["workload"]
    return [
        f"Command: `{meta['command']}`, then `python tools/bench_peers.py tables`; "
        f"{meta['date']} to {meta.get('date_end', '(unfinished)')}. Machine: {meta['cpu']}, "
        f"{meta['cores']} cores"
        + (f"; triollm at commit `{meta['commit']}`" if meta.get("commit") else "")
        + (f", sgemm {meta['sgemm_gflops']:.0f} GFLOP/s" if meta.get("sgemm_gflops") else "")
        + f"; every system gets {w['threads']} threads. Results: "
        f"`~/.cache/triollm/peers/results/{results.name}/`.",
        "",
        f"Rounds: {meta['rounds']} per comparison, llama.cpp (A) then triollm (B) each "
        f"round; {len(rounds)} rounds run, {n_busy} marked busy. The guard waited before each "
        f"round until other processes used under {g['threshold_cores']} cores (at most "
        f"{g['max_wait_s']:.0f} s) and measured them again over the round"
        + (
            f" (they used {min(others):.2f}-{max(others):.2f} cores during the rounds)"
            if others
            else ""
        )
        + ". Children started without "
        + (", ".join(f"`{v}`" for v in meta["scrubbed_from_children"]) or "any threading variable")
        + (" (scrubbed from the harness's environment)" if meta["scrubbed_from_children"] else "")
        + f"; load average {meta['load_avg_start'][0]:.1f} at the start"
        + (f", {meta['load_avg_end'][0]:.1f} at the end." if meta.get("load_avg_end") else ".")
        + judged,
        "",
        f"Workload: decode {w['prompt']}-token prompts then {w['new']} tokens per sequence "
        f"at batch {', '.join(map(str, w['batches']))}; prefill of "
        f"{' and '.join(map(str, w['prefill']))} tokens; {w['depth_new']} tokens at batch 1 "
        f"after a {w['depth']}-token context; the servers at "
        f"{', '.join(map(str, w['concurrency']))} concurrent streams, {w['serve_requests']} "
        f"requests per level, {w['serve_prompt']}-token prompts, {w['serve_new']} tokens each "
        f"(ignore_eos), {max(w['concurrency'])} slots of {w['slot_context']} positions on both.",
        "",
        "Ratios are triollm / llama.cpp within one round; the ratio column is the median "
        "of the quiet rounds' ratios (for latencies, below 1.00x is triollm faster). A "
        "verdict names the faster system only when every quiet round agrees and there are "
        "at least 3 of them.",
    ]


def section(
    results: Path, threshold: float | None = None
) -> tuple[list[str], list[dict[str, Any]]]:
    """The markdown lines of the results section, and summary.json's content."""
    meta = json.loads((results / "meta.json").read_text())
    records = read(results / "records.jsonl")
    rounds = read(results / "rounds.jsonl")
    if threshold is not None:
        records, rounds = rejudge(records, rounds, threshold)
    entries = summaries(records)
    lines = [*_header(meta, rounds, results, threshold), ""]
    for model, info in meta["models"].items():
        mine = [e for e in entries if e["model"] == model]
        if not mine and not any(r["model"] == model for r in records):
            continue
        headline = " (the headline)" if model == "qwen1.5b" else ""
        lines += [f"### {info['title']}{headline}", "", f"Files: {info['pairing']}.", ""]
        for part in ("decode", "prefill", "depth", "serve"):
            es = [e for e in mine if e["part"] == part]
            if es:
                lines += [f"**{PART_TITLES[part]}**", "", *_part_table(es), ""]
        errors = _errors(records, model)
        if errors:
            lines += ["Failures in this run:", "", *errors, ""]
        lines += ["Commands (round 1):", "", *_commands(records, model), ""]
    summary = [{k: v for k, v in e.items() if k != "s"} | e["s"].as_json() for e in entries]
    return lines, summary


def write_report(runs: list[Path], *, doc: bool = True, threshold: float | None = None) -> None:
    body = [BEGIN, ""]
    for results in runs:
        lines, summary = section(results, threshold)
        (results / "summary.json").write_text(json.dumps(summary, indent=1))
        if len(runs) > 1:
            meta = json.loads((results / "meta.json").read_text())
            body += [f"### Run of {meta['date'][:16].replace('T', ' ')} UTC", ""]
        body += lines
    drawn = plots(runs, threshold) if doc else []
    if doc:
        write_long_context(runs, threshold)
        write_targets(runs, threshold)
    body += [*[f"![{alt}](img/{name})\n" for name, alt in drawn], END]
    print("\n".join(body))
    if doc:
        # a picture this run did not draw would show an older run's figures
        for stale in set(IMG.glob("peers-*.png")) - {IMG / name for name, _ in drawn}:
            stale.unlink()
        _replace_between(DOC, BEGIN, END, body)


def step_bytes(path: str) -> dict[str, int] | None:
    """What one decode step reads from a GGUF file: ``weights``, the bytes of every
    tensor the step multiplies (the token embedding counts only when the output head is
    tied to it: untied, a step reads one row of it), and ``kv_per_position``, the K and
    V bytes of one position over all layers in a 16-bit cache (both systems' default).
    None for a file that is not GGUF (the 16-bit SmolLM2 pairing reads an HF dir)."""
    f = Path(path)
    if f.suffix != ".gguf" or not f.exists():
        return None
    st = f.stat()
    key = f"{f.name}:{st.st_size}:{int(st.st_mtime)}"
    cache = json.loads(BYTES_CACHE.read_text()) if BYTES_CACHE.exists() else {}
    if key not in cache:
        import gguf

        reader = gguf.GGUFReader(f)
        sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
        tied = "output.weight" not in sizes
        weights = sum(n for name, n in sizes.items() if tied or name != "token_embd.weight")

        def field(name: str) -> int:
            fl = reader.fields[name]
            return int(fl.parts[fl.data[0]][0])

        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        heads = field(f"{arch}.attention.head_count")
        head_dim = (
            field(f"{arch}.attention.key_length")
            if f"{arch}.attention.key_length" in reader.fields
            else field(f"{arch}.embedding_length") // heads
        )
        kv = 2 * field(f"{arch}.block_count") * field(f"{arch}.attention.head_count_kv")
        cache[key] = {"weights": weights, "kv_per_position": kv * head_dim * 2}
        BYTES_CACHE.parent.mkdir(parents=True, exist_ok=True)
        BYTES_CACHE.write_text(json.dumps(cache, indent=1))
    return cache[key]


LONG_ROWS = ("decode b=1", "decode b=16", "prefill 512", "prefill 2048")


def _floor(row: str, rec: dict[str, Any], w: dict[str, Any], b: dict[str, int], gbps: float):
    """tok/s a row cannot exceed at ``gbps``: its tokens per step over the bytes a step
    reads (weights once, each sequence's K/V at its mean context). None for a prefill:
    a prompt's rows share each weight read, so arithmetic, not bytes, bounds it."""
    if rec["part"] == "depth":
        batch, ctx = 1, rec["depth"] + w["depth_new"] / 2
    elif rec["part"] == "decode":
        batch, ctx = rec["batch"], w["prompt"] + w["new"] / 2
    else:
        return None
    return batch * gbps * 1e9 / (b["weights"] + batch * ctx * b["kv_per_position"])


Rows = dict[tuple[str, str, str], tuple[dict[str, Any], list[dict[str, Any]]]]


def latest_rows(runs: list[Path], threshold: float | None = None) -> Rows:
    """Each (model, part, row) with the meta and records of the last run that measured
    that row: a run at depth 16384 leaves an earlier run's depth 4096 row in place."""
    latest: Rows = {}
    for results in runs:
        meta = json.loads((results / "meta.json").read_text())
        rs = [r for r in read(results / "records.jsonl") if "error" not in r]
        if threshold is not None:
            rs, _ = rejudge(rs, read(results / "rounds.jsonl"), threshold)
        for key in {(r["model"], r["part"], r["row"]) for r in rs}:
            latest[key] = (meta, [r for r in rs if (r["model"], r["part"], r["row"]) == key])
    return latest


def long_context(runs: list[Path], threshold: float | None = None) -> list[str]:
    """The lines between performance.md's long-context markers: for each model, the
    rows a long prompt or a long conversation lives on, each from the last run that
    measured that row (a run at depth 16384 leaves the 4096 row of an earlier run),
    against the floor of the run's own bandwidth probe."""
    latest = {
        key: v
        for key, v in latest_rows(runs, threshold).items()
        if key[1] == "depth" or key[2] in LONG_ROWS
    }
    lines = [
        "| model | row | triollm tok/s | llama.cpp tok/s | ratio | per round | floor tok/s "
        "| triollm of floor | llama.cpp of floor | run |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    parts = ("decode", "prefill", "depth")
    for model, part, row in sorted(
        latest,
        key=lambda k: (k[0] != "qwen1.5b", k[0], parts.index(k[1]), _row_order(k[2])),
    ):
        meta, rs = latest[(model, part, row)]
        gbps = meta.get("stream_gbps")
        b = step_bytes(meta["models"][model]["ours"])
        for e in summaries(rs):
            if e["metric"] != "tok/s":
                continue
            s = e["s"]
            fl = _floor(row, rs[0], meta["workload"], b, gbps) if b and gbps else None
            of = [
                "—" if fl is None or v is None else f"{100 * v / fl:.0f} %"
                for v in (s.ours, s.peer)
            ]
            ratio = "—" if s.ratio is None else f"{s.ratio:.2f}x"
            lines.append(
                f"| {meta['models'][model]['title']} | {row} | {fmt(s.ours)} | "
                f"{fmt(s.peer)} | {ratio} ({s.verdict}) | {s.per_round()} | "
                + ("—" if fl is None else f"{fl:.1f}")
                + f" | {of[0]} | {of[1]} | {meta['date'][:16].replace('T', ' ')}, "
                f"`{meta.get('commit', '?')}`, {gbps or '—'} GB/s |"
            )
    return [LONG_BEGIN, "", *lines, "", LONG_END]


# docs/results.md's table of the wave's targets (the int8 issue's and the long-context
# issue's, as they were written): each row judged from the last run that measured it.
TARGETS_BEGIN = "<!-- targets:begin (written by tools/bench_peers.py tables; edit the tool) -->"
TARGETS_END = "<!-- targets:end -->"
_B1 = "engine.md#the-steps-fixed-costs"
_INT8 = "engine.md#int8-activations-the-default-and-exact-activations"
_ATTN = "engine.md#attention-tiles-an-online-softmax-split-contexts"
_SERVE = "performance.md#the-server-path"
# (model, row, metric, the ratio triollm / llama.cpp must reach, where its cost is taken
# apart). For a latency (ms) the target is a ceiling: at most that ratio.
TARGETS: tuple[tuple[str, str, str, float, str], ...] = (
    *(
        t
        for m in ("qwen1.5b", "qwen0.5b")
        for t in (
            (m, "decode b=1", "tok/s", 1.3, _B1),
            (m, "decode b=16", "tok/s", 2.0, _INT8),
            (m, "prefill 512", "tok/s", 1.5, _INT8),
            (m, "prefill 2048", "tok/s", 1.5, _ATTN),
            (m, "decode after 4096", "tok/s", 1.3, _ATTN),
            (m, "decode after 16384", "tok/s", 1.3, _ATTN),
            (m, "c=1", "TTFT p50 ms", 1.0, _SERVE),
            (m, "c=1", "aggregate tok/s", 1.2, _SERVE),
            (m, "c=8", "aggregate tok/s", 1.5, _SERVE),
            (m, "c=8", "ITL p99 ms", 1.0, _SERVE),
        )
    ),
    *(
        t
        for m in ("smollm2-q8_0", "smollm2-q4_1")
        for t in (
            (m, "decode b=1", "tok/s", 1.2, _B1),
            (m, "decode b=16", "tok/s", 2.0, _INT8),
            (m, "prefill 512", "tok/s", 1.5, _INT8),
        )
    ),
    ("smollm2-q4_1", "c=1", "aggregate tok/s", 1.0, _SERVE),
    ("smollm2-16bit", "c=1", "aggregate tok/s", 1.0, _SERVE),
)


def target_status(s: Summary, target: float) -> str:
    """``met`` when the median of the quiet rounds reaches the target and every quiet
    round does; ``met by the median`` when some round fell short; else ``missed``. At
    least 3 quiet rounds, or nothing is judged."""
    ratios = [r.ratio for r in s.quiet if r.ratio is not None]
    if len(ratios) < 3 or s.ratio is None:
        return f"not judged: {len(ratios)} quiet round(s)"

    def ok(x: float) -> bool:
        return x >= target if s.higher_is_better else x <= target

    if not ok(s.ratio):
        return "**missed**"
    short = sum(not ok(x) for x in ratios)
    return "met" if not short else f"met by the median ({short} of {len(ratios)} rounds short)"


def targets(runs: list[Path], threshold: float | None = None) -> list[str]:
    """The lines between results.md's target markers: every target, its median ratio,
    rounds and status, from the last run that measured its row."""
    latest = latest_rows(runs, threshold)
    lines = [
        "| model | row | target | ratio (median) | per round | status | run "
        "| cost taken apart in |",
        "| --- | --- | ---: | ---: | --- | --- | --- | --- |",
    ]
    for model, row, metric, target, where in TARGETS:
        key = next((k for k in latest if k[0] == model and k[2] == row), None)
        meta, rs = latest[key] if key else ({}, [])
        entry = next((e for e in summaries(rs) if e["metric"] == metric), None)
        if key is None or entry is None:
            lines.append(f"| {model} | {row} {metric} | — | — | — | not measured | — | — |")
            continue
        title = meta["models"][model]["title"]
        s = entry["s"]
        sign = ">=" if s.higher_is_better else "<="
        lines.append(
            f"| {title} | {row} {metric} | {sign} {target:.1f}x | "
            + ("—" if s.ratio is None else f"{s.ratio:.2f}x")
            + f" | {s.per_round()} | {target_status(s, target)} | "
            f"{meta['date'][:16].replace('T', ' ')}, `{meta.get('commit', '?')}` | "
            f"[{where.split('#')[0]}]({where}) |"
        )
    return [TARGETS_BEGIN, "", *lines, "", TARGETS_END]


def write_targets(runs: list[Path], threshold: float | None = None) -> None:
    body = targets(runs, threshold)
    print("\n".join(body))
    _replace_between(DOC, TARGETS_BEGIN, TARGETS_END, body)


def write_long_context(runs: list[Path], threshold: float | None = None) -> None:
    body = long_context(runs, threshold)
    print("\n".join(body))
    _replace_between(PERF, LONG_BEGIN, LONG_END, body)


def _replace_between(doc: Path, begin: str, end: str, body: list[str]) -> None:
    """Put ``body`` (which starts with ``begin`` and ends with ``end``) where the markers
    are in ``doc``; the text around them is the page's own."""
    text = doc.read_text()
    if begin not in text:
        raise SystemExit(f"{doc} has no {begin!r} marker: put it where the table goes")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(head + "\n".join(body) + tail)


def merged(
    runs: list[Path], threshold: float | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One meta and one record list over several runs: each model's part comes from the
    last run that measured it (a re-measured part replaces its earlier figures)."""
    meta: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    for results in runs:
        m = json.loads((results / "meta.json").read_text())
        rs = read(results / "records.jsonl")
        if threshold is not None:
            rs, _ = rejudge(rs, read(results / "rounds.jsonl"), threshold)
        # a model's part re-measured replaces that part only (a depth-only run must not
        # take the model's decode rounds out of the plots)
        measured = {(r["model"], r["part"]) for r in rs}
        records = [r for r in records if (r["model"], r.get("part")) not in measured] + rs
        models = meta.get("models", {}) | {
            k: v for k, v in m["models"].items() if any(k == mk for mk, _ in measured)
        }
        meta = m | {"models": models}
    return meta, records


# the order of the pictures' panels: the headline first, then the files by size
_MODEL_ORDER = ("qwen1.5b", "qwen0.5b", "smollm2-q4_1", "smollm2-q8_0", "smollm2-16bit")


def _model_rank(model: str) -> tuple[int, str]:
    """A model key's place among the panels (an unknown key last, by name)."""
    return (_MODEL_ORDER.index(model) if model in _MODEL_ORDER else len(_MODEL_ORDER), model)


def plots(runs: list[Path], threshold: float | None = None) -> list[tuple[str, str]]:
    """Decode tok/s against batch per model and the headline's server; every round a
    dot, the median a line. (file name, alt text) of each picture drawn."""
    try:
        import matplotlib
    except ImportError:
        print("(no plots: matplotlib is in the `plots` extra)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    meta, records = merged(runs, threshold)
    records = [r for r in records if "error" not in r]
    IMG.mkdir(parents=True, exist_ok=True)
    drawn = []
    styles = {"triollm": ("-o", "tab:blue"), "llama.cpp": ("--s", "tab:red")}
    decode_models = sorted(
        (
            m
            for m in meta["models"]
            if any(r["model"] == m and r["part"] == "decode" for r in records)
        ),
        key=_model_rank,
    )
    if decode_models:
        fig, axes = plt.subplots(
            1, len(decode_models), figsize=(3.6 * len(decode_models), 3.8), squeeze=False
        )
        for ax, model in zip(axes[0], decode_models, strict=True):
            for system, (style, color) in styles.items():
                rs = [
                    r
                    for r in records
                    if r["model"] == model and r["part"] == "decode" and r["system"] == system
                ]
                if not rs:
                    continue
                xs = sorted({r["batch"] for r in rs})
                for r in rs:
                    ax.plot(
                        r["batch"],
                        r["tok_s"],
                        "x" if r.get("busy") else ".",
                        color=color,
                        alpha=0.5,
                    )
                meds = [statistics.median(r["tok_s"] for r in rs if r["batch"] == x) for x in xs]
                ax.plot(xs, meds, style, color=color, label=system)
            mine = [r for r in records if r["model"] == model and r["part"] == "decode"]
            title = meta["models"][model]["title"]
            if all(r.get("busy") for r in mine):
                title += "\n(busy rounds only: no verdict)"
            ax.set_title(title, fontsize=8)
            ax.set(xlabel="batch", xscale="log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xticks(
                meta["workload"]["batches"], [str(b) for b in meta["workload"]["batches"]]
            )
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("decode tok/s (dots: rounds, x: busy)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"decode, 2 threads, {meta['date'][:10]}", fontsize=10)
        fig.tight_layout()
        fig.savefig(IMG / "peers-decode.png", dpi=100)
        plt.close(fig)
        drawn.append(("peers-decode.png", "decode tok/s against batch, every round a dot"))
    serve_models = sorted(
        (
            m
            for m in meta["models"]
            if any(r["model"] == m and r["part"] == "serve" for r in records)
        ),
        key=_model_rank,
    )
    if serve_models:
        model = "qwen1.5b" if "qwen1.5b" in serve_models else serve_models[0]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
        for system, (style, color) in styles.items():
            rs = [
                r
                for r in records
                if r["model"] == model and r["part"] == "serve" and r["system"] == system
            ]
            if not rs:
                continue
            xs = sorted({r["concurrency"] for r in rs})
            for ax, key in ((a, "aggregate_tok_s"), (b, "ttft_ms")):
                vals = {x: [] for x in xs}
                for r in rs:
                    v = r[key]["p50"] if key == "ttft_ms" else r[key]
                    if v is not None:
                        vals[r["concurrency"]].append(v)
                        ax.plot(
                            r["concurrency"],
                            v,
                            "x" if r.get("busy") else ".",
                            color=color,
                            alpha=0.5,
                        )
                pts = [(x, statistics.median(v)) for x, v in vals.items() if v]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=system)
        a.set(xlabel="concurrent streams", ylabel="aggregate output tok/s", title="throughput")
        b.set(
            xlabel="concurrent streams",
            ylabel="TTFT p50 (ms)",
            yscale="log",
            title="time to first token",
        )
        for ax in (a, b):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{meta['models'][model]['title']}, server, {meta['date'][:10]}", fontsize=10)
        fig.tight_layout()
        fig.savefig(IMG / "peers-serve.png", dpi=100)
        plt.close(fig)
        drawn.append(("peers-serve.png", "server aggregate tok/s and TTFT p50 against streams"))
    return drawn
