"""The Llama-family decoder, run on a ragged batch over a paged KV cache.

One :meth:`LlamaModel.forward` call computes the rows of several sequences at
once: some contribute a prefill chunk of many prompt tokens, others a single
decode token. Rows are stacked into one ``(n_rows, hidden)`` matrix, so every
weight product runs once for the whole batch (the point of batching: a weight
read from memory serves every row). Only attention is per sequence, and it
finds each sequence's earlier K/V through that sequence's block table.

Theory of operation, per layer (the labels match the comments in ``forward``):

1. attention RMSNorm, then q/k/v projections for all rows (+ qwen2 biases);
2. qwen3 only: RMSNorm of each q and k head;
3. RoPE at each row's own position;
4. write this step's K/V into the paged pool *first*, then attend: row i reads
   positions ``0 .. position[i]`` of its sequence from the pool, so its own
   chunk's earlier rows and the sequence's earlier steps look the same, and
   the causal mask is just the loop bound;
5. output projection and residual; MLP RMSNorm, SwiGLU, residual.

After the last layer, the final norm and the output head run only on the rows
whose logits will be sampled (the last row of a chunk with ``sample=True``):
a 512-token prefill chunk needs one row of logits, not 512, and the head is the
largest single product for a small model (vocab x hidden). A chunk that scores its
prompt (``ChunkPlan.score_ids``: echo with logprobs) needs every row's logits;
:meth:`LlamaModel.forward_scored` returns those rows' normed hidden states instead,
and the caller runs :meth:`LlamaModel.head` over them a slice of rows at a time
(``batch.py``), since all of them at once would be rows x vocab float32 (512 x
49152 is 100 MB).

Every array is float32. numpy 2 promotes a float32 array times an
``np.float64`` scalar to float64, and one such constant once made a step 14x
slower by turning the residual stream into float64; constants here are made
``np.float32`` explicitly and the tests assert the dtypes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from triollm.errors import ModelLoadError
from triollm.model import gemma, kernels, phi3
from triollm.model.config import ModelConfig
from triollm.model.kvstore import KVDtype, PagedKVCache
from triollm.model.matmul import PreparedWeight, linear, prepare
from triollm.model.moe import Expert, MoeBlock, expert_keys, router_key
from triollm.model.quant import QuantizedTensor, stack_rows
from triollm.model.weights import (
    TensorSource,
    as_source,
    bf16_bits_to_f32,
    expected_shapes,
)
from triollm.plan import ChunkPlan, chunk_problems


@dataclass(eq=False)
class LlamaLayer:
    """One decoder block's parameters, named after their checkpoint keys
    (``model.layers.{i}.<name>``) minus the ``self_attn.``/``mlp.`` prefix.

    Two pairs of names are fused: ``qkv_proj`` is the checkpoint's ``q_proj``,
    ``k_proj`` and ``v_proj`` stacked along the output axis, ``gate_up_proj``
    is ``gate_proj`` over ``up_proj``. They multiply the same input, so one
    product reads the same weight bytes as three (or two) and launches the
    parallel kernel once instead: 121 weight-product launches per step
    instead of 211 for SmolLM2's 30 layers, ~5 ms less per batch-1 step on the
    2-core target (docs/performance.md). Each output row is still the
    dot product of one checkpoint row with the input, computed the same way,
    so nothing else changes; the forward reads q, k, v (and gate, up) as
    column ranges of the fused output.
    """

    input_layernorm: np.ndarray  # (hidden,) float32
    qkv_proj: PreparedWeight  # [q_proj; k_proj; v_proj]: [(n_heads + 2 n_kv) * head_dim, hidden]
    o_proj: PreparedWeight  # [hidden, n_heads * head_dim]
    q_proj_bias: np.ndarray | None  # (n_heads * head_dim,) float32, qwen2
    k_proj_bias: np.ndarray | None  # (n_kv_heads * head_dim,) float32
    v_proj_bias: np.ndarray | None  # (n_kv_heads * head_dim,) float32
    o_proj_bias: np.ndarray | None  # (hidden,) float32, llama attention_bias
    q_norm: np.ndarray | None  # (head_dim,) float32, qwen3
    k_norm: np.ndarray | None  # (head_dim,) float32, qwen3
    post_attention_layernorm: np.ndarray  # (hidden,) float32
    # the MLP: dense SwiGLU, or (qwen3_moe / mixtral sparse layers) experts, never both
    gate_up_proj: PreparedWeight | None  # [gate_proj; up_proj]: [2 * intermediate, hidden]
    down_proj: PreparedWeight | None  # [hidden, intermediate]
    moe: MoeBlock | None = None  # router + experts (moe.py)
    # Gemma 3's sandwich (gemma.py): a norm on the attention's and the MLP's outputs,
    # before each residual add. Gemma's checkpoint calls the first one
    # post_attention_layernorm and the MLP's input norm pre_feedforward_layernorm;
    # here post_attention_layernorm is always the MLP's input norm (Llama's meaning).
    attn_out_norm: np.ndarray | None = None  # (hidden,) float32, 1 + w
    mlp_out_norm: np.ndarray | None = None  # (hidden,) float32, 1 + w
    # [q_proj_bias; k_proj_bias; v_proj_bias] as kernels.qkv_rope_store adds them to
    # the fused product's columns: ((n_heads + 2 n_kv) * head_dim,) float32, or (0,)
    qkv_bias: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))


class _Scratch:
    """Per-row buffers reused by every layer and every step; grown, never shrunk."""

    def __init__(self, config: ModelConfig, rows: int) -> None:
        c = config
        self.rows = rows
        q_dim = c.num_attention_heads * c.head_dim
        kv_dim = c.num_key_value_heads * c.head_dim
        f32 = np.float32
        self.x = np.empty((rows, c.hidden_size), f32)  # residual stream
        self.xn = np.empty((rows, c.hidden_size), f32)  # normed input of a sublayer
        self.q = np.empty((rows, q_dim), f32)
        self.k = np.empty((rows, kv_dim), f32)
        self.v = np.empty((rows, kv_dim), f32)
        self.att = np.empty((rows, q_dim), f32)  # attention output, heads concatenated
        self.proj = np.empty((rows, c.hidden_size), f32)  # o_proj / down_proj output
        # fused products' outputs: [q | k | v] and [gate | up] side by side per row
        self.qkv = np.empty((rows, q_dim + 2 * kv_dim), f32)
        self.gate_up = np.empty((rows, 2 * c.intermediate_size), f32)
        self.gate = np.empty((rows, c.intermediate_size), f32)


class LlamaModel:
    """Llama-family decoder weights plus a ragged forward pass: Llama, Mistral, Qwen2,
    Qwen3, their mixtures of experts (moe.py), Gemma 3 (gemma.py) and Phi-3 (phi3.py).

    ``weights`` is an in-memory ``{checkpoint key: array}`` mapping, a getter
    ``key -> array``, or a :class:`~triollm.model.weights.TensorSource` (a
    :class:`Checkpoint`, read lazily); :func:`expected_shapes` lists the keys.
    Arrays are float32, float16, or uint16 holding bfloat16 bits. Each tensor
    is taken once, checked against its expected shape, prepared, and the raw
    array dropped, so a lazy source never has the model in memory twice.

    Trap: one model runs one forward at a time (it reuses its scratch buffers);
    ``forward`` takes a lock, so a second caller waits rather than corrupts.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray] | Callable[[str], np.ndarray] | TensorSource,
    ) -> None:
        self.config = config
        self._source = as_source(weights)
        self._shapes = expected_shapes(config)
        c = config
        # model.embed_tokens.weight: (vocab, hidden), kept in the checkpoint dtype
        # (or, tied to the head, the head's PreparedWeight); only the rows a step
        # looks up are widened to float32.
        self.embed_tokens: np.ndarray | PreparedWeight = self._take("model.embed_tokens.weight")
        self.layers: list[LlamaLayer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            bias = c.attention_bias
            self.layers.append(
                LlamaLayer(
                    input_layernorm=self._norm(p + "input_layernorm.weight"),
                    qkv_proj=self._fused(*phi3.qkv_keys(c, i)),  # Phi-3: fused already
                    o_proj=self._linear(p + "self_attn.o_proj.weight"),
                    q_proj_bias=self._vector(p + "self_attn.q_proj.bias") if bias else None,
                    k_proj_bias=self._vector(p + "self_attn.k_proj.bias") if bias else None,
                    v_proj_bias=self._vector(p + "self_attn.v_proj.bias") if bias else None,
                    o_proj_bias=(
                        self._vector(p + "self_attn.o_proj.bias") if c.o_proj_bias else None
                    ),
                    q_norm=self._norm(p + "self_attn.q_norm.weight") if c.qk_norm else None,
                    k_norm=self._norm(p + "self_attn.k_norm.weight") if c.qk_norm else None,
                    **self._norms(i),  # post_attention_layernorm (+ Gemma's sandwich)
                    **self._mlp(i),  # gate_up_proj, down_proj, moe
                )
            )
        for layer in self.layers:
            qb, kb, vb = layer.q_proj_bias, layer.k_proj_bias, layer.v_proj_bias
            if qb is not None and kb is not None and vb is not None:
                layer.qkv_bias = np.concatenate([qb, kb, vb])
        self.norm = self._norm("model.norm.weight")  # (hidden,) float32
        if c.tie_word_embeddings:
            # The head is the embedding matrix. prepare() repacks it into column
            # panels (a new array); the embedding lookup then reads its rows from
            # the panels, and the checkpoint-layout copy is dropped: held once.
            self.lm_head = self._prepare("model.embed_tokens.weight", self.embed_tokens)
            if isinstance(self.lm_head, PreparedWeight):
                self.embed_tokens = self.lm_head
        else:
            self.lm_head = self._linear("lm_head.weight")
        # Drop the source: a Checkpoint holds its files open, and nothing is read later.
        del self._source, self._shapes
        g = c.gemma
        # Gemma 3: the embedding row times sqrt(hidden), float32 (as transformers)
        self.embed_scale = np.float32(c.hidden_size**0.5) if g is not None else None
        self._activation = gemma.gelu_tanh_mul if g is not None else kernels.silu_mul
        self.logit_cap = g.final_logit_softcapping if g is not None else None
        self.eps = np.float32(c.rms_norm_eps)
        self.scale = np.float32(1.0 / np.sqrt(np.float32(c.head_dim)))
        if g is not None:  # transformers: query_pre_attn_scalar ** -0.5 in double, then float32
            self.scale = np.float32(g.query_pre_attn_scalar**-0.5)
        self._scratch = _Scratch(c, 16)
        self._lock = threading.Lock()
        # RoPE tables, (max_position_embeddings, rope_dim // 2) float32 each, and per
        # layer (cos, sin, window); the model's own limit until a server says its context
        self.use_context(c.max_position_embeddings)

    def use_context(self, context_tokens: int) -> None:
        """Build the RoPE tables for sequences of up to ``context_tokens`` positions.

        Only LongRoPE (Phi-3's 128k variants) depends on it: the long factors when the
        context exceeds the original training length, the short ones otherwise, chosen
        once for every sequence (``phi3.py`` says why). Every other RoPE ignores it.
        Trap: call it before the first forward into a KV cache; K already cached keep
        the rotation they were written with.
        """
        c = self.config
        with self._lock:
            self.rope_cos, self.rope_sin = rope_tables(c, context_tokens)
            # per layer: (cos, sin, window); Gemma 3's sliding layers have their own
            # RoPE base and window, its full layers the config's (gemma.py)
            self._attention_kind = _attention_kinds(c, self.rope_cos, self.rope_sin)

    # -- loading ---------------------------------------------------------------

    def _take(self, key: str) -> np.ndarray:
        arr = self._source.get_tensor(key)
        want = self._shapes[key]
        if tuple(arr.shape) != want:
            raise ModelLoadError(
                f"{self._source.where(key)}: tensor {key!r} has shape {tuple(arr.shape)}, "
                f"expected {want}"
            )
        if isinstance(arr, QuantizedTensor):  # GGUF blocks (quant.py): shape checked above
            return arr
        if arr.dtype not in (np.float32, np.float16, np.uint16):
            raise ModelLoadError(
                f"{self._source.where(key)}: tensor {key!r} has dtype {arr.dtype}; "
                "expected float32, float16 or bfloat16 bits (uint16)"
            )
        return arr

    def _mlp(self, i: int) -> dict[str, Any]:
        """Layer ``i``'s MLP fields: dense SwiGLU, or a sparse layer's experts."""
        c = self.config
        if c.moe is not None and i in c.moe.sparse_layers:
            experts = []
            for e in range(c.moe.num_experts):
                gate, up, down = expert_keys(c, i, e)
                experts.append(Expert(self._fused(gate, up), self._linear(down)))
            block = MoeBlock(
                self._linear(router_key(c, i)), experts, c.moe.top_k, c.moe.norm_topk_prob
            )
            return {"gate_up_proj": None, "down_proj": None, "moe": block}
        return {
            "gate_up_proj": self._fused(*phi3.gate_up_keys(c, i)),  # Phi-3: fused already
            "down_proj": self._linear(f"model.layers.{i}.mlp.down_proj.weight"),
        }

    def _norm(self, key: str) -> np.ndarray:
        """An RMSNorm weight as the kernel's multiplier: Gemma's ``1 + w``, else ``w``."""
        w = self._vector(key)
        return gemma.norm_weight(w) if self.config.gemma is not None else w

    def _norms(self, i: int) -> dict[str, Any]:
        """Layer ``i``'s MLP input norm, and Gemma 3's two output norms."""
        p = f"model.layers.{i}."
        if self.config.gemma is None:
            return {"post_attention_layernorm": self._norm(p + "post_attention_layernorm.weight")}
        return {
            "post_attention_layernorm": self._norm(p + "pre_feedforward_layernorm.weight"),
            "attn_out_norm": self._norm(p + "post_attention_layernorm.weight"),
            "mlp_out_norm": self._norm(p + "post_feedforward_layernorm.weight"),
        }

    def _vector(self, key: str) -> np.ndarray:
        return to_f32(self._take(key))

    def _prepare(self, key: str, arr: np.ndarray | QuantizedTensor) -> PreparedWeight:
        if isinstance(arr, QuantizedTensor):  # stays its blocks; linear() dispatches on it
            return prepare(arr)  # type: ignore[return-value]
        return prepare(arr, bf16=arr.dtype == np.uint16)

    def _linear(self, key: str) -> PreparedWeight:
        return self._prepare(key, self._take(key))

    def _fused(self, *keys: str) -> PreparedWeight:
        """Stack the weights named by ``keys`` along the output axis and prepare them.

        Each tensor is checked by its own checkpoint key first, so a missing or
        mis-shaped ``k_proj`` is still reported as ``k_proj``. Trap: the parts
        must share one dtype (one checkpoint never mixes them; checked anyway).
        One key is a tensor the checkpoint stored fused (Phi-3): taken as it is.
        """
        if len(keys) == 1:
            return self._linear(keys[0])
        parts = [self._take(key) for key in keys]
        if any(isinstance(a, QuantizedTensor) for a in parts):
            return stack_rows(parts)  # type: ignore[return-value]  # one type stacks (quant.py)
        if len({a.dtype for a in parts}) != 1:
            raise ModelLoadError(
                f"{self._source.where(keys[0])}: tensors {', '.join(keys)} have different "
                f"dtypes ({', '.join(str(a.dtype) for a in parts)}); they are multiplied as one"
            )
        fused = np.concatenate(parts, axis=0)
        del parts  # peak memory: the fused copy plus these parts, briefly
        return self._prepare(keys[0], fused)

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters held in memory (prepared weights, embedding, norms)."""
        total = self.embed_tokens.nbytes + self.norm.nbytes
        if self.lm_head is not self.embed_tokens and not np.shares_memory(
            self.lm_head.data, self.embed_tokens
        ):
            total += self.lm_head.nbytes  # untied, or a tied head prepared into its own buffer
        for layer in self.layers:
            for value in vars(layer).values():  # a MoeBlock counts every expert
                if value is not None:
                    total += value.nbytes
        return int(total)

    # -- the forward pass ------------------------------------------------------

    def forward(self, chunks: Sequence[ChunkPlan], kv: PagedKVCache) -> np.ndarray:
        """Run one ragged step; return ``(n_sampled, vocab)`` float32 logits.

        Row order is the chunks' order; the logits rows are the chunks with
        ``sample=True``, in order. Writes every row's K/V into ``kv`` through
        the chunk's block table before any row attends.

        Trap: a block table must cover ``start + n_rows`` positions and name
        blocks inside the pool; this is checked (ValueError), because the
        kernels themselves do no bounds checks.
        """
        with self._lock:
            return self._forward(chunks, kv)[0]

    def forward_scored(
        self, chunks: Sequence[ChunkPlan], kv: PagedKVCache
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`forward`, plus the final-normed hidden state of every scored row.

        The scored rows are the first ``len(score_ids)`` rows of each chunk, in
        chunk order: ``(n_scored, hidden)`` float32, a copy. Their logits are
        :meth:`head` of them; the sampled rows' logits are computed exactly as
        :meth:`forward` computes them, scored rows or not.
        """
        with self._lock:
            return self._forward(chunks, kv)

    def head(self, h: np.ndarray) -> np.ndarray:
        """``(k, hidden)`` final-normed hidden states -> ``(k, vocab)`` float32 logits.

        Needs no lock: it reads only the head's weights and writes a new array."""
        logits = linear(h, self.lm_head)
        return gemma.soft_cap(logits, self.logit_cap) if self.logit_cap is not None else logits

    def _forward(
        self, chunks: Sequence[ChunkPlan], kv: PagedKVCache
    ) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        rows = _RowIndex.build(chunks, kv, c)
        n = rows.n
        if n > self._scratch.rows:
            self._scratch = _Scratch(c, max(n, 2 * self._scratch.rows))
        s = self._scratch
        n_h, n_kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = s.x[:n]  # (n, hidden) float32: the residual stream
        xn = s.xn[:n]  # (n, hidden) float32
        q = s.q[:n]  # (n, n_heads * head_dim) float32
        k = s.k[:n]  # (n, n_kv_heads * head_dim) float32
        v = s.v[:n]  # (n, n_kv_heads * head_dim) float32
        att = s.att[:n]  # (n, n_heads * head_dim) float32
        proj = s.proj[:n]  # (n, hidden) float32
        qkv = s.qkv[:n]  # (n, (n_heads + 2 n_kv_heads) * head_dim) float32
        gate_up = s.gate_up[:n]  # (n, 2 * intermediate) float32
        gate = s.gate[:n]  # (n, intermediate) float32
        q_dim, kv_dim = n_h * hd, n_kv * hd
        q3 = q.reshape(n, n_h, hd)  # (n, n_heads, head_dim) view
        k3 = k.reshape(n, n_kv, hd)  # (n, n_kv_heads, head_dim) view
        v3 = v.reshape(n, n_kv, hd)  # (n, n_kv_heads, head_dim) view
        att3 = att.reshape(n, n_h, hd)  # (n, n_heads, head_dim) view

        # token embedding (widened from the checkpoint dtype, only these rows)
        table = self.embed_tokens
        if isinstance(table, PreparedWeight):  # tied to the head: rows read from its panels
            x[...] = table.rows(rows.tokens)
        else:
            x[...] = to_f32(table[rows.tokens])
        if self.embed_scale is not None:
            x *= self.embed_scale

        # attention's work items, planned once per window and shared by the layers
        plans: dict[int, kernels.AttentionPlan] = {}
        # the first layer's attention rmsnorm; each later layer's follows the
        # residual add that ends the layer before it (below)
        kernels.rms_norm(x, self.layers[0].input_layernorm, self.eps, xn)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos, sin, window = self._attention_kind[i]
            # (attention rmsnorm: xn holds it already)
            # q, k, v projections, one fused product (+ qwen2 / attention_bias biases)
            linear(xn, layer.qkv_proj, out=qkv)
            if layer.q_norm is None and kv.dtype is not KVDtype.Q8_0:
                # split into q, k, v (+ biases), RoPE at each row's own position, and
                # this step's K/V rounded into the pool through the block tables: one call
                kernels.qkv_rope_store(
                    qkv, layer.qkv_bias, rows.positions, cos, sin, q3, k3, v3,
                    kv.k[i], kv.v[i], rows.block, rows.offset,
                )  # fmt: skip
            else:
                # the same by stages: qwen3 norms each head between the split and RoPE,
                # and q8_0 stores through numpy's encode. Copied out into contiguous q,
                # k, v: the kernels take C-contiguous arrays, and qwen3's per-head norm
                # needs q as (n * n_heads, head_dim), which a column range of qkv
                # cannot be viewed as (a copy the in-place norm would write and lose).
                q[...] = qkv[:, :q_dim]
                k[...] = qkv[:, q_dim : q_dim + kv_dim]
                v[...] = qkv[:, q_dim + kv_dim :]
                qb, kb, vb = layer.q_proj_bias, layer.k_proj_bias, layer.v_proj_bias
                if qb is not None and kb is not None and vb is not None:
                    q += qb
                    k += kb
                    v += vb
                # qwen3: RMSNorm over each head's vector, before RoPE
                if layer.q_norm is not None and layer.k_norm is not None:
                    q_heads = q.reshape(n * n_h, hd)
                    k_heads = k.reshape(n * n_kv, hd)
                    kernels.rms_norm(q_heads, layer.q_norm, self.eps, q_heads)
                    kernels.rms_norm(k_heads, layer.k_norm, self.eps, k_heads)
                # RoPE at each row's own position, queries and keys in one call
                kernels.rope_qk(q3, k3, rows.positions, cos, sin)
                # write this step's K/V through the block tables, then attend over the pool
                # (in the cache's element type: kvstore.py rounds, attention widens)
                if kv.dtype is not KVDtype.Q8_0:  # rounded on the way in, one call
                    kernels.store_kv(k3, v3, kv.k[i], kv.v[i], rows.block, rows.offset)
                else:  # q8_0: numpy's blocks and scales, then two writes
                    k_store, k_scales = kv.encode(k3)
                    v_store, v_scales = kv.encode(v3)
                    kernels.write_kv(k_store, v_store, kv.k[i], kv.v[i], rows.block, rows.offset)
                    if k_scales is not None and v_scales is not None:
                        kernels.write_kv(
                            k_scales,
                            v_scales,
                            kv.k_scale[i],
                            kv.v_scale[i],
                            rows.block,
                            rows.offset,
                        )
            plan = plans.get(window)
            if plan is None:
                plan = kernels.plan_attention(rows.positions, rows.chunk, window, n_kv, n_h, hd)
                plans[window] = plan
            kernels.paged_attention(
                q3,
                kv.k[i],
                kv.v[i],
                rows.positions,
                rows.chunk,
                rows.tables,
                window,
                self.scale,
                att3,
                kv.k_scale[i],
                kv.v_scale[i],
                plan,
            )
            # output projection + residual
            linear(att, layer.o_proj, out=proj)
            if layer.o_proj_bias is not None:
                proj += layer.o_proj_bias
            if layer.attn_out_norm is not None:  # Gemma 3: norm the output, then add
                kernels.rms_norm(proj, layer.attn_out_norm, self.eps, proj)
            # residual, then the mlp rmsnorm. Not one fused kernel: add_rms_norm (this
            # stop) gave a row different last bits on two calls with the same inputs
            # (hypothesis, FlakyFailure), so it was taken out; numpy's add + rms_norm
            # is the path the batch-invariance tests have always held.
            x += proj
            kernels.rms_norm(x, layer.post_attention_layernorm, self.eps, xn)
            if layer.moe is not None:
                # a sparse layer: each row's top-k experts, batched by expert (moe.py)
                layer.moe.forward(xn, proj)
            elif layer.gate_up_proj is not None and layer.down_proj is not None:
                # SwiGLU: down(silu(gate(x)) * up(x))
                linear(xn, layer.gate_up_proj, out=gate_up)
                self._activation(gate_up, gate)  # SwiGLU's silu, Gemma's tanh GELU
                linear(gate, layer.down_proj, out=proj)
            if layer.mlp_out_norm is not None:  # Gemma 3: norm the output, then add
                kernels.rms_norm(proj, layer.mlp_out_norm, self.eps, proj)
            x += proj  # residual (the final norm takes only the sampled rows)
            if i < last:  # the next layer's attention rmsnorm
                kernels.rms_norm(x, self.layers[i + 1].input_layernorm, self.eps, xn)

        # final norm + output head, only on the rows that are sampled
        h = x[rows.sampled]  # (n_sampled, hidden) float32, a copy
        kernels.rms_norm(h, self.norm, self.eps, h)
        logits = self.head(h)  # (n_sampled, vocab) float32 (Gemma: soft-capped)
        # final norm of the scored rows; the caller takes their head in slices
        scored = x[rows.scored]  # (n_scored, hidden) float32, a copy
        if len(scored):
            kernels.rms_norm(scored, self.norm, self.eps, scored)
        return logits, scored


@dataclass(frozen=True)
class _RowIndex:
    """The ragged batch flattened into per-row arrays the kernels index by."""

    n: int
    tokens: np.ndarray  # (n,) int64 token ids
    positions: np.ndarray  # (n,) int64 position of each row in its sequence
    chunk: np.ndarray  # (n,) int64 index of the row's chunk (its row of `tables`)
    block: np.ndarray  # (n,) int64 pool block the row's K/V goes to
    offset: np.ndarray  # (n,) int64 offset inside that block
    tables: np.ndarray  # (n_chunks, max_blocks) int64 block tables, padded with 0
    sampled: np.ndarray  # (n_sampled,) int64 rows whose logits are returned
    scored: np.ndarray  # (n_scored,) int64 rows whose next prompt token is scored
    window: int  # sliding window, 0 for none

    @staticmethod
    def build(chunks: Sequence[ChunkPlan], kv: PagedKVCache, c: ModelConfig) -> _RowIndex:
        if not chunks:
            raise ValueError("forward needs at least one chunk (an empty plan is not run)")
        bs = kv.block_size
        # The kernels do no bounds checks: refuse what cannot run (plan.chunk_problems,
        # the one statement of it, which Batch.check raises as BadChunks).
        bad = chunk_problems(
            chunks,
            vocab_size=c.vocab_size,
            block_size=bs,
            num_blocks=kv.num_blocks,
            max_positions=c.max_position_embeddings,
        )
        if bad:
            raise ValueError("; ".join(f"sequence {s}: {why}" for s, why in bad.items()))
        max_blocks = max(len(ch.block_table) for ch in chunks)
        tables = np.zeros((len(chunks), max(max_blocks, 1)), dtype=np.int64)
        lengths = [len(ch.token_ids) for ch in chunks]
        n = sum(lengths)
        positions = np.empty(n, dtype=np.int64)
        chunk_of_row = np.empty(n, dtype=np.int64)
        sampled: list[int] = []
        scored: list[int] = []
        row = 0
        for ci, ch in enumerate(chunks):
            m = lengths[ci]
            end = ch.start + m
            tables[ci, : len(ch.block_table)] = ch.block_table
            positions[row : row + m] = np.arange(ch.start, end)
            chunk_of_row[row : row + m] = ci
            scored.extend(range(row, row + len(ch.score_ids)))
            row += m
            if ch.sample:
                sampled.append(row - 1)
        tokens = np.fromiter((t for ch in chunks for t in ch.token_ids), dtype=np.int64, count=n)
        block = tables[chunk_of_row, positions // bs]
        return _RowIndex(
            n=n,
            tokens=tokens,
            positions=positions,
            chunk=chunk_of_row,
            block=np.ascontiguousarray(block),
            offset=positions % bs,
            tables=tables,
            sampled=np.asarray(sampled, dtype=np.int64),
            scored=np.asarray(scored, dtype=np.int64),
            window=c.sliding_window or 0,
        )


def to_f32(arr: np.ndarray) -> np.ndarray:
    """Widen a checkpoint array (float32, float16, or uint16 bf16 bits) to float32."""
    if arr.dtype == np.uint16:
        return bf16_bits_to_f32(arr)
    return np.ascontiguousarray(arr, dtype=np.float32)


def inverse_frequencies(config: ModelConfig, context_tokens: int | None = None) -> np.ndarray:
    """RoPE's per-pair angular frequencies, (rope_dim // 2,) float32, with scaling.

    Computed in float32 the way transformers does, so the angles (and so the
    logits of long prompts) agree with the reference to float32 rounding.
    ``context_tokens`` (default: the model's limit) picks LongRoPE's factor list.
    """
    sc = config.rope_scaling
    if sc is not None and sc.rope_type == "longrope":
        context = config.max_position_embeddings if context_tokens is None else context_tokens
        return phi3.longrope_inverse_frequencies(
            config, long=phi3.uses_long_factors(config, context)
        )
    d = config.rope_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)
    if sc is None:
        return inv_freq
    if sc.rope_type == "linear":
        return (inv_freq / np.float32(sc.factor)).astype(np.float32)
    if sc.rope_type == "factors":
        return (inv_freq / np.asarray(sc.frequency_factors, np.float32)).astype(np.float32)
    # llama3: stretch long wavelengths by `factor`, keep short ones, blend between.
    factor = np.float32(sc.factor)
    old_len = np.float32(sc.original_max_position_embeddings)
    low_wavelen = old_len / np.float32(sc.low_freq_factor)
    high_wavelen = old_len / np.float32(sc.high_freq_factor)
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_len / wavelen - np.float32(sc.low_freq_factor)) / np.float32(
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (np.float32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _attention_kinds(
    config: ModelConfig, cos: np.ndarray, sin: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Each layer's RoPE tables and sliding window (0: none).

    Every layer shares the config's unless it is Gemma 3, whose sliding layers
    use ``local_rope_theta`` (unscaled) and ``sliding_window``, and whose full
    layers the config's RoPE with no window (gemma.py).
    """
    g = config.gemma
    if g is None:
        return [(cos, sin, config.sliding_window or 0)] * config.num_hidden_layers
    local = dataclasses.replace(config, rope_theta=g.local_rope_theta, rope_scaling=None)
    local_cos, local_sin = rope_tables(local)
    return [
        (local_cos, local_sin, g.sliding_window) if sliding else (cos, sin, 0)
        for sliding in g.layer_sliding
    ]


def rope_tables(
    config: ModelConfig, context_tokens: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``position * inv_freq``: two (max_positions, rope_dim // 2) float32.

    LongRoPE multiplies both by its attention factor (in float32, as transformers
    does after the cos); the kernel turns ``rope_dim // 2`` pairs, as wide as the table.
    """
    inv_freq = inverse_frequencies(config, context_tokens)
    pos = np.arange(config.max_position_embeddings, dtype=np.float32)
    angles = np.outer(pos, inv_freq).astype(np.float32)  # (max_positions, rope_dim // 2)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    sc = config.rope_scaling
    if sc is not None and sc.rope_type == "longrope" and sc.attention_factor != 1.0:
        scale = np.float32(sc.attention_factor)
        cos, sin = (cos * scale).astype(np.float32), (sin * scale).astype(np.float32)
    return cos, sin
