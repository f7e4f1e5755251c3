"""A real single-node Slurm on this machine (SPEC section 6): the harness installs Debian's
slurm-wlm and munge if needed, starts munged, slurmctld and slurmd with a private slurm.conf,
submits the sbatch that `dsa-train launch slurm` generates, the job trains the tiny demo recipe
for a few steps with two tasks (torchrun ranks), and the harness stops the daemons by their own
process ids. Skips (printing why) only if the daemons cannot be started here."""

from __future__ import annotations

import os
import pwd
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.integration


TINY = [
    "data.seq_len=64", "data.micro_batch_size=1", "probe_batches=1", "logging.wandb_mode=disabled",
    "logging.progress_bar=false", "stages.pretrain.warmup_steps=1", "stages.sparse.warmup_steps=1",
    "stages.sparse.topk=16", "checkpoint.every_n_steps=0",
    *[f"stages.{s}.{k}={v}" for s in ("pretrain", "warmup", "sparse") for k, v in (("steps", 2), ("global_batch_size", 2))],
]


def _skip(reason: str):
    print(f"SKIP slurm test: {reason}", file=sys.stderr)
    pytest.skip(reason)


def _ensure_installed() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        _skip("slurm-wlm/munge are not installed and this user cannot apt-get install them")
    out = subprocess.run(["apt-get", "install", "-y", "slurm-wlm", "munge"], capture_output=True, text=True,
                         env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    if out.returncode != 0:
        _skip(f"apt-get install slurm-wlm munge failed: {out.stderr[-500:]}")


class SingleNodeSlurm:
    """munged + slurmctld + slurmd in the foreground (so their pids are ours to stop)."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.cleanup: list[Path] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def _munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        try:
            munge = pwd.getpwnam("munge")
        except KeyError:
            _skip("no munge user (munge package incomplete)")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(128))
            os.chown(key, munge.pw_uid, munge.pw_gid)
            key.chmod(0o400)
        # not under pytest's tmp_path (0700, root): munged runs as the munge user
        sock_dir = Path(tempfile.mkdtemp(prefix="dsa-munge-"))
        self.cleanup.append(sock_dir)
        os.chown(sock_dir, munge.pw_uid, munge.pw_gid)
        sock_dir.chmod(0o755)  # munged: clients need execute permission on the socket directory
        self.munge_socket = sock_dir / "munge.socket"
        log = open(self.root / "munged.log", "w")

        def as_munge():
            os.setgid(munge.pw_gid)
            os.setuid(munge.pw_uid)

        self.procs.append(subprocess.Popen(
            ["munged", "--foreground", f"--socket={self.munge_socket}", f"--pid-file={sock_dir}/munged.pid",
             f"--seed-file={sock_dir}/munged.seed", f"--log-file={sock_dir}/munged.log"],
            preexec_fn=as_munge, stdout=log, stderr=subprocess.STDOUT))
        for _ in range(50):
            if self.munge_socket.exists():
                return
            if self.procs[-1].poll() is not None:
                _skip(f"munged exited: {(self.root / 'munged.log').read_text()[-500:]}")
            time.sleep(0.1)
        _skip("munged did not create its socket")

    def start(self) -> None:
        self._munge()
        host = socket.gethostname().split(".")[0]
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
        for d in ("state", "spool"):
            (self.root / d).mkdir()
        conf = f"""ClusterName=dsatest
SlurmctldHost={host}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
NodeName={host} CPUs={os.cpu_count()} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        (self.root / "slurm.conf").write_text(conf)
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.root / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen([daemon, "-D", "-f", str(self.root / "slurm.conf")], env=self.env,
                                               stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + 60
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    logs = "".join((self.root / f).read_text()[-800:] for f in ("slurmctld.out", "slurmd.out", "slurmctld.log")
                                   if (self.root / f).exists())
                    _skip(f"a Slurm daemon exited with {p.returncode}: {logs}")
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and "idle" in out.stdout:
                return
            time.sleep(1)
        _skip(f"the node did not become idle: {out.stdout} {out.stderr}")

    def stop(self) -> None:
        for p in reversed(self.procs):  # by their own pids: slurmd, slurmctld, munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for d in self.cleanup:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def _job_field(job, key, env):
    info = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return next((f.split("=", 1)[1] for f in info.split() if f.startswith(key + "=")), "")


def _submit(run_dir, env, extra):
    cmd = [sys.executable, "-m", "dsa_train.cli", "launch", "slurm", "--config-name", "demo", *TINY, *extra,
           "parallel=zero2", "cluster.gpus_per_node=0", "cluster.procs_per_node=2", "cluster.time=00:15:00",
           f"cluster.master_port={free_port()}", f"run_dir={run_dir}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.split()[2]


@pytest.mark.slow
def test_slurm_preemption_signal_checkpoints_requeues_and_resumes(tmp_path):
    """Slurm's warning signal (here by `scancel -b -s USR1`, as `--signal=B:USR1@180` sends it) is
    forwarded to the ranks, which checkpoint and exit 75; the job requeues itself and resumes to
    the same final loss as an uninterrupted job."""
    _ensure_installed()
    (tmp_path / "slurm").mkdir()
    slurm = SingleNodeSlurm(tmp_path / "slurm")
    try:
        slurm.start()
        env = {**slurm.env, "DS_ACCELERATOR": "cpu", "DSA_TRAIN_BACKEND": "gloo"}
        extra = ["stages.sparse.steps=10", "probe_batches=0", "checkpoint.export=false"]
        run_dir = tmp_path / "run"
        job = _submit(run_dir, env, extra)
        log_path = run_dir / f"slurm-{job}.out"
        deadline = time.time() + 300
        while time.time() < deadline and not (log_path.exists() and "sparse 2/10" in log_path.read_text()):
            time.sleep(0.5)
        subprocess.run(["scancel", "-b", "-s", "USR1", job], env=env, check=True)
        deadline = time.time() + 400
        pending_since = None
        while time.time() < deadline:
            state = _job_field(job, "JobState", env)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            if state == "PENDING" and _job_field(job, "Restarts", env) == "1":
                # a requeued job waits (BeginTime) before it is eligible again; let it start sooner,
                # but not at once: slurmd revokes the old run's credential for a few seconds and a
                # restart inside that window is killed ("Job credential revoked")
                pending_since = pending_since or time.time()
                if time.time() - pending_since > 5:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
            time.sleep(1)
        log = log_path.read_text()
        assert state == "COMPLETED" and _job_field(job, "Restarts", env) == "1", f"{state}\n{log[-4000:]}"
        assert "forwarding preemption signal" in log and "preempted by SIGUSR1" in log, log[-4000:]
        # torchrun (--max_restarts=3) restarted the preempted workers; they left at once
        assert "was preempted and its checkpoint written; not restarting on it" in log, log[-4000:]
        assert "resumed from" in log and "sparse 10/10" in log, log[-4000:]
        ref_dir = tmp_path / "ref"
        ref = _submit(ref_dir, env, extra)
        deadline = time.time() + 300
        while time.time() < deadline and _job_field(ref, "JobState", env) not in ("COMPLETED", "FAILED"):
            time.sleep(1)
        ref_log = (ref_dir / f"slurm-{ref}.out").read_text()
        final = lambda text: re.findall(r"sparse 10/10  (loss \S+  lm \S+)", text)[-1]  # noqa: E731
        assert final(log) == final(ref_log), (final(log), final(ref_log))
    finally:
        slurm.stop()
    assert all(p.poll() is not None for p in slurm.procs)


@pytest.mark.slow
def test_slurm_job_from_generated_sbatch_trains(tmp_path):
    _ensure_installed()
    slurm = SingleNodeSlurm(tmp_path / "slurm")
    (tmp_path / "slurm").mkdir()
    try:
        slurm.start()
        run_dir = tmp_path / "run"
        env = {**slurm.env, "DS_ACCELERATOR": "cpu", "DSA_TRAIN_BACKEND": "gloo"}
        # the step's resources from the cluster group: gloo bound to the loopback interface (the job
        # trains only if gloo accepts it), and a job submitted with a low open-files soft limit
        # (Slurm propagates it) that the step raises to the node's hard limit
        cmd = [sys.executable, "-m", "dsa_train.cli", "launch", "slurm", "--config-name", "demo", *TINY,
               "parallel=zero2", "cluster.gpus_per_node=0", "cluster.procs_per_node=2", "cluster.time=00:15:00",
               "cluster.gloo_socket_ifname=lo", "cluster.nccl_socket_ifname=lo",
               f"cluster.master_port={free_port()}", f"run_dir={run_dir}"]
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        low = min(1024, hard)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                             preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
        assert out.returncode == 0, out.stdout + out.stderr
        job = out.stdout.split()[2]
        assert (run_dir / "launch" / "demo.sbatch").is_file()
        deadline, state = time.time() + 480, ""
        while time.time() < deadline:
            info = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
            state = next((f.split("=", 1)[1] for f in info.split() if f.startswith("JobState=")), "")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(2)
        log = (run_dir / f"slurm-{job}.out").read_text() if (run_dir / f"slurm-{job}.out").exists() else ""
        assert state == "COMPLETED", f"job {job} {state}\n{log[-4000:]}"
        assert "rank 0/2" in log and "rank 1/2" in log, log[-3000:]
        script = (run_dir / "launch" / "demo.sbatch").read_text()
        assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=2 " in script, script
        step = re.search(r"dsa-train: step on \S+: cpus (\d+) for 2 ranks, OMP_NUM_THREADS (\d+), open files (\d+), "
                         r"NCCL_SOCKET_IFNAME ([^,\s]+), GLOO_SOCKET_IFNAME (\S+)", log)
        assert step, log[-3000:]
        cpus, omp, open_files, nccl_if, gloo_if = step.groups()
        # the step got the CPUs asked for (not 1, as a step without --cpus-per-task can), one thread per rank
        assert (int(cpus), int(omp)) == (2, 1), step.group(0)
        assert int(open_files) == hard, (step.group(0), low, hard)  # raised from the submitted soft limit `low`
        assert (nccl_if, gloo_if) == ("lo", "lo"), step.group(0)
        assert "sparse 2/2" in log, log[-3000:]
        assert (run_dir / "export" / "model.safetensors").is_file()
    finally:
        slurm.stop()
    assert all(p.poll() is not None for p in slurm.procs)
