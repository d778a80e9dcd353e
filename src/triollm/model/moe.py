"""Mixture of experts: the MLP of Qwen3-MoE and Mixtral layers.

A sparse layer holds ``E`` small SwiGLU MLPs (the experts) and a router, one
``(E, hidden)`` matrix. For each row the router's logits go through a softmax;
the row takes the ``top_k`` most probable experts, and its MLP output is their
outputs summed, each weighted by its probability (renormalised over the chosen
``top_k`` when the config says so)::

    row x ──router──> softmax over E ──top-k──> experts {3, 6}, weights {.7, .3}
    out = .7 * expert3(x) + .3 * expert6(x)          (expert(x) = down(silu(gate x) * up x))

A step has many rows, and each expert is a weight read from memory: so the
products are batched *by expert*. The rows that chose expert ``e`` are gathered
into one matrix, multiplied by ``e``'s weights in one product, weighted, and
added back to their rows::

    rows     0 1 2 3 4          expert 3: rows [0, 2, 4] -> one (3, hidden) product
    choose   3 3 1 6 3          expert 6: rows [1, 3]    -> one (2, hidden) product
             6 6 3 1 1          expert 1: rows [2, 3, 4] -> ...

Experts nobody chose this step are not read at all: that is where a MoE model's
speed comes from (a 30B-A3B model reads ~3B parameters per token).

Batch invariance (a row's bits do not depend on what else is in the step): the
router and softmax are per row (:func:`route`, one loop per row), every weight
product computes each row with the same instructions whatever the row count
(``matmul.py``, ``quant.py``), and a row's expert outputs are added to it in
ascending expert order, whichever other rows chose those experts. That is also
the order transformers adds them (its loop runs over the experts hit, ascending),
so the sum rounds as the reference's does.

Quantized experts (GGUF ``ffn_*_exps``, one 3-D tensor per projection) are
served per expert as 2-D :class:`~triollm.model.quant.QuantizedTensor` slices
(``gguf.py``) and go through the same kernels as dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from triollm.model import kernels
from triollm.model.config import ModelConfig
from triollm.model.matmul import PreparedWeight, linear


def router_key(config: ModelConfig, layer: int) -> str:
    """The checkpoint key of layer ``layer``'s router, ``(num_experts, hidden)``."""
    return f"model.layers.{layer}.{_block(config)}.gate.weight"


def expert_keys(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The checkpoint keys of one expert's gate, up and down projections.

    Qwen3-MoE names them as a dense MLP's (``mlp.experts.{e}.gate_proj``);
    Mixtral keeps the original release's ``w1`` (gate), ``w3`` (up), ``w2`` (down).
    """
    p = f"model.layers.{layer}.{_block(config)}.experts.{expert}."
    if config.model_type == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _block(config: ModelConfig) -> str:
    return "block_sparse_moe" if config.model_type == "mixtral" else "mlp"


def moe_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of one sparse layer's experts and router, with its shape."""
    moe = config.moe
    assert moe is not None
    h, w = config.hidden_size, moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {router_key(config, layer): (moe.num_experts, h)}
    for e in range(moe.num_experts):
        gate, up, down = expert_keys(config, layer, e)
        shapes[gate] = (w, h)
        shapes[up] = (w, h)
        shapes[down] = (h, w)
    return shapes


@njit(cache=True, nogil=True)
def _route(
    logits: np.ndarray, top_k: int, normalize: bool, experts: np.ndarray, weights: np.ndarray
) -> None:  # pragma: no cover - numba
    n, n_experts = logits.shape
    probs = np.empty(n_experts, np.float32)
    for i in range(n):
        # softmax in float32, as transformers computes it (dtype=torch.float)
        m = logits[i, 0]
        for e in range(1, n_experts):
            m = max(m, logits[i, e])
        total = np.float32(0.0)
        for e in range(n_experts):
            probs[e] = np.exp(logits[i, e] - m)
            total += probs[e]
        for e in range(n_experts):
            probs[e] = probs[e] / total
        # top-k by repeated selection (k is 2 or 8: cheaper than a sort); a tie
        # goes to the lower expert id, as torch.topk's does on CPU
        chosen = np.float32(0.0)
        for j in range(top_k):
            best = -1
            for e in range(n_experts):
                if probs[e] >= 0 and (best < 0 or probs[e] > probs[best]):
                    best = e
            experts[i, j] = best
            weights[i, j] = probs[best]
            chosen += probs[best]
            probs[best] = np.float32(-1.0)  # taken
        if normalize:
            for j in range(top_k):
                weights[i, j] = weights[i, j] / chosen


def route(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``top_k`` experts (most probable first) and their weights.

    ``logits``: ``(n, num_experts)`` float32 router outputs. Returns ``experts``
    ``(n, top_k)`` int64 and ``weights`` ``(n, top_k)`` float32: the softmax
    probabilities of the chosen experts, divided by their sum when ``normalize``.
    Each row is computed alone (one loop per row), so a row's choice and weights
    never depend on the other rows.
    """
    n = logits.shape[0]
    experts = np.empty((n, top_k), np.int64)
    weights = np.empty((n, top_k), np.float32)
    if n:
        _route(np.ascontiguousarray(logits, np.float32), top_k, normalize, experts, weights)
    return experts, weights


@dataclass(eq=False)
class Expert:
    """One expert's SwiGLU weights, gate and up fused as in the dense MLP."""

    gate_up_proj: PreparedWeight  # [gate; up]: [2 * moe width, hidden]
    down_proj: PreparedWeight  # [hidden, moe width]


@dataclass(eq=False)
class MoeBlock:
    """A sparse layer's router and experts, and the batched-by-expert forward."""

    router: PreparedWeight  # [num_experts, hidden]
    experts: list[Expert]
    top_k: int
    normalize: bool  # renormalise the chosen experts' probabilities to sum to 1

    @property
    def nbytes(self) -> int:
        total = self.router.nbytes
        for e in self.experts:
            total += e.gate_up_proj.nbytes + e.down_proj.nbytes
        return int(total)

    def forward(self, xn: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = sum_j w_ij * expert_ij(xn[i])`` for every row ``i``.

        ``xn``: ``(n, hidden)`` float32, the normed MLP input; ``out``: ``(n, hidden)``
        float32, overwritten.
        """
        n = xn.shape[0]
        logits = linear(xn, self.router)  # (n, num_experts) float32
        chosen, weights = route(logits, self.top_k, self.normalize)
        out[...] = 0.0
        # Group the (row, slot) pairs by expert: a stable sort keeps each expert's
        # rows ascending. A row chooses an expert at most once, so an expert's rows
        # are distinct and the scatter-add below writes each row once.
        flat = chosen.reshape(-1)
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=len(self.experts))
        row_of = order // self.top_k
        slot_of = order % self.top_k
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count == 0:
                continue  # not chosen by any row: its weights are not read
            rows = row_of[start : start + count]
            w = weights[rows, slot_of[start : start + count]]  # (count,) float32
            start += count
            expert = self.experts[e]
            x_e = xn[rows]  # (count, hidden) float32, gathered
            gate_up = linear(x_e, expert.gate_up_proj)  # (count, 2 * width)
            act = np.empty((count, gate_up.shape[1] // 2), np.float32)
            kernels.silu_mul(gate_up, act)
            y = linear(act, expert.down_proj)  # (count, hidden)
            y *= w[:, None]
            out[rows] += y  # experts in ascending id: each row's sum in one order
        assert start == n * self.top_k
