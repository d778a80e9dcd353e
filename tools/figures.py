"""Draw the teaching pictures in docs/img from real runs of the scheduler.

Every picture is computed, not drawn by hand: the seed's scenario (seven requests,
four slots, a pool of fourteen blocks of four positions) is replayed through the real
:class:`~triollm.scheduler.Scheduler` by ``triollm.sim``, and the figures plot what it
recorded. Run ``just figures`` (needs matplotlib, in the ``fixtures`` extra) and look at
the PNGs before committing them.

- ``pool-deadlock.png``: who holds each block, step by step, under free-slot admission
  (it locks up) and under reservation (it cannot);
- ``step-rows.png``: the rows of every forward pass: prefill chunks and decode rows of
  several requests sharing one step, within the row budget;
- ``request-timeline.png``: each request's life: queued, prefilling, decoding, with its
  first token (TTFT) and the gaps between tokens (ITL) marked;
- ``block-table.png``: one moment's block tables: each running sequence's positions
  mapped, block by block, onto blocks scattered through the shared pool;
- ``prefix-chain.png``: the prefix cache's chained block hashes for two turns of one
  conversation and the same text under another tenant's salt (hashed by the real
  ``kv.prefix_hashes``);
- ``cancel-path.png``: the path from a closed socket to freed blocks and the next
  admission (not a run: the one drawing here, kept beside the others so the file and
  function names in it are checked with them).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from triollm.plan import SampledToken, StepResult
from triollm.scheduler import Policy, Scheduler
from triollm.sim.palette import FREE, PALETTE, colour_of
from triollm.sim.runner import Run, simulate
from triollm.sim.scenario import seed_scenario
from triollm.spec import SequenceSpec

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"
COLOURS = PALETTE  # one scheme with the simulator's page (src/triollm/sim/palette.py)


def _colour(names: list[str], name: str) -> str:
    return colour_of(names, name)


def block_label(lo: int, hi: int, block: int) -> str:
    """A block-table cell: the positions it holds and the pool block they live in."""
    return f"{lo}-{hi}\n→ {block}"


def pool_deadlock() -> Path:
    scenario = seed_scenario()
    names = [r.name for r in scenario.requests]
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.2), sharex=True)
    for ax, policy in zip(axes, (Policy.FREE_SLOT, Policy.RESERVE), strict=True):
        run = simulate(scenario, policy)
        grid = [
            [names.index(b) + 1 if b is not None else 0 for b in step.blocks] for step in run.steps
        ]
        cmap = ListedColormap([FREE, *COLOURS[: len(names)]])
        ax.imshow(
            list(map(list, zip(*grid, strict=True))),
            aspect="auto",
            cmap=cmap,
            vmin=0,
            vmax=len(names),
            interpolation="nearest",
            origin="lower",
        )
        ax.set_ylabel("pool block")
        title = f"{policy.value}: "
        if run.deadlock is not None:
            ax.axvline(run.deadlock.t, color="black", lw=2)
            ax.annotate(
                "deadlock: 0 blocks free,\nevery running request\nneeds one more",
                xy=(run.deadlock.t, scenario.num_blocks - 0.5),
                xytext=(run.deadlock.t + 1.5, scenario.num_blocks - 4),
                arrowprops={"arrowstyle": "->"},
                fontsize=9,
            )
            title += f"admits on a free slot alone, locks up at step {run.deadlock.t}"
        else:
            title += f"reserves prompt + answer, all {len(names)} finish in {run.total_steps} steps"
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_yticks(range(scenario.num_blocks))
        ax.tick_params(axis="y", labelsize=7)
    axes[-1].set_xlabel("step")
    fig.legend(
        handles=[Patch(color=_colour(names, n), label=n) for n in names]
        + [Patch(color=FREE, label="free")],
        loc="upper right",
        ncol=len(names) + 1,
        fontsize=8,
    )
    fig.suptitle("Who holds each KV block, step by step (the seed's scenario)", x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _save(fig, "pool-deadlock.png")


def step_rows(run: Run) -> Path:
    scenario = run.scenario
    names = [r.name for r in scenario.requests]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for step in run.steps:
        bottom = 0
        for row in step.rows:
            ax.bar(
                step.t,
                row.rows,
                bottom=bottom,
                color=_colour(names, row.request),
                hatch="///" if row.kind == "prefill" else None,
                edgecolor="white",
                linewidth=0.5,
            )
            bottom += row.rows
    ax.axhline(scenario.step_rows, color="black", ls="--", lw=1)
    ax.text(0, scenario.step_rows + 0.3, f"row budget: {scenario.step_rows}", fontsize=8)
    ax.set_xlabel("step (one forward pass)")
    ax.set_ylabel("rows")
    ax.set_title(
        "The rows of each forward pass under reservation: prefill chunks (hatched, "
        f"up to {scenario.chunk_tokens} tokens) ride with one decode row per running request",
        fontsize=10,
        loc="left",
    )
    ax.legend(
        handles=[Patch(color=_colour(names, n), label=n) for n in names]
        + [Patch(facecolor="white", edgecolor="grey", hatch="///", label="prefill")],
        ncol=len(names) + 1,
        fontsize=8,
        loc="upper right",
    )
    ax.set_ylim(0, scenario.step_rows + 3)
    fig.tight_layout()
    return _save(fig, "step-rows.png")


def request_timeline(run: Run) -> Path:
    names = [o.name for o in run.outcomes]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for y, o in enumerate(reversed(run.outcomes)):
        assert o.admitted is not None and o.first_token is not None and o.done is not None
        ax.barh(y, o.admitted - o.arrival, left=o.arrival, color=(0.85, 0.85, 0.85), height=0.5)
        prefill_steps = [
            s.t for s in run.steps for r in s.rows if r.request == o.name and r.kind == "prefill"
        ]
        decode_steps = [
            s.t for s in run.steps for r in s.rows if r.request == o.name and r.kind == "decode"
        ]
        colour = _colour(names, o.name)
        for t in prefill_steps:
            ax.barh(y, 1, left=t, color=colour, alpha=0.45, height=0.5, hatch="///")
        for t in decode_steps:
            ax.barh(y, 1, left=t, color=colour, height=0.5)
        ax.plot(o.first_token + 1, y + 0.38, marker="v", color="black", ms=6)
        ax.text(o.first_token + 1.2, y + 0.3, f"TTFT {o.ttft}", fontsize=7, va="bottom", ha="left")
        gaps = [b - a for a, b in itertools.pairwise(decode_steps)]
        if gaps and max(gaps) > 1:
            ax.text(o.done + 1.3, y, f"ITL max {max(gaps)}", fontsize=7, va="center")
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel("step")
    ax.set_title(
        "Each request's life under reservation: queued (grey), prefill chunks (hatched), "
        "one decode row per step (solid); TTFT in steps from arrival",
        fontsize=10,
        loc="left",
    )
    fig.tight_layout()
    return _save(fig, "request-timeline.png")


def block_table(at_step: int = 24) -> Path:
    """Replay the seed's scenario under reservation up to ``at_step``; draw the tables."""
    return _save(draw_block_table(at_step), "block-table.png")


def draw_block_table(at_step: int = 24) -> plt.Figure:
    """The figure of :func:`block_table`, unsaved (tests read its labels)."""
    scenario = seed_scenario()
    s = Scheduler(scenario.config(Policy.RESERVE))
    name_of: dict[int, str] = {}
    pending = sorted(scenario.requests, key=lambda r: r.arrival)
    for t in range(at_step + 1):
        while pending and pending[0].arrival == t:
            r = pending.pop(0)
            name_of[s.add(SequenceSpec([1] * r.prompt, r.answer))] = r.name
        s.admit_waiting()
        plan = s.plan_step()
        if t == at_step:
            break
        sampled = tuple(SampledToken(c.seq_id, 1) for c in plan.chunks if c.sample)
        s.commit(StepResult(plan.step, sampled, plan.n_rows))
    names = [r.name for r in scenario.requests]
    running = s.running_ids()
    fig, ax = plt.subplots(figsize=(11, 1.4 + 1.2 * len(running)))
    pool_y = 0
    for b in range(scenario.num_blocks):
        holder = next((name_of[q] for q in running if b in s.sequence(q).blocks), None)
        face = _colour(names, holder) if holder else FREE
        ax.add_patch(Rectangle((b, pool_y), 0.9, 0.8, facecolor=face, edgecolor="black"))
        ax.text(b + 0.45, pool_y + 0.4, str(b), ha="center", va="center", fontsize=8)
    ax.text(-0.3, pool_y + 0.4, "pool", ha="right", va="center", fontsize=9)
    for i, q in enumerate(running):
        info = s.sequence(q)
        # tables alternate above and below the pool, so no arrow crosses another table
        above = i % 2 == 0
        y = 1.4 + 1.1 * (i // 2) if above else -1.3 - 1.1 * (i // 2)
        name = name_of[q]
        ax.text(-0.3, y + 0.35, f"{name}'s table", ha="right", va="center", fontsize=9)
        for j, b in enumerate(info.blocks):
            lo = j * scenario.block_size
            hi = lo + scenario.block_size - 1
            filled = max(0, min(scenario.block_size, info.n_computed - lo))
            x = j * 1.05
            ax.add_patch(
                Rectangle(
                    (x, y),
                    1.0,
                    0.7,
                    facecolor=_colour(names, name),
                    alpha=0.35 + 0.65 * filled / scenario.block_size,
                    edgecolor="black",
                    zorder=2,  # boxes in front: arrows from the rows above pass behind them
                )
            )
            ax.text(
                x + 0.5,
                y + 0.35,
                block_label(lo, hi, b),
                ha="center",
                va="center",
                fontsize=7,
                zorder=3,
            )
            ax.add_patch(
                FancyArrowPatch(
                    (x + 0.5, y if above else y + 0.7),
                    (b + 0.45, pool_y + 0.8 if above else pool_y),
                    arrowstyle="->",
                    color=_colour(names, name),
                    lw=0.7,
                    alpha=0.6,
                    mutation_scale=8,
                    zorder=1,
                )
            )
    ax.set_xlim(-2.2, max(scenario.num_blocks, 12) + 0.5)
    ax.set_ylim(-1.4 - 1.1 * ((len(running) - 1) // 2), 2.2 + 1.1 * ((len(running) - 1) // 2))
    ax.axis("off")
    ax.set_title(
        f"Block tables at step {at_step} (reservation): positions lo-hi of each sequence → a pool "
        "block; pale = reserved for the answer, not yet written",
        fontsize=10,
        loc="left",
    )
    fig.tight_layout()
    return fig


# The cancel path, in the order it happens; (where it lives, what happens there).
CANCEL_PATH: tuple[tuple[str, str], ...] = (
    ("the client", "closes the socket mid-stream (or while queued)"),
    ("hypercorn (transport)", "its reader sees EOF and puts http.disconnect on the queue"),
    (
        "quart-trio",
        "cancels the request's nursery: the handler gets Cancelled\n"
        "at its next checkpoint, mid-write or waiting on its channel",
    ),
    (
        "Lifetime (server/lifetime.py)",
        "its finally runs, synchronously (an await would raise):\n"
        "RequestStream.close(EndCode.CLIENT_CLOSED), access log 499",
    ),
    (
        "OutputProcessor.end (output.py)",
        "Service._retire: scheduler.cancel(seq), the blocks are back\n"
        "in the pool now; the Batch drops it at the next step boundary",
    ),
    (
        "AdmissionQueue (admission.py)",
        "queue.signal(): the one driver wakes and admits the next\n"
        "waiter that fits, from the state, in FCFS order",
    ),
)


def cancel_path() -> Path:
    fig, ax = plt.subplots(figsize=(11, 5.4))
    n = len(CANCEL_PATH)
    for i, (where, what) in enumerate(CANCEL_PATH):
        y = n - 1 - i
        colour = COLOURS[i % len(COLOURS)]
        ax.add_patch(
            Rectangle((0, y * 1.15), 3.1, 0.85, facecolor=colour, alpha=0.25, edgecolor=colour)
        )
        ax.text(0.12, y * 1.15 + 0.42, where, va="center", fontsize=10, weight="bold")
        ax.add_patch(Rectangle((3.3, y * 1.15), 7.6, 0.85, facecolor="white", edgecolor="grey"))
        ax.text(3.45, y * 1.15 + 0.42, what, va="center", fontsize=9)
        if i < n - 1:
            ax.add_patch(
                FancyArrowPatch(
                    (1.55, y * 1.15),
                    (1.55, (y - 1) * 1.15 + 0.85),
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color="black",
                )
            )
    ax.set_xlim(-0.1, 11)
    ax.set_ylim(-0.2, n * 1.15)
    ax.axis("off")
    ax.set_title(
        "From a closed socket to freed blocks: every step runs on the event loop, "
        "in the same instant, with no step of the model in between",
        fontsize=10,
        loc="left",
    )
    fig.tight_layout()
    return _save(fig, "cancel-path.png")


def prefix_chain() -> Path:
    """Two turns of one conversation and a second tenant, hashed by the real
    ``kv.prefix_hashes``: equal hashes are shared blocks."""
    from triollm.kv import prefix_hashes

    block = 4
    turn1 = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]  # system + first question
    turn2 = [*turn1, 33, 34, 41, 42, 43, 44, 51, 52, 53]  # + the answer + the next question
    rows = [
        ("turn 1, salt 'a'", turn1, "a"),
        ("turn 2, salt 'a'", turn2, "a"),
        ("turn 2, salt 'b'", turn2, "b"),
    ]
    chains = [prefix_hashes(ids, block, salt) for _, ids, salt in rows]
    cached = set(chains[0])
    fig, ax = plt.subplots(figsize=(11, 3.9))
    for r, ((label, ids, _), chain) in enumerate(zip(rows, chains, strict=True)):
        y = (len(rows) - 1 - r) * 1.25
        ax.text(-0.2, y + 0.35, label, ha="right", va="center", fontsize=9)
        for i in range(-(-len(ids) // block)):
            x = i * 2.05
            tokens = ids[i * block : (i + 1) * block]
            full = i < len(chain)
            hit = full and r > 0 and chain[i] in cached
            face = COLOURS[2] if hit else (COLOURS[0] if full else FREE)
            ax.add_patch(Rectangle((x, y), 1.9, 0.7, facecolor=face, alpha=0.35, edgecolor="black"))
            digest = chain[i].hex()[:6] if full else "partial: no hash"
            ax.text(x + 0.95, y + 0.47, " ".join(map(str, tokens)), ha="center", fontsize=7)
            ax.text(x + 0.95, y + 0.17, digest, ha="center", fontsize=7, family="monospace")
            if full and i > 0:
                ax.annotate(
                    "",
                    xy=(x, y + 0.35),
                    xytext=(x - 0.15, y + 0.35),
                    arrowprops={"arrowstyle": "->", "lw": 0.8},
                )
    ax.set_xlim(-2.3, 10.5)
    ax.set_ylim(-0.2, len(rows) * 1.25)
    ax.axis("off")
    ax.legend(
        handles=[
            Patch(facecolor=COLOURS[2], alpha=0.35, label="found in the cache: held, not computed"),
            Patch(facecolor=COLOURS[0], alpha=0.35, label="full block: computed, then published"),
            Patch(facecolor=FREE, label="partial last block: private"),
        ],
        loc="lower center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=3,
        fontsize=8,
    )
    ax.set_title(
        "The prefix cache's hash chain (blocks of 4): each block's hash digests the one "
        "before it and its tokens, from a root made of the salt",
        fontsize=10,
        loc="left",
    )
    fig.tight_layout()
    return _save(fig, "prefix-chain.png")


def _save(fig: plt.Figure, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    reserve = simulate(seed_scenario(), Policy.RESERVE)
    figures = (pool_deadlock(), step_rows(reserve), request_timeline(reserve), block_table())
    for path in (*figures, cancel_path(), prefix_chain()):
        print(path.relative_to(OUT.parents[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
