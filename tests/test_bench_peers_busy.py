"""The busy-machine table of ``tools/bench_peers_report.py`` (issue 10's comparison).

The measurement itself (``python tools/bench_peers.py run --parts busy``) needs
llama.cpp and half an hour; the arithmetic of the table is checked here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "bench_peers_report", ROOT / "tools" / "bench_peers_report.py"
)
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
sys.modules["bench_peers_report"] = report
_spec.loader.exec_module(report)


def _rec(system: str, busy: int, tok_s: float, batch: int = 1, rnd: int = 0) -> dict:
    return {
        "system": system,
        "busy": busy,
        "batch": batch,
        "tok_s": tok_s,
        "row": f"decode b={batch} 32-bit",
        "step": "decode",
        "round": rnd,
        "competitor": "while True: pass",
        "load_avg": [1.0, 1.0, 1.0],
    }


def test_the_fall_is_quiet_over_busy_and_the_ratio_is_ours_over_the_peers() -> None:
    records = [
        _rec("triollm", 0, 30.0),
        _rec("triollm", 1, 20.0),  # falls 1.5x
        _rec("llama.cpp", 0, 40.0),
        _rec("llama.cpp", 1, 10.0),  # falls 4x
    ]
    row = next(line for line in report.busy_section(records) if line.startswith("| 32-bit | 1 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:] == ["30.0", "20.0", "1.50x", "40.0", "10.0", "4.00x", "0.38x"]


def test_each_figure_is_the_median_over_the_rounds() -> None:
    records = [_rec("triollm", 0, v, rnd=i) for i, v in enumerate((10.0, 30.0, 20.0))]
    records += [_rec("triollm", 1, 10.0), _rec("llama.cpp", 0, 10.0), _rec("llama.cpp", 1, 10.0)]
    row = next(line for line in report.busy_section(records) if line.startswith("| 32-bit | 1 "))
    assert row.split("|")[3].strip() == "20.0"


def test_a_batch_one_system_lacks_gets_no_row() -> None:
    records = [_rec("triollm", 0, 30.0, batch=16), _rec("triollm", 1, 20.0, batch=16)]
    records += [_rec("llama.cpp", 0, 40.0), _rec("llama.cpp", 1, 10.0)]
    assert not [line for line in report.busy_section(records) if line.startswith("| 32-bit")]
