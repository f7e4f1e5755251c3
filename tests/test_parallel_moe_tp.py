"""The MoE's router and routed experts under tensor parallelism on a contiguous share of the tokens
(`dsa_train.parallel.tensor.TensorParallelTokens`), on spawned gloo ranks (one session for all
checks):
  * TP 2 (2 ranks; experts as grouped GEMMs and as the loop): an MoE layer gives every TP rank the
    output, input gradient, router and routed-expert gradients (after their sum over TP) and expert
    loads of one process over the same tokens -- for token counts TP divides, does not divide
    (shares 13 and 12) and one token (the second rank's share empty); each rank's experts run only
    its share's (token, expert) slots;
  * TP 2 x EP 2 (4 ranks, two data-parallel TP groups with their own tokens, each TP rank's EP
    group dispatching that rank's share): the same against one process over both groups' tokens
    (router gradients then also summed over the DP replicas, as DeepSpeed's reduction does)."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HIDDEN, TOP_K = 16, 4
TOKEN_COUNTS = {"even": 24, "uneven": 25, "one": 1}


def _layers(grouped: bool = True):
    from dsa_train.model import MoE, tiny_config

    cfg = tiny_config(vocab_size=64, hidden_size=HIDDEN, moe_intermediate_size=8, n_routed_experts=8,
                      n_group=4, topk_group=2, num_experts_per_tok=TOP_K, n_shared_experts=1)
    torch.manual_seed(0)
    reference = MoE(cfg)
    torch.nn.init.normal_(reference.gate.weight, std=0.5)
    reference.set_layout(grouped_gemm=grouped)
    return cfg, reference, copy.deepcopy(reference)


def _counting_expert_rows(moe) -> list[int]:
    """The rows each forward's routed experts run (the (token, expert) slots this rank computes)."""
    rows, run = [], moe.run_experts

    def counted(x_sorted, counts):
        rows.append(int(x_sorted.shape[0]))
        return run(x_sorted, counts)

    moe.run_experts = counted
    return rows


def _diffs(moe, reference, y, y_ref, x, x_ref, grads: dict) -> dict:
    ref = dict(reference.named_parameters())
    return {
        "output_diff": float((y - y_ref).abs().max()), "output_max": float(y_ref.abs().max()),
        "input_grad_diff": float((x.grad - x_ref.grad).abs().max()),
        "param_grad_diff": {name: float((g - ref[name].grad).abs().max()) for name, g in grads.items()},
        "load_equal": torch.equal(moe.last_expert_load, reference.last_expert_load),
    }


def _tp_checks(n_tokens: int, grouped: bool) -> dict:
    from dsa_train.parallel.comm import row_share
    from dsa_train.parallel.tensor import split_moe_tokens

    _, reference, moe = _layers(grouped)
    split_moe_tokens(moe, SimpleNamespace(tp_group=dist.group.WORLD))
    rows = _counting_expert_rows(moe)
    g = torch.Generator().manual_seed(1)
    x_all, dy = torch.randn(n_tokens, HIDDEN, generator=g), torch.randn(n_tokens, HIDDEN, generator=g)
    x = x_all.clone().requires_grad_(True)  # every TP rank holds all the tokens
    y = moe(x)
    with _counted_all_reduces() as reduced:
        (y * dy).sum().backward()
    x_ref = x_all.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    (y_ref * dy).sum().backward()
    start, stop = row_share(n_tokens, dist.group.WORLD)
    out = _diffs(moe, reference, y, y_ref, x, x_ref, {n: p.grad for n, p in moe.named_parameters()})
    return {**out, "expert_rows": rows, "share": stop - start, "backward_all_reduces": reduced,
            "router_params": len(list(moe.gate.parameters()))}


@contextlib.contextmanager
def _counted_all_reduces():
    """The shapes of the tensors all-reduced inside (torch.distributed.all_reduce, as the hooks and
    `copy_to_group` call it)."""
    shapes, real = [], dist.all_reduce

    def counted(tensor, *args, **kwargs):
        shapes.append(list(tensor.shape))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield shapes
    finally:
        dist.all_reduce = real


def _tp_ep_checks(rank: int) -> dict:
    """World 4 in megatron's order (tp fastest): TP groups {0, 1} and {2, 3} (one data-parallel
    replica each, its own tokens), EP groups {0, 2} and {1, 3}."""
    from dsa_train.parallel.expert import AllToAllDispatcher
    from dsa_train.parallel.tensor import split_moe_tokens

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_groups = ep_groups  # the ranks holding the same TP rank of each replica
    replica, tp_rank = rank // 2, rank % 2
    cfg, reference, moe = _layers()
    split_moe_tokens(moe, SimpleNamespace(tp_group=tp_groups[replica]))
    moe.set_layout(grouped_gemm=True, dispatcher=AllToAllDispatcher(cfg.n_routed_experts, ep_groups[tp_rank]))
    rows = _counting_expert_rows(moe)
    n_tokens = TOKEN_COUNTS["uneven"]
    g = torch.Generator().manual_seed(2)
    x_all, dy_all = torch.randn(2 * n_tokens, HIDDEN, generator=g), torch.randn(2 * n_tokens, HIDDEN, generator=g)
    mine = slice(replica * n_tokens, (replica + 1) * n_tokens)
    x = x_all[mine].clone().requires_grad_(True)
    (moe(x) * dy_all[mine]).sum().backward()
    y = moe(x_all[mine])  # (a second forward, no backward: its output and loads)
    x_ref = x_all.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    (y_ref * dy_all).sum().backward()
    grads = {}
    for name, p in moe.named_parameters():
        grad = p.grad.clone()
        if not name.startswith("experts."):  # replicated over DP: DeepSpeed's reduction sums the replicas' parts
            dist.all_reduce(grad, group=dp_groups[tp_rank])
        grads[name] = grad
    reference(x_all[mine])  # the reference's loads of this replica's tokens
    out = _diffs(moe, reference, y, y_ref[mine], x, SimpleNamespace(grad=x_ref.grad[mine]), grads)
    return {**out, "expert_rows": rows, "kept_experts": sorted(int(e) for e in moe.experts.keys())}


def _worker(rank: int, world: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        if world == 2:
            result = {name: _tp_checks(n, grouped=True) for name, n in TOKEN_COUNTS.items()}
            result.update({f"{name}_loop": _tp_checks(n, grouped=False) for name, n in TOKEN_COUNTS.items()})
        else:
            result = {"tp_ep": _tp_ep_checks(rank)}
    finally:
        gc.collect()
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _spawn(tmp_path_factory, world: int) -> list[dict]:
    out_dir = tmp_path_factory.mktemp(f"moe_tp_{world}")
    mp.start_processes(_worker, args=(world, str(out_dir)), nprocs=world, start_method="spawn")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict]:
    return _spawn(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def tp2_ep2(tmp_path_factory) -> list[dict]:
    return _spawn(tmp_path_factory, 4)


def _assert_matches_one_process(m: dict) -> None:
    # the same terms summed in another order (a token's experts on two ranks, gradients over TP): fp32 rounding
    assert m["output_max"] > 0 and m["output_diff"] <= 1e-6 * max(1.0, m["output_max"]), m
    assert m["input_grad_diff"] <= 1e-5, m
    assert m["param_grad_diff"] and max(m["param_grad_diff"].values()) <= 1e-5, m
    assert m["load_equal"], m


@pytest.mark.parametrize("tokens", list(TOKEN_COUNTS))
def test_tp2_grouped_experts_sum_their_gradients_in_one_all_reduce_per_projection(tp2, tokens):
    """Grouped GEMMs: the routed experts' gradients summed over TP on the stacked [E, I, h] /
    [E, h, I] weights, 3 all-reduces a layer whatever the number of experts; as a loop one per
    expert weight (3 x 8). The router's by its hooks in both."""
    for r in tp2:
        grouped, loop = r[tokens]["backward_all_reduces"], r[f"{tokens}_loop"]["backward_all_reduces"]
        router = r[tokens]["router_params"]
        assert len(grouped) == router + 3 and len(loop) == router + 3 * 8, (grouped, loop)
        stacked = sorted(x for x in grouped if len(x) == 3)  # gate / up [E, I, h], down [E, h, I]
        assert stacked == sorted([[8, 8, HIDDEN], [8, 8, HIDDEN], [8, HIDDEN, 8]]), grouped


@pytest.mark.parametrize("experts", ["grouped", "loop"])
@pytest.mark.parametrize("tokens", list(TOKEN_COUNTS))
def test_tp2_moe_equals_one_process(tp2, tokens, experts):
    for r in tp2:
        _assert_matches_one_process(r[tokens if experts == "grouped" else f"{tokens}_loop"])


@pytest.mark.parametrize("tokens", list(TOKEN_COUNTS))
def test_tp2_routed_experts_run_only_their_ranks_share(tp2, tokens):
    n = TOKEN_COUNTS[tokens]
    shares = [r[tokens]["share"] for r in tp2]
    assert sum(shares) == n and shares[0] == -(-n // 2), shares  # contiguous, ceil(N / 2) first
    for r in tp2:
        assert r[tokens]["expert_rows"] == [r[tokens]["share"] * TOP_K], r[tokens]  # not N x top_k


def test_tp2_ep2_moe_equals_one_process(tp2_ep2):
    # EP rank = the replica: ranks 0 and 1 (TP ranks of replica 0) keep experts 0-3
    assert [r["tp_ep"]["kept_experts"] for r in tp2_ep2] == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    for r in tp2_ep2:
        _assert_matches_one_process(r["tp_ep"])
    # the EP group's experts ran the slots of its TP ranks' shares: together every token's top_k
    n = TOKEN_COUNTS["uneven"]
    assert sum(r["tp_ep"]["expert_rows"][0] for r in tp2_ep2) == 2 * n * TOP_K
