"""`dsa-train launch`: start a distributed run from a recipe.

    dsa-train launch torchrun [--nproc-per-node N] [--nnodes N --master-addr IP --master-port P] [--max-restarts K]
                              [--config-name R | recipe=R] [overrides ...]
        torchrun with c10d rendezvous (127.0.0.1 for one node; the first node's IP address for
        several: start the same command on every node). Runs `dsa_train.launch.rank`.
    dsa-train launch slurm [--dry-run] [--output FILE] [recipe=R] [overrides ...]
        writes an sbatch script from the recipe's `cluster` group to <run_dir>/launch/<run>.sbatch,
        prints it with --dry-run, else submits it with sbatch.

The sbatch script: one task per node running torchrun (--nnodes = cluster.nodes, --nproc_per_node
= cluster.procs_per_node or gpus_per_node), rendezvous at the first node's IP address (never a
hostname), one run directory per run shared by all ranks (the recipe's run_dir, made absolute),
a Triton cache per node (node-local, so nodes never race on a shared file system), the step's
resources set on srun itself (`--cpus-per-task`, which a step no longer inherits since Slurm 22.05;
OMP_NUM_THREADS = those CPUs over the node's ranks; `ulimit -n` raised; NCCL_SOCKET_IFNAME /
GLOO_SOCKET_IFNAME from `cluster.nccl_socket_ifname` / `gloo_socket_ifname`), and Slurm's
warning signal (`--signal=B:USR1@180`, sent to the batch shell) forwarded as SIGUSR1 to every
process of the step (torchrun ignores it, the ranks catch it), so the trainer checkpoints and exits 75; with `requeue` the script then
requeues the job, which resumes (`checkpoint.resume` auto). A crashed rank instead makes torchrun
restart the workers in place (`cluster.max_restarts`); a restart after a preemption exits 75 at once
(`dsa_train.signals.exit_if_preempted_earlier`), so the job still ends and is requeued.
"""

from __future__ import annotations

from dsa_train.config.overrides import recipe_args
from dsa_train.data.sources import is_local_source
import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

TRAIN_MODULE = "dsa_train.launch.rank"


# torch's c10d rendezvous shares the agent's TCPStore with the workers by default; after a
# restart the new workers then read the failed attempt's gloo/NCCL addresses. With this set, rank
# 0 of every attempt hosts a fresh store (docs/reliability.md).
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(
    recipe: str, overrides: list[str], nproc_per_node: int, nnodes: int = 1, master_addr: str = "127.0.0.1",
    master_port: int = 29500, run_id: str = "dsa-train", python: str | None = None, node_rank: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    cmd = [
        python or sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={master_addr}:{master_port}", f"--rdzv_id={run_id}",
        f"--max_restarts={max_restarts}",
    ]
    if node_rank is not None:
        cmd.append(f"--node_rank={node_rank}")
    return [*cmd, "-m", TRAIN_MODULE, "--config-name", recipe, *overrides]


def render_sbatch(recipe: str, overrides: list[str], python: str | None = None, workdir: str | None = None) -> tuple[str, Path]:
    """The sbatch script for the recipe (+ overrides) and where it is written."""
    from dsa_train.config import ConfigError, resolve_sizes, to_train_config
    from dsa_train.config.hydra_errors import compose_checked

    cfg = to_train_config(compose_checked(recipe, overrides))
    cl = cfg.cluster
    nproc = cl.procs_per_node or cl.gpus_per_node
    if nproc < 1:
        raise SystemExit("dsa-train launch slurm: cluster.procs_per_node (or gpus_per_node) must be >= 1")
    world = cl.nodes * nproc
    resolve_sizes(cfg.parallel, world)  # fail here, not after queueing, if the layout does not fit
    run_dir = Path(cfg.run_dir)
    if not run_dir.is_absolute():
        run_dir = Path(workdir or os.getcwd()) / run_dir
    overrides = [o for o in overrides if not o.startswith("run_dir=")] + [f"run_dir={run_dir}"]
    lines = ["#!/bin/bash", f"#SBATCH --job-name=dsa-{cfg.run_name}", f"#SBATCH --nodes={cl.nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if cl.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={cl.gpus_per_node}")
    cpus_per_task, mem = task_resources(cl, nproc)
    if cpus_per_task < nproc:
        raise ConfigError(f"cluster.cpus_per_task={cpus_per_task} is fewer than the {nproc} ranks per node: "
                          f"give each rank at least one core (cluster.cpus_per_task={nproc} or more)")
    lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if mem:
        lines.append(f"#SBATCH --mem={mem}")
    for key in ("partition", "account", "qos", "time"):
        value = getattr(cl, key)
        if value:
            lines.append(f"#SBATCH --{key}={value}")
    for warning in node_local_paths(cfg, Path(workdir or os.getcwd())):
        print(f"dsa-train launch slurm: warning: {warning}", file=sys.stderr)
    lines.append(f"#SBATCH --output={run_dir}/slurm-%j.out")
    lines.append("#SBATCH --open-mode=append")  # a requeued job appends to its log
    if cl.signal:
        lines.append(f"#SBATCH --signal=B:{cl.signal}")
    if cl.requeue:
        lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {opt}" for opt in cl.sbatch_options]
    train = torchrun_command(
        recipe, overrides, nproc, nnodes=cl.nodes, master_addr="$MASTER_ADDR", master_port=cl.master_port,
        run_id="$SLURM_JOB_ID", python=python or "python", node_rank="$SLURM_NODEID", max_restarts=cl.max_restarts,
    )
    # quote everything but the shell variables the node expands
    quoted = " ".join(a if "$" in a else shlex.quote(a) for a in train)
    inner = quoted.replace("'", "'\"'\"'")  # inside the single-quoted bash -c script
    setup = "\n".join(cl.setup)
    network = "".join(f"export {var}={shlex.quote(value)}\n" for var, value in
                      (("NCCL_SOCKET_IFNAME", cl.nccl_socket_ifname), ("GLOO_SOCKET_IFNAME", cl.gloo_socket_ifname))
                      if value)
    # raise the soft limit (to the configured value, or the hard limit); a failure is reported, not fatal
    open_files = (f"ulimit -n {int(cl.open_files)} || echo \"dsa-train: warning: ulimit -n {int(cl.open_files)} refused "
                  f"(hard limit $(ulimit -Hn)); set cluster.open_files lower\"" if cl.open_files
                  else "ulimit -n \"$(ulimit -Hn)\"")
    body = f"""
# generated by `dsa-train launch slurm` for recipe {recipe}: {world} ranks = {cl.nodes} nodes x {nproc}
set -uo pipefail
export RUN_DIR={shlex.quote(str(run_dir))}
mkdir -p "$RUN_DIR"
cd {shlex.quote(workdir or os.getcwd())}
# c10d rendezvous at the first node's IP address (hostnames do not always resolve between nodes)
FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_ADDR=$(getent ahostsv4 "$FIRST_NODE" | awk 'NR==1 {{print $1}}')
MASTER_ADDR=${{MASTER_ADDR:-$FIRST_NODE}}
# CPU threads per rank: the step's CPUs (srun --cpus-per-task below) over its {nproc} ranks
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{max(1, cpus_per_task // nproc)}}}
{network}# torchrun restarts (--max_restarts={cl.max_restarts}) need a fresh rendezvous store per attempt
{chr(10).join(f"export {k}={v}" for k, v in RESTART_ENV.items())}
{setup}

# one task per node; each sets a node-local Triton cache and runs torchrun
# torchrun ignores SIGUSR1 (inherited SIG_IGN); the ranks install their own handler for it
# --cpus-per-task again: since Slurm 22.05 a step does not inherit the batch job's, and with core
# binding the node's ranks would share one core. Open files: gloo and NCCL keep sockets per peer.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task={cpus_per_task} bash -c '
  export TRITON_CACHE_DIR="${{TMPDIR:-/tmp}}/dsa-triton-$SLURM_JOB_ID-$SLURMD_NODENAME"
  mkdir -p "$TRITON_CACHE_DIR"
  {open_files}
  echo "dsa-train: step on $SLURMD_NODENAME: cpus $SLURM_CPUS_PER_TASK for {nproc} ranks, OMP_NUM_THREADS $OMP_NUM_THREADS, open files $(ulimit -n), NCCL_SOCKET_IFNAME ${{NCCL_SOCKET_IFNAME:-unset}}, GLOO_SOCKET_IFNAME ${{GLOO_SOCKET_IFNAME:-unset}}"
  trap "" USR1
  exec {inner}
' &
SRUN_PID=$!

# Slurm's warning (--signal=B:...) reaches only this shell. SIGUSR1 to srun is delivered to every
# process of the step (a SIGTERM to srun would end the step at once, and torchrun kills its
# workers 30 s after a SIGTERM): the ranks checkpoint at the next step boundary and exit 75.
PREEMPTED=0
forward() {{ PREEMPTED=1; echo "dsa-train: forwarding preemption signal to the ranks"; kill -USR1 "$SRUN_PID" 2>/dev/null; }}
trap forward USR1 USR2 TERM
while true; do
  wait "$SRUN_PID"; RC=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break   # wait returns early when a trapped signal arrives
done
if [ "$PREEMPTED" = 1 ] && [ "{1 if cl.requeue else 0}" = 1 ]; then
  echo "dsa-train: preempted (rc $RC); requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $RC
"""
    script = "\n".join(lines) + "\n" + body
    path = run_dir / "launch" / f"{cfg.run_name}.sbatch"
    return script, path


# Defaults for GPU nodes when the cluster group leaves them unset: the one task per node (torchrun
# and its ranks) gets 8 CPU cores per GPU (data loader workers, host-side work; H100/H200 nodes have
# 96-224 cores), and on a whole 8-GPU node all of its memory (--mem=0: the job owns the node).
CPUS_PER_GPU = 8
WHOLE_NODE_GPUS = 8
NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run/user", "/scratch/local", "/local")


def task_resources(cl, nproc: int) -> tuple[int, str | None]:
    """(--cpus-per-task, --mem) of the one task per node: the cluster group's, else the defaults
    (8 cores per GPU; CPU nodes: one core per rank)."""
    cpus = cl.cpus_per_task or (CPUS_PER_GPU * cl.gpus_per_node if cl.gpus_per_node else nproc)
    mem = cl.mem or ("0" if cl.gpus_per_node >= WHOLE_NODE_GPUS else None)
    return cpus, mem


def node_local_paths(cfg, workdir: Path) -> list[str]:
    """Warnings for paths a multi-node (or requeued) job would see only on one node (relative
    paths count from `workdir`, where the job starts)."""
    paths = {"model.pretrained": cfg.model.pretrained, "run_dir": cfg.run_dir, "checkpoint.dir": cfg.checkpoint.dir,
             "data.tokenizer": cfg.data.tokenizer, "data.cache_dir": cfg.data.cache_dir}
    # the bundled corpus (in the installed package) and hub datasets are not paths of the job
    paths.update({f"data.sources[{i}]": src for i, src in enumerate(cfg.data.sources)
                  if is_local_source(str(src), workdir)})
    tmpdir = os.environ.get("TMPDIR")
    prefixes = NODE_LOCAL_PREFIXES + ((tmpdir,) if tmpdir and tmpdir != "/" else ())
    out = []
    for key, value in paths.items():
        if not value:
            continue
        resolved = str((workdir / str(value)).resolve()) if "://" not in str(value) else ""
        if any(resolved == p or resolved.startswith(p.rstrip("/") + "/") for p in prefixes):
            out.append(f"{key}={value} is on a node-local path: the other nodes (and a requeued job on another "
                       "node) will not find it; put it on a shared file system")
    return out


def slurm_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsa-train launch slurm", description="sbatch script from the recipe's cluster group")
    p.add_argument("--dry-run", action="store_true", help="print the script, do not write or submit it")
    p.add_argument("--output", help="write the script here (default <run_dir>/launch/<run_name>.sbatch)")
    p.add_argument("--python", default=None, help="python on the nodes (default: this interpreter)")
    args, recipe, overrides = recipe_args(p, argv)
    from dsa_train.config import ConfigError

    try:
        script, path = render_sbatch(recipe, overrides, python=args.python or sys.executable)
    except ConfigError as err:
        print(f"dsa-train launch slurm: invalid recipe: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script)
        return 0
    path = Path(args.output) if args.output else path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"dsa-train launch slurm: wrote {path}; no sbatch on this machine, submit it there", file=sys.stderr)
        return 2
    out = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"dsa-train launch slurm: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    print(f"submitted job {out.stdout.strip()} ({path})")
    return 0


def torchrun_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsa-train launch torchrun")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: GPUs on this node, else 1")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--master-addr", default="127.0.0.1", help="IP address of the rendezvous node")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--run-id", default="dsa-train")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restart all workers from the last checkpoint this many times after a rank fails")
    args, recipe, overrides = recipe_args(p, argv)
    for flag, value, least in (("--nproc-per-node", args.nproc_per_node, 1), ("--nnodes", args.nnodes, 1),
                               ("--max-restarts", args.max_restarts, 0), ("--master-port", args.master_port, 1)):
        if value is not None and value < least:
            p.error(f"{flag} {value}: must be >= {least}")
    if not args.master_port <= 65535:
        p.error(f"--master-port {args.master_port}: must be a TCP port, 1..65535 (default 29500)")
    nproc = args.nproc_per_node
    if nproc is None:
        import torch

        nproc = max(torch.cuda.device_count(), 1)
    problems = check_recipe(recipe, overrides, nproc * args.nnodes)
    if problems:  # one message from the launcher; no worker is started (nothing to restart)
        print(f"dsa-train launch torchrun: {problems}", file=sys.stderr)
        return 2
    cmd = torchrun_command(recipe, overrides, nproc, args.nnodes, args.master_addr, args.master_port, args.run_id,
                           max_restarts=args.max_restarts)
    env = {**os.environ, **RESTART_ENV}
    env.setdefault("DS_ACCELERATOR", "cuda" if nproc and _has_cuda() else "cpu")
    return run_torchrun(cmd, env)


def run_torchrun(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun (torch.distributed.run, in this process) with `cmd`'s arguments. A rank that
    failed with a project error (one line, exit 2: dsa_train/errors.py) ends the launch with that
    line and code 2, not with torchrun's ChildFailedError traceback; a preempted job exits 75; any
    other failure prints torchrun's failure summary and exits 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run

    from dsa_train.signals import EXIT_PREEMPTED
    from dsa_train.errors import EXIT_USER_ERROR

    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    os.environ.update(env)  # the workers inherit this process's environment
    try:
        run(parse_args(cmd[3:]))
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        message = str(data.get("original") or failure.message or "")
        if failure.exitcode == EXIT_USER_ERROR and message.startswith("dsa-train"):
            print(message, file=sys.stderr)
            return EXIT_USER_ERROR
        print(err.format_msg(), file=sys.stderr)
        return EXIT_PREEMPTED if failure.exitcode == EXIT_PREEMPTED else 1
    except SignalException as err:  # SIGTERM / SIGINT to the launcher: torchrun stopped the workers
        print(f"dsa-train launch torchrun: stopped by {err.sigval.name}", file=sys.stderr)
        return 128 + int(err.sigval)
    return 0


def check_recipe(recipe: str, overrides: list[str], world_size: int) -> str | None:
    """The recipe's problems (unknown keys, values, the layout against `world_size`, CUDA on this
    node) as one message, or None: checked here, before any worker starts, so that a configuration
    error is reported once instead of by every rank and every torchrun restart."""
    from dsa_train.config import ConfigError
    from dsa_train.config.hydra_errors import compose_checked
    from dsa_train.config.recipes import to_train_config

    try:
        to_train_config(compose_checked(recipe, overrides), check_environment=True, world_size=world_size)
    except ConfigError as err:
        return f"invalid recipe: {err}"
    return None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str]) -> int:
    if argv[:1] in (["--help"], ["-h"]):  # asked for: the usage on stdout, success
        print(__doc__)
        return 0
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] not in ("torchrun", "slurm"):
        import difflib

        near = difflib.get_close_matches(argv[0], ["torchrun", "slurm"], n=1, cutoff=0.6)
        print(f"dsa-train launch: {argv[0]}: no such launcher{f' (did you mean {near[0]}?)' if near else ''} — use "
              "`dsa-train launch torchrun ...` or `dsa-train launch slurm ...` (`dsa-train launch --help`)",
              file=sys.stderr)
        return 2
    return (slurm_main if argv[0] == "slurm" else torchrun_main)(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
