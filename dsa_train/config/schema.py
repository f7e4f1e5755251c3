"""Structured configs: the schema every recipe is validated against.

Each dataclass is one Hydra config group (``recipes/<group>/*.yaml``). Recipes compose them
on top of :class:`TrainConfig`; a key that is not declared here, or a value of the wrong
type, fails at start-up with an error naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

from omegaconf import MISSING

from dsa_train.stage import STAGE_KINDS


class Attention(str, Enum):
    dense = "dense"    # full causal attention
    sparse = "sparse"  # attention over the indexer's top-k keys (DSA)


# The values of `stages.<name>.trainable`: the stage kinds declared in dsa_train/stage.py
# (`STAGE_KINDS`: "indexer", the dense warm-up's indexer-only training; "all", every parameter).
Trainable = Enum("Trainable", {name: name for name in STAGE_KINDS}, type=str, module=__name__, qualname="Trainable")


class IndexScores(str, Enum):
    """How a sparse stage's indexer scores keys for its top-k (dsa_kernels.ops.indexer_topk.fp8)."""

    bf16 = "bf16"            # q_I / k_I as the model computes them, fp32 products (the reference)
    fp8 = "fp8"              # e4m3 q_I / k_I, fp32 per-token scales (DeepGEMM's fp8_mqa_logits)
    fp8_ue8m0 = "fp8_ue8m0"  # e4m3 with power-of-two scales (DeepSeek-V3.2-Exp's inference, scale_fmt ue8m0)


class Decay(str, Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Device(str, Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


class WandbMode(str, Enum):
    auto = "auto"  # online when WANDB_API_KEY is set, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class ModelConfig:
    # Hugging Face directory (DeepSeek-V3 / V3.1 / V3.2 layout), or null for a from-scratch
    # model built from `arch`. Mandatory: a recipe says which one it means.
    pretrained: str | None = MISSING
    # Fields passed to `dsa_train.model.tiny_config(**arch)` for a from-scratch model,
    # e.g. {num_hidden_layers: 4, hidden_size: 256, index_topk: 64}. Must be empty with
    # `pretrained`. `vocab_size` defaults to the tokenizer's.
    arch: dict[str, Any] = field(default_factory=dict)
    dtype: DType = DType.float32


@dataclass
class StageConfig:
    """One stage of the continued-pretraining chain (report section 2.1.1)."""

    attention: Attention = Attention.dense
    trainable: Trainable = Trainable.indexer
    steps: int = 100
    # Sequences per optimizer step over all data-parallel ranks. Gradient accumulation
    # steps = global_batch_size / (data.micro_batch_size * data-parallel size).
    global_batch_size: int = 1
    lr: float = 1e-3
    # Linear warm-up from 0 to `lr` over `warmup_steps`, then `decay` down to `lr * min_lr_ratio`.
    warmup_steps: int = 0
    decay: Decay = Decay.constant
    min_lr_ratio: float = 0.0
    # loss = lm_loss_coef * LM cross-entropy + indexer_loss_coef * indexer KL (eq. 3 / eq. 4).
    # lm_loss_coef == 0 skips the final norm, LM head and cross-entropy.
    lm_loss_coef: float = 0.0
    indexer_loss_coef: float = 1.0
    # Multi-token prediction: + mtp_loss_coef * CE of the MTP module (predicting token t+2),
    # weighted like the LM loss. 0 (default) leaves the MTP module untrained. Needs lm_loss_coef > 0.
    mtp_loss_coef: float = 0.0
    # Top-k of the sparse selection; None: the model's `index_topk`.
    topk: int | None = None
    # Index scores the sparse selection is made on: bf16 (the reference), fp8 or fp8_ue8m0 (e4m3
    # q_I / k_I as FP8 inference scores them, so the model trains on the keys inference will pick).
    # Only the selection: the indexer KL's gradient flows through the bf16/fp32 scores (docs/kernels.md).
    index_scores: IndexScores = IndexScores.bf16
    # Aux-loss-free MoE balancing: e_score_correction_bias += rate * sign(mean load - load)
    # after every optimizer step. 0 disables.
    router_bias_update_rate: float = 0.0
    # Queries sampled per layer to measure top-k recall of the dense attention mass
    # (sparse stages only; 0 disables). Measured on logging steps.
    topk_recall_queries: int = 0


@dataclass
class DataConfig:
    """The ``data:`` section of a recipe, and what `dsa_train.data.build_dataloader` takes."""

    # files/dirs/globs/hub names; "bundled" (dsa_train.data.BUNDLED_SOURCE): the bundled corpus
    sources: list[str] = field(default_factory=lambda: ["bundled"])
    text_field: str = "text"  # field holding the text in .jsonl/.json/.parquet
    tokenizer: str | None = None  # None: bundled demo tokenizer; or a checkpoint dir/tokenizer.json
    # model.pretrained's own tokenizer.json differing (by content) from data.tokenizer is refused at
    # start-up (the model would read the data as other tokens); true trains anyway (recorded in the recipe)
    allow_tokenizer_mismatch: bool = False
    seq_len: int = 512  # T, tokens per sequence
    micro_batch_size: int = 1  # B, sequences per rank per forward pass
    seed: int = 1234  # shuffling seed (order is a pure function of seed, epoch, dp_size, B)
    streaming: bool = False  # pack on the fly from a datasets.IterableDataset (huge corpora)
    cache_dir: str | None = None  # pre-tokenized cache; None: $DSA_TRAIN_CACHE or ~/.cache/dsa_train
    add_bos: bool = True  # frame each document as [bos] + tokens + [eos]
    add_eos: bool = True
    num_workers: int = 0  # background reader processes (map-style path only)
    txt_sample_by: str = "document"  # .txt: "document" (one per file) or "paragraph" (blank lines)
    split: str = "train"  # split of hub datasets
    shuffle_buffer: int = 10_000  # streaming only: documents in the shuffle buffer (0: no shuffle)


@dataclass
class OptimConfig:
    """AdamW; the learning rate and its schedule belong to each stage."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # Applied to matrices only (ndim >= 2); norms, biases and router biases are not decayed.
    weight_decay: float = 0.1
    # Max global gradient L2 norm; 0 disables clipping (the norm is still logged).
    grad_clip: float = 1.0
    # dtype in which gradients of bf16 parameters are accumulated over micro-batches and reduced
    # over data parallel. float32 (default, as Megatron's accumulate_allreduce_grads_in_fp32):
    # each micro-batch's bf16 gradient is added into an fp32 buffer (the fp32 master's gradient;
    # DeepSpeed's grad_accum_dtype and communication_data_type fp32). bfloat16: in the
    # parameters' dtype (half the gradient memory and traffic, rounding at every addition).
    grad_accum_dtype: DType = DType.float32


@dataclass
class ParallelConfig:
    """Parallel layout. The single-process engine requires every size to be 1."""

    tensor_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    # -1: world size / (tensor_parallel * context_parallel).
    data_parallel: int = -1
    zero_stage: int = 0
    # Activation checkpointing (distributed trainer): none | attention | moe | full (whole
    # decoder layers). Recomputed blocks keep only their inputs for the backward.
    recompute: str = "none"
    # Routed experts as grouped GEMMs (torch._grouped_mm over tokens sorted by expert) instead of a
    # Python loop over experts (every layout, one process included; docs/training.md, "Host overhead").
    grouped_experts: bool = True


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    # Save every N optimizer steps within a stage (0: only at stage ends).
    every_n_steps: int = 100
    # Training checkpoints kept on disk (oldest deleted first); 0 keeps all.
    keep_last: int = 2
    # auto (default) or true: continue from the newest checkpoint in `dir` that verifies (a fresh
    # start when there is none), so a restarted or requeued job resumes on its own.
    # false: start fresh; refused when `dir` already holds checkpoints (they would be pruned).
    resume: Union[bool, str] = "auto"
    # On resume, check every file's sha256 against the checkpoint's manifest (sizes are always
    # checked). Reads the checkpoint twice; false for huge checkpoints on trusted storage.
    verify_checksums: bool = True
    # Write the checkpoint's tensors in the background (torch.distributed.checkpoint.async_save):
    # training continues after a copy of this rank's pieces; the checkpoint is committed (renamed
    # into place, `latest` updated) only once every rank's write finished.
    async_save: bool = False
    # Write <run_dir>/export (V3.2 Hugging Face layout) at the end, streamed from the last checkpoint
    # by every rank (docs/checkpoints.md, "Export at the end of a run"; as `dsa-train export`).
    export: bool = True


@dataclass
class LoggingConfig:
    wandb_mode: WandbMode = WandbMode.auto
    project: str = "dsa-train"
    entity: str | None = None
    run_name: str = "${run_name}"
    # W&B writes <wandb_dir>/wandb/<run>/.
    wandb_dir: str = "${run_dir}"
    tags: list[str] = field(default_factory=list)
    # Seconds to wait for the W&B server before falling back to offline.
    wandb_init_timeout_s: float = 90.0
    log_every: int = 1
    # Rich progress bar; only shown when stdout is a terminal.
    progress_bar: bool = True
    # Peak FLOP/s of one device for MFU. None: a table lookup for known GPUs (dense bf16),
    # on the CPU 96 GFLOP/s per core (fp32 FMA, 2x AVX2 units, 3 GHz).
    peak_flops: float | None = None
    # global steps to run under torch.profiler: <run_dir>/profile/step_<N>.txt (dsa_train/logging/profile.py)
    profile_steps: list[int] = field(default_factory=list)
    profile_trace: bool = False  # also a Chrome trace per profiled step (tens of MB at 32K)


class NonFinitePolicy(str, Enum):
    skip = "skip"  # drop the update, count the step, go on (up to max_consecutive_nonfinite in a row)
    stop = "stop"  # checkpoint (state before the bad step) and stop with an error


@dataclass
class FaultToleranceConfig:
    """What the trainer does on non-finite steps and preemption (docs/reliability.md)."""

    nonfinite: NonFinitePolicy = NonFinitePolicy.skip
    # With `skip`: this many non-finite steps in a row stop the run as `stop` does.
    max_consecutive_nonfinite: int = 3
    # Signals that checkpoint at the next step boundary and exit with code 75 (empty: none).
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


@dataclass
class NetworkConfig:
    """What collectives achieve on the cluster, per GPU: EFFECTIVE bandwidths (what nccl-tests'
    busbw shows at large messages, not the links' line rate), per-call latencies, and the GPU
    memory NCCL allocates for its buffers (outside PyTorch's allocator). `dsa-train plan` prices
    the step's communication and adds NCCL's memory with these (docs/distributed.md,
    "Communication"). The defaults are an 8-GPU NVLink (H100/H800 SXM) node with one 400 Gb/s
    InfiniBand NIC per GPU; measure yours (nccl-tests all_reduce_perf / alltoall_perf at 1 GiB
    over the job's node count) and set them in the recipe's cluster group."""

    intra_node_gbps: float = 300.0  # GB/s, ring collectives and all-to-all among a node's GPUs (NVLink)
    inter_node_gbps: float = 40.0  # GB/s per GPU, ring collectives across nodes (400 Gb/s = 50 line rate)
    all_to_all_inter_node_gbps: float = 30.0  # GB/s per GPU, the cross-node part of an all-to-all
    intra_node_latency_us: float = 10.0  # per collective call within one node
    inter_node_latency_us: float = 30.0  # per collective call spanning nodes
    # NCCL's own buffers: per communicator used for collectives (ring/tree channels x protocol
    # buffers), per NVLink peer of an all-to-all (p2p channels x buffers), per network peer
    nccl_communicator_mib: float = 300.0
    nccl_nvlink_peer_mib: float = 470.0
    nccl_net_peer_mib: float = 2.0


@dataclass
class ClusterConfig:
    """Slurm allocation (used by the launchers in `launch/`) and its network (`network`: what
    `dsa-train plan` prices communication with)."""

    nodes: int = 1
    gpus_per_node: int = 1
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    # Training processes per node (torchrun --nproc_per_node); null: gpus_per_node. CPU nodes:
    # gpus_per_node 0 and procs_per_node N (no GPU request in the sbatch).
    procs_per_node: int | None = None
    cpus_per_task: int | None = None  # null: 8 per GPU; CPU nodes: one per rank
    mem: str | None = None  # e.g. "480G"; null: the partition's default
    # Network interfaces for NCCL's and gloo's sockets (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME,
    # e.g. "ib0" or "^docker,lo"); null: the libraries pick one.
    nccl_socket_ifname: str | None = None
    gloo_socket_ifname: str | None = None
    # `ulimit -n` of the step (soft limit on open files: gloo and NCCL open sockets per peer);
    # null: raised to the node's hard limit.
    open_files: int | None = None
    master_port: int = 29500  # c10d rendezvous port on the first node (by IP address)
    # torchrun --max-restarts: a crashed rank restarts all workers, which resume from the last
    # checkpoint, without leaving the allocation (0: a crash ends the job)
    max_restarts: int = 3
    # Slurm's warning signal before the time limit / preemption, forwarded to the ranks, which
    # checkpoint and exit 75; with `requeue` the job is requeued and resumes.
    signal: str = "USR1@180"
    requeue: bool = True
    # Shell lines run on every node before torchrun (module load, venv activation, exports).
    setup: list[str] = field(default_factory=list)
    # Extra "#SBATCH ..." option lines, e.g. ["--exclusive", "--constraint=h100"].
    sbatch_options: list[str] = field(default_factory=list)
    network: NetworkConfig = field(default_factory=NetworkConfig)


@dataclass
class ProfileConfig:
    """A way to run a recipe (recipes/profile/*.yaml), applied over the composed recipe by
    `dsa_train.config.profile.apply_profile`. `none` changes nothing; `smoke` runs every stage of
    the recipe for real in one CPU process in a few minutes (tiny batch, short sequences, a few
    steps) and keeps everything else. Null fields leave the recipe's value."""

    name: str = "none"
    run_suffix: str = ""  # appended to the run directory (runs/<run_name><run_suffix>)
    device: Device | None = None
    one_process: bool = False  # every parallel size 1, ZeRO 0, no recompute
    steps: int | None = None  # each stage: min(its steps, this)
    warmup_steps: int | None = None  # each stage: min(its warmup_steps, this)
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    seq_len: int | None = None
    topk: int | None = None  # sparse stages: min(their top-k, this), below seq_len
    topk_recall_queries: int | None = None  # sparse stages: min(theirs, this)
    dtype: DType | None = None
    probe_batches: int | None = None
    data_sources: list[str] | None = None  # used only when the recipe has no data.sources
    num_workers: int | None = None
    # A from-scratch model (model.arch): these fields override the recipe's (shrink it). With
    # model.pretrained the checkpoint is the architecture and the recipe's arch is dropped.
    arch: dict[str, Any] = field(default_factory=dict)
    checkpoint_every_n_steps: int | None = None


class EvalMode(str, Enum):
    dense = "dense"    # full causal attention
    sparse = "sparse"  # the learned indexer's top-k
    oracle = "oracle"  # the k keys with the most true attention mass (what a perfect indexer reaches)


@dataclass
class EvalConfig:
    """The recipe's optional evaluation (docs/eval.md, "In a training run"): `dsa_train.eval` on the
    model in memory, at the end of every stage and every `every_n_steps` steps, on held-out rows of
    the training data (the last `num_sequences` rows of the packed stream at data.seq_len, which
    the training loader then never visits). Logged under `eval/`."""

    enabled: bool = False
    every_n_steps: int = 0  # also evaluate every N optimizer steps within a stage (0: stage ends only)
    num_sequences: int = 2  # held-out rows of data.seq_len tokens
    # Top-k of the sparse and oracle modes; None: the last sparse stage's top-k (else the model's
    # index_topk), the same k at every stage's end so that the numbers compare.
    topk: int | None = None
    modes: list[EvalMode] = field(default_factory=lambda: [EvalMode.dense, EvalMode.sparse, EvalMode.oracle])
    layer_metrics: bool = True  # per layer: recall, overlap with the oracle top-k, KL-captured, FP8 overlap
    buckets: list[int] | None = None  # position bucket edges; None: [0, k, 2k, 4k, ...]


@dataclass
class TrainConfig:
    run_name: str = "demo"
    # Deterministic per run (never ${now:...}: every torchrun rank would resolve its own).
    run_dir: str = "runs/${run_name}${profile.run_suffix}"
    seed: int = 1234
    # torch.use_deterministic_algorithms(True) and deterministic cuBLAS workspace.
    deterministic: bool = False
    device: Device = Device.auto
    # Batches (from a loader seeded apart from training) measured at every stage's start and
    # end for the run summary. 0 disables.
    probe_batches: int = 2
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # Stages run in this order; keys are stage names (override with stages.<name>.<field>=...).
    stages: dict[str, StageConfig] = field(default_factory=dict)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
