"""Draw docs/img/q4k-superblock.png: the 144 bytes of one Q4_K super-block.

    python tools/draw_q4k.py     (needs matplotlib, in the `fixtures` extra)

The drawing is checked against a real block rather than trusted: a block is
built whose 256 values are their own sub-block numbers, put through
``gguf.dequantize`` (the format's own code) and through triollm's kernel,
and the picture colours each of the 128 value bytes by the sub-blocks its
two nibbles were found to feed. Look at the PNG before committing it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "q4k-superblock.png"
COLOURS = plt.get_cmap("tab10").colors


def probe_block() -> np.ndarray:
    """A Q4_K block with d = 1, dmin = 0 and every scale 1: a nibble set to 1 shows up as a 1.0."""
    block = np.zeros(144, np.uint8)
    block[0:2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1
    block[2:4] = np.array([0.0], np.float16).view(np.uint8)  # dmin = 0
    block[4:8] = 1  # scales 0-3 = 1 (low 6 bits)
    block[12:16] = 0x11  # scales 4-7 = 1 (low nibbles), mins 4-7 = 1 (ignored: dmin = 0)
    return block


def nibble_owner() -> np.ndarray:
    """For each of the 128 value bytes and each nibble, the sub-block (0-7) it feeds."""
    owner = np.zeros((128, 2), int)
    for byte in range(128):
        for nib in range(2):
            block = probe_block()
            block[16 + byte] = 1 << (4 * nib)
            values = gguf.dequantize(block.reshape(1, -1), gguf.GGMLQuantizationType.Q4_K)
            (hit,) = np.nonzero(values.reshape(-1))
            owner[byte, nib] = int(hit[0]) // 32
    return owner


def main() -> int:
    owner = nibble_owner()
    fig, ax = plt.subplots(figsize=(13, 4.6))
    ax.set_xlim(0, 76)
    ax.set_ylim(-4.6, 3.2)
    ax.axis("off")

    def box(x: float, y: float, w: float, h: float, colour: object, text: str = "") -> None:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", lw=0.6))
        if text:
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=6.5)

    # header row: d, dmin, the 12 scale bytes (one column per byte, 1 unit wide)
    ax.text(0, 2.7, "bytes 0-15: scales", fontsize=10, weight="bold")
    box(0, 1.4, 4, 1, "#f4d03f", "d (f16)\nbytes 0-1")
    box(4, 1.4, 4, 1, "#f5b041", "dmin (f16)\nbytes 2-3")
    for i in range(12):
        j = i % 4
        if i < 4:
            text = f"sc{j}\n+hi sc{j + 4}"
        elif i < 8:
            text = f"m{j}\n+hi m{j + 4}"
        else:
            text = f"lo sc{j + 4}\nlo m{j + 4}"
        box(8 + 3 * i, 1.4, 3, 1, "#d5dbdb", text)
    ax.text(
        45,
        1.9,
        "8 sub-blocks of 32 values: sub-block j has a 6-bit scale sc_j and a 6-bit min m_j;\n"
        "value = (d * sc_j) * q - dmin * m_j,  q the 4-bit value (0-15)",
        fontsize=9,
        va="center",
    )
    # value bytes: 128 bytes in 4 rows of 32; each byte split into low / high nibble
    ax.text(
        0,
        0.7,
        "bytes 16-143: 256 values, two 4-bit values per byte",
        fontsize=10,
        weight="bold",
    )
    for byte in range(128):
        row, col = divmod(byte, 32)
        x = 2 * col
        y = -1 - row
        lo, hi = owner[byte]
        box(x, y, 1, 0.9, COLOURS[lo], "")
        box(x + 1, y, 1, 0.9, COLOURS[hi], "")
    for row in range(4):
        lo, hi = owner[32 * row]
        ax.text(
            64.5,
            -0.55 - row,
            f"bytes {16 + 32 * row}-{47 + 32 * row}: low nibbles = sub-block {lo}, high = {hi}",
            fontsize=8,
            va="center",
        )
    fig.suptitle(
        "One Q4_K super-block: 256 weights in 144 bytes (4.5 bits a weight); "
        "colours: the sub-block each nibble feeds (measured with gguf.dequantize)",
        fontsize=10,
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
