"""Sharded, layout-independent training state on torch.distributed.checkpoint (DCP).

The tensors of a training checkpoint are *global* tensors, named by what they are, independent of
how the run was laid out:

    model/<parameter or buffer name>      the model's value, its dtype, its full (single-process) shape
    optim/master/<parameter name>         fp32 master of a parameter stored in lower precision (bf16)
    optim/exp_avg/<parameter name>        AdamW first moment, fp32, the parameter's full shape
    optim/exp_avg_sq/<parameter name>     AdamW second moment

Each rank contributes only the pieces it holds (`GlobalPieces`: boxes of the global tensor with
their global offsets):
  * model values: its tensor-parallel slice or the whole tensor (replicas and this
    expert-parallel rank's experts, which keep their global names), placed by the parameter's
    `Sharding` record (`dsa_train.sharding`);
  * optimizer state: its ZeRO partition, as the engine's `fragments()` (`Fragment`) describe it.
    DeepSpeed's ZeRO-1/2 (and its BF16 optimizer) keep one flat fp32 partition per parameter
    group; the part of a parameter in this rank's partition is a contiguous range of the
    parameter's flattened (TP-local) tensor, which is cut into at most 2 * ndim - 1 row-major
    boxes (`range_boxes`) and shifted by the TP offset. ZeRO-3 partitions every parameter on its
    own: rank r holds elements [r * partition, (r + 1) * partition) of it. ZeRO-0 and the
    single-process engine contribute whole tensors. (Reading DeepSpeed's layouts:
    `dsa_train.parallel.deepspeed_compat.zero_fragments`.)
Replicas (the same box on several ranks: data-parallel copies of the weights, tensor-parallel
copies of replicated parameters' optimizer fragments) are proposed by one holder only, decided
on each rank from the layout without communication (`replica_slot`, `proposes`: the holder is
picked by a hash of the name, so the writes spread over the holders); DCP's global save plan
then has one write item per stored chunk, and it rejects overlapping, out-of-bounds or
incompletely covered tensors, so no element is stored twice or missed.

Loading under another layout builds the pieces of the *new* layout (views into the model's
parameters and the new engine's partitions) and DCP reads the overlapping parts of the saved
chunks: each rank reads only what it holds. Region checksums: every write item's byte range
(file, offset, length) gets a sha256 as it is written (`HashingWriter`, no re-read); a reader
verifies only the ranges it reads (`VerifyingReader`). An error on any rank fails the load on every rank (DCP
gathers the ranks' results), raised as `CorruptCheckpoint`.

Why DCP (docs/checkpoints.md): it composes with our engine as it is. DeepSpeed's universal
checkpoints convert a ZeRO checkpoint offline after the fact (ds_to_universal) and their loader
assumes DeepSpeed's own layouts (no single-process engine, EP through DeepSpeed's MoE layer,
not our megatron-core groups); megatron-core's dist_checkpointing needs its sharded-state-dict
machinery on every module and its distributed optimizer, which we do not use. DCP takes any
global tensor described by (offsets, sizes) chunks, plans reads across layouts, deduplicates
replicas and writes asynchronously; DeepSpeed's fragment mapping gives the chunks.
"""

from __future__ import annotations

import hashlib
import math
import warnings
import zlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dsa_train.sharding import sharding_of

MODEL = "model/"
MASTER = "optim/master/"
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_DIR = "state"  # the DCP directory inside a step directory


def optim_key(kind: str, name: str) -> str:
    return f"optim/{kind}/{name}"


# ------------------------------------------------------------------------------ global pieces
class GlobalPieces:
    """This rank's pieces of one global tensor of `shape`: [(global offsets, tensor view)].
    Implements the hooks DCP asks a distributed tensor for (`__create_write_items__`,
    `__create_chunk_list__`); the planners below look a piece up by its offsets."""

    def __init__(self, shape, dtype: torch.dtype, pieces: list[tuple[tuple[int, ...], torch.Tensor]] | None = None):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces: dict[tuple[int, ...], torch.Tensor] = {}
        for offsets, t in pieces or []:
            self.add(offsets, t)

    def add(self, offsets, tensor: torch.Tensor) -> None:
        offsets = tuple(int(o) for o in offsets)
        if len(offsets) != len(self.shape) or any(o + s > n for o, s, n in zip(offsets, tensor.shape, self.shape)):
            raise ValueError(f"piece at {offsets} of shape {tuple(tensor.shape)} is outside {tuple(self.shape)}")
        self.pieces[offsets] = tensor

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for offsets, t in self.pieces.items()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.pieces.items()]

    def piece(self, offsets) -> torch.Tensor:
        return self.pieces[tuple(int(o) for o in offsets)]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _lookup(state_dict: dict, index, fallback):
    obj = state_dict.get(index.fqn)
    if isinstance(obj, GlobalPieces):
        return obj.piece(index.offset)
    return fallback(index)


def _save_planner():
    from torch.distributed.checkpoint import DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            return _lookup(self.state_dict, index, super().lookup_object)

    return SavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # as DefaultLoadPlanner's without its meta-tensor initialization, which replaces values
            # that are no tensors (our GlobalPieces) by None; the state dict is flat already
            self.original_state_dict = self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def lookup_tensor(self, index):
            return _lookup(self.state_dict, index, super().lookup_tensor)

    return LoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def range_boxes(shape: tuple[int, ...], start: int, numel: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The contiguous range [start, start + numel) of a row-major tensor of `shape`, as boxes
    (offsets, sizes, position of the box's first element in the range). Each box is itself
    contiguous in memory, so it is a view of the range reshaped."""
    if numel <= 0:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (numel,), 0)]
    row = math.prod(shape[1:])
    end = start + numel
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    pos = start
    while pos < end:
        r, within = divmod(pos, row)
        if within == 0 and end - pos >= row:  # whole rows
            rows = (end - pos) // row
            out.append(((r, *([0] * (len(shape) - 1))), (rows, *shape[1:]), pos - start))
            pos += rows * row
        else:  # part of one row
            stop = min(end, (r + 1) * row)
            for offs, sizes, at in range_boxes(tuple(shape[1:]), within, stop - pos):
                out.append(((r, *offs), (1, *sizes), pos - start + at))
            pos = stop
    return out


# ------------------------------------------------------------------------------ who writes a replica
@dataclass(frozen=True)
class ReplicaCoordinates:
    """This rank's coordinates in the layout, as far as they decide which ranks hold the same
    piece: world = TP x (DP x CP) for dense tensors, = expert-TP x EP x expert-DP for routed
    experts (megatron-core's two grids; pipeline parallel is 1). ZeRO partitions dense tensors
    over DP x CP and experts over expert-DP."""

    rank: int
    world: int
    tp_rank: int = 0
    tp_size: int = 1
    dense_dp_rank: int = 0  # rank in DP x CP
    dense_dp_size: int = 1
    etp_rank: int = 0  # expert tensor parallel (megatron-core: = TP unless set otherwise)
    etp_size: int = 1
    edp_rank: int = 0  # expert data parallel
    edp_size: int = 1
    zero_stage: int = 0  # 0: whole tensors in the optimizer (as the single-process engine)


def replica_slot(tensor: torch.Tensor, optimizer: bool, c: ReplicaCoordinates) -> tuple[int, int]:
    """(which holder this rank is, how many ranks hold the same piece) for a piece of `tensor`'s
    model value (`optimizer` False) or of its ZeRO fragment (True), from the layout alone:
      model value   replicated: every rank; TP slice: the DP x CP ranks of this TP rank; routed
                    expert: the expert-TP x expert-DP ranks of this EP rank
      ZeRO >= 1     a fragment of a replicated tensor: the TP ranks (each partitions its copy the
                    same way); of an expert: the expert-TP ranks; of a TP slice: this rank alone"""
    record = sharding_of(tensor)
    if optimizer and c.zero_stage > 0:
        if record.tensor_parallel:
            return 0, 1
        if record.expert:
            return c.etp_rank, c.etp_size
        return c.tp_rank, c.tp_size
    if record.expert:
        return c.etp_rank * c.edp_size + c.edp_rank, c.etp_size * c.edp_size
    if record.tensor_parallel:
        return c.dense_dp_rank, c.dense_dp_size
    return c.rank, c.world


def proposes(name: str, slot: tuple[int, int]) -> bool:
    """Whether this rank writes its piece of `name`: one holder of each replicated piece, the
    same on every holder without communication, spread over the holders by the name (crc32)."""
    index, copies = slot
    return copies <= 1 or zlib.crc32(name.encode()) % copies == index


# ------------------------------------------------------------------------------ what a rank holds
def model_pieces(model: torch.nn.Module, tp_size: int = 1, writer: ReplicaCoordinates | None = None
                 ) -> dict[str, GlobalPieces]:
    """model/<name> -> this rank's tensor of every model state-dict entry (parameters and
    persistent buffers), placed in the global tensor. `writer`: only the pieces this rank writes
    (`proposes`), for a save; None: every piece it holds (a load fills them all)."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t is None:
            continue
        if writer is not None and not proposes(MODEL + name, replica_slot(t, False, writer)):
            continue
        shape, offsets = sharding_of(t).place(tuple(t.shape), tp_size)
        out[MODEL + name] = GlobalPieces(shape, t.dtype, [(offsets, t.detach())])
    return out


@dataclass
class Fragment:
    """The part of one trainable parameter whose update this rank computes: elements
    [start, start + numel) of the flattened (TP-local) parameter, stepped by `optimizer` as
    elements [opt_start, opt_start + numel) of its parameter `opt_param` (a flat ZeRO partition,
    a fp32 master, or the parameter itself)."""

    name: str
    param: torch.Tensor
    start: int
    numel: int
    optimizer: torch.optim.Optimizer
    opt_param: torch.Tensor
    opt_start: int
    shape: tuple[int, ...] | None = None  # the parameter's (TP-local) shape when `param` is partitioned (ZeRO-3)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().view(-1).narrow(0, self.opt_start, self.numel)

    def master(self) -> torch.Tensor | None:
        """The fp32 master of the fragment; None when the parameter is fp32 (it is its own master)."""
        return None if self.param.dtype == torch.float32 else self.view(self.opt_param)

    def moments(self, create: bool = False) -> dict[str, torch.Tensor]:
        state = self.optimizer.state[self.opt_param]
        if not state:
            if not create:
                return {}
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in MOMENTS:
                state[key] = torch.zeros_like(self.opt_param, memory_format=torch.preserve_format)
        return {key: self.view(state[key]) for key in MOMENTS if key in state}


def optimizer_pieces(engine, tp_size: int = 1, create: bool | Collection[str] = False,
                     writer: ReplicaCoordinates | None = None) -> dict[str, GlobalPieces]:
    """optim/<kind>/<name> -> this rank's fragments of the fp32 masters and AdamW moments.
    `create`: make the optimizer's state (zeros) where it has none yet, to load into -- True: for
    every fragment; a collection of keys (a checkpoint's `saved_keys`): only for the fragments whose
    moments it holds. A resume passes the checkpoint's keys: state made for a parameter that never
    gets a gradient (the MTP layer of a stage without the MTP loss) would stay, zeros, and be
    written by every later checkpoint (+47% on the demo model; docs/reliability.md). `writer`: only
    the fragments this rank writes (`proposes`)."""
    out: dict[str, GlobalPieces] = {}
    for f in engine.fragments():
        if writer is not None and not proposes("optim/" + f.name, replica_slot(f.param, True, writer)):
            continue
        local_shape = f.shape or tuple(f.param.shape)
        shape, base = sharding_of(f.param).place(local_shape, tp_size)
        make = create if isinstance(create, bool) else any(optim_key(k, f.name) in create for k in MOMENTS)
        views = {"master": f.master(), **f.moments(make)}
        for offs, sizes, at in range_boxes(local_shape, f.start, f.numel):
            offsets = tuple(b + o for b, o in zip(base, offs))
            for kind, flat in views.items():
                if flat is None:
                    continue
                key = optim_key(kind, f.name)
                out.setdefault(key, GlobalPieces(shape, torch.float32)).add(
                    offsets, flat.narrow(0, at, math.prod(sizes)).view(sizes))
    return out


def optimizer_meta(engine) -> dict:
    """The optimizer's scalars, the same on every rank: AdamW's step count and the schedule's
    position (`optimizer.json`)."""
    steps = {float(f.optimizer.state[f.opt_param]["step"]) for f in engine.fragments()
             if "step" in f.optimizer.state[f.opt_param]}
    sched = engine.scheduler
    return {"adam_step": int(max(steps)) if steps else 0, "scheduler_last_epoch": int(sched.last_epoch),
            "scheduler_step_count": int(getattr(sched, "_step_count", sched.last_epoch + 1))}


def load_optimizer_meta(engine, meta: dict) -> None:
    """Set AdamW's step count, the schedule's position and the learning rate it implies."""
    for f in engine.fragments():
        state = f.optimizer.state[f.opt_param]
        if "step" in state:
            state["step"].fill_(float(meta["adam_step"]))
    sched = engine.scheduler
    sched.last_epoch = meta["scheduler_last_epoch"]
    sched._step_count = meta["scheduler_step_count"]
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


# ------------------------------------------------------------------------------ storage
def region_key(offset: int, length: int) -> str:
    return f"{offset}+{length}"


def _sha_range(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


class RegionHashingStream:
    """A file DCP writes, hashed as it is written: the sha256 of the bytes between consecutive
    positions DCP asks for (`tell`, called at the start and end of every write item) is kept as
    `segments[(start, end)]`, so each item's byte range gets its checksum without a re-read."""

    def __init__(self, f):
        self.f = f
        self.position = 0
        self.start = 0
        self.sha = hashlib.sha256()
        self.segments: dict[tuple[int, int], str] = {}

    def write(self, data) -> int:
        n = self.f.write(data)
        self.sha.update(data)
        self.position += len(memoryview(data).cast("B"))
        return n

    def tell(self) -> int:
        if self.position != self.start:
            self.segments[(self.start, self.position)] = self.sha.hexdigest()
            self.start, self.sha = self.position, hashlib.sha256()
        return self.position

    def __getattr__(self, name):  # fileno, flush, close, ...
        return getattr(self.f, name)


def hashing_writer(path: Path, on_write: Callable[[], None] | None = None):
    """A DCP FileSystemWriter that records the sha256 of every byte range it wrote
    (`.regions`: {file relative to `path`: {"offset+length": sha256}}), hashed while writing.
    `.reread_bytes` counts the bytes it had to read back instead (a range DCP's positions did
    not delimit; none in practice: the tests check it)."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self):
            super().__init__()
            self.segments: dict[str, dict[tuple[int, int], str]] = {}

        @contextmanager
        def create_stream(self, stream_path, mode: str):
            with super().create_stream(stream_path, mode) as f:
                if "w" not in mode:
                    yield f
                    return
                stream = RegionHashingStream(f)
                yield stream
                stream.tell()
                self.segments[Path(stream_path).name] = stream.segments

    class HashingWriter(FileSystemWriter):
        regions: dict[str, dict[str, str]] = {}
        reread_bytes = 0

        def write_data(self, plan, planner):
            if on_write is not None:
                on_write()
            fut = super().write_data(plan, planner)
            results = fut.wait()
            regions: dict[str, dict[str, str]] = {}
            for r in results:
                info = r.storage_data
                sha = self.fs.segments.get(Path(info.relative_path).name, {}).get((info.offset, info.offset + info.length))
                if sha is None:
                    sha = _sha_range(Path(self.path) / info.relative_path, info.offset, info.length)
                    self.reread_bytes += info.length
                regions.setdefault(info.relative_path, {})[region_key(info.offset, info.length)] = sha
            self.regions = regions
            return fut

    writer = HashingWriter(path, single_file_per_rank=True, sync_files=True, overwrite=True)
    writer.fs = HashingFileSystem()
    return writer


def verifying_reader(path: Path, regions: dict[str, dict[str, str]] | None, corrupt: Callable[[str], Exception],
                     metadata=None):
    """A DCP FileSystemReader that checks, before reading, the sha256 of each byte range this
    rank reads against `regions` (None: no checksums). `metadata`: the checkpoint's metadata,
    already read (else read from `.metadata`)."""
    from torch.distributed.checkpoint import FileSystemReader

    class VerifyingReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata if metadata is not None else super().read_metadata(*args, **kwargs)

        def read_data(self, plan, planner):
            if regions is not None:
                checked = set()
                for item in plan.items:
                    info = self.storage_data[item.storage_index]
                    key = (info.relative_path, info.offset, info.length)
                    if key in checked:
                        continue
                    checked.add(key)
                    want = regions.get(info.relative_path, {}).get(region_key(info.offset, info.length))
                    if want is None:
                        raise corrupt(f"{STATE_DIR}/{info.relative_path} bytes {info.offset}+{info.length} have "
                                      "no checksum in the manifest")
                    if _sha_range(Path(self.path) / info.relative_path, info.offset, info.length) != want:
                        raise corrupt(f"{STATE_DIR}/{info.relative_path} bytes {info.offset}+{info.length} "
                                      f"({item.dest_index.fqn}) do not match their sha256 (corrupt)")
            return super().read_data(plan, planner)

    return VerifyingReader(path)


class SnapshotStager:
    """DCP's stager for `async_save`: copies this rank's pieces before `async_save` returns, so
    training may change the parameters and optimizer state while the copy is written."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        out = {}
        for key, value in state_dict.items():
            if isinstance(value, GlobalPieces):
                value = GlobalPieces(value.shape, value.dtype,
                                     [(o, t.detach().to("cpu", copy=True)) for o, t in value.pieces.items()])
            out[key] = value
        return out

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _quiet_single_process() -> None:
    """DCP warns on every single-process save / load ("torch.distributed is disabled, unavailable or
    uninitialized, assuming the intent is to ... in a single process") even when told so
    (`no_dist=True`): one process (the demo, export, eval) is what is meant here. The filter is
    process-wide (the background save runs in a thread) and covers that message only."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
                            "assuming the intent", category=UserWarning)


def save_pieces(directory: Path, pieces: dict[str, GlobalPieces], process_group=None,
                on_write: Callable[[], None] | None = None, async_save: bool = False):
    """Write `pieces` (every rank calls this with its own) into the DCP directory `directory`.
    Returns the writer (its `.regions` filled once written) and, with `async_save`, the future
    that completes when every rank's files and the metadata are written."""
    import torch.distributed.checkpoint as dcp

    writer = hashing_writer(directory, on_write)
    no_dist = not _distributed()
    if no_dist:
        _quiet_single_process()
    if async_save and not no_dist:
        fut = dcp.async_save(pieces, storage_writer=writer, planner=_save_planner(), process_group=process_group,
                             async_stager=SnapshotStager())
        return writer, fut
    if async_save:  # one process: DCP's background save needs a process group; a thread does the same
        from concurrent.futures import ThreadPoolExecutor

        pieces = SnapshotStager().stage(pieces)
        pool = ThreadPoolExecutor(max_workers=1)
        fut = pool.submit(dcp.save, pieces, storage_writer=writer, planner=_save_planner(), no_dist=True)
        pool.shutdown(wait=False)
        return writer, fut
    dcp.save(pieces, storage_writer=writer, planner=_save_planner(), process_group=process_group, no_dist=no_dist)
    return writer, None


def load_pieces(directory: Path, pieces: dict[str, GlobalPieces], regions: dict | None,
                corrupt: Callable[[str], Exception], process_group=None) -> None:
    """Fill `pieces` (this rank's, of the layout now) from the DCP directory `directory`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not pieces:
        pieces = {}
    if not _distributed():
        _quiet_single_process()
    try:
        dcp.load(pieces, storage_reader=verifying_reader(directory, regions, corrupt), planner=_load_planner(),
                 process_group=process_group, no_dist=not _distributed())
    except CheckpointException as e:
        _raise_first_failure(e, corrupt)


def _raise_first_failure(err, corrupt: Callable[[str], Exception]):
    """One line for a failed DCP load: the first rank's error itself when it is ours (a checksum
    mismatch names the range and the fix), else `corrupt` with its type and message."""
    from dsa_train.errors import DSATrainError

    failures = getattr(err, "failures", {}) or {}
    first = next(iter(failures.values()), err)
    if isinstance(first, tuple):  # (exception, traceback) in some torch versions
        first = first[0]
    if isinstance(first, DSATrainError):
        raise first from err
    raise corrupt(f"cannot read the sharded state ({type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''})") from err


def read_metadata(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(directory).read_metadata()


def global_shapes(directory: Path, prefix: str = MODEL) -> dict[str, tuple[int, ...]]:
    """name (without `prefix`) -> global shape of every saved tensor under `prefix`."""
    md = read_metadata(directory)
    return {k[len(prefix):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
            if k.startswith(prefix) and hasattr(v, "size")}


def read_full_tensors(directory: Path, names: list[str], prefix: str = MODEL, regions: dict | None = None,
                      corrupt: Callable[[str], Exception] = RuntimeError, batch_bytes: int = 1 << 30,
                      metadata=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Offline (one process, no process group): the full tensors `names` under `prefix`, read a
    batch of at most `batch_bytes` at a time (the export streams them). `metadata`: the
    checkpoint's, already read."""
    metadata = metadata if metadata is not None else read_metadata(directory)
    md = metadata.state_dict_metadata
    batch: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        if batch:
            load_pieces_offline(directory, batch, regions, corrupt, metadata)
            yield from batch.items()

    for name in names:
        meta = md[prefix + name]
        t = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        batch[prefix + name] = t
        size += t.numel() * t.element_size()
        if size >= batch_bytes:
            for key, value in flush():
                yield key[len(prefix):], value
            batch, size = {}, 0
    for key, value in flush():
        yield key[len(prefix):], value


def load_pieces_offline(directory: Path, tensors: dict[str, torch.Tensor], regions: dict | None,
                        corrupt: Callable[[str], Exception], metadata=None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _quiet_single_process()
    try:
        dcp.load(tensors, storage_reader=verifying_reader(directory, regions, corrupt, metadata), no_dist=True)
    except CheckpointException as e:
        _raise_first_failure(e, corrupt)


def dcp_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []

