"""What one training step communicates, by kind, for `dsa-train plan`; and what it costs at the
cluster's effective bandwidths (`cluster.network`, `NetworkConfig`).

Each kind is a small function of the model, the layout and the stage that returns `Collective`
rows: the op, its group, when it runs (a micro-batch's forward, its recompute under
`parallel.recompute`, its backward, or once per step), how many calls per step and the payload of
one call. They model the code as it is; when the code changes what it sends (e.g. per-node
de-duplication of MoE tokens, one gradient reduction per step, a reduce-scatter for the CP
gather's backward), update that kind's function: `dsa-train plan --trace` records every
collective of a traced step and `tests/test_parallel_trace.py` compares the two per kind.

Payload of one call (what the trace records for the same call):
  all_to_all      the bytes this rank sends (its input, its own share included)
  all_gather      the gathered output (group size x the input)
  all_reduce, reduce, broadcast   the tensor
  reduce_scatter  the input (group size x the output)
Bytes on the wire per rank (NCCL's bus-bandwidth convention): all_reduce 2(n-1)/n x payload,
all_gather / reduce_scatter / all_to_all (n-1)/n x payload, reduce / broadcast 1 x payload.
Time of a call: latency (intra- or inter-node) + wire bytes / effective bandwidth, where a group
within one node uses `intra_node_gbps`; a ring collective across nodes `inter_node_gbps`; an
all-to-all across nodes sends (g-1)/n of its payload over NVLink and (n-g)/n over the network
(g of its n ranks on this node), concurrently: the slower part counts. Kinds add up without
overlap (an upper bound: ZeRO-2's `overlap_comm` hides part of the gradient reduction behind the
backward, not counted here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9
MiB = 2**20
PHASES = ("forward", "recompute", "backward", "step")  # the first three: per micro-batch


@dataclass(frozen=True)
class Collective:
    """One kind of communication of a step."""

    kind: str  # e.g. "moe_all_to_all_forward"
    op: str  # all_to_all | all_gather | all_reduce | reduce | reduce_scatter | broadcast
    group: str  # tp | cp | ep | dp | dense_dp | expert_dp | world (ParallelState's groups)
    phase: str  # forward | recompute | backward (per micro-batch) | step (once)
    calls: float  # per step
    payload_bytes: float  # per call (module doc)


@dataclass(frozen=True)
class GroupSpan:
    size: int  # ranks in the group
    on_node: int  # of them on this rank's node (this rank included)

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / max(self.on_node, 1))


def wire_fraction(op: str, n: int) -> float:
    """Bytes each rank puts on links per payload byte (module doc)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce", "broadcast"):
        return 1.0
    return (n - 1) / n


def collective_seconds(op: str, payload_bytes: float, span: GroupSpan, net) -> float:
    """Seconds of one call at the effective bandwidths of `net` (a NetworkConfig)."""
    n = span.size
    if n <= 1:
        return 0.0
    across = span.nodes > 1
    latency = (net.inter_node_latency_us if across else net.intra_node_latency_us) * 1e-6
    if op == "all_to_all" and across:
        intra = payload_bytes * (span.on_node - 1) / n / (net.intra_node_gbps * GB)
        inter = payload_bytes * (n - span.on_node) / n / (net.all_to_all_inter_node_gbps * GB)
        return latency + max(intra, inter)
    bandwidth = net.inter_node_gbps if across else net.intra_node_gbps
    return latency + payload_bytes * wire_fraction(op, n) / (bandwidth * GB)


# ------------------------------------------------------------------ the layout's groups
def ranks_per_node(cfg) -> int:
    cl = cfg.cluster
    return max(cl.procs_per_node or cl.gpus_per_node, 1)


def group_spans(sizes, ranks_per_node: int, rank: int = 0) -> dict[str, GroupSpan]:
    """Size and on-node count of the groups holding `rank`, as megatron-core's rank generator
    lays them out (`parallel_state.initialize_model_parallel`, order tp-cp-ep-dp-pp; expert
    groups with the expert tensor-parallel size = TP)."""
    from megatron.core.parallel_state import RankGenerator

    dense = RankGenerator(tp=sizes.tensor, ep=1, dp=sizes.data, pp=1, cp=sizes.context, order="tp-cp-ep-dp-pp")
    expert_dp = sizes.world // (sizes.tensor * sizes.expert)
    experts = RankGenerator(tp=sizes.tensor, ep=sizes.expert, dp=expert_dp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    tokens = {"tp": (dense, "tp"), "cp": (dense, "cp"), "dp": (dense, "dp"), "dense_dp": (dense, "dp-cp"),
              "ep": (experts, "ep"), "expert_dp": (experts, "dp")}
    spans = {}
    for name, (generator, token) in tokens.items():
        ranks = next(g for g in generator.get_ranks(token) if rank in g)
        spans[name] = span_of(ranks, rank, ranks_per_node)
    spans["world"] = span_of(range(sizes.world), rank, ranks_per_node)
    return spans


def span_of(ranks, rank: int, ranks_per_node: int) -> GroupSpan:
    ranks = list(ranks)
    node = rank // ranks_per_node
    return GroupSpan(len(ranks), sum(1 for r in ranks if r // ranks_per_node == node))


# ------------------------------------------------------------------ the step's shape
@dataclass(frozen=True)
class StepShape:
    """What the kinds' byte formulas read (see `step_shape`)."""

    micro_batches: int  # per rank and step
    batch: int  # sequences per micro-batch
    seq_len: int
    tokens_local: int  # tokens this rank holds per micro-batch (B x T / CP)
    dtype_bytes: int  # model dtype (activations, gradients of activations, parameters)
    main_trains: bool  # the main model runs a backward (the sparse stage); else only the indexer
    uses_mtp: bool  # the MTP layer runs (stages with the LM loss)
    recompute: str  # parallel.recompute
    indexer_loss: bool  # the stage's loss has the indexer KL (eq. 3 / eq. 4)
    mqa_form: bool  # attention in the absorbed form (sparse, or context parallel)
    topk: int  # selected keys per query (the sparse KL's target has one fp32 value per selected key)
    target_from_attention: bool  # the sparse KL's target comes from the sparse MLA forward (CUDA path)
    zero_stage: int
    grad_reduce_bytes: int  # bytes per element of the data-parallel gradient reduction
    dense_trainable: float  # trainable elements on this rank, replicated over DP x CP
    expert_trainable: float  # routed-expert elements on this rank, replicated over expert-DP
    dense_reduced: float  # of dense_trainable: those that get a gradient (the stage runs them)
    expert_reduced: float
    router_bias_update: bool
    grouped_experts: bool = True  # parallel.grouped_experts: routed experts as grouped GEMMs (else a loop)


def step_shape(cfg, stage, sizes, trainable: tuple[float, float], reduced: tuple[float, float],
               topk: int = 0, kernel_path: str = "cpu") -> StepShape:
    """`trainable`: (dense, expert) trainable elements on this rank; `reduced`: of them, those with
    a gradient in this stage; `topk`: the stage's selected keys per query (`Stage.topk_for`);
    `kernel_path`: "cuda" or "cpu" (`plan.trace.kernel_path_of`)."""
    pb = 2 if cfg.model.dtype.value == "bfloat16" else 4
    B, T = cfg.data.micro_batch_size, cfg.data.seq_len
    return StepShape(
        micro_batches=max(stage.config.global_batch_size // (B * sizes.data), 1), batch=B, seq_len=T,
        tokens_local=B * T // sizes.context, dtype_bytes=pb, main_trains=stage.kind.main_backward,
        uses_mtp=stage.uses_mtp, recompute=cfg.parallel.recompute, zero_stage=cfg.parallel.zero_stage,
        indexer_loss=stage.uses_indexer_loss, mqa_form=stage.sparse or sizes.context > 1,
        topk=topk if stage.sparse else 0,
        target_from_attention=stage.sparse and kernel_path != "cpu",
        grad_reduce_bytes=gradient_reduce_bytes(cfg.parallel.zero_stage, pb, cfg.optim.grad_accum_dtype),
        dense_trainable=trainable[0], expert_trainable=trainable[1], dense_reduced=reduced[0],
        expert_reduced=reduced[1],
        router_bias_update=stage.config.router_bias_update_rate != 0,
        grouped_experts=cfg.parallel.grouped_experts,
    )


def gradient_reduce_bytes(zero_stage: int, dtype_bytes: int, grad_accum_dtype) -> int:
    """Bytes per element DeepSpeed reduces gradients in (`trainer/deepspeed_engine.py`: bf16
    models reduce in fp32 only under ZeRO-2 with `optim.grad_accum_dtype: float32`)."""
    accum = getattr(grad_accum_dtype, "value", grad_accum_dtype)
    if dtype_bytes == 2 and not (zero_stage == 2 and accum == "float32"):
        return 2
    return 4


# ------------------------------------------------------------------ the kinds
def moe_all_to_all(c, sizes, s: StepShape) -> list[Collective]:
    """`parallel/expert.py` AllToAllDispatcher, per MoE layer and forward: one counts exchange
    (int64 [EP, 1 + L], L = local experts), the token rows (one per (token, destination rank)
    pair; counted here as one per (token, expert) slot, the traced plan's balanced routing: at the
    671B layouts a token's 8 experts sit on ~8 ranks, `benchmarks/moe_dispatch_bytes.py`), their
    routing weights (fp32 [pairs, L]) and the combine (the summed rows back); backward: the reverse
    all-to-all of the rows, the weights and the combine. Recomputed layers run their forward's
    again. Under TP each rank dispatches its share of the tokens, ceil(T_loc / TP) (`tp_moe_collectives`)."""
    if sizes.expert <= 1 or not c.n_routed_experts:
        return []
    main_moe = sum(1 for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
    mtp = range(c.num_hidden_layers, c.num_hidden_layers + (c.num_nextn_predict_layers or 0)) if s.uses_mtp else ()
    moe = main_moe + sum(1 for i in mtp if c.is_moe_layer(i))
    slots = -(-s.tokens_local // sizes.tensor) * c.num_experts_per_tok
    tokens = slots * c.hidden_size * s.dtype_bytes  # [slots, hidden] in the model dtype
    local_experts = c.n_routed_experts // sizes.expert
    weights = slots * local_experts * 4  # [slots, L] fp32 routing weights
    # per layer: counts, token rows + combine, routing weights
    forward = [(sizes.expert * (1 + local_experts) * 8, 1), (tokens, 2), (weights, 1)]
    recomputed = main_moe if (s.main_trains and s.recompute in ("full", "moe")) else 0
    mb = s.micro_batches
    return (_rows("moe_all_to_all_forward", "all_to_all", "ep", "forward", [(b, n * moe) for b, n in forward], mb)
            + _rows("moe_all_to_all_recompute", "all_to_all", "ep", "recompute",
                    [(b, n * recomputed) for b, n in forward], mb)
            + _rows("moe_all_to_all_backward", "all_to_all", "ep", "backward",
                    [(tokens, 2 * moe), (weights, moe)] if s.main_trains else [], mb))


def cp_gather(c, sizes, s: StepShape) -> list[Collective]:
    """`parallel/comm.py` all_gather_autograd, per attention layer: the indexer key k_I [B, T_loc,
    d_I] and the MQA latent KV [B, T_loc, 576] all-gathered over CP (again when the layer is
    recomputed); backward: the gradient of the gathered tensor [B, T, d] reduce-scattered to each
    rank's slice (kv when the main model trains; k_I where the indexer loss reads it: the main
    layers)."""
    if sizes.context <= 1:
        return []
    layers = c.num_hidden_layers + ((c.num_nextn_predict_layers or 0) if s.uses_mtp else 0)
    full = s.batch * s.seq_len
    kv = full * (c.kv_lora_rank + c.qk_rope_head_dim) * s.dtype_bytes
    k_idx = full * c.index_head_dim * s.dtype_bytes
    recomputed = c.num_hidden_layers if s.recompute in ("full", "attention") else 0
    backward = ([(kv, layers)] if s.main_trains else []) + ([(k_idx, c.num_hidden_layers)] if s.indexer_loss else [])
    mb = s.micro_batches
    return (_rows("cp_gather_forward", "all_gather", "cp", "forward", [(kv, layers), (k_idx, layers)], mb)
            + _rows("cp_gather_recompute", "all_gather", "cp", "recompute", [(kv, recomputed), (k_idx, recomputed)], mb)
            + _rows("cp_gather_backward", "reduce_scatter", "cp", "backward", backward, mb))


def tp_collectives(c, sizes, s: StepShape) -> list[Collective]:
    """Tensor parallel (`parallel/tensor.py`, megatron-core's linears), per layer and micro-batch.
    Forward: the row-parallel outputs all-reduced (o_proj; the down projection of a dense MLP or
    of the shared experts), [T_loc, hidden]; where the indexer loss needs every head, the
    attention queries and log-sum-exps gathered (`TensorParallelHeads.gather`), except in the
    sparse stage on the CUDA path: there the sparse KL's target (the local heads' Sigma_h P,
    [T_loc, k] fp32, from the attention's forward) is all-reduced instead (`sum_heads`). Backward (main
    model trains): the column-parallel inputs' gradients (q_b_proj, kv_b_proj in the MHA form,
    gate and up projections) and the shared latent and k_rope (`heads.shared`) all-reduced; the replicated
    indexer's parameter gradients averaged (five tensors a layer). MoE layers (`TensorParallelTokens`,
    each TP rank routing its ceil(T_loc / TP)-row share): `tp_moe_*`. The 671B recipes run TP 1:
    checked on a small TP 2 trace only (docs/distributed.md)."""
    if sizes.tensor <= 1:
        return []
    main = c.num_hidden_layers
    layers = main + ((c.num_nextn_predict_layers or 0) if s.uses_mtp else 0)
    T, pb, h, H = s.tokens_local, s.dtype_bytes, c.hidden_size, c.num_attention_heads
    mlp_layers = sum(1 for i in range(layers) if not c.is_moe_layer(i) or c.n_shared_experts)
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if s.mqa_form:  # one call each: queries in the absorbed form [T, H, 576], lse [T, H] fp32
        heads = [T * H * (c.kv_lora_rank + c.qk_rope_head_dim) * pb, T * H * 4]
    else:  # MHA: q and k [T, H, 192], lse
        heads = [T * H * qk * pb, T * H * qk * pb, T * H * 4]
    gathers = [(b, main) for b in heads] if s.indexer_loss and not s.target_from_attention else []
    targets = [(T * s.topk * 4, main)] if s.indexer_loss and s.target_from_attention else []
    outputs = layers + mlp_layers  # o_proj + down projections
    recomputed = s.recompute in ("full", "attention")
    # a recomputed layer re-runs its gathers; its all-reduces only when the main model trains
    # (a frozen model's recompute stops after the indexer's tensors: checkpoint's early stop)
    main_outputs = main + sum(1 for i in range(main) if not c.is_moe_layer(i) or c.n_shared_experts)
    rec_reduce = [(T * h * pb, main_outputs)] if (recomputed and s.main_trains and s.recompute == "full") else []
    if recomputed and s.main_trains and s.recompute == "attention":
        rec_reduce = [(T * h * pb, main)]
    bwd = []
    if s.main_trains:
        q_in = c.q_lora_rank or h
        # the latent's gradient: summed over TP by `heads.shared`, and (MHA form only: the absorbed
        # form uses kv_b_proj's weight, not the linear) by kv_b_proj's input all-reduce
        latent_calls = layers if s.mqa_form else 2 * layers
        bwd += [(T * q_in * pb, layers), (T * c.kv_lora_rank * pb, latent_calls), (T * c.qk_rope_head_dim * pb, layers),
                (T * h * pb, 2 * mlp_layers)]
    if s.indexer_loss:
        # wq_b, wk (model dtype); k_norm weight and bias, weights_proj (fp32, FP32_PARAM_SUFFIXES)
        idx = [((c.q_lora_rank or h) * c.index_n_heads * c.index_head_dim, pb), (h * c.index_head_dim, pb),
               (c.index_head_dim, 4), (c.index_head_dim, 4), (h * c.index_n_heads, 4)]
        bwd += [(n * b, main) for n, b in idx]
    mb = s.micro_batches
    return (tp_moe_collectives(c, sizes, s)
            + _rows("tp_forward", "all_reduce", "tp", "forward", [(T * h * pb, outputs)], mb)
            + _rows("tp_gather_forward", "all_gather", "tp", "forward", gathers, mb)
            + _rows("tp_kl_target_forward", "all_reduce", "tp", "forward", targets, mb)
            + _rows("tp_recompute", "all_reduce", "tp", "recompute", rec_reduce, mb)
            + _rows("tp_gather_recompute", "all_gather", "tp", "recompute", gathers if recomputed else [], mb)
            + _rows("tp_kl_target_recompute", "all_reduce", "tp", "recompute", targets if recomputed else [], mb)
            + _rows("tp_backward", "all_reduce", "tp", "backward", bwd, mb))


def tp_moe_collectives(c, sizes, s: StepShape) -> list[Collective]:
    """The MoE layers under TP (`parallel/tensor.py` TensorParallelTokens), per layer and micro-batch:
    forward the routed output all-gathered over TP (each rank's share padded to ceil(T_loc / TP)
    rows: TP x that x hidden, model dtype; again in a recomputed layer) and the tokens per expert
    all-reduced (int64 [experts]; not in the recompute, which counts no loads); backward (main model trains): the input gradient all-gathered
    (the same size), and the router's and this rank's routed experts' weight gradients summed over
    TP: the router's [E, hidden] by a hook, the experts' as grouped GEMMs once per projection, the
    stacked [E_local, I, hidden] (`TensorParallelTokens.sum_gradient`), as a loop (`parallel.grouped_experts:
    false`) by a hook per expert weight [I, hidden] (3 per local expert)."""
    if sizes.tensor <= 1 or not c.n_routed_experts:
        return []
    main_moe = sum(1 for i in range(c.num_hidden_layers) if c.is_moe_layer(i))
    mtp = range(c.num_hidden_layers, c.num_hidden_layers + (c.num_nextn_predict_layers or 0)) if s.uses_mtp else ()
    moe = main_moe + sum(1 for i in mtp if c.is_moe_layer(i))
    gathered = sizes.tensor * -(-s.tokens_local // sizes.tensor) * c.hidden_size * s.dtype_bytes
    loads = c.n_routed_experts * 8
    recomputed = main_moe if (s.main_trains and s.recompute in ("full", "moe")) else 0
    weights = []
    if s.main_trains:
        local_experts = c.n_routed_experts // sizes.expert
        expert_weight = c.moe_intermediate_size * c.hidden_size * s.dtype_bytes
        experts = ([(local_experts * expert_weight, 3 * moe)] if s.grouped_experts
                   else [(expert_weight, 3 * local_experts * moe)])
        weights = [(c.n_routed_experts * c.hidden_size * s.dtype_bytes, moe), *experts]
    mb = s.micro_batches
    return (_rows("tp_moe_gather_forward", "all_gather", "tp", "forward", [(gathered, moe)], mb)
            + _rows("tp_moe_loads_forward", "all_reduce", "tp", "forward", [(loads, moe)], mb)
            + _rows("tp_moe_gather_recompute", "all_gather", "tp", "recompute", [(gathered, recomputed)], mb)
            + _rows("tp_moe_gather_backward", "all_gather", "tp", "backward",
                    [(gathered, moe)] if s.main_trains else [], mb)
            + _rows("tp_moe_grads_backward", "all_reduce", "tp", "backward", weights, mb))


def _rows(kind, op, group, phase, parts, micro_batches) -> list[Collective]:
    """One row for (bytes, calls per micro-batch) parts: their calls and mean payload."""
    calls = sum(n for _, n in parts)
    if not calls:
        return []
    return [Collective(kind, op, group, phase, calls * micro_batches, sum(b * n for b, n in parts) / calls)]


def _replica_groups(sizes, s: StepShape, dense: float, expert: float):
    """(group, size, elements) of the gradients / parameters DeepSpeed reduces or gathers: dense over
    DP x CP, routed experts over expert-DP. With expert_parallel=1 the routed experts are ordinary
    parameters (`parallel.expert.shard_experts` gives them no expert group), reduced and gathered
    with the dense ones, in the same buckets over DP x CP."""
    if sizes.expert <= 1:
        return [("dense_dp", sizes.dense_dp, dense + expert)]
    return [("dense_dp", sizes.dense_dp, dense), ("expert_dp", sizes.expert_dp, expert)]


def gradient_reduction(sizes, s: StepShape, bucket: int) -> list[Collective]:
    """The data-parallel gradient reduction: an `all_reduce` of each bucket of gradients (the whole
    bucket, every rank receiving the sum) over the group, in `grad_reduce_bytes`, at every ZeRO
    stage, as DeepSpeed 0.19 and the trainer issue it (recorded on a real 2-rank step:
    `tests/test_comm_deepspeed.py`, docs/distributed.md "Communication"):
      ZeRO-0  once, at the step: fp32 by the trainer's `DeepSpeedEngine.reduce_gradients` (DeepSpeed's
              reduction is switched off), bf16 by DeepSpeed's `buffered_allreduce_fallback`;
      ZeRO-1  once, at the step: the ZeRO optimizer's `reduce_gradients` fills `reduce_bucket_size`
              buckets and `average_tensor` all-reduces each (`use_multi_rank_bucket_allreduce`,
              DeepSpeed's default, takes the all-reduce over the per-partition `reduce`); each rank
              keeps its partition's slice;
      ZeRO-2  the same all-reduce, from its backward hooks, a bucket at a time on every micro-batch.
    Parameters without a gradient (the MTP layer of a stage that does not run it) are not reduced,
    except at ZeRO-0 in bf16: DeepSpeed's BF16_Optimizer all-reduces each param group's whole flat
    gradient buffer (`get_grads_for_reduction`), every trainable parameter's slot."""
    per_micro_batch = s.zero_stage >= 2
    phase, repeat = ("backward", s.micro_batches) if per_micro_batch else ("step", 1)
    flat_buffers = s.zero_stage == 0 and s.dtype_bytes == 2
    dense, expert = (s.dense_trainable, s.expert_trainable) if flat_buffers else (s.dense_reduced, s.expert_reduced)
    rows = []
    for group, n, elems in _replica_groups(sizes, s, dense, expert):
        if n > 1 and elems > 0:
            calls = math.ceil(elems / bucket)
            rows.append(Collective(f"gradient_reduction_{group}", "all_reduce", group, phase, calls * repeat,
                                   elems * s.grad_reduce_bytes / calls))
    return rows


def parameter_all_gather(sizes, s: StepShape, bucket: int) -> list[Collective]:
    """ZeRO-1/2 after the update: each rank's updated partition (model dtype) of every trainable
    parameter all-gathered back into the parameters, `bucket` elements of output per call, once
    per step."""
    if s.zero_stage not in (1, 2):
        return []
    rows = []
    for group, n, elems in _replica_groups(sizes, s, s.dense_trainable, s.expert_trainable):
        if n > 1 and elems > 0:
            calls = math.ceil(elems / bucket)
            rows.append(Collective(f"parameter_all_gather_{group}", "all_gather", group, "step", calls,
                                   elems * s.dtype_bytes / calls))
    return rows


def step_scalars(c, sizes, s: StepShape) -> list[Collective]:
    """Small all-reduces of a step: token counts over DP and metric sums over DP x CP
    (`parallel/reduction.py`), and with the router's bias update two fp32 [experts] load vectors per
    MoE layer over DP x CP (`MoE.update_bias`)."""
    rows = []
    if sizes.data > 1:
        rows.append(Collective("step_token_counts", "all_reduce", "dp", "step", 1, 3 * 8))
    if sizes.dense_dp > 1:
        rows.append(Collective("step_metrics", "all_reduce", "dense_dp", "step", 1, 16 * 8))
        if s.router_bias_update and s.main_trains and c.n_routed_experts:
            moe = sum(1 for i in range(c.num_hidden_layers + (c.num_nextn_predict_layers or 0)) if c.is_moe_layer(i))
            rows.append(Collective("router_bias_all_reduce", "all_reduce", "dense_dp", "step", 2 * moe, c.n_routed_experts * 4))
    return rows


def step_collectives(c, sizes, s: StepShape, bucket: int) -> list[Collective]:
    rows = (moe_all_to_all(c, sizes, s) + cp_gather(c, sizes, s) + tp_collectives(c, sizes, s)
            + gradient_reduction(sizes, s, bucket) + parameter_all_gather(sizes, s, bucket) + step_scalars(c, sizes, s))
    return [r for r in rows if r.calls > 0]


# ------------------------------------------------------------------ cost and memory
def price(rows: list[Collective], spans: dict[str, GroupSpan], net) -> list[dict]:
    """Each kind per step: calls, payload and wire bytes per rank, seconds (one dict per row)."""
    out = []
    for r in rows:
        span = spans[r.group]
        out.append({
            "kind": r.kind, "op": r.op, "group": r.group, "group_size": span.size, "group_nodes": span.nodes,
            "phase": r.phase, "calls": r.calls, "payload_bytes": r.calls * r.payload_bytes,
            "wire_bytes": r.calls * r.payload_bytes * wire_fraction(r.op, span.size),
            "seconds": r.calls * collective_seconds(r.op, r.payload_bytes, span, net),
        })
    return out


def nccl_buffer_bytes(rows: list[Collective], spans: dict[str, GroupSpan], net) -> float:
    """NCCL's GPU memory on this rank: one set of collective buffers per communicator the step
    uses, plus per-peer point-to-point buffers of each all-to-all group (NVLink peers and
    network peers), from `cluster.network`'s nccl_* sizes."""
    groups = {r.group for r in rows if spans[r.group].size > 1}
    total = len(groups) * net.nccl_communicator_mib * MiB
    for group in {r.group for r in rows if r.op == "all_to_all" and spans[r.group].size > 1}:
        span = spans[group]
        total += (span.on_node - 1) * net.nccl_nvlink_peer_mib * MiB
        total += (span.size - span.on_node) * net.nccl_net_peer_mib * MiB
    return total


def check_network(net) -> None:
    """One line per bad value (ConfigError): bandwidths must be positive."""
    from dsa_train.config import ConfigError

    for name in ("intra_node_gbps", "inter_node_gbps", "all_to_all_inter_node_gbps"):
        if not getattr(net, name) > 0:
            raise ConfigError(f"cluster.network.{name}={getattr(net, name)}: an effective bandwidth in GB/s per GPU "
                              f"must be > 0 (e.g. nccl-tests' busbw; docs/distributed.md, \"Communication\")")
    for name in ("intra_node_latency_us", "inter_node_latency_us", "nccl_communicator_mib", "nccl_nvlink_peer_mib",
                 "nccl_net_peer_mib"):
        if getattr(net, name) < 0:
            raise ConfigError(f"cluster.network.{name}={getattr(net, name)}: must be >= 0")
