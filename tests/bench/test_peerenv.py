"""Every child the harness starts runs in its own default environment (issue 21, cause 1).

The parent here carries the variables a harness that imported triollm/numpy, or the
machine, may have set; a fake llama.cpp binary records the environment it got.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from triollm.bench import peerenv

ROOT = Path(__file__).resolve().parents[2]
LEAKY = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "OMP_NUM_THREADS": "1",
    "GOMP_SPINCOUNT": "0",
    "KMP_BLOCKTIME": "0",
    "NUMBA_NUM_THREADS": "1",
    "OPENBLAS_CORETYPE": "Haswell",
}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def leaky(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for k, v in LEAKY.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KEEP_ME", "yes")  # an ordinary variable passes through
    dump = tmp_path / "env.json"
    monkeypatch.setenv("ENV_DUMP", str(dump))
    return dump


def _fake(bin_dir: Path, name: str, prints: str) -> None:
    """An executable named like a llama.cpp tool: writes its environment, prints ``prints``."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(
        f"#!{sys.executable}\nimport json, os\n"
        "open(os.environ['ENV_DUMP'], 'w').write(json.dumps(dict(os.environ)))\n"
        f"print({prints!r})\n"
    )
    exe.chmod(0o755)


def _assert_clean(env: dict[str, str]) -> None:
    assert not [k for k in env if k.startswith(peerenv.SCRUBBED_PREFIXES)]
    assert env["KEEP_ME"] == "yes"


def test_clean_env_drops_every_threading_family_and_keeps_the_rest() -> None:
    base = LEAKY | {"PATH": "/bin", "OMPX": "not a prefix match", "HOME": "/root"}
    assert peerenv.clean_env(base) == {
        "PATH": "/bin",
        "OMPX": "not a prefix match",
        "HOME": "/root",
    }
    assert peerenv.scrubbed(base) == sorted(LEAKY)


def test_a_peer_started_by_bench_peers_sees_none_of_the_parents_variables(
    leaky: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench_peers = _load("bench_peers", ROOT / "tools" / "bench_peers.py")
    monkeypatch.setattr(bench_peers, "BIN", tmp_path / "bin")
    _fake(
        tmp_path / "bin", "llama-batched-bench", json.dumps({"pl": 1, "speed_tg": 9.0, "t_tg": 1})
    )
    _fake(
        tmp_path / "bin", "llama-bench", json.dumps([{"n_prompt": 0, "n_gen": 32, "avg_ts": 5.0}])
    )
    m = bench_peers.Model("x", "x", tmp_path / "x.gguf", tmp_path / "x.gguf", "same")
    w = bench_peers.Workload()
    assert bench_peers.llama_decode(m, w)[0]["tok_s"] == 9.0
    _assert_clean(json.loads(leaky.read_text()))
    leaky.unlink()
    assert bench_peers.llama_depth(m, w)[0]["tok_s"] == 5.0
    _assert_clean(json.loads(leaky.read_text()))


def test_bench_gguf_starts_its_peer_through_the_same_launcher(leaky: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        bench_gguf = _load("bench_gguf", ROOT / "bench" / "bench_gguf.py")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    _fake(tmp_path / "bin", "llama-batched-bench", json.dumps({"pl": 1, "speed_tg": 3.0}))
    got = bench_gguf.llama_round(str(tmp_path / "bin" / "llama-batched-bench"), tmp_path, [1], 4, 4)
    assert got == {1: 3.0}
    _assert_clean(json.loads(leaky.read_text()))


def test_a_server_started_with_popen_and_triollms_child_get_only_their_thread_count(
    leaky: Path,
) -> None:
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    proc = peerenv.popen([sys.executable, "-c", code], stdout=-1, text=True)
    out, _ = proc.communicate()
    _assert_clean(json.loads(out))
    env = json.loads(
        peerenv.run(
            [sys.executable, "-c", code],
            env=peerenv.triollm_env(2, "/src"),
            capture_output=True,
            text=True,
        ).stdout
    )
    assert [k for k in env if k.startswith(peerenv.SCRUBBED_PREFIXES)] == ["NUMBA_NUM_THREADS"]
    assert env["NUMBA_NUM_THREADS"] == "2" and env["PYTHONPATH"] == "/src"
