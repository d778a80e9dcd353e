"""llama.cpp's tokenizer test vectors: real vocabularies, and the ids their models' own
tokenizers give.

llama.cpp ships, in ``models/``, vocabulary-only GGUF files of real models
(``ggml-vocab-llama-spm.gguf`` is Llama 2's SentencePiece vocabulary,
``ggml-vocab-llama-bpe.gguf`` Llama 3's, ``ggml-vocab-qwen2.gguf`` Qwen2's, ...)
each beside a ``.inp`` corpus and a ``.out`` file: the ids the model's own Hugging
Face tokenizer gives for each text (``encode(text, add_special_tokens=False)``,
written by llama.cpp's ``convert_hf_to_gguf_update.py``). They come with the
llama.cpp source in the ``llama-cpp-python`` sdist on PyPI (the same pin the
peers benchmark builds from, so one download serves both).

:func:`fetch` returns the directory holding them, downloading the sdist once
into ``~/.cache/triollm/peers/src`` and extracting only these files; tests call
:func:`fetch_or_skip_reason` and skip, saying why, when they cannot be had.
``python tools/llama_vocab.py`` prints the directory; ``--check`` tokenizes every
corpus with triollm's GGUF tokenizer and prints, per vocabulary, how many texts
give the model's own ids (or why the vocabulary is refused).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench_peers import LLAMA_CPP_PYTHON as SPEC  # one pin for the peers and these files

CACHE = Path(os.environ.get("TRIOLLM_CACHE", Path.home() / ".cache" / "triollm"))
SRC = CACHE / "peers" / "src"
SDIST_NAME = SPEC.replace("-", "_").replace("==", "-")  # llama_cpp_python-0.3.36
MODELS = "vendor/llama.cpp/models"
VOCABS = SRC / SDIST_NAME / MODELS  # where bench_peers' extraction (or ours) puts them
SEPARATOR = "\n__ggml_vocab_test__\n"


def fetch() -> Path:
    """The directory of ``ggml-vocab-*.gguf`` files with their ``.inp``/``.out``;
    raises OSError if it cannot be had."""
    if (VOCABS / "ggml-vocab-llama-spm.gguf.out").is_file():
        return VOCABS
    SRC.mkdir(parents=True, exist_ok=True)
    sdist = SRC / f"{SDIST_NAME}.tar.gz"
    if not sdist.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        proc = subprocess.run(
            [*cmd, "-d", str(SRC), SPEC], capture_output=True, text=True, timeout=900
        )
        if proc.returncode or not sdist.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise OSError(f"pip download {SPEC} (sdist) failed: {tail[0]}")
    prefix = f"{SDIST_NAME}/{MODELS}/ggml-vocab-"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        if not members:
            raise OSError(f"{sdist} holds no {prefix}* files")
        tar.extractall(SRC, members=members, filter="data")
    return VOCABS


def fetch_or_skip_reason() -> tuple[Path | None, str]:
    """(the directory, "") or (None, why it cannot be had), for tests that skip."""
    try:
        return fetch(), ""
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as exc:
        return None, f"llama.cpp's vocabulary test files ({SPEC} sdist) unobtainable: {exc}"


def cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, the ids its model's own tokenizer gives) for each text of ``vocab``'s corpus."""
    # .inp: each text followed by the separator line; .out: one line of ids per text
    inp = vocab.with_name(vocab.name + ".inp").read_text(encoding="utf-8")
    texts = inp.removesuffix(SEPARATOR).split(SEPARATOR)
    outs = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").split("\n")[:-1]
    if len(texts) != len(outs):
        raise ValueError(f"{vocab}: {len(texts)} texts but {len(outs)} id lists")
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs, strict=True)]


def check(where: Path) -> None:
    from triollm.errors import ModelLoadError
    from triollm.model.gguf import GGUFFile
    from triollm.model.gguf_tokenizer import tokenizer_from_gguf

    for out in sorted(where.glob("ggml-vocab-*.gguf.out")):
        vocab = out.with_suffix("")
        try:
            tokenizer = tokenizer_from_gguf(GGUFFile(vocab))
        except ModelLoadError as exc:
            why = str(exc).split(": ", 1)[-1].split(" (supported")[0]
            print(f"{vocab.name}: refused: {why}")
            continue
        got = cases(vocab)
        same = sum(list(tokenizer.encode(t, add_special_tokens=False)) == ids for t, ids in got)
        print(f"{vocab.name}: {same}/{len(got)} texts give the model's own ids")


if __name__ == "__main__":
    where = fetch()
    print(where)
    if "--check" in sys.argv[1:]:
        check(where)
