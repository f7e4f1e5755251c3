"""The compile gate: every kernel the dispatchers can launch, compiled at the 671B shapes with the
block sizes the launchers pick there (`dsa-train kernels report --arch ARCH --triton VERSION --json`:
Triton's compiler + its bundled ptxas, no GPU), for every (Triton, arch) pair of
`compile_report.GATE_TARGETS` (the oldest and the newest supported Triton for sm_90a, the newest for
sm_100), must compile, not spill, fit in the per-block shared memory, and use tensor-core
instructions in every dot-product kernel (wgmma on sm_90a). The Triton that is not installed is
side-installed once by this session (`ensure_side_triton`, pip from its cache); if that fails, the
tests of that Triton fail with pip's reason. The reports run once per session, in parallel
(`run_reports`, as `dsa-train kernels gate` does)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton
import triton.language as tl

from dsa_kernels import compile_report
from dsa_kernels.compile_report import (ARCHES, GATE_TARGETS, ROW_KEYS, SMEM_LIMIT, SUPPORTED_TRITON,
                                        SideTritonError, ensure_side_triton, gate_failures, main as report_main,
                                        run_reports)
from dsa_kernels.registry import DOT_FREE_KERNELS, OPS, calls_tl_dot, cases

REQUIRED_OPS = set(OPS)  # every op of the report has registered kernels


def _target_id(target) -> str:
    return f"triton{target[0]}-{target[1]}"


@pytest.fixture(scope="session")
def gate_reports():
    """{(version, arch): run_reports' result}: the gate's reports, run once per session, in parallel."""
    return run_reports(GATE_TARGETS)


@pytest.mark.parametrize("target", GATE_TARGETS, ids=_target_id)
@pytest.mark.integration
def test_compile_gate(gate_reports, target):
    version, arch = target
    res = gate_reports[target]
    if res["install_error"]:
        pytest.fail(res["install_error"], pytrace=False)
    returncode, out, err, rows, seconds = (res[k] for k in ("returncode", "stdout", "stderr", "rows", "seconds"))
    table = "\n".join(line for line in out.splitlines() if not line.startswith("[{"))  # without the JSON line
    print(table[-8000:], f"\nreport took {seconds:.0f} s (the {len(gate_reports)} reports ran in parallel)")
    assert rows is not None, f"no JSON rows from the report (exit {returncode}): {err[-2000:]}"
    header = out.splitlines()[0]
    assert f"Triton {version} " in header and f"--arch {arch}" in header, header
    assert all(tuple(r) == ROW_KEYS for r in rows)
    assert {r["triton"] for r in rows} == {version}, "the report did not run the intended Triton"
    ops = {r["op"] for r in rows}
    assert REQUIRED_OPS <= ops, f"missing ops: {REQUIRED_OPS - ops}"
    assert ops <= set(OPS)
    cap = ARCHES[arch]
    for r in rows:
        assert r["dots"] == (r["kernel"] not in DOT_FREE_KERNELS)
        assert r["gate"] == gate_failures(r, cap, r["dots"])
        if r["error"] is None:
            assert 0 < r["registers"] <= 255 and r["shared_bytes"] > 0, r
    failures = [f"{r['op']} {r['kernel']} [{r['config']}]: {f}" for r in rows for f in r["gate"]]
    if failures:
        pytest.fail(f"compile gate, Triton {version}, {arch}: {len(failures)} failures:\n" + "\n".join(failures),
                    pytrace=False)
    assert returncode == 0, out[-2000:] + err[-2000:]


def test_dot_product_marking_matches_the_kernel_sources():
    """`KernelCase.dots` (every kernel not in DOT_FREE_KERNELS) must agree with the source: a
    dot-product kernel calls tl.dot (itself or through a @triton.jit helper), a listed one does not."""
    registered = cases()
    wrong = [f"{c.kernel_name}: dots={c.dots} but calls tl.dot: {calls_tl_dot(c.launch.kernel)}"
             for c in registered if c.dots != calls_tl_dot(c.launch.kernel)]
    assert not wrong, "registry.DOT_FREE_KERNELS disagrees with the kernels: " + "; ".join(wrong)
    assert set(DOT_FREE_KERNELS) <= {c.kernel_name for c in registered}, "stale DOT_FREE_KERNELS entry"
    assert any(c.dots for c in registered) and any(not c.dots for c in registered)


@triton.jit
def _helper_with_dot(a, b):
    return tl.dot(a, b)


@triton.jit
def _kernel_calling_helper(x_ptr):
    offs = tl.arange(0, 16)
    x = tl.load(x_ptr + offs[:, None] * 16 + offs[None, :])
    tl.store(x_ptr + offs[:, None] * 16 + offs[None, :], _helper_with_dot(x, x))


@triton.jit
def _kernel_without_dot(x_ptr):
    # tl.dot(x, x) in a comment does not count
    offs = tl.arange(0, 16)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2)


def test_calls_tl_dot_follows_jit_helpers():
    assert calls_tl_dot(_helper_with_dot)
    assert calls_tl_dot(_kernel_calling_helper)
    assert not calls_tl_dot(_kernel_without_dot)


def _row(**kw):
    row = dict.fromkeys(ROW_KEYS)
    row.update(op="sparse_mla_fwd", kernel="k", config="", triton="3.9.0", registers=200, spill_bytes=0,
               shared_bytes=100_000, wgmma=8, mma_sync=0, tcgen05_mma=0, dots=True, gate=[])
    row.update(kw)
    return row


def test_gate_allows_only_the_listed_spills():
    """`ALLOWED_SPILLS`: the split backward's 32-key, 3-stage config (measured faster on an H200)
    may spill up to its listed bytes under Triton 3.6 on sm_90a; one byte more, another Triton,
    another architecture, another config or another kernel fails as before."""
    (key, allowed), = compile_report.ALLOWED_SPILLS.items()
    kernel, prefix, version, cap = key
    listed = dict(kernel=kernel, config=prefix + "BLOCK_K=32 warps=8 stages=3", triton=version + ".0")
    assert gate_failures(_row(**listed, spill_bytes=allowed), cap, dots=True) == []
    assert gate_failures(_row(**listed, spill_bytes=allowed + 1), cap, dots=True) == [
        f"spills {allowed + 1} bytes (allowed: {allowed}, ALLOWED_SPILLS)"]
    for other in (dict(triton="3.9.0"), dict(config="BLOCK_K=16 warps=8"), dict(kernel="_sparse_mla_fwd_kernel")):
        assert gate_failures(_row(**{**listed, **other}, spill_bytes=4), cap, dots=True) == ["spills 4 bytes"]
    assert gate_failures(_row(**listed, spill_bytes=4, wgmma=0, tcgen05_mma=8), 100, dots=True) == ["spills 4 bytes"]


def test_gate_rejects_bad_rows():
    ok = _row()
    assert gate_failures(ok, 90, dots=True) == []
    assert gate_failures(_row(spill_bytes=4), 90, dots=True) == ["spills 4 bytes"]
    assert gate_failures(_row(shared_bytes=SMEM_LIMIT[90] + 1), 90, dots=True)
    assert gate_failures(_row(shared_bytes=SMEM_LIMIT[90]), 90, dots=True) == []
    assert gate_failures(_row(error="CompilationError"), 90, dots=False)[0].startswith("does not compile")
    # sm_90a: a dot-product kernel needs wgmma; mma.sync alone (the Ampere path) fails
    (fail,) = gate_failures(_row(wgmma=0, mma_sync=72), 90, dots=True)
    assert "wgmma.mma_async" in fail and "mma.sync 72" in fail
    assert gate_failures(_row(wgmma=0), 90, dots=False) == []  # the radix top-k: no dots, no tensor cores
    assert len(gate_failures(_row(wgmma=0, spill_bytes=8), 90, dots=True)) == 2
    # sm_100: tcgen05.mma or mma.sync (wgmma is sm_90a-only)
    assert gate_failures(_row(wgmma=0, tcgen05_mma=12), 100, dots=True) == []
    assert gate_failures(_row(wgmma=0, mma_sync=56), 100, dots=True) == []
    assert gate_failures(_row(wgmma=0), 100, dots=True)
    assert gate_failures(_row(wgmma=4), 100, dots=True)
    # a kernel that writes no global memory (what a tensor-memory overflow compiled to on sm_100)
    (fail,) = gate_failures(_row(wgmma=0, tcgen05_mma=0, global_writes=0), 90, dots=False)
    assert "writes no global memory" in fail
    # sm_80: mma.sync
    assert gate_failures(_row(wgmma=0, mma_sync=8), 80, dots=True) == []
    assert gate_failures(_row(wgmma=0), 80, dots=True)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in version.split("."))
    return parts + (0,) * (3 - len(parts))


def test_supported_triton_range_matches_the_install_files():
    """SUPPORTED_TRITON is the one definition: the gate covers both ends, pyproject's floor is the
    oldest, and the development venv (constraints-cpu.txt) installs the newest."""
    oldest, newest = SUPPORTED_TRITON
    assert _version_tuple(oldest) < _version_tuple(newest)
    assert set(GATE_TARGETS) == {(oldest, "sm_90a"), (newest, "sm_90a"), (newest, "sm_100")}
    root = Path(__file__).resolve().parents[1]
    floor = re.search(r'"triton>=([\d.]+)', (root / "pyproject.toml").read_text())
    assert floor and _version_tuple(floor.group(1)) == _version_tuple(oldest), \
        f"pyproject.toml's triton floor {floor and floor.group(1)} is not the oldest supported {oldest}"
    pin = re.search(r"^triton==([\d.]+)", (root / "constraints-cpu.txt").read_text(), re.M)
    assert pin and pin.group(1) == newest, f"constraints-cpu.txt pins triton {pin and pin.group(1)}, not {newest}"


@pytest.mark.integration
def test_side_install_failure_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSA_TRITON_SIDE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_report, "_pip_install_cmd",
                        lambda version, target: [sys.executable, "-c", "import sys; sys.exit('ERROR: no network')"])
    with pytest.raises(SideTritonError) as err:
        ensure_side_triton("3.6.0")
    msg = str(err.value)
    assert "\n" not in msg and "triton==3.6.0" in msg and "no network" in msg and str(tmp_path) in msg
    assert list(tmp_path.iterdir()) == []  # the temporary install directory is removed
    other = "3.6.0" if compile_report._base_version(triton.__version__) != "3.6.0" else "3.9.0"
    assert report_main(["report", "--triton", other]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "no network" in err_lines[0]


@pytest.mark.integration
def test_ptxas_log_parsing_and_stats_cache(tmp_path, monkeypatch):
    """Registers / spills / static shared memory are read from `ptxas -v` output (here: Triton's
    bundled ptxas on a small PTX, and a log with spills), and kept per compiled kernel in
    TRITON_CACHE_DIR for reruns whose compile Triton's cache answers without ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = tmp_path / "k.ptx"
    ptx.write_text(".version 8.0\n.target sm_90a\n.address_size 64\n"
                   ".visible .entry k(.param .u64 p)\n{\n  .reg .b64 %rd<2>;\n  .reg .b32 %r<2>;\n"
                   "  ld.param.u64 %rd1, [p];\n  mov.u32 %r1, 7;\n  st.global.u32 [%rd1], %r1;\n  ret;\n}\n")
    proc = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    stats = compile_report._parse_ptxas_log(proc.stdout + proc.stderr)
    assert stats is not None and 0 < stats["registers"] <= 255 and stats["spill_bytes"] == 0, proc.stderr
    spilling = ("ptxas info    : Function properties for k\n    152 bytes stack frame, 88 bytes spill stores, "
                "40 bytes spill loads\nptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem")
    assert compile_report._parse_ptxas_log(spilling) == {"registers": 255, "spill_bytes": 128, "static_smem": 1024}
    assert compile_report._parse_ptxas_log("") is None  # a Triton cache hit prints no log

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert compile_report._load_stats("abc123") is None
    compile_report._store_stats("abc123", stats)
    assert compile_report._load_stats("abc123") == stats and compile_report._load_stats("abc124") is None


def test_gate_command_verdicts(monkeypatch, capsys):
    """`dsa-train kernels gate` prints one verdict per target and exits 0 / 1 (a failing kernel) /
    2 (a report that could not run), on synthetic report results."""
    passing = dict(returncode=0, stdout="", stderr="", rows=[_row()], seconds=1.0, install_error=None)
    failing = {**passing, "returncode": 1, "rows": [_row(spill_bytes=8, gate=["spills 8 bytes"])]}
    not_run = {**passing, "rows": None, "install_error": "side install of Triton 3.6.0 failed: no network"}
    for results, code in (((passing, passing, passing), 0), ((passing, failing, passing), 1),
                          ((not_run, failing, passing), 2)):
        monkeypatch.setattr(compile_report, "run_reports", lambda targets, ops, r=results: dict(zip(targets, r)))
        assert report_main(["gate"]) == code
        lines = capsys.readouterr().out.splitlines()
        verdicts = [line for line in lines if line.startswith("gate Triton")]
        assert len(verdicts) == len(GATE_TARGETS)
        assert ("spills 8 bytes" in "\n".join(lines)) == (failing in results)
        assert ("no network" in "\n".join(lines)) == (not_run in results)


def test_report_bad_arguments_one_line(capsys, monkeypatch):
    assert report_main(["report", "--op", "no_such_op"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_op" in err[0] and "sparse_mla_fwd" in err[0]
    assert report_main(["report", "--triton", "2.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2.0.0" in err[0] and SUPPORTED_TRITON[0] in err[0]
    # a re-run whose side install did not take effect says so instead of compiling with the wrong Triton
    monkeypatch.setenv(compile_report._REEXEC_MARK, "/nowhere")
    other = "3.6.0" if compile_report._base_version(triton.__version__) != "3.6.0" else "3.9.0"
    assert report_main(["report", "--triton", other]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and other in err[0] and triton.__version__ in err[0]
    with pytest.raises(SystemExit):
        report_main(["report", "--arch", "sm_75"])


# ----------------------------------------------------------------------------- the analysis column
def _rows_of(gate_reports, op: str, arch: str = "sm_90a"):
    out = []
    for (version, a), res in gate_reports.items():
        if a == arch and res["rows"]:
            out += [r for r in res["rows"] if r["op"] == op]
    return out


@pytest.mark.integration
def test_sparse_mla_forward_issues_the_useful_flops_and_reads_like_flashmla(gate_reports):
    """Issue 18's forward targets, from the report's analysis column at the 671B shapes (both
    supported Tritons, sm_90a, the default config): the tl.dot FLOPs equal the useful ones within 5%
    (the logits once per head block, not once per value half) and the gathered bytes per token are
    at most FlashMLA's (each selected row gathered once per 64-head block); all reads within 0.1%
    of FlashMLA's (ours add the per-row slot count)."""
    rows = [r for r in _rows_of(gate_reports, "sparse_mla_fwd") if "autotune" not in r["config"] and "KL target" not in r["config"]]
    assert {r["triton"] for r in rows} == {v for v, a in GATE_TARGETS if a == "sm_90a"}
    for r in rows:
        a = r["analysis"]
        assert abs(a["recompute"] - 1.0) <= 0.05, (r["config"], a)
        assert a["gather_bytes_per_token"] <= a["anchor"]["gather_bytes"], (r["config"], a)
        assert a["read_bytes_per_token"] <= 1.001 * a["anchor"]["read_bytes"], (r["config"], a)
        assert a["estimate"]["note"].startswith("roofline estimate"), a


@pytest.mark.integration
def test_on_hopper_only_the_split_backward_uses_mma_sync(gate_reports):
    """Issue 18's "wgmma everywhere" on sm_90a, both supported Tritons: the gate lets a kernel mix
    mma.sync with wgmma, so this pins which may. Only the split sparse MLA backward (its dKV
    products, 36) does; the sparse KL's dk_I ran 32 mma.sync until it was formed transposed."""
    mixed = {"_sparse_mla_bwd_kernel"}
    for (version, arch), res in gate_reports.items():
        if arch != "sm_90a":
            continue
        rows = res["rows"] or []
        assert rows, (version, arch)
        for r in rows:
            if r["kernel"] not in mixed:
                assert r["mma_sync"] == 0, (version, r["op"], r["kernel"], r["config"], r["shapes"])
        assert any(r["kernel"] in mixed and r["mma_sync"] > 0 for r in rows), "the pinned set is stale"


@pytest.mark.integration
def test_every_row_has_shapes_occupancy_and_replication(gate_reports):
    for (version, arch), res in gate_reports.items():
        for r in res["rows"] or []:
            if r["error"]:
                continue
            assert r["occupancy"]["ctas"] >= 1, r
            assert r["replication"]["ratio"] >= 1.0, r
            if arch == "sm_90a" and r["wgmma"]:
                assert sum(r["shapes"]["wgmma"].values()) == r["wgmma"], r


def test_warpgroup_replication_reads_the_layout():
    """A [64, 16] logits tile under warpsPerCTA [8, 1] (the flash-attention layout Triton gives a dot
    feeding another dot) is computed by both warp groups; a [64, 128] one under [4, 2] with 64-wide
    instructions is split, not replicated."""
    from dsa_kernels.analysis import warpgroup_replication

    ir = "\n".join([
        "#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 8, 16]}>",
        "#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 64, 16]}>",
        "  %s = ttng.warp_group_dot %q, %k, %c {isAsync = true} : !ttg.memdesc<64x128xbf16, #shared, #smem> * "
        "!ttg.memdesc<128x16xbf16, #shared1, #smem, mutable> -> tensor<64x16xf32, #mma> loc(#l)",
        "  %o = ttng.warp_group_dot %p, %v, %a {isAsync = true} : tensor<64x16xbf16, #ttg.dot_op<{opIdx = 0, "
        "parent = #mma1, kWidth = 2}>> * !ttg.memdesc<16x128xbf16, #shared, #smem, mutable> -> tensor<64x128xf32, #mma1> loc(#l)",
    ])
    rep = warpgroup_replication(ir)
    assert rep["replicated"] == ["64x16x128 x2"]
    once = 2 * 64 * 16 * 128 + 2 * 64 * 128 * 16
    assert rep["ratio"] == round((2 * 2 * 64 * 16 * 128 + 2 * 64 * 128 * 16) / once, 3)


def test_occupancy_limits():
    from dsa_kernels.analysis import occupancy

    assert occupancy(255, 8, 110656, 90) == dict(ctas=1, warps=8, limit="registers")
    assert occupancy(96, 4, 8192, 90)["ctas"] == 5  # 96 x 128 threads: 5 CTAs in 64K registers
    assert occupancy(32, 4, 120 * 1024, 90) == dict(ctas=1, warps=4, limit="shared")


@pytest.mark.integration  # the gate reports come from compile_report subprocesses
def test_gluon_forward_is_in_the_gate_on_hopper_under_both_tritons(gate_reports):
    """Issue 31: the Gluon sparse MLA forward (FlashMLA's schedule: a cp.async producer warp group and
    two wgmma consumer warp groups, setmaxnreg) is compiled for sm_90a under the oldest and the newest
    supported Triton (every Gluon config of that Triton's forward space), marked "Gluon" in the
    report's language column, with wgmma, no spill, and the warp-specialized partitions' register
    rebalance (maxnreg 168: 384 threads); sm_100 has no Gluon config. Every other kernel is "Triton"."""
    from dsa_kernels.ops.sparse_mla.kernel import fwd_config_space

    for (version, arch), res in gate_reports.items():
        rows = res["rows"] or []
        assert rows, (version, arch)
        assert {r["language"] for r in rows} <= {"Triton", "Gluon"}
        assert {r["kernel"] for r in rows if r["language"] == "Gluon"} <= {"_sparse_mla_fwd_gluon_kernel",
                                                                           "_sparse_mla_bwd_gluon_kernel",
                                                                           "_index_scores_gluon_kernel"}
        gluon = [r for r in rows if r["language"] == "Gluon" and r["op"] == "sparse_mla_fwd"]
        assert all(r["kernel"] == "_sparse_mla_fwd_gluon_kernel" for r in gluon)
        if arch != "sm_90a":
            assert not gluon, (version, arch)
            continue
        names = {c[0] for c in fwd_config_space(90, version) if c[0].startswith("gluon")}
        assert {r["config"].split()[2] for r in gluon} == names, (version, [r["config"] for r in gluon])
        for r in gluon:
            assert r["error"] is None and r["gate"] == [], (version, r)
            assert r["wgmma"] > 0 and r["spill_bytes"] == 0 and r["registers"] == 168, (version, r)


@pytest.mark.integration  # the gate reports come from compile_report subprocesses
def test_gluon_backward_is_in_the_gate_on_hopper_under_both_tritons(gate_reports):
    """Issue 31: the Gluon sparse MLA backward (q / dO resident, a cp.async producer warp group, two
    wgmma consumer warp groups, dq in registers, dkv by fp32 atomics) is compiled for sm_90a under the
    oldest and the newest supported Triton, one row per Gluon config of that Triton's backward space,
    marked "Gluon", with wgmma only (no mma.sync), no spill, maxnreg 168 (384 threads), within the
    shared memory; nothing on sm_100."""
    from dsa_kernels.ops.sparse_mla.kernel import bwd_config_space

    for (version, arch), res in gate_reports.items():
        rows = [r for r in res["rows"] or [] if r["kernel"] == "_sparse_mla_bwd_gluon_kernel"]
        if arch != "sm_90a":
            assert not rows, (version, arch)
            continue
        assert all(r["op"] == "sparse_mla_bwd" and r["language"] == "Gluon" for r in rows)
        names = {c[0] for c in bwd_config_space(90, version) if c[1] == "gluon"}
        assert names and {r["config"].split()[2] for r in rows} == names, (version, [r["config"] for r in rows])
        for r in rows:
            assert r["error"] is None and r["gate"] == [], (version, r)
            assert r["wgmma"] > 0 and r["mma_sync"] == 0, (version, r)
            assert r["spill_bytes"] == 0 and r["registers"] == 168, (version, r)
            # occupancy counts the compiled warps (4 launched + two 4-warp worker partitions), not the launch's 4
            assert r["occupancy"]["ctas"] == 1 and r["occupancy"]["warps"] == 12, (version, r["occupancy"])
        # "-v2" / "-v4": gluon-k32-c64 with dkv added by vector reductions (red.global.add.v2 / .v4.f32):
        # half / a quarter of its reduction instructions, its other global writes (dq's stores) the same
        writes = {r["config"].split()[2]: r["global_writes"] for r in rows}
        fewer_v2, fewer_v4 = (writes["gluon-k32-c64"] - writes[f"gluon-k32-c64-{v}"] for v in ("v2", "v4"))
        assert fewer_v2 > 0 and 3 * fewer_v2 == 2 * fewer_v4, (version, writes)


@pytest.mark.integration
def test_fp8_index_scores_multiply_e4m3_on_the_tensor_cores(gate_reports):
    """Issue 31 item 5: the FP8 score launch (e4m3 q_I / k_I) runs FP8 wgmma (k32, the e4m3 instruction
    shape; bf16's is k16) without spilling, under both supported Tritons on sm_90a."""
    rows = [r for r in _rows_of(gate_reports, "indexer_scores") if r["config"].startswith("fp8")]
    assert {r["triton"] for r in rows} == {v for v, a in GATE_TARGETS if a == "sm_90a"}
    for r in rows:
        assert r["spill_bytes"] == 0 and r["wgmma"] > 0, r
        assert r["shapes"]["wgmma"] and all(s.endswith("k32") for s in r["shapes"]["wgmma"]), r["shapes"]


@pytest.mark.integration  # the gate reports come from compile_report subprocesses
def test_gluon_index_scores_are_in_the_gate_on_hopper_under_both_tritons(gate_reports):
    """Issue 31: the Gluon index-score kernel (keys along the wgmma M, a cp.async producer warp group, two
    ping-pong consumer warp groups) is compiled for sm_90a under the oldest and the newest supported
    Triton, for every Gluon config of the score space and both score-block dtypes (fp32, bf16), marked
    "Gluon", with wgmma only (no mma.sync), no spill, maxnreg 168 (384 threads), within the shared
    memory; nothing on sm_100 (the kernel is sm_90a only)."""
    from dsa_kernels.ops.indexer_topk.kernel import score_config_space

    for (version, arch), res in gate_reports.items():
        rows = [r for r in res["rows"] or [] if r["kernel"] == "_index_scores_gluon_kernel"]
        if arch != "sm_90a":
            assert not rows, (version, arch)
            continue
        assert all(r["op"] == "indexer_scores" and r["language"] == "Gluon" for r in rows)
        names = {n for n, kind in score_config_space(90) if kind == "gluon"}
        assert names and {r["config"].split("autotune config ")[1].split()[0] for r in rows} == names, version
        assert len(rows) == 2 * len(names), [r["config"] for r in rows]  # fp32 and bf16 score blocks
        for r in rows:
            assert r["error"] is None and r["gate"] == [], (version, r)
            assert r["wgmma"] > 0 and r["mma_sync"] == 0, (version, r)
            assert r["spill_bytes"] == 0 and r["registers"] == 168, (version, r)
            # one CTA per SM: 12 compiled warps (4 launched + two 4-warp worker partitions) at 168 registers
            assert r["occupancy"]["ctas"] == 1 and r["occupancy"]["warps"] == 12, (version, r["occupancy"])
