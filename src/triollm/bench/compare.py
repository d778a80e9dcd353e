"""Side-by-side ratios of two result files (ours / the peer's), per matching row.

Both ``triollm bench serve --json`` and ``bench/bench_engine.py --json`` write one
JSON object per line with a ``row`` (what was measured: ``"c=4"``,
``"decode b=16 16-bit"``) and a ``system``. Rows match by ``row``. Engine rows name
the weight *width*, not the format: bf16 (ours) and f16 (llama.cpp's) are both
16-bit weights, read at the same bytes per step, which is the comparison that
matters on a memory-bound CPU.

Pure: reads parsed records, returns text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triollm.errors import UserError


@dataclass(frozen=True)
class Metric:
    path: str  # "aggregate_tok_s" or "ttft_ms.p50"
    label: str
    higher_is_better: bool

    def of(self, record: dict[str, Any]) -> float | None:
        value: Any = record
        for part in self.path.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return float(value) if isinstance(value, int | float) else None


SERVE_METRICS = (
    Metric("aggregate_tok_s", "aggregate tok/s", True),
    Metric("ttft_ms.p50", "TTFT p50 ms", False),
    Metric("tpot_ms.p50", "TPOT p50 ms", False),
    # per token since "itl_definition": "per token"; older files hold per-chunk gaps here
    Metric("itl_ms.p99", "ITL p99 ms", False),
)
ENGINE_METRICS = (Metric("tok_s", "tok/s", True),)


def width_class(dtype: str) -> str:
    """bf16 and f16 compare with each other; quantized types only with themselves."""
    return {"f32": "32-bit", "f16": "16-bit", "bf16": "16-bit"}.get(dtype, dtype)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"cannot read results file {path}: {exc.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
        if not isinstance(rec, dict) or "row" not in rec:
            raise UserError(f"{path}:{n}: a result line needs a 'row' field")
        out.append(rec)
    return out


def _by_row(records: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        rows.setdefault(r["row"], []).append(r)
    return rows


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def ratios(
    ours: Sequence[dict[str, Any]], peer: Sequence[dict[str, Any]], metrics: Sequence[Metric]
) -> list[dict[str, Any]]:
    """One entry per row both sides measured: each metric's median over the repeats
    (alternating rounds) on each side, and ours / peer."""
    a, b = _by_row(ours), _by_row(peer)
    out = []
    for row in [r for r in a if r in b]:
        entry: dict[str, Any] = {"row": row}
        for m in metrics:
            va = [v for r in a[row] if (v := m.of(r)) is not None]
            vb = [v for r in b[row] if (v := m.of(r)) is not None]
            if not va or not vb:
                continue
            mine, theirs = _median(va), _median(vb)
            entry[m.path] = {
                "ours": mine,
                "peer": theirs,
                "ratio": mine / theirs if theirs else None,
                "n": (len(va), len(vb)),
            }
        out.append(entry)
    return out


def ratio_table(
    ours: Sequence[dict[str, Any]],
    peer: Sequence[dict[str, Any]],
    metrics: Sequence[Metric],
    *,
    ours_name: str = "triollm",
    peer_name: str = "peer",
) -> str:
    """A markdown table, one line per row and metric: each side's median, the median of
    the per-repeat ratios ours / peer, every repeat's ratio, and a verdict.

    Repeats pair by their order in each file (the i-th run of ours with the i-th of the
    peer's: alternating runs append in that order). A ratio without its repeats is not
    a claim (CONVENTIONS rule 17), so a single repeat, or repeats on both sides of 1.0,
    say "not established" (``rounds.Summary``). Rows or metrics only one side measured
    are left out.
    """
    from triollm.bench.rounds import Summary, pair_rounds, table_row

    a, b = _by_row(ours), _by_row(peer)
    head = f"| row | {ours_name} | {peer_name} | ratio (median) | spread | per repeat | verdict |"
    lines = [head, "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for row in [r for r in a if r in b]:
        for m in metrics:
            va = [v for r in a[row] if (v := m.of(r)) is not None]
            vb = [v for r in b[row] if (v := m.of(r)) is not None]
            if not va or not vb:
                continue
            if len(va) != len(vb):  # unpaired repeats: the medians' ratio, as one repeat
                va, vb = [_median(va)], [_median(vb)]
            s = Summary(
                pair_rounds(dict(enumerate(va)), dict(enumerate(vb)), ()),
                m.higher_is_better,
                ours_name=ours_name,
                peer_name=peer_name,
            )
            lines.append(table_row(f"{row} {m.label}", s))
    if len(lines) == 2:
        return f"(no row of {ours_name}'s results matches a row of {peer_name}'s)"
    return "\n".join(lines)


def metrics_for(records: Sequence[dict[str, Any]]) -> tuple[Metric, ...]:
    """Engine records carry ``tok_s``, serve records ``aggregate_tok_s``."""
    return ENGINE_METRICS if records and "tok_s" in records[0] else SERVE_METRICS
