"""`dsa-train plan`: per-GPU memory and step-time estimate of a recipe on its cluster layout.

    dsa-train plan [--config-name R | recipe=R] [overrides ...] [--peak-tflops 989] [--mfu 0.35]
                   [--gpu-gb 80] [--json] [--trace [--rank R]]

Per rank and per stage (the largest stage decides whether it fits):
  parameters   dense ones replicated over DP x CP (or sharded by ZeRO-3), MLA heads / MLPs / shared
               experts split over TP, routed experts split over EP (not TP-split: each TP rank
               runs them on its 1/TP share of the tokens, as it does the router);
  gradients    trainable parameters only, fp32 accumulation; partitioned by ZeRO-2/3 (dense over
               DP x CP, experts over expert-DP) plus one reduce bucket;
  optimizer    AdamW m and v (fp32) and the fp32 master (DeepSpeed keeps one with ZeRO >= 1 or
               bf16), partitioned by ZeRO >= 1 (all created at initialization, live throughout);
               the update's temporary (one fp32 tensor the size of the param group it steps:
               torch's foreach AdamW; DeepSpeed steps its groups one at a time) exists only during the optimizer step,
               when activations are freed: the peak is the largest of the forward/backward phase
               (the sum of the categories), the step phase (model state + temporaries) and the MLP
               backward phase (a dense layer's or shared expert's row-chunked MLP backward: model
               state, the kept layer inputs, the recomputed layer whose MLP it is, the DSA buffers and that MLP's own
               working set, `mlp_backward_working_set`; in `step_detail_gib`);
  activations  what the backward keeps for one micro-batch of T / CP local tokens: per layer the
               tensors saved by the model's ops (only those on a path to a trainable parameter:
               the dense warm-up keeps the indexer's only), minus what `parallel.recompute`
               recomputes (plus one block's worth while it is recomputed: with `full`, a whole
               layer, attention and MLP; with `attention` / `moe`, that block; each mode's terms
               checked against `--trace`: docs/distributed.md "The plan's activations in every
               recompute mode"), or, if larger, the LM head's logits (the chunked
               cross-entropy keeps no fp32 copy of them) with the head's backward (the logits'
               gradient and the loss backward's fp32 row chunk, at most 2^22 logits: a fixed
               size per micro-batch once the rows exceed it; in the loss's forward two such
               chunks): the logits are freed once that backward has read them, before any
               layer is recomputed;
  DSA buffers  per layer the top-k indices (T_loc x k int32) and, with CP, the all-gathered
               latent KV (T x 576) and indexer keys (T x 128); plus the kernels' transient working
               set (`kernel_workspace` in the output): on a CUDA recipe the largest of the CUDA
               path's kernel launchers' own `workspace` functions at this rank's shapes (the top-k's
               [B, C, T] fp32 score block, the sparse MLA backward's fp32 dkv, the CP attention
               rows' key block, ...: dsa_train.plan.kernel_workspace, the figures `--trace` adds);
               on a CPU recipe what the PyTorch reference kernels hold, the same layer on that
               path (their query chunks' fp32 blocks; a dense stage's: the dense attention's);
  NCCL buffers NCCL's own GPU memory (outside PyTorch's allocator, in both phases): per
               communicator the step uses and per all-to-all peer (`cluster.network.nccl_*`);
               none for a `device: cpu` recipe (gloo).
`--trace` also builds rank R of the layout at the full world size under a fake process group and
traces one training step of the largest stage under FakeTensorMode (dsa_train.plan.trace):
the per-category peak beside these figures, and every collective of the step beside the plan's
communication (dsa_train.plan.trace_comm); `--json` prints it as one JSON object on the last
line.
Step time: the stage's step as the CUDA path runs it, part by part (`Stage.step_flops`,
dsa_train/model/step_flops.py: matmuls at the given MFU, kernels at max(issued FLOPs at the MFU,
bytes at --hbm-tbps); dsa_train.plan.compute), plus every kind of communication of the step (dsa_train.plan.comm: MoE all-to-all
in the forward, the recompute and the backward; CP gathers; TP; the data-parallel gradient
reduction, per micro-batch under ZeRO-2; ZeRO's parameter all-gather; the step's small
all-reduces) at the EFFECTIVE bandwidths and latencies of the recipe's `cluster.network` (not
overlapped: an upper bound). The CPU check in tests/test_parallel_plan.py compares the memory
terms with measured peaks.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from dsa_train.parallel.buckets import REDUCE_BUCKET
from dsa_train.plan.comm import (
    check_network, group_spans, nccl_buffer_bytes, price, ranks_per_node, step_collectives, step_shape,
)
from dsa_train.stage import Stage

GiB = 2**30
KERNEL_CHUNK_ELEMS = 1 << 24  # dsa_kernels/masking.query_chunk_size budget
# fp32 tensors the size of a param group that torch's foreach AdamW step allocates and frees
# (`exp_avg_sq_sqrt`; tests/test_plan_optimizer_step.py measures it on the installed torch)
ADAMW_STEP_TEMPORARIES = 1
# the step line's communication summary: seconds of the kinds whose names start so
COMM_SUMMARY = {"moe_all_to_all_s": "moe_all_to_all", "grad_reduce_s": ("gradient_reduction", "parameter_all_gather"),
                "cp_gather_s": "cp_gather", "tp_s": "tp_"}


@dataclass
class ParamCounts:
    """Parameter counts of one model, by how they are split."""

    replicated: float = 0.0  # embeddings, LM head, norms, q_a/kv_a projections, routers
    tp_split: float = 0.0  # MLA heads (q_b, kv_b, o_proj), dense MLPs, shared experts
    indexer: float = 0.0  # replicated (part of `replicated` for sharding purposes)
    expert: float = 0.0  # one routed expert (gate, up, down)
    moe_layers: int = 0  # layers (incl. MTP) with routed experts
    n_experts: int = 0
    largest_layer: float = 0.0  # dense part of the largest layer (ZeRO-3's gathered working set)
    mtp_replicated: float = 0.0  # of `replicated` / `tp_split`: the MTP layers' (no gradient
    mtp_tp_split: float = 0.0  # where the stage does not run them)
    mtp_moe_layers: int = 0

    @property
    def total(self) -> float:
        return self.replicated + self.tp_split + self.expert * self.n_experts * self.moe_layers


def count_params(c) -> ParamCounts:
    h, H = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    r, rope = c.kv_lora_rank, c.qk_rope_head_dim
    n = ParamCounts(n_experts=c.n_routed_experts or 0)
    n.replicated += c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h
    n.expert = 3 * h * (c.moe_intermediate_size or 0)
    n_layers = c.num_hidden_layers + (c.num_nextn_predict_layers or 0)
    for i in range(n_layers):
        rep = 2 * h + h * (r + rope) + r  # norms, kv_a_proj_with_mqa, kv_a_layernorm
        tp = H * r * 0 + r * H * (c.qk_nope_head_dim + c.v_head_dim) + H * c.v_head_dim * h  # kv_b, o_proj
        if c.q_lora_rank:
            rep += h * c.q_lora_rank + c.q_lora_rank
            tp += c.q_lora_rank * H * qk
        else:
            tp += h * H * qk
        idx = (c.q_lora_rank or h) * c.index_n_heads * c.index_head_dim + h * c.index_head_dim + 2 * c.index_head_dim \
            + h * c.index_n_heads
        rep += idx
        n.indexer += idx
        if c.is_moe_layer(i):
            rep += c.n_routed_experts * h
            tp += 3 * h * c.moe_intermediate_size * (c.n_shared_experts or 0)
            n.moe_layers += 1
        else:
            tp += 3 * h * c.intermediate_size
        if i >= c.num_hidden_layers:  # MTP: its own embedding, enorm/hnorm, eh_proj, shared head
            rep += c.vocab_size * h * 2 + 3 * h + 2 * h * h
            n.mtp_replicated += rep
            n.mtp_tp_split += tp
            n.mtp_moe_layers += int(c.is_moe_layer(i))
        n.replicated += rep
        n.tp_split += tp
        n.largest_layer = max(n.largest_layer, rep + tp)  # + this rank's experts (plan_stage)
    return n


@dataclass
class StagePlan:
    stage: str
    trainable: str
    attention: str
    gib: dict = field(default_factory=dict)  # component -> GiB per rank
    total_gib: float = 0.0
    step_s: float = 0.0
    step_detail: dict = field(default_factory=dict)
    step_detail_gib: dict = field(default_factory=dict)  # the optimizer step's phase (see plan_stage)
    communication: list = field(default_factory=list)  # per kind (plan_comm.price)
    kernel_workspace: dict = field(default_factory=dict)  # the DSA buffers' kernel term (kernel_working_set)


def kernel_working_set(cfg, model_cfg, stage: Stage, sizes, rank: int = 0) -> dict:
    """The DSA buffers' kernel term: the largest transient working set among the kernels the step
    runs, one attention layer run at this rank's shapes on the recipe's path (`kernel_path_of`;
    `dsa_train.plan.kernel_workspace`, the figures `plan --trace` adds). A CUDA recipe: its kernel
    launchers' own `workspace` functions; a CPU recipe: what the PyTorch reference kernels hold
    (their query chunks' fp32 blocks, each at most KERNEL_CHUNK_ELEMS elements; a dense stage's is
    the dense attention reference's: no indexer, no top-k)."""
    import torch

    from dsa_train.plan.kernel_workspace import kernel_workspace
    from dsa_train.plan.trace import kernel_path_of

    path = kernel_path_of(cfg)
    ws = kernel_workspace(model_cfg, stage, sizes, cfg.data.seq_len, cfg.data.micro_batch_size,
                          getattr(torch, cfg.model.dtype.value), rank, cuda=path == "cuda")
    return {"path": path, **ws}


def largest_trainable_param(c, sizes, main_trains: bool) -> float:
    """Elements of the largest trainable parameter tensor of a rank (vocabulary not split; MLA
    output projection and dense MLPs split over TP; routed experts are one tensor per projection);
    `main_trains` False: the indexer's only."""
    idx = max((c.q_lora_rank or c.hidden_size) * c.index_n_heads * c.index_head_dim, c.hidden_size * c.index_n_heads)
    if not main_trains:
        return float(idx)
    h = c.hidden_size
    return float(max(idx, c.vocab_size * h, c.num_attention_heads * c.v_head_dim * h // sizes.tensor,
                     c.intermediate_size * h // sizes.tensor, (c.moe_intermediate_size or 0) * h))


def activation_bytes_per_token(c, sizes, stage: Stage, recompute: str, dtype_bytes: int, seq_len: int, topk: int) -> dict:
    """Bytes kept for the backward per local token (and per-layer DSA buffers), see module doc."""
    h, H = c.hidden_size, c.num_attention_heads // sizes.tensor
    r, rope, nope, v = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    qk, ql = nope + rope, (c.q_lora_rank or 0)
    HI, dI = c.index_n_heads, c.index_head_dim
    sparse = stage.sparse
    main_trains = stage.kind.main_backward
    b = dtype_bytes
    # indexer (detached input): inputs of wq_b / wk / weights_proj for their weight gradients, the
    # k LayerNorm input, and the KL op's inputs q_I, k_I (fp32 weights); score chunks are recomputed
    cp, tp = sizes.context, sizes.tensor
    k = c.num_experts_per_tok or 0
    E, I_moe = c.n_routed_experts or 0, c.moe_intermediate_size or 0
    # indexer (detached input): inputs of wq_b / wk / weights_proj for their weight gradients, the
    # k LayerNorm input, and the KL op's inputs q_I, k_I (fp32 weights); score chunks are recomputed;
    # under CP the gathered keys of the whole sequence (`context.gather`, [T, dI]: cp rows a local token)
    indexer = b * ((ql or h) + h + HI * dI + 2 * dI) + 4 * HI + (b * cp * dI if cp > 1 else 0)
    if sparse:  # the sparse KL keeps its target, Sigma_h P per selected slot (fp32), for its backward
        indexer += 4 * topk
    # live all step: the rotary tables (`rotary_emb`: cos, sin [T_loc, rope / 2] fp32) and the
    # micro-batch's input ids, labels and positions (int64)
    rotary = 4 * rope + 3 * 8
    if main_trains:
        # what an attention layer's backward keeps (its tensors saved by autograd), by what the
        # trace finds live (`plan --trace`, docs/distributed.md "recompute modes"):
        # the layer input (input_layernorm's, `recomputed` keeps its input) and its output x (read
        # by q_a / kv_a / the indexer: their weight gradients) ...
        attn_in = b * 2 * h
        if sparse or cp > 1:  # ... the absorbed (MQA) form: q_a's output and its norm's (ql each),
            # q_b's output (H x qk), kv_a's output (r + rope, its norm's input), the absorbed
            # queries q_abs (H x (r + rope)), the latent keys [kv | k_rope] (this rank's, or under
            # CP the gathered sequence's: cp rows a local token), the latent output (H x r) and its
            # lse (fp32), the up-projected output read by o_proj (H x v)
            attn_body = (b * (2 * ql + H * qk + (r + rope) + H * (r + rope) + cp * (r + rope) + H * r + H * v)
                         + 4 * H)
        else:  # MHA form: per-head k, v and the attention output
            attn_body = (b * (2 * ql + H * qk + (r + rope) + r + rope + H * rope)
                         + b * (H * (nope + v) + 2 * H * qk + H * v + 2 * H * v) + 4 * H)
        attn = attn_in + attn_body
        # the MLP's: post_attention_layernorm's input and output (the MLP's input); the row-chunked
        # MLP (`_RowChunkedMLP`: dense MLPs, shared experts) keeps only its input and recomputes
        # its blocks in the backward
        mlp_in = b * 2 * h
        dense_mlp = mlp_in
        # a MoE layer adds: the router's fp32 copy of x and its sigmoid scores (fp32, E), the expert
        # ids (int64) and weights (fp32) and the dispatch's index tensors (~6 x 8 bytes a pair);
        # the k dispatched copies, the experts' outputs and the weighted product (3 x k x hidden);
        # the experts' gate, up, silu(gate) and their product (4 x k x moe_intermediate) -- for
        # this TP rank's share of the tokens (`TensorParallelTokens`: 1 / TP of them)
        moe = mlp_in + (4 * h + 4 * E + 48 * k + b * (3 * k * h + 4 * k * I_moe)) / tp if E else mlp_in
    else:
        attn_in, attn_body, attn, dense_mlp, moe = 0.0, 0.0, 0.0, 0.0, 0.0
    # the frozen warm-up (the main model runs without autograd): the KL (eq. 3) keeps its main-model
    # inputs (`MLA._forward_frozen`'s `held`: every head's q and k in the MHA form; under CP the
    # absorbed q and the gathered latent keys) and the attention's lse (fp32, every head), unless
    # the recompute covers the attention (`recompute_indexer`: then x and the lse alone)
    H_all = c.num_attention_heads
    if main_trains:
        frozen_kl = 0.0
    elif recompute in ("full", "attention"):
        frozen_kl = b * h + 4 * H_all
    elif cp > 1:
        frozen_kl = b * (H_all * (r + rope) + cp * (r + rope)) + 4 * H_all
    else:
        frozen_kl = b * 2 * H_all * qk + 4 * H_all
    per_layer = []
    for i in range(c.num_hidden_layers):
        mlp = moe if c.is_moe_layer(i) else dense_mlp
        a, m = attn + indexer, mlp
        if not main_trains:  # the indexer and the KL's inputs, or the checkpoint's inputs
            a, m = (frozen_kl if recompute in ("full", "attention") else indexer + frozen_kl), 0.0
        elif recompute == "full":
            a, m = b * h, 0.0  # the layer input only
        elif recompute == "attention":  # the layer input (input_layernorm's) and x, the checkpoint's input
            a = attn_in
        elif recompute == "moe" and c.is_moe_layer(i):  # the residual (post_attention_layernorm's
            m = mlp_in  # input) and its output, the checkpoint's input
        per_layer.append(a + m)
    # a MoE layer's backward adds the gradients of three [k x T_loc / TP, hidden] tensors (the weighted
    # product, the experts' output, the dispatched copies) beside what the MoE keeps
    moe_backward = moe + b * 3 * k * h / tp
    if not main_trains:  # the recompute of the indexer and the KL's inputs, beside x and the lse
        largest_block = indexer + (b * 2 * H_all * qk if cp == 1 else b * (H_all * (r + rope) + cp * (r + rope))) \
            if recompute in ("full", "attention") else 0.0
        layer_saved = {"dense": 0.0, "shared": 0.0}
    elif recompute == "full":  # a whole layer runs again: its attention's tensors stay live while its MLP runs
        mlps = [moe_backward if c.is_moe_layer(i) else dense_mlp for i in range(c.num_hidden_layers)]
        largest_block = attn + indexer + max(mlps, default=0.0)
        # what a recomputed dense / MoE layer keeps while its row-chunked MLP (dense MLP, shared
        # experts) runs its backward: the layer's saved tensors (the MoE's routed part is done or
        # not yet started: its gradients are not live then)
        layer_saved = {"dense": attn + indexer + dense_mlp, "shared": attn + indexer + moe}
    elif recompute == "attention":
        # the attention run again (its tensors beyond x, which the checkpoint keeps) while its
        # backward runs: the MLP's of that layer are freed by then (its backward came first)
        largest_block = attn_body + b * h + indexer
        layer_saved = {"dense": 0.0, "shared": 0.0}  # every layer's MLP tensors are in `layers`
    elif recompute == "moe":  # the MoE run again and its backward (its input kept by the checkpoint)
        largest_block = moe_backward if any(c.is_moe_layer(i) for i in range(c.num_hidden_layers)) else 0.0
        layer_saved = {"dense": 0.0, "shared": moe}
    else:
        largest_block = 0.0
        layer_saved = {"dense": 0.0, "shared": 0.0}
    # a MoE block's forward working set (expert parallel, measured by the trace at its combine):
    # the k dispatched copies of each token sorted by expert, the experts' output, its copy in the
    # received order, the all-to-all's return buffer and the weighted product (5 x k x hidden),
    # plus the combined output. It exists in every forward; when the MoE's tensors are not kept for
    # the backward (recomputed or frozen) it can exceed what a recomputed block keeps.
    if E and (recompute in ("full", "moe") or not main_trains):
        moe_ws = b * (5 * k * h / tp + h)
        if not main_trains:  # the frozen layer in flight (no autograd: nothing of it kept): its input,
            # the attention's output, the residual and its norm (4 x hidden) beside the MoE's k
            # dispatched copies, the experts' output and the weighted sum's two [k x T, hidden]
            # tensors, and the routing (the demo's maximum; at 671B the combine's 5 x k x hidden is larger)
            moe_ws = max(moe_ws, b * (4 * k * h / tp + 4 * h) + (48 * k + 4 * E) / tp)
        if recompute == "full" and main_trains:  # beside the recomputed layer's attention
            largest_block = max(largest_block, attn + indexer + moe_ws)
        else:
            largest_block = max(largest_block, moe_ws)
    elif E and recompute == "attention":  # the MoE's tensors are kept: beyond them, in its forward,
        # the experts' output in the received order and the all-to-all's return buffer, the combined output
        largest_block = max(largest_block, b * (2 * k * h / tp + h))
    # the LM head (not vocabulary-parallel: every rank holds the whole [T_loc, V] logits). The loss
    # (`dsa_train.loss.cross_entropy_sum`) works in fp32 row chunks and saves only the logits and an
    # fp32 log-sum-exp per row; the logits live until the head's backward has read them (the step
    # drops its outputs before the backward: `dsa_train.trainer.step`), once more for the MTP head's.
    # Beside them, never while a layer is recomputed (`head_working_set_bytes` sums these for a
    # micro-batch): in the backward (`head_backward`) the logits' gradient (model dtype,
    # `_CrossEntropySum.backward`'s `grad`) and that backward's fp32 row chunk (softmax - onehot of
    # `head_chunk_rows` rows at a time, `head_chunk_row` bytes a row: the whole logits where they are
    # fewer rows, a fixed size per micro-batch past that, 16 MiB; the demo's traced maximum, 256 local
    # tokens x 4096 vocab, is this 4 MiB block beside two 2 MiB [T, V] bf16 tensors); in the forward two
    # such chunks (the fp32 rows and `torch.logsumexp`'s shifted copy of them, `aten::sub` inside it);
    # or, if larger, the fp32 copy of the no-label micro-batch's zero loss (`trainer/step.py`, 4 x
    # vocab a token; its logits are freed without a loss backward)
    lm = stage.uses_lm and main_trains
    # + a row's vectors in the loss (lse fp32, the valid mask, int64 targets, the nll) and, once, the
    # final norm's input (kept by its `recomputed`) and output (the LM head's input, for its weight gradient)
    head = (1 + stage.uses_mtp) * (b * c.vocab_size + 24) + 2 * b * h if lm else 0.0
    head_backward = b * c.vocab_size if lm else 0.0
    head_chunk_row = 4 * c.vocab_size if lm else 0.0
    head_no_label = 4 * c.vocab_size if lm else 0.0
    # DSA buffers per layer: top-k indices of local queries, CP-gathered latent KV + indexer key
    dsa_layer_tokens = 4 * topk if sparse else 0.0
    cp_gather_full = b * ((r + rope) + dI) if sizes.context > 1 else 0.0  # per *full-sequence* token
    return {
        "layers": sum(per_layer) + rotary, "recompute_block": largest_block, "head": head, "head_backward": head_backward,
        "head_chunk_row": head_chunk_row, "head_chunk_rows": cross_entropy_chunk_rows(c.vocab_size),
        "head_no_label": head_no_label,
        "layer_saved": layer_saved,
        "dsa_indices": dsa_layer_tokens * c.num_hidden_layers if recompute != "full" else dsa_layer_tokens,
        # per MoE layer whose tensors the backward keeps: the router's fp32 copy of its weight
        # (`Router.forward`: F.linear(x.float(), weight.float()) saves both), bytes a layer
        "router_weight_copies": 4 * E * c.hidden_size * sum(
            1 for i in range(c.num_hidden_layers) if c.is_moe_layer(i)) if main_trains and recompute in ("none", "attention") else 0.0,
        "cp_gather": cp_gather_full * (c.num_hidden_layers if recompute != "full" else 1),
    }


def cross_entropy_chunk_rows(vocab: int) -> int:
    """Rows of the logits the loss turns into fp32 at a time (`dsa_train.loss.cross_entropy_sum`:
    its `chunk_elems` default over the vocabulary, at least one)."""
    import inspect

    from dsa_train.loss import cross_entropy_sum

    return max(1, inspect.signature(cross_entropy_sum).parameters["chunk_elems"].default // vocab)


def head_working_set_bytes(act: dict, tokens: float) -> float:
    """What the LM head's loss holds for one micro-batch of `tokens` local tokens beside the kept
    logits (`activation_bytes_per_token`'s `head`), the largest of: its backward (the logits'
    gradient and an fp32 row chunk, at most `head_chunk_rows` rows: a fixed size past them), its
    forward (two fp32 row chunks: the rows and logsumexp's shifted copy) and the no-label
    micro-batch's fp32 copy of the logits."""
    chunk = min(tokens, act["head_chunk_rows"]) * act["head_chunk_row"]
    return max(tokens * act["head_backward"] + chunk, 2 * chunk, tokens * act["head_no_label"])


def mlp_backward_working_set(c, sizes, rows: int, elem_bytes: int, main_trains: bool,
                             kinds: tuple[str, ...] = ("dense", "shared")) -> int:
    """Bytes the row-chunked MLP's backward (`dsa_train.model.moe._RowChunkedMLP`: the dense layers'
    MLP, the shared experts) holds beyond what its layer keeps, for the larger of the two: its three
    weight gradients in the model dtype (and two weight-sized copies), its blocks' [rows, I] temporaries, dx and a block's three
    [block, hidden] terms of it, and, where it walks
    the rows in several blocks, three fp32 weight-sized accumulators. 0 when the MLPs do not train."""
    if not main_trains:
        return 0
    from dsa_train.model.moe import _RowChunkedMLP

    h, b = c.hidden_size, elem_bytes
    inters = []
    if "dense" in kinds and any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        inters.append(c.intermediate_size // sizes.tensor)
    if "shared" in kinds and c.n_routed_experts and c.n_shared_experts:
        inters.append(c.moe_intermediate_size * c.n_shared_experts // sizes.tensor)
    block = _RowChunkedMLP.backward_rows_per_block(rows, h, b)
    # 3 + 2: the weight gradients, and the transposed weight copies F.linear makes where the trace runs
    # (a CPU under FakeTensorMode; cuBLAS reads them transposed: an upper bound there)
    return max((12 * I * h * (block < rows) + 5 * b * I * h + _RowChunkedMLP.BLOCK_TEMPORARIES * min(block, rows) * I * b
                + (rows + 3 * min(block, rows)) * h * b for I in inters), default=0)  # dx, a block's dx terms


def plan_stage(cfg, model_cfg, stage: Stage, sizes, opts) -> StagePlan:
    c = model_cfg
    n = count_params(c)
    pb = 2 if cfg.model.dtype.value == "bfloat16" else 4
    zero = cfg.parallel.zero_stage
    dense_rank = n.replicated + n.tp_split / sizes.tensor
    expert_rank = n.expert * n.moe_layers * (n.n_experts / sizes.expert)
    # a kind whose main model runs no backward trains the indexer only
    main_trains = stage.kind.main_backward
    t_dense = dense_rank if main_trains else n.indexer
    t_expert = expert_rank if main_trains else 0.0
    shard_d, shard_e = sizes.dense_dp, sizes.expert_dp
    p = StagePlan(stage.name, stage.kind.name, stage.attention)
    g = p.gib
    if zero == 3:
        layer_rank = n.largest_layer + n.expert * n.n_experts / sizes.expert
        g["parameters"] = pb * (dense_rank / shard_d + expert_rank / shard_e + 2 * layer_rank) / GiB
    else:
        g["parameters"] = pb * (dense_rank + expert_rank) / GiB
    grad_elems = (t_dense / shard_d + t_expert / shard_e) if zero >= 2 else (t_dense + t_expert)
    # + the largest trainable parameter's gradient in the model dtype: autograd produces p.grad
    # whole before ZeRO's hook reduces it into the fp32 bucket (the LM head / embedding, vocab x
    # hidden, in the sparse stage: 1.7 GiB at 671B; the indexer's wq_b in the warm-up)
    grad_elems += (pb / 4) * largest_trainable_param(c, sizes, main_trains)
    g["gradients"] = 4 * (grad_elems + (min(REDUCE_BUCKET, t_dense + t_expert) if zero >= 1 else 0)) / GiB
    master = 4 if (zero >= 1 or pb == 2) else 0
    opt_elems = (t_dense / shard_d + t_expert / shard_e) if zero >= 1 else (t_dense + t_expert)
    # + the update's temporaries (the optimizer step phase only): torch's foreach AdamW
    # (`_multi_tensor_adam`, the default on CUDA) allocates ADAMW_STEP_TEMPORARIES fp32 tensors the
    # size of the param group it steps and updates everything else in place; DeepSpeed ZeRO-1/2
    # keeps one flat fp32 partition per param group and steps the groups one after the other
    # (`_optimizer_step(i)`), its fp32 gradient partition being the partition's `.grad` as is
    # (no copy with fp32 accumulation); the largest group is at most the dense or the expert partition
    if zero >= 1:
        largest_group = max(t_dense / shard_d, t_expert / shard_e)
    else:
        largest_group = t_dense + t_expert
    g["optimizer"] = (8 + master) * opt_elems / GiB
    step_temporaries = ADAMW_STEP_TEMPORARIES * 4 * largest_group / GiB
    T_loc = cfg.data.micro_batch_size * cfg.data.seq_len / sizes.context
    topk = stage.topk_for(c)
    act = activation_bytes_per_token(c, sizes, stage, cfg.parallel.recompute, pb, cfg.data.seq_len, topk)
    # the head's backward and a layer's recompute come one after the other (the head's first)
    g["activations"] = (T_loc * act["layers"] + act["router_weight_copies"] + max(T_loc * act["recompute_block"],
                                                    T_loc * act["head"] + head_working_set_bytes(act, T_loc))) / GiB
    # the kernels' transient working set at this rank's shapes, on the path the recipe's device runs
    ws = kernel_working_set(cfg, c, stage, sizes, getattr(opts, "rank", 0))
    p.kernel_workspace = ws
    # recomputed layers keep their top-k indices for the recompute (it replays them) up to the memo's
    # budget for all layers together (`dsa_kernels.ops.indexer_topk.memo`); past it they select again
    reused = 0.0
    if cfg.parallel.recompute == "full" and act["dsa_indices"]:
        from dsa_kernels.ops.indexer_topk.memo import DEFAULT_BUDGET_BYTES

        per_layer = T_loc * act["dsa_indices"]
        reused = min(c.num_hidden_layers, DEFAULT_BUDGET_BYTES // per_layer) * per_layer
    g["dsa_buffers"] = (T_loc * act["dsa_indices"] + reused + cfg.data.micro_batch_size * cfg.data.seq_len
                        * act["cp_gather"] + ws["bytes"]) / GiB
    # two phases: forward/backward (everything above) and the optimizer step (model state plus the
    # update's temporaries; activations and DSA buffers are freed by then) -- the peak is the larger
    step_phase = g["parameters"] + g["gradients"] + g["optimizer"] + step_temporaries
    # a third phase: a dense layer's (or shared expert's) MLP backward, after the LM head's: the kept
    # layer inputs, the block being recomputed, the DSA buffers and that MLP's working set
    # (the logits are gone by then: freed after the head's backward; the block is the layer whose MLP it is)
    mlp_ws = mlp_backward_working_set(c, sizes, int(T_loc), pb, main_trains) / GiB
    mlp_phase = (g["parameters"] + g["gradients"] + g["optimizer"] + g["dsa_buffers"]
                 + (T_loc * act["layers"] + act["router_weight_copies"]) / GiB
                 + max(T_loc * act["layer_saved"][kind] / GiB
                       + mlp_backward_working_set(c, sizes, int(T_loc), pb, main_trains, (kind,)) / GiB
                       for kind in ("dense", "shared")))
    p.step_detail_gib = {"optimizer_step_temporaries": step_temporaries, "optimizer_step_phase": step_phase,
                         "mlp_backward_working_set": mlp_ws, "mlp_backward_phase": mlp_phase}
    # step time: every part of the step as the CUDA path issues it (`Stage.step_flops`: FLOPs at the MFU,
    # kernels at max(FLOPs at the MFU, bytes at the HBM bandwidth)), plus every kind of communication at
    # the cluster's effective bandwidths (plan/comm.py), added without overlap
    from dsa_train.plan.compute import compute_seconds

    tokens = stage.config.global_batch_size * cfg.data.seq_len
    step = stage.step_flops(c, cfg.data.seq_len, sizes.context, cfg.parallel.recompute, cfg.data.micro_batch_size,
                            tensor=sizes.tensor)
    timing = compute_seconds(step, tokens / sizes.world, opts.peak_tflops * 1e12, opts.mfu,
                             getattr(opts, "hbm_tbps", 3.35) * 1e12, tensor=sizes.tensor)
    compute = timing["compute_s"]
    # what gets a gradient to reduce: the trainable parameters less the MTP layer's where it does not run
    reduced_dense, reduced_expert = t_dense, t_expert
    if main_trains and not stage.uses_mtp:
        reduced_dense -= n.mtp_replicated + n.mtp_tp_split / sizes.tensor
        reduced_expert -= n.expert * n.mtp_moe_layers * (n.n_experts / sizes.expert)
    shape = step_shape(cfg, stage, sizes, (t_dense, t_expert), (reduced_dense, reduced_expert), topk,
                       ws["path"])
    rows = step_collectives(c, sizes, shape, REDUCE_BUCKET)
    spans = group_spans(sizes, ranks_per_node(cfg), opts.rank)
    p.communication = price(rows, spans, cfg.cluster.network)
    # NCCL's buffers (outside PyTorch's allocator) count in every phase; a CPU recipe runs gloo
    on_gpu = getattr(cfg.device, "value", cfg.device) != "cpu"
    g["nccl_buffers"] = nccl_buffer_bytes(rows, spans, cfg.cluster.network) / GiB if on_gpu else 0.0
    p.total_gib = max(sum(g.values()), step_phase + g["nccl_buffers"], mlp_phase + g["nccl_buffers"])
    comm = sum(r["seconds"] for r in p.communication)
    p.step_s = compute + comm
    # the MFU the trainer reports (`perf/mfu`: the stage's model FLOPs over the step's time) at this step time
    model_fpt = stage.flops_per_token(c, cfg.data.seq_len)
    p.step_detail = {"compute_s": compute, "communication_s": comm, "micro_batches": shape.micro_batches,
                     "flops_per_token": model_fpt, "issued_flops_per_token": step.issued,
                     "recomputed_flops_per_token": step.recomputed, "hbm_bytes_per_token": step.hbm_bytes,
                     "tokens_per_step": tokens, "model_flops_compute_s": timing["model_flops_s"],
                     "mfu": tokens * model_fpt / (sizes.world * opts.peak_tflops * 1e12 * p.step_s) if p.step_s else 0.0,
                     "parts": timing["parts"]}
    for key, kinds in COMM_SUMMARY.items():
        p.step_detail[key] = sum(r["seconds"] for r in p.communication if r["kind"].startswith(kinds))
    return p


def model_config_of(cfg):
    from pathlib import Path

    from dsa_train.model import tiny_config
    from dsa_train.model.config import DSAConfig

    if cfg.model.pretrained is None:
        from dsa_train.data import load_tokenizer

        arch = dict(cfg.model.arch)
        arch.setdefault("vocab_size", load_tokenizer(cfg.data.tokenizer).vocab_size)
        return tiny_config(**arch), "from-scratch arch"
    path = Path(cfg.model.pretrained)
    if (path / "config.json").is_file():
        return DSAConfig.from_pretrained(path), str(path)
    return DSAConfig(), f"{path} not found here: DeepSeek-V3.2 671B defaults"


def make_plan(cfg, opts, world: int | None = None) -> dict:
    from dsa_train.config import resolve_sizes
    from dsa_train.parallel.groups import check_model_divisibility

    cl = cfg.cluster
    # a one-process profile (profile=smoke) runs on one rank whatever the cluster group says
    one_process = getattr(getattr(cfg, "profile", None), "one_process", False)
    world = world or (1 if one_process else cl.nodes * (cl.procs_per_node or cl.gpus_per_node))
    rank = getattr(opts, "rank", 0)
    if not 0 <= rank < world:
        from dsa_train.config import ConfigError

        raise ConfigError(f"--rank {rank}: the layout has {world} ranks",
                          fix=f"pass --rank 0..{world - 1} (or --world N with more ranks)")
    sizes = resolve_sizes(cfg.parallel, world, launch="pass --world {}")
    model_cfg, source = model_config_of(cfg)
    check_model_divisibility(sizes, model_cfg)
    check_network(cfg.cluster.network)
    stages = [plan_stage(cfg, model_cfg, Stage.of(name, st), sizes, opts) for name, st in cfg.stages.items()]
    n = count_params(model_cfg)
    peak = max(s.total_gib for s in stages)
    return {
        "run_name": cfg.run_name, "model": source, "params_total_b": n.total / 1e9,
        "layout": {"world": world, "nodes": cl.nodes, "tp": sizes.tensor, "cp": sizes.context, "ep": sizes.expert,
                   "dp": sizes.data, "zero": cfg.parallel.zero_stage, "recompute": cfg.parallel.recompute},
        "seq_len": cfg.data.seq_len, "micro_batch_size": cfg.data.micro_batch_size,
        "stages": [asdict(s) for s in stages], "peak_gib": peak, "gpu_gib": opts.gpu_gb, "usable": opts.usable,
        "fits": peak <= opts.gpu_gb * opts.usable,
    }


def format_plan(plan: dict) -> str:
    lay = plan["layout"]
    out = [f"plan {plan['run_name']}: {plan['params_total_b']:.1f}B parameters ({plan['model']})",
           f"  layout: {lay['world']} ranks = {lay['nodes']} nodes; TP {lay['tp']} CP {lay['cp']} EP {lay['ep']} "
           f"DP {lay['dp']}; ZeRO-{lay['zero']}; recompute {lay['recompute']}; {plan['micro_batch_size']} x "
           f"{plan['seq_len']} tokens per micro-batch"]
    for s in plan["stages"]:
        parts = "  ".join(f"{k} {v:.2f}" for k, v in s["gib"].items())
        d = s["step_detail"]
        out.append(f"  stage {s['stage']} ({s['attention']}, trains {s['trainable']}): {s['total_gib']:.2f} GiB/rank "
                   f"[{parts}]")
        ws = s["kernel_workspace"]
        if ws:
            out.append(f"      kernel working set ({ws['path']} path, in dsa_buffers): {ws['bytes'] / GiB:.3f} GiB, "
                       f"largest: {ws['op']}")
        ph, nccl = s["step_detail_gib"], s["gib"].get("nccl_buffers", 0.0)
        if ph:  # the peak is the largest phase's
            out.append(f"      phases: forward/backward {sum(s['gib'].values()):.2f}, optimizer step "
                       f"{ph['optimizer_step_phase'] + nccl:.2f}, MLP backward {ph['mlp_backward_phase'] + nccl:.2f} GiB "
                       f"(its working set {ph['mlp_backward_working_set']:.2f})")
        out.append(f"      step ~{s['step_s']:.1f} s = compute {d['compute_s']:.1f} + communication "
                   f"{d['communication_s']:.1f} (MoE all-to-all {d['moe_all_to_all_s']:.1f}, gradients "
                   f"{d['grad_reduce_s']:.1f}, CP gather {d['cp_gather_s']:.2f}, TP {d['tp_s']:.1f}; not overlapped); "
                   f"{d['micro_batches']} micro-batches; {d['flops_per_token'] / 1e9:.1f} model GFLOP/token (MFU's), "
                   f"{d['issued_flops_per_token'] / 1e9:.1f} issued; MFU at this step {d['mfu']:.1%}")
        parts = ", ".join(f"{k} {v['seconds']:.1f}" + (" (memory)" if v["bound"] == "memory" else "")
                          for k, v in d["parts"].items())
        out.append(f"      compute by part (s; FLOPs at the MFU, kernels at max(FLOPs, bytes at --hbm-tbps)): {parts}; "
                   f"the model FLOPs alone at the MFU: {d['model_flops_compute_s']:.1f} s")
        out.append(f"      {'communication per step':33s} {'op':14s} {'group':>18s} {'calls':>7s} {'GB sent':>9s} "
                   f"{'seconds':>8s}")
        for r in s["communication"]:
            group = f"{r['group']} {r['group_size']}" + (f"/{r['group_nodes']}n" if r["group_nodes"] > 1 else "")
            out.append(f"        {r['kind']:31s} {r['op']:14s} {group:>18s} {r['calls']:7.0f} "
                       f"{r['wire_bytes'] / 1e9:9.2f} {r['seconds']:8.2f}")
    verdict = "fits" if plan["fits"] else "does NOT fit"
    out.append(f"  peak {plan['peak_gib']:.1f} GiB/rank: {verdict} in {plan['gpu_gib']} GB GPUs "
               f"(with {1 - plan['usable']:.0%} headroom for allocator and CUDA context)")
    return "\n".join(out)


def parse_opts(argv):
    p = argparse.ArgumentParser(prog="dsa-train plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H800 SXM: 989)")
    p.add_argument("--mfu", type=float, default=0.35)
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GiB (an \"80 GB\" H100 reports 79.2 GiB)")
    p.add_argument("--hbm-tbps", type=float, default=3.35,
                   help="HBM bandwidth per GPU in TB/s (H100 SXM: 3.35; H200: 4.8): the kernels' bytes (memory-bound parts)")
    p.add_argument("--usable", type=float, default=0.9, help="fraction of GPU memory the plan may use")
    p.add_argument("--net-gbps", type=float, default=None, help=argparse.SUPPRESS)  # gone: cluster.network
    p.add_argument("--world", type=int, default=None, help="ranks (default: cluster.nodes x procs/GPUs per node)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trace", action="store_true",
                   help="also trace one training step of rank --rank at the full world size (dsa_train.plan.trace)")
    p.add_argument("--rank", type=int, default=0, help="the rank --trace builds (default 0)")
    from dsa_train.config.overrides import recipe_args

    opts, recipe, overrides = recipe_args(p, argv)
    bounds = {"--peak-tflops": (opts.peak_tflops, "> 0", opts.peak_tflops > 0),
              "--mfu": (opts.mfu, "in (0, 1]", 0 < opts.mfu <= 1),
              "--gpu-gb": (opts.gpu_gb, "> 0", opts.gpu_gb > 0),
              "--hbm-tbps": (opts.hbm_tbps, "> 0", opts.hbm_tbps > 0),
              "--usable": (opts.usable, "in (0, 1]", 0 < opts.usable <= 1),
              "--world": (opts.world, ">= 1", opts.world is None or opts.world >= 1),
              "--rank": (opts.rank, ">= 0", opts.rank >= 0)}
    for flag, (value, rule, ok) in bounds.items():
        if not ok:
            default = p.get_default(flag[2:].replace("-", "_"))
            p.error(f"{flag} {value}: must be {rule} (default: "
                    f"{'cluster.nodes x cluster.procs_per_node' if default is None else default})")
    opts.recipe_args = ["--config-name", recipe, *overrides]
    return opts, opts.recipe_args


def traced_plan(cfg, opts, plan: dict) -> dict:
    """`--trace`: the traced peak of the plan's largest stage beside the plan's figures (bytes; the
    plan's without NCCL's buffers, which are outside PyTorch's storages), and the traced step's
    collectives beside the plan's communication, per (op, group, phase)."""
    from dsa_train.plan.trace import trace_step
    from dsa_train.plan.trace_comm import compare_communication, traced_communication

    stage = max(plan["stages"], key=lambda s: s["total_gib"])
    model_cfg, _ = model_config_of(cfg)
    traced = trace_step(cfg, model_cfg, rank=opts.rank, world=plan["layout"]["world"], stage_name=stage["stage"])
    planned = {k: int(v * GiB) for k, v in stage["gib"].items() if k != "nccl_buffers"}
    nccl = int(stage["gib"]["nccl_buffers"] * GiB)
    # each category's maximum over the step as the plan has it (beside the trace's `category_max`):
    # the optimizer's is its state plus the update's temporaries, in the optimizer step phase
    planned_max = dict(planned)
    planned_max["optimizer"] += int(stage["step_detail_gib"]["optimizer_step_temporaries"] * GiB)
    comm = compare_communication(
        stage["communication"],
        traced_communication(traced["collectives"], stage["step_detail"]["micro_batches"], cfg.cluster.network))
    return {
        "world_size": traced["world_size"], "rank": traced["rank"], "stage": stage["stage"],
        "traced_peak_bytes": traced["peak_total"], "planned_peak_bytes": int(stage["total_gib"] * GiB) - nccl,
        "planned_nccl_bytes": nccl, "gpu_memory_bytes": int(opts.gpu_gb * GiB), "traced": traced["peak"],
        "planned": planned, "traced_max": traced["category_max"], "planned_max": planned_max,
        "peak_phase": traced["peak_phase"], "layout": traced["layout"], "trace_seconds": round(traced["seconds"], 1),
        "peak_at": traced["peak_at"], "peak_dsa_sites": traced["peak_dsa_sites"],
        "kernels": traced["kernels"], "kernel_ops": traced["kernel_ops"], "fits": traced["peak_total"] + nccl <= opts.gpu_gb * GiB * opts.usable,
        "micro_batches": stage["step_detail"]["micro_batches"], "traced_collective_calls": len(traced["collectives"]),
        "communication": comm,
        "planned_comm_bytes": sum(r["planned_bytes"] for r in comm), "traced_comm_bytes": sum(r["traced_bytes"] for r in comm),
        "planned_comm_s": sum(r["planned_s"] for r in comm), "traced_comm_s": sum(r["traced_s"] for r in comm),
        "traced_matmul_flops": traced["matmul_flops"],
        "planned_matmul_flops": planned_matmul_flops(cfg, stage, traced["layout"]["tp"], traced["layout"]["cp"]),
    }


def planned_matmul_flops(cfg, stage: dict, tensor: int, context: int) -> dict:
    """The plan's matmul parts (those it times by FLOPs alone: no kernel bytes) as one rank issues
    them for one micro-batch (`data.micro_batch_size` x `data.seq_len` / CP tokens; a part's TP-split
    share divided over the TP group, the rest whole): what `--trace` counts with aten's FLOP formulas."""
    tokens = cfg.data.micro_batch_size * cfg.data.seq_len / context
    return {name: tokens * p["issued_flops"] * (p["tp_split"] / tensor + 1.0 - p["tp_split"])
            for name, p in stage["step_detail"]["parts"].items() if not p["hbm_bytes"]}


def format_trace(t: dict) -> str:
    out = [f"trace: rank {t['rank']} of {t['world_size']}, stage {t['stage']}, {t['kernels']} kernel path, one step "
           f"({t['trace_seconds']} s): peak {t['traced_peak_bytes'] / GiB:.2f} GiB traced (in the "
           f"{t['peak_phase'].replace('_', ' ')} phase), {t['planned_peak_bytes'] / GiB:.2f} GiB planned "
           f"(+ {t['planned_nccl_bytes'] / GiB:.2f} GiB NCCL buffers); per category: at the traced peak, "
           f"and each one's maximum over the step"]
    for k in t["traced"]:
        plan, plan_max = t["planned"].get(k), t["planned_max"].get(k)
        out.append(f"  {k:13s} traced {t['traced'][k] / GiB:8.3f} GiB (max {t['traced_max'][k] / GiB:8.3f})   planned "
                   + (f"{plan / GiB:8.3f} GiB (max {plan_max / GiB:8.3f})" if plan is not None else "       - (in gradients)"))
    for site, n in list(t.get("peak_dsa_sites", {}).items())[:8]:  # what the DSA buffers at the peak are
        out.append(f"    dsa_buffers at the peak {n / GiB:8.3f} GiB  {site}")
    if t["kernel_ops"]:
        out.append("  kernel ops traced (calls): " + ", ".join(f"{k.split('::')[-1]} {n}" for k, n in t["kernel_ops"].items()))
    traced_mm, planned_mm = sum(t["traced_matmul_flops"].values()), sum(t["planned_matmul_flops"].values())
    out.append(f"matmul FLOPs of one micro-batch on this rank: {traced_mm / 1e9:.2f} GFLOP traced (aten's formulas), "
               f"{planned_mm / 1e9:.2f} planned (the parts timed by FLOPs: "
               + ", ".join(t["planned_matmul_flops"]) + ")")
    out.append(f"communication per step ({t['traced_collective_calls']} collectives traced in one micro-batch and "
               f"the update; x {t['micro_batches']} micro-batches): {t['traced_comm_bytes'] / 1e9:.1f} GB traced, "
               f"{t['planned_comm_bytes'] / 1e9:.1f} GB planned; {t['traced_comm_s']:.1f} s traced, "
               f"{t['planned_comm_s']:.1f} s planned")
    for r in t["communication"]:
        out.append(f"  {r['key']:32s} traced {r['traced_bytes'] / 1e9:9.2f} GB {r['traced_s']:7.2f} s   planned "
                   f"{r['planned_bytes'] / 1e9:9.2f} GB {r['planned_s']:7.2f} s  {' '.join(r['kinds'])}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from dsa_train.config import ConfigError, to_train_config
    from dsa_train.config.hydra_errors import compose_checked
    from dsa_train.config.overrides import split_recipe_args

    opts, rest = parse_opts(argv)
    if opts.net_gbps is not None:
        print("dsa-train plan: --net-gbps is gone: the plan prices communication with the recipe's effective "
              "bandwidths, e.g. cluster.network.inter_node_gbps=40 (docs/distributed.md, \"Communication\")",
              file=sys.stderr)
        return 2
    recipe, overrides = split_recipe_args(rest)
    try:
        # the recipe's values checked as for training; not its data sources or checkpoint paths
        # against this machine (`check_environment`): a plan needs neither
        composed = compose_checked(recipe, overrides)
        if OmegaConf.is_missing(composed.model, "pretrained"):
            composed.model.pretrained = "<model.pretrained>"
        if OmegaConf.is_missing(composed.data, "sources") or not composed.data.sources:
            composed.data.sources = ["<data.sources>"]
        cfg = to_train_config(composed)
        plan = make_plan(cfg, opts, world=opts.world)
    except ConfigError as err:
        print(f"dsa-train plan: {err}", file=sys.stderr)
        return 2
    if opts.trace:
        trace = traced_plan(cfg, opts, plan)
        print(format_plan(plan) if not opts.json else "")
        print(json.dumps(trace) if opts.json else format_trace(trace))
        return 0 if trace["fits"] else 1
    print(json.dumps(plan, indent=1) if opts.json else format_plan(plan))
    return 0 if plan["fits"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
