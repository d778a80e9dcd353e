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


def _fmt(v: float | None) -> str:
    if v is None:
        return "—"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if abs(v) >= 1 else f"{v:.2f}"


def ratio_table(
    ours: Sequence[dict[str, Any]],
    peer: Sequence[dict[str, Any]],
    metrics: Sequence[Metric],
    *,
    ours_name: str = "triollm",
    peer_name: str = "peer",
) -> str:
    """A markdown table: per row and metric, ours, the peer's and ours / peer."""
    table = ratios(ours, peer, metrics)
    if not table:
        return f"(no row of {ours_name}'s results matches a row of {peer_name}'s)"
    head = ["row"]
    for m in metrics:
        head += [f"{ours_name} {m.label}", f"{peer_name} {m.label}", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for e in table:
        cells = [e["row"]]
        for m in metrics:
            cell = e.get(m.path)
            if cell is None:
                cells += ["—", "—", "—"]
                continue
            r = cell["ratio"]
            cells += [_fmt(cell["ours"]), _fmt(cell["peer"]), f"{r:.2f}x" if r else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def metrics_for(records: Sequence[dict[str, Any]]) -> tuple[Metric, ...]:
    """Engine records carry ``tok_s``, serve records ``aggregate_tok_s``."""
    return ENGINE_METRICS if records and "tok_s" in records[0] else SERVE_METRICS
