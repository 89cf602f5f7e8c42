"""CPU tests of flashinfer_cake.cp (CI): partitions of every layout and explicit fragments, the
tables one rank derives, and the halo exchange with gloo in 2-4 processes (each with a timeout:
a hung collective fails the test) against the FP64 reference of the unsplit batch."""

from __future__ import annotations

import gc
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from cp_by_hand import all_pairs_tables, exchanged_by_hand, halo_rows, random_fragments
from flashinfer_cake.cp import LAYOUTS, build_cp_context, cp_partition
from flashinfer_cake.cp.partition import FRAG_CONTINUES, FRAG_HEAD_MASK

F64 = torch.float64


def random_cu(rng: random.Random, n_docs: int, choices=(0, 1, 2, 3, 5, 9, 40)) -> list[int]:
    cu = [0]
    for _ in range(n_docs):
        cu.append(cu[-1] + rng.choice(choices))
    return cu


CUS = [
    [0, 17],
    [0, 0, 5, 5, 6, 30, 30],
    [0, 1, 2, 3, 4, 5, 6, 7],
    [0, 100, 101, 104, 250],
] + [random_cu(random.Random(s), 12) for s in range(4)]


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_token_on_exactly_one_rank(cu, world_size, layout):
    part = cp_partition(torch.tensor(cu, dtype=torch.int32), world_size, layout)
    tokens = [t for r in range(world_size) for t in part.global_tokens(r)]
    assert sorted(tokens) == list(range(cu[-1]))
    for r in range(world_size):
        local = part.local_cu_seqlens(r)
        assert local[0] == 0 and local[-1] == part.local_tokens(r) == len(part.global_tokens(r))
    if layout == "contiguous":  # balanced within one token, in global order
        sizes = [part.local_tokens(r) for r in range(world_size)]
        assert max(sizes) - min(sizes) <= 1
        assert tokens == list(range(cu[-1]))


def test_zigzag_layouts_hold_chunks_r_and_mirror():
    part = cp_partition([0, 10, 16], 2, "zigzag")  # 16 tokens, 4 chunks of 4
    assert part.global_tokens(0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert part.global_tokens(1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert part.fragments[1] == ((0, 4, 6), (1, 0, 2))  # chunks 1 and 2 continue each other: one piece
    part = cp_partition([0, 8, 12], 2, "zigzag_per_document")
    assert part.fragments[0] == ((0, 0, 2), (0, 6, 2), (1, 0, 1), (1, 3, 1))
    assert part.fragments[1] == ((0, 2, 4), (1, 1, 2))  # chunks 1 and 2 of each document: one piece


def test_explicit_fragments_ragged_and_zero_length():
    frags = [[(0, 0, 1), (1, 0, 0)], [(0, 1, 1), (0, 2, 0)], [(0, 2, 5), (1, 0, 3)]]
    part = cp_partition([0, 7, 10], 3, fragments=frags)
    assert part.layout == "fragments" and part.local_cu_seqlens(1) == [0, 1, 1]
    assert sorted(t for r in range(3) for t in part.global_tokens(r)) == list(range(10))
    # integers of any library, as cu_seqlens takes them (NumPy's: a loader's arrays)
    np = pytest.importorskip("numpy")
    as_numpy = [[tuple(np.int64(v) for v in f) for f in rank] for rank in frags]
    assert cp_partition(np.array([0, 7, 10]), 3, fragments=as_numpy) == part
    with pytest.raises(ValueError, match=r"^cp_partition: fragments\[0\]\[0\] must be a \(doc, offset, length\) "
                                         r"triple of ints, got \(0, 0, 1\.0\)"):
        cp_partition([0, 7, 10], 3, fragments=[[(0, 0, 1.0)], [], []])


@pytest.mark.parametrize("cu, world_size, layout, frags, match", [
    ([0, 5, 3], 2, "contiguous", None, r"never decrease .*, got cu_seqlens_global_cpu\[1\] = 5 > "
                                       r"cu_seqlens_global_cpu\[2\] = 3$"),
    ([1, 5], 2, "contiguous", None, r"cu_seqlens_global_cpu\[0\] must be 0, got 1"),
    ([0, 5], 0, "contiguous", None, "world_size"),
    ([0, 5], 2, "diagonal", None, "layout"),
    ([0, 5], 2, None, [[(0, 0, 5)]], "one sequence per rank"),
    ([0, 5], 2, None, [[(0, 0, 3)], [(0, 2, 3)]], "more than one fragment"),
    ([0, 5], 2, None, [[(0, 0, 2)], [(0, 3, 2)]], r"tokens \[2, 3\) are in no fragment"),
    ([0, 5], 2, None, [[(0, 0, 2)], [(0, 2, 2)]], r"tokens \[4, 5\) are in no fragment"),
    ([0, 5], 2, None, [[(0, 0, 6)], []], "must lie in its document"),
    ([0, 5], 2, None, [[(1, 0, 1)], [(0, 0, 5)]], "must lie in its document"),
    ([0, 5], 2, None, [[(0, 0)], [(0, 0, 5)]], "doc, offset, length"),
    ([0, 5], 2, None, [[(0, 0, 5)], 3], r"^cp_partition: fragments\[1\] must be a sequence .* got 3"),
    ([0, 5], 2, "contiguous", [[(0, 0, 5)], []], "not both"),  # an explicit layout too, even the default one
    (None, 2, None, None, "got NoneType"),
    ([0, 5.0], 2, None, None, r"must hold ints, got 5\.0 \(float\)"),
])
def test_bad_partitions_are_value_errors(cu, world_size, layout, frags, match):
    with pytest.raises(ValueError, match=match):
        cp_partition(cu, world_size, layout, fragments=frags)


@pytest.mark.parametrize("fields, match", [
    ((2, (5,), (((0, 0, 2),), ((0, 3, 2),)), "fragments"),  # token 2 on no rank: its halo silently nobody's
     r"^CPPartition: every token of every document must be in exactly one fragment, but document 0's tokens "
     r"\[2, 3\) are in no fragment"),
    ((2, (5,), (((0, 0, 3),), ((0, 2, 3),)), "fragments"),
     r"document 0's tokens \[2, 3\) are in more than one fragment \(fragments\[0\]\[0\] = \(0, 0, 3\), "
     r"fragments\[1\]\[0\] = \(0, 2, 3\)\)"),
    ((2, (5, 4), (((0, 0, 5),), ((1, 0, 3),)), "fragments"), r"document 1's tokens \[3, 4\) are in no fragment"),
    ((3, (5,), (((0, 0, 5),), ()), "fragments"),
     r"^CPPartition: fragments must hold one sequence per rank \(world_size = 3\), got 2"),
    ((2, (5,), (((0, 0, 6),), ()), "fragments"),
     r"^CPPartition: fragments\[0\]\[0\] = \(0, 0, 6\) must lie in its document: doc in \[0, 1\), offset >= 0, "
     r"length >= 0, offset \+ length <= 5 \(doc_lengths\[0\]\)"),
    ((2, (5,), (((1, 0, 1),), ((0, 0, 5),)), "fragments"), r"fragments\[0\]\[0\] = \(1, 0, 1\) must lie in its"),
    ((2, (5,), (((0, 0, 5),), ((0, 5, -1),)), "fragments"), r"fragments\[1\]\[0\] = \(0, 5, -1\) must lie in"),
    ((2, (5,), (((0, 0, 5.0),), ()), "fragments"),
     r"^CPPartition: fragments\[0\]\[0\] must be a \(doc, offset, length\) triple of ints, got \(0, 0, 5\.0\)"),
    ((2, (5,), (((0, 0, torch.tensor(5)),), ()), "fragments"), r"fragments\[0\]\[0\] must be .*got \(0, 0, tensor"),
    ((2, (5,), (5, ()), "fragments"),
     r"^CPPartition: fragments\[0\] must be a sequence of \(doc, offset, length\) triples, got 5"),
    ((2, (5,), ((0, 0, 5), ()), "fragments"), r"fragments\[0\]\[0\] must be a \(doc, offset, length\) triple .*got 0"),
    ((0, (), (), "fragments"), r"^CPPartition: world_size must be a positive int \(the CP group's size\), got 0"),
    ((2.0, (5,), (((0, 0, 5),), ()), "fragments"), r"world_size must be a positive int .*got 2\.0"),
    ((1, (5, -1), (((0, 0, 5),),), "fragments"),
     r"^CPPartition: doc_lengths must be a sequence of non-negative ints \(one per document\), got -1 at index 1"),
    ((1, torch.tensor([5]), (((0, 0, 5),),), "fragments"), r"doc_lengths must be a sequence .*got a Tensor"),
    ((2, (4,), (((0, 0, 2),), ((0, 2, 2),)), "zigzag"),  # contiguous's cut named zigzag (which is 0-1 + 3-4 / 1-3)
     r"^CPPartition: layout 'zigzag' names cp_partition's cut of these documents, but the fragments are another: "
     r"pass layout='fragments'"),
    ((1, (5,), (((0, 0, 5),),), "zig-zag"),
     r"^CPPartition: layout must be one of \['contiguous', 'zigzag', 'zigzag_per_document', 'fragments'\], got "
     r"'zig-zag'"),
])
def test_a_partition_built_by_hand_is_checked_at_construction(fields, match):
    """A CPPartition constructed directly is held to cp_partition's rules when it is made (on the
    host, no collective): each broken rule named with what it takes and what it got. Before, one
    missing a token built a context silently (that token's rows nobody's) and other mistakes failed
    deep in build_cp_context."""
    from flashinfer_cake.cp import CPPartition
    with pytest.raises(ValueError, match=match):
        CPPartition(*fields)


@pytest.mark.parametrize("layout", [*LAYOUTS, "fragments"])
def test_partitions_of_cp_partition_pass_the_construction_checks(layout):
    """What cp_partition makes satisfies CPPartition's own checks (every layout, explicit ragged
    fragments with empty ones); a hand-built one's lists and integers of any library are taken as
    tuples of ints, equal to cp_partition's."""
    from flashinfer_cake.cp import CPPartition
    for cu in CUS:
        for world_size in (1, 2, 3, 5):
            part = partition_of(cu, world_size, layout)
            assert CPPartition(part.world_size, part.doc_lengths, part.fragments, part.layout) == part
    np = pytest.importorskip("numpy")
    by_hand = CPPartition(np.int64(2), [np.int32(7), 3], [[(0, 0, 1), [1, 0, 0]], [(np.int64(0), 1, 6), (1, 0, 3)]],
                          "fragments")
    want = cp_partition([0, 7, 10], 2, fragments=[[(0, 0, 1), (1, 0, 0)], [(0, 1, 6), (1, 0, 3)]])
    assert by_hand == want and type(by_hand.world_size) is int and hash(by_hand) == hash(want)
    assert all(type(v) is int for rank in by_hand.fragments for f in rank for v in f)


def test_partitions_take_the_integers_data_loaders_give():
    """cu_seqlens as any integer CPU tensor, a list of 0-d tensors (list(tensor)) or NumPy's
    integers, world_size as any integer: the same partition as from ints; floats and CUDA tensors
    are refused."""
    want = cp_partition([0, 5, 9, 20], 3, "zigzag")
    forms = [torch.tensor([0, 5, 9, 20], dtype=torch.int16), list(torch.tensor([0, 5, 9, 20])), (0, 5, 9, 20)]
    try:
        import numpy as np
    except ImportError:  # (not a dependency: the torch forms still run)
        np = None
    if np is not None:
        forms += [np.array([0, 5, 9, 20]), list(np.array([0, 5, 9, 20], dtype=np.int32))]
    for cu in forms:
        assert cp_partition(cu, 3, "zigzag") == want, cu
    assert cp_partition([0, 5, 9, 20], torch.tensor(3), "zigzag") == want
    cpu_only = r"must be a 1-D integer CPU tensor, .*, got torch.int64 of shape \(2,\) on meta \(read on the host once"
    for cu, match in [(torch.tensor([0.0, 5.0]), "float32"), (torch.tensor([True, False]), "torch.bool"),
                      ([0, torch.tensor(5.0)], r"must hold ints, got tensor\(5\.\)"),
                      (torch.tensor([0, 5], device="meta"), cpu_only),
                      ([0, torch.tensor(5, device="meta")],
                       r"must hold ints, got tensor\(\.\.\., device='meta'.* at index 1$")]:
        with pytest.raises(ValueError, match=match):
            cp_partition(cu, 2)



def gathered_states(part, x_global: torch.Tensor, rank: int) -> torch.Tensor:
    """What halo_exchange gives `rank`, computed from the tables alone on one process: every
    rank's rows for it, then a zero row, indexed by its import rows."""
    ctxs = [build_cp_context(part, None, r, "cpu") for r in range(part.world_size)]
    C, sends = x_global.shape[1], []
    for r, c in enumerate(ctxs):
        local = x_global[torch.tensor(part.global_tokens(r), dtype=torch.long)]
        sends.append(local.index_select(0, c.export_rows))
    received = torch.cat([exchanged_by_hand(ctxs, sends, "halo")[rank], torch.zeros(1, C, dtype=x_global.dtype)])
    return received.index_select(0, ctxs[rank].import_rows).view(-1, 3, C)


def assert_receives_only_what_it_needs(ctx, imported: list[int], kind: str) -> None:
    """From each sender, the rows the rank's fragments import, each once (none when none)."""
    base = 0
    for s, n in enumerate(getattr(ctx, f"{kind}_recv_splits")):
        used = {i for i in imported if base <= i < base + n}
        assert n == len(used), (kind, s, n, sorted(used))
        base += n
    assert all(0 <= i < base for i in imported), (kind, base, imported)


def partition_of(cu, world_size, layout):
    """The layout's partition, or (layout "fragments") random 0-4-token pieces on random ranks in
    shuffled order: histories from several ranks, a rank holding pieces of one document apart."""
    if layout != "fragments":
        return cp_partition(cu, world_size, layout)
    rng, frags = random.Random(len(cu) * world_size), [[] for _ in range(world_size)]
    for d, n in enumerate(b - a for a, b in zip(cu, cu[1:])):
        at = 0
        while at < n:
            k = min(n - at, rng.choice((0, 1, 1, 2, 4)))
            frags[rng.randrange(world_size)].append((d, at, k))
            at += k
    for f in frags:
        rng.shuffle(f)
    return cp_partition(cu, world_size, fragments=frags)


def test_tables_equal_the_all_pairs_plan():
    """build_cp_context (which works out only its rank's pairs) gives exactly the tables of the
    plain all-pairs plan (tests/cp_by_hand.py) on random batches: up to 16 ranks, documents of 0-60
    tokens, every layout, and random ragged fragments with many empty ones (at any offset, the
    document's end included), each rank's list shuffled. The passes' fragment lists are the
    fragments the kernel's own checks select: non-empty, with the frag_info bit of the pass."""
    rng = random.Random(7)
    checked = 0
    for trial in range(300):
        P = rng.choice((1, 2, 3, 5, 8, 16))
        cu = random_cu(rng, rng.randint(1, 10), choices=(0, 1, 2, 3, 4, 7, 20, 60))
        layout = rng.choice([*LAYOUTS, "fragments"])
        if layout == "fragments":
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            part = cp_partition(cu, P, fragments=random_fragments(lengths, P, rng, pieces=(0, 0, 1, 2, 3, 5, 30)))
        else:
            part = cp_partition(cu, P, layout)
        for r in range(P):
            ctx, want = build_cp_context(part, None, r, "cpu"), all_pairs_tables(part, r)
            for name, value in want.items():
                got = getattr(ctx, name)
                got = got.tolist() if isinstance(got, torch.Tensor) else got
                assert got == value, (trial, r, name, part)
            info, cu_local = ctx.frag_info.tolist(), ctx.cu_seqlens.tolist()
            tokens = [b - a for a, b in zip(cu_local, cu_local[1:])]
            for name, bit in (("head_frags", FRAG_HEAD_MASK), ("tail_frags", FRAG_CONTINUES)):
                want_list = [f for f, i in enumerate(info) if tokens[f] > 0 and i & bit]
                assert getattr(ctx, name).tolist() == want_list, (trial, r, name, part)
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("layout", [*LAYOUTS, "fragments"])
def test_tables_give_each_fragment_its_documents_previous_rows(cu, world_size, layout):
    part = partition_of(cu, world_size, layout)
    C = 4
    x = torch.arange(1, cu[-1] * C + 1, dtype=F64).view(-1, C)
    for r in range(world_size):
        states = gathered_states(part, x, r)
        assert states.shape[0] == len(part.fragments[r])
        c = build_cp_context(part, None, r, "cpu")
        zero_row = sum(c.halo_recv_splits)
        assert_receives_only_what_it_needs(c, [i for i in c.import_rows.tolist() if i != zero_row], "halo")
        assert torch.equal(states, halo_rows(part, x)[r]), r


_WORKER = textwrap.dedent("""
    import datetime, json, os, sys, torch, torch.distributed as dist
    from flashinfer_cake.cp import build_cp_context, cp_partition, halo_exchange, halo_exchange_multi
    from flashinfer_cake.cp.exchange import exchange_rows
    from flashinfer_cake.reference import causal_conv1d_backward_reference, causal_conv1d_reference
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["CP_TEST_STORE"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = json.loads(sys.argv[1])
    cu, C = cfg["cu"], cfg["C"]
    g = torch.Generator().manual_seed(cfg["seed"])  # the same global batch on every rank
    x = torch.randn(cu[-1], C, generator=g, dtype=torch.float64)
    w, b = torch.randn(C, 4, generator=g, dtype=torch.float64), torch.randn(C, generator=g, dtype=torch.float64)
    dy = torch.randn(cu[-1], C, generator=g, dtype=torch.float64)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    part = cp_partition(cu_t, world, cfg["layout"], fragments=cfg["fragments"])
    ctx = build_cp_context(part, dist.group.WORLD, rank, "cpu")
    mine = torch.tensor(part.global_tokens(rank), dtype=torch.long)
    x_local = x[mine].clone().requires_grad_()
    states = halo_exchange(x_local, ctx)
    y = causal_conv1d_reference(x_local, w, ctx.cu_seqlens, b, initial_states=states)
    want = causal_conv1d_reference(x, w, cu_t, b)[mine]
    # every rank runs the exchange's backward (its collective), also where y does not use the states
    ((y * dy[mine]).sum() + 0 * states.sum()).backward()
    dx_want = causal_conv1d_backward_reference(x, w, cu_t, dy, b, silu_grad_preactivation="fp32")[0][mine]
    ok_y = torch.allclose(y, want, rtol=1e-12, atol=1e-12)
    ok_dx = torch.allclose(x_local.grad, dx_want, rtol=1e-12, atol=1e-12)
    # q, k, v of other widths through one exchange: bitwise the separate exchanges, gradients too
    qkv = [torch.randn(x_local.shape[0], c, generator=g, dtype=torch.float64).requires_grad_() for c in (8, 16, 24)]
    together = halo_exchange_multi(qkv, ctx)
    alone = [halo_exchange(t, ctx) for t in qkv]
    ok_multi = all(torch.equal(a, b) for a, b in zip(together, alone))
    gs = [torch.randn(s.shape, generator=g, dtype=torch.float64) for s in alone]
    multi_grads = torch.autograd.grad(together, qkv, gs)
    alone_grads = torch.autograd.grad(alone, qkv, gs)
    ok_multi = ok_multi and all(torch.equal(a, b) for a, b in zip(multi_grads, alone_grads))
    # the conv's backward exchange (the torch binding's, of these splits): rows carrying their
    # global token, found through g_import as the j-th token after each fragment
    starts = [0]
    for n in part.doc_lengths:
        starts.append(starts[-1] + n)
    tokens = [starts[frag[0]] + frag[1] + (code & 3) for code in ctx.g_rows.tolist()
              for frag in [part.fragments[rank][code >> 2]]]
    got = torch.empty(sum(ctx.g_recv_splits), 1, dtype=torch.float64)
    exchange_rows(got, torch.tensor(tokens, dtype=torch.float64).view(-1, 1), ctx.g_recv_splits, ctx.g_send_splits,
                  ctx.group)
    ok_g = True
    for (d, o, n), row in zip(part.fragments[rank], ctx.g_import.view(-1, 3).tolist()):
        for j in range(3):
            p = o + n + j
            want = starts[d] + p if n and p < part.doc_lengths[d] else None
            ok_g = ok_g and (row[j] == -1 if want is None else got[row[j], 0].item() == want)
    print(json.dumps({"rank": rank, "y": ok_y, "dx": ok_dx, "multi": ok_multi, "g": ok_g,
                      "fragments": len(part.fragments[rank])}), flush=True)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    sys.stdout.flush()
    # torch 2.13's gloo sometimes aborts in its static destructors at interpreter exit ("terminate
    # called without an active exception", after every collective completed): skip them.
    os._exit(0)
""")


def run_ranks(world_size: int, cfg: dict, store: str, timeout: float = 120, worker: str = _WORKER) -> list[dict]:
    """world_size processes of ``worker`` meeting in a FileStore (no TCP port to race for), each
    killed after `timeout` seconds; their JSON results (each one's last line), rank by rank."""
    import json

    env = {**os.environ, "CP_TEST_STORE": store, "WORLD_SIZE": str(world_size),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", worker, json.dumps(cfg)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world_size)]
    outs = []
    try:
        for p in procs:  # every rank's outcome, so a crash is reported by the rank that crashed
            try:
                outs.append(p.communicate(timeout=timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"rank {r} exited with {p.returncode}:\n{err[-2500:]}" for r, (p, (_, err)) in enumerate(zip(procs, outs))
              if p.returncode != 0]
    assert not failed, "\n".join(failed)
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return results


@pytest.mark.parametrize("world_size, layout, cu, fragments", [
    (2, "contiguous", [0, 1, 3, 50, 51, 52, 90], None),
    (2, "zigzag", [0, 7, 8, 8, 40, 41, 43], None),
    (3, "zigzag_per_document", [0, 2, 30, 31, 60], None),
    (4, "contiguous", [0, 5, 5, 9, 10, 11, 12, 40], None),
    (4, "zigzag_per_document", [0, 9, 11, 30], None),  # 1- and 2-token chunks: histories from several ranks
    (3, "contiguous", [0, 2], None),  # rank 2 holds no token
    (2, "zigzag", [0, 0], None),  # no token at all
    (3, None, [0, 9, 14], [[(0, 0, 2), (0, 4, 1), (1, 3, 2)], [(0, 2, 1), (0, 3, 0), (0, 5, 4)],
                           [(0, 3, 1), (1, 0, 3)]]),
])
def test_halo_exchange_with_gloo_matches_the_unsplit_reference(world_size, layout, cu, fragments, tmp_path):
    """Each rank's y and dx (FP64 reference with the exchanged states, autograd through the
    exchange) equal the unsplit batch's restricted to its tokens; three tensors of other widths
    through one halo_exchange_multi give bitwise the separate exchanges, forward and backward."""
    cfg = {"cu": cu, "C": 8, "seed": 11, "layout": layout, "fragments": fragments}
    results = run_ranks(world_size, cfg, str(tmp_path / "store"))
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["y"] and r["dx"] and r["multi"] and r["g"] for r in results), results


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("layout", [*LAYOUTS, "fragments"])
def test_backward_tables_give_each_fragment_the_next_tokens(cu, world_size, layout):
    """The conv's backward tables (cp/conv.py, causal_conv1d_cp.cuh): each rank exports the head
    tokens listed in g_rows (4 * fragment + position < 3), rank by rank; every fragment's g_import
    row j is the received row of the j-th token after it in its document (-1 past the document, or
    for an empty fragment); frag_info is min(offset, 3) | 4 when the document goes on. Checked
    against the global token index of every row, the all_to_all done by hand; each rank receives
    only the rows it imports."""
    part = partition_of(cu, world_size, layout)
    ctxs = [build_cp_context(part, None, r, "cpu") for r in range(world_size)]
    sends = []  # global token of every row each rank sends
    for r, c in enumerate(ctxs):
        assert c.g_rows.numel() == sum(c.g_send_splits)
        starts, frags = part.local_cu_seqlens(r), part.fragments[r]
        tokens = []
        for code in c.g_rows.tolist():
            f, pos = code >> 2, code & 3
            d, o, n = frags[f]
            assert pos < min(n, 3), (r, code)
            tokens.append(cu[d] + o + pos)
        sends.append(torch.tensor(tokens, dtype=torch.long).view(-1, 1))
        assert c.frag_info.tolist() == [min(o, 3) | (4 if o + n < cu[d + 1] - cu[d] else 0) for d, o, n in frags]
        assert len(starts) == len(frags) + 1
    received = exchanged_by_hand(ctxs, sends, "g")
    for r, c in enumerate(ctxs):
        imports = c.g_import.view(-1, 3).tolist()
        for (d, o, n), row in zip(part.fragments[r], imports):
            for j in range(3):
                p = o + n + j
                if n == 0 or cu[d] + p >= cu[d + 1]:
                    assert row[j] == -1, (r, d, o, n, j)
                else:
                    assert row[j] >= 0 and received[r][row[j], 0].item() == cu[d] + p, (r, d, o, n, j)
        assert_receives_only_what_it_needs(c, [i for i in c.g_import.tolist() if i >= 0], "g")


class _Ctx:
    """A stand-in context (the handle holds contexts weakly)."""


def test_recompute_handle_keeps_one_halo_per_input_identity():
    """CPRecomputeHandle (the conv's activation-checkpointing aid): a halo kept for live inputs
    (storage, offset, version, shape) and a context is taken back only for the same inputs and
    context, once; at most max_kept are kept, the oldest dropped."""
    from flashinfer_cake.cp import CPRecomputeHandle
    handle = CPRecomputeHandle(max_kept=2)
    ctx_a, ctx_b = _Ctx(), _Ctx()
    x, y, z = torch.zeros(4, 8), torch.ones(4, 8), torch.full((4, 8), 2.0)
    handle._keep(ctx_a, [x], "rows x")
    handle._keep(ctx_a, [y], "rows y")
    assert len(handle) == 2 and "2 halos" in repr(handle)
    assert handle._take("f", ctx_b, [x]) is None  # another context
    x.add_(1)  # a new version of x: not the inputs the halo was exchanged for
    assert handle._take("f", ctx_a, [x]) is None
    assert handle._take("f", ctx_a, [x.view(4, 8)]) is None  # a view: the same storage, still the new version
    assert handle._take("f", ctx_a, [y.detach()]) == "rows y"  # (a reentrant checkpoint's detached input)
    assert handle._take("f", ctx_a, [y]) is None  # taken once
    handle._keep(ctx_a, [x], "x1")
    handle._keep(ctx_a, [y], "y1")
    handle._keep(ctx_a, [z], "z1")  # the oldest (x) dropped
    assert len(handle) == 2 and handle._take("f", ctx_a, [x]) is None and handle._take("f", ctx_a, [z]) == "z1"
    handle._keep(ctx_a, [y], "y2")  # the same inputs again: replaces y1
    assert len(handle) == 1 and handle._take("f", ctx_a, [y]) == "y2"
    handle._keep(ctx_a, [y], "y on a")
    handle._keep(ctx_b, [y], "y on b")  # the same inputs on another context: both kept
    assert len(handle) == 2 and handle._take("f", ctx_a, [y]) == "y on a" and handle._take("f", ctx_b, [y]) == "y on b"


def test_recompute_handle_matches_freed_inputs_by_context_alone():
    """An x_local made inside the checkpointed function is freed after the first run, and its
    recomputation is a new tensor (possibly at the same address as another micro-batch's): the halo
    is then found by its context, only when the context holds exactly one halo of freed inputs; a
    context that is gone takes its halos with it."""
    from flashinfer_cake.cp import CPRecomputeHandle
    handle = CPRecomputeHandle()
    ctx_a, ctx_b = _Ctx(), _Ctx()
    handle._keep(ctx_a, [torch.zeros(16, 8)], "a")  # freed at once, like an intermediate of the region
    handle._keep(ctx_b, [torch.zeros(16, 8)], "b")
    alive = torch.zeros(16, 8)
    handle._keep(ctx_b, [alive], "b alive")  # a live input's halo is never taken for other inputs
    assert handle._take("f", ctx_a, [torch.zeros(8, 8)]) is None  # another shape
    assert handle._take("f", ctx_b, [torch.zeros(16, 8)]) == "b"
    assert handle._take("f", ctx_a, [torch.zeros(16, 8)]) == "a"
    assert handle._take("f", ctx_a, [torch.zeros(16, 8)]) is None
    assert len(handle) == 1 and handle._take("f", ctx_b, [alive]) == "b alive"
    handle._keep(ctx_a, [torch.zeros(16, 8)], "a1")  # two micro-batches of one context in flight
    handle._keep(ctx_a, [torch.zeros(16, 8)], "a2")
    with pytest.raises(RuntimeError, match=r"f: the recompute_handle holds 2 halos of this context whose inputs "
                                           r"were freed.*a context of its own.*handle.clear\(\)"):
        handle._take("f", ctx_a, [torch.zeros(16, 8)])
    handle.clear()  # e.g. after an evaluation forward that left its halo
    assert len(handle) == 0
    # a recomputation that finds nothing: the handle's error, naming max_kept where the context lost halos to it
    assert "max_kept" not in str(handle._none_kept("f", ctx_a))
    kept = [torch.zeros(16, 8), torch.zeros(16, 8)]  # alive inputs: found by themselves, and dropped too
    one = CPRecomputeHandle(max_kept=1)
    one._keep(ctx_a, kept[:1], "first")
    one._keep(ctx_a, kept[1:], "second")
    assert one._take("f", ctx_a, kept[:1]) is None
    assert re.fullmatch(r"f: the recompute_handle holds no halo for these inputs: .*; this context lost halos to the "
                        r"handle's max_kept=1 limit, so this one may be among them: raise max_kept",
                        str(one._none_kept("f", ctx_a)))
    small = CPRecomputeHandle(max_kept=1)  # a halo of freed inputs dropped to the limit: never guessed
    small._keep(ctx_a, [torch.zeros(16, 8)], "train")
    small._keep(ctx_a, [torch.zeros(16, 8)], "eval")
    with pytest.raises(RuntimeError, match=r"f: the recompute_handle dropped a halo of this context to its "
                                           r"max_kept=1 limit"):
        small._take("f", ctx_a, [torch.zeros(16, 8)])
    small.clear()
    small._keep(ctx_a, [torch.zeros(16, 8)], "a5")
    assert small._take("f", ctx_a, [torch.zeros(16, 8)]) == "a5"
    handle._keep(ctx_a, [torch.zeros(16, 8)], "a3")
    handle._keep(ctx_a, [torch.zeros(16, 8)], "a4")
    del ctx_a
    gc.collect()
    assert len(handle) == 0 and handle._take("f", ctx_b, [torch.zeros(16, 8)]) is None


_VERIFY_WORKER = textwrap.dedent("""
    import datetime, json, os, sys, torch.distributed as dist
    from flashinfer_cake.cp import build_cp_context, cp_partition
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["CP_TEST_STORE"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = json.loads(sys.argv[1])
    P = cfg.get("P", [world] * world)[rank]
    part = cp_partition(cfg["cu"][rank], P, cfg["layout"][rank])  # each rank its own batch / layout / size
    group = [0, 1] if cfg.get("group") == "list" else dist.new_group(cfg["group"]) if "group" in cfg else None
    try:
        build_cp_context(part, group, cfg.get("rank", range(world))[rank], cfg.get("device", ["cpu"] * world)[rank],
                         verify=cfg.get("verify", True))
        error = None
    except (TypeError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"rank": rank, "error": error}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (as _WORKER: gloo's static destructors)
""")


@pytest.mark.parametrize("cfg, differ", [
    ({"cu": [[0, 10, 20]] * 2, "layout": ["zigzag"] * 2}, None),
    ({"cu": [[0, 10, 20], [0, 12, 20]], "layout": ["zigzag"] * 2}, "digest"),  # same sizes: wrong halos unchecked
    ({"cu": [[0, 10, 20]] * 2, "layout": ["zigzag", "contiguous"]}, "digest"),
    ({"cu": [[0, 10, 20], [0, 10, 20, 21]], "layout": ["contiguous"] * 2}, "digest"),
    ({"cu": [[0, 10, 20]] * 2, "layout": ["zigzag"] * 2, "P": [2, 3]}, "the group has 2 ranks"),  # rank 1's own error
    # a device error (TypeError, RuntimeError) on one rank only: every rank's ValueError, none left in the gather
    ({"cu": [[0, 10, 20]] * 2, "layout": ["zigzag"] * 2, "device": ["cpu", None]}, "device must be a torch.device"),
    ({"cu": [[0, 10, 20]] * 2, "layout": ["zigzag"] * 2, "device": ["cuda:63", "cpu"]},
     "device must be an available CUDA device, got cuda:63"),
    ({"cu": [[0, 10, 20]] * 2, "layout": ["zigzag"] * 2, "device": ["cpu", 2**70]}, "rank 1: its arguments: "),
])
def test_verify_names_ranks_that_planned_different_partitions(cfg, differ, tmp_path):
    """build_cp_context(verify=True) over gloo: where the ranks' partitions differ, or one rank's
    arguments fail, every rank raises the same ValueError (none is left waiting), naming what each
    rank planned; equal partitions pass."""
    results = run_ranks(2, cfg, str(tmp_path / "store"), timeout=90, worker=_VERIFY_WORKER)
    errors = [r["error"] for r in results]
    if differ is None:
        assert errors == [None, None]
    else:
        assert errors[0] is not None and errors[0] == errors[1], errors
        assert "planned different partitions" in errors[0] and "rank 0:" in errors[0] and "rank 1:" in errors[0]
        assert differ in errors[0], errors[0]


def test_verify_with_a_group_that_is_no_process_group_is_each_ranks_own_type_error(tmp_path):
    """build_cp_context(verify=True) with a list of ranks as the group: no group to gather over, so each
    rank raises its own TypeError (the hint to dist.new_group), not an AttributeError from the gather."""
    cfg = {"cu": [[0, 10, 20]] * 2, "layout": ["zigzag"] * 2, "group": "list"}
    results = run_ranks(2, cfg, str(tmp_path / "store"), timeout=90, worker=_VERIFY_WORKER)
    for r in results:
        assert r["error"].startswith("TypeError: build_cp_context: group must be a torch.distributed ProcessGroup"), r
        assert "dist.new_group(ranks)" in r["error"], r


def test_a_process_outside_the_group_is_told_so(tmp_path):
    """build_cp_context with a group this process is not in: a ValueError saying so (not "the group
    has -1 ranks"); the member builds its context."""
    cfg = {"cu": [[0, 10]] * 2, "layout": ["contiguous"] * 2, "P": [1, 1], "group": [1], "rank": [0, 0],
           "verify": False}  # every rank creates the group of rank 1 alone; rank 0 is not in it
    results = run_ranks(2, cfg, str(tmp_path / "store"), timeout=90, worker=_VERIFY_WORKER)
    assert "(global rank 0) is not a member of the group" in results[0]["error"]
    assert results[1]["error"] is None


# The end of a worker that defines rank and `calls`, (name, function) pairs: each call's ValueError
# message or None, as its JSON line (another exception ends the rank: run_ranks shows its traceback).
_CALLS_REPORTED = textwrap.dedent("""
    out = {"rank": rank}
    for name, call in calls:
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (as _WORKER: gloo's static destructors)
""")


_EARLY_CONTEXT_WORKER = textwrap.dedent("""
    import datetime, json, os, sys, torch, torch.distributed as dist
    from flashinfer_cake.cp import build_cp_context, cake_causal_conv1d_cp, cp_partition, halo_exchange
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = json.loads(sys.argv[1])
    init = lambda r, store: dist.init_process_group("gloo", init_method="file://" + store, rank=r, world_size=world,
                                                    timeout=datetime.timedelta(seconds=30))
    make = lambda: build_cp_context(cp_partition([0, 10, 20], cfg["P"], "zigzag"), None, cfg["rank"][rank], "cpu")
    if cfg.get("reinit"):  # checked against a default group that a re-initialization replaces, its ranks swapped
        init(rank, os.environ["CP_TEST_STORE"])
        ctx = make()
        dist.destroy_process_group()
        init(world - 1 - rank, os.environ["CP_TEST_STORE"] + ".again")
    else:  # the context first, as a data-loader or setup step may do: torch.distributed not initialized yet
        ctx = make()
        init(rank, os.environ["CP_TEST_STORE"])
    calls = (("conv", lambda: cake_causal_conv1d_cp(torch.zeros(ctx.num_tokens, 16, dtype=torch.bfloat16),
                                                    torch.zeros(16, 4), ctx)),
             ("exchange", lambda: halo_exchange(torch.zeros(ctx.num_tokens, 8), ctx)),
             ("again", lambda: halo_exchange(torch.zeros(ctx.num_tokens, 8), ctx)))
""") + _CALLS_REPORTED


@pytest.mark.parametrize("cfg, error", [
    ({"P": 2, "rank": [0, 1]}, None),
    ({"P": 3, "rank": [0, 1]}, "the partition is for 3 ranks and this is rank {r}, but the group has 2 ranks and this "
                               "process is its rank {r}"),  # was gloo's "Number of tensor splits not equal to group size"
    ({"P": 2, "rank": [1, 0]}, "the partition is for 2 ranks and this is rank {o}, but the group has 2 ranks and this "
                               "process is its rank {r}"),  # ranks swapped: was an exchange of the wrong rows
    ({"P": 2, "rank": [0, 1], "reinit": True}, "the partition is for 2 ranks and this is rank {r}, but the group has 2 "
                                               "ranks and this process is its rank {n}"),
])
def test_a_context_built_before_init_process_group_is_checked_at_its_first_call(cfg, error, tmp_path):
    """build_cp_context before torch.distributed.init_process_group (group None: the default group,
    which does not exist yet) cannot compare the partition with the group; its first call does,
    before any collective, as build_cp_context would have: a ValueError on each rank naming both
    sides. A context that matches its group runs. Likewise a context checked against a default
    group that a re-initialization replaced (here with the ranks swapped)."""
    results = run_ranks(2, cfg, str(tmp_path / "store"), timeout=90, worker=_EARLY_CONTEXT_WORKER)
    for r, res in enumerate(results):
        if error is None:
            assert res["exchange"] is None and res["again"] is None, res
            assert "x must be a CUDA tensor" in res["conv"], res  # (this CPU machine: the conv's own rule)
            continue
        want = error.format(r=r, o=cfg["rank"][r], n=1 - r)
        for key, fn in (("conv", "cake_causal_conv1d_cp"), ("exchange", "halo_exchange"), ("again", "halo_exchange")):
            assert res[key].startswith(f"{fn}: {want}"), (key, res[key])
            assert "the context was built before the group existed" in res[key], res[key]


def test_conv_argument_errors_name_the_call_and_the_tensor():
    """The CP conv's own rules run before any collective, for every tensor, under the name of the
    function called and of the argument (xs[i] / weights[i] / biases[i] in a multi call)."""
    from flashinfer_cake.cp import CPRecomputeHandle, cake_causal_conv1d_cp, cake_causal_conv1d_cp_multi
    part = cp_partition([0, 5, 9], 1)
    ctx = build_cp_context(part, None, 0, "cpu")
    x, w = torch.zeros(9, 16, dtype=torch.bfloat16), torch.zeros(16, 4)
    cases = [
        (lambda: cake_causal_conv1d_cp(x, w, part), TypeError, r"^cake_causal_conv1d_cp: ctx must be a CPContext"),
        (lambda: cake_causal_conv1d_cp(x[1:], w, ctx), ValueError,
         r"^cake_causal_conv1d_cp: x_local must be \[T, C\] .* T = 9 tokens \(ctx\.partition\.local_tokens\(ctx\.rank\): "
         r"pass cp_partition the whole batch's cu_seqlens, not a rank's\), got shape \(8, 16\)$"),
        (lambda: cake_causal_conv1d_cp(x.t().contiguous().t(), w, ctx), ValueError, r"x_local must be contiguous"),
        (lambda: cake_causal_conv1d_cp(torch.empty(9, 2**25, dtype=torch.bfloat16, device="meta"),
                                       torch.empty(2**25, 4, device="meta"), ctx), ValueError,
         r"^cake_causal_conv1d_cp: x_local must have C below 2\^25 channels .* got C=33554432"),
        (lambda: cake_causal_conv1d_cp(x, w, ctx, silu_grad_preactivation="fp16"), ValueError,
         r"^cake_causal_conv1d_cp: silu_grad_preactivation"),
        (lambda: cake_causal_conv1d_cp(x, w, ctx, recompute_handle=object()), TypeError, r"got object"),
        (lambda: cake_causal_conv1d_cp(x, w, ctx), ValueError, r"^cake_causal_conv1d_cp \(x_local as x\): x must be"),
        (lambda: cake_causal_conv1d_cp_multi([x, x[1:]], [w, w], ctx), ValueError,
         r"^cake_causal_conv1d_cp_multi: xs\[1\] must be \[T, C\]"),
        (lambda: cake_causal_conv1d_cp_multi([x, x], [w, "w"], ctx), TypeError,
         r"^cake_causal_conv1d_cp_multi: weights\[1\] must be a torch.Tensor, got str"),
        (lambda: cake_causal_conv1d_cp_multi([x, x], [w], ctx), ValueError, r"got 2 inputs, 1 weights, 2 biases"),
        # one tensor where a list goes (iterated, its rows would pass for tensors)
        (lambda: cake_causal_conv1d_cp_multi([x, x], [w, w], ctx, torch.zeros(16)), TypeError,
         r"^cake_causal_conv1d_cp_multi: biases must be a list of tensors or None, got a tensor of shape \(16,\)"),
        (lambda: cake_causal_conv1d_cp_multi([x], [w], ctx), ValueError,
         r"^cake_causal_conv1d_cp_multi \(xs\[0\] as x, weights\[0\], biases\[0\]\): x must be"),
        (lambda: CPRecomputeHandle(max_kept=0), ValueError, r"max_kept must be an int >= 1, got 0"),
        (lambda: CPRecomputeHandle(max_kept="a"), ValueError, r"got 'a'"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_conv_refuses_a_context_edited_by_hand():
    """A context whose tables or sizes are not build_cp_context's (dataclasses.replace) is a
    ValueError naming the field before any collective, not the binding's "internal error"."""
    import dataclasses

    from flashinfer_cake.cp import cake_causal_conv1d_cp
    part = cp_partition([0, 5, 9, 20], 3, "zigzag")
    ctx = build_cp_context(part, None, 1, "cpu")
    x, w = torch.zeros(ctx.num_tokens, 16, dtype=torch.bfloat16), torch.zeros(16, 4)
    shrunk = ctx.frag_info.clone()
    shrunk.untyped_storage().resize_(4)
    edits = [
        ({"cu_seqlens": ctx.cu_seqlens.long()}, r"ctx.cu_seqlens must be int32 1-D contiguous \[4\].*got torch.int64"),
        ({"frag_info": ctx.frag_info[:-1]}, r"ctx.frag_info must be int32 1-D contiguous \[3\]"),
        ({"import_rows": ctx.import_rows.view(3, 3)}, r"ctx.import_rows must be .*got torch.int32 \(3, 3\)"),
        ({"g_import": torch.zeros(18, dtype=torch.int32)[::2]}, r"ctx.g_import must be .*strides \(2,\)"),
        ({"export_rows": ctx.export_rows[1:]}, r"ctx.export_rows must be int32 1-D contiguous \[4\]"),
        ({"head_frags": ctx.head_frags.to("meta")}, r"ctx.head_frags must be int32 1-D contiguous on cpu"),
        ({"tail_frags": [0]}, r"ctx.tail_frags must be .*got list"),
        ({"g_send_splits": (1, -1, 0)}, r"ctx.g_send_splits must be a tuple of 3 non-negative ints"),
        ({"halo_recv_splits": (0, 1)}, r"ctx.halo_recv_splits must be a tuple of 3"),
        ({"frag_info": shrunk}, r"ctx.frag_info reaches past its storage"),
    ]
    for edit, match in edits:
        with pytest.raises(ValueError, match=r"^cake_causal_conv1d_cp: " + match):
            cake_causal_conv1d_cp(x, w, dataclasses.replace(ctx, **edit))
    with pytest.raises(ValueError, match=r"x must be a CUDA tensor"):  # the context itself passes
        cake_causal_conv1d_cp(x, w, ctx)


def test_a_context_on_another_device_than_x_local_is_named_with_both_devices():
    """A context built on another device than the call's tensors: the error names the context and
    the tensor, both devices and the fix (build the context on the tensor's device), not
    "cu_seqlens" (the context's table, which the caller never passed). Here the context on meta and
    x_local on the CPU, the two devices this machine has; on a GPU the case is a context on the CPU
    (test_cp_gpu.py: test_bad_arguments, "ctx_device")."""
    from flashinfer_cake.cp import cake_causal_conv1d_cp, cake_causal_conv1d_cp_multi, halo_exchange, halo_exchange_multi
    part = cp_partition([0, 5, 9], 1)
    ctx = build_cp_context(part, None, 0, "meta")
    x, w = torch.zeros(9, 16, dtype=torch.bfloat16), torch.zeros(16, 4)
    fix = (r": move it there \({0}\.to\('meta'\)\), or build the context on its device \(build_cp_context\(partition, "
           r"group, rank, {0}\.device\)\)$")
    cases = [
        (lambda: cake_causal_conv1d_cp(x, w, ctx), "cake_causal_conv1d_cp", "x_local", "cpu"),
        (lambda: cake_causal_conv1d_cp_multi([x, x], [w, w], ctx), "cake_causal_conv1d_cp_multi", r"xs\[0\]", "cpu"),
        (lambda: halo_exchange(x.double(), ctx), "halo_exchange", "x_local", "cpu"),
        (lambda: halo_exchange_multi([x, x], ctx), "halo_exchange_multi", r"xs\[0\]", "cpu"),
    ]
    for call, fn, name, device in cases:
        want = (rf"^{fn}: {name} must be on the context's device meta \(ctx's tables, from build_cp_context\), got "
                rf"{device}" + fix.format(name))
        with pytest.raises(ValueError, match=want):
            call()
    # on the context's device, meta: the exchange has no rows to send (it ran on none, at world size 1)
    meta = x.to("meta")
    for call, fn, name in ((lambda: halo_exchange(meta, ctx), "halo_exchange", "x_local"),
                           (lambda: halo_exchange_multi([meta, meta], ctx), "halo_exchange_multi", r"xs\[0\]")):
        with pytest.raises(ValueError, match=rf"^{fn}: {name} must be a CUDA tensor with memory of its own, got a "
                                             rf"tensor of type Tensor \(meta, fake"):
            call()


def test_exchange_and_context_argument_errors():
    """halo_exchange(_multi) and build_cp_context name the argument, what they take and what they
    got, before any collective."""
    from flashinfer_cake.cp import halo_exchange, halo_exchange_multi
    part = cp_partition([0, 5, 9], 1)
    ctx = build_cp_context(part, None, 0, "cpu")
    x = torch.zeros(9, 16, dtype=torch.float64)
    cases = [
        (lambda: halo_exchange(x, part), TypeError, r"^halo_exchange: ctx must be a CPContext.*got CPPartition"),
        (lambda: halo_exchange(x[1:], ctx), ValueError, r"^halo_exchange: x_local must be .*got shape \(8, 16\)"),
        (lambda: halo_exchange(torch.zeros(9, 16, dtype=torch.float64, device="meta"), ctx), ValueError,
         r"^halo_exchange: x_local must be on the context's device cpu .*got meta"),
        (lambda: halo_exchange_multi([x, x.float()], ctx), ValueError, r"^halo_exchange_multi: xs\[1\] .*float32"),
        (lambda: halo_exchange_multi([], ctx), ValueError, r"at least one tensor"),
        (lambda: build_cp_context(part, None, True, "cpu"), TypeError, r"rank must be an int, got True \(bool\)"),
        (lambda: build_cp_context(part, None, "0", "cpu"), TypeError, r"got '0' \(str\)"),
        (lambda: build_cp_context(part, None, 1, "cpu"), ValueError, r"rank must be in \[0, 1\), got 1"),
        (lambda: build_cp_context(ctx, None, 0, "cpu"), TypeError, r"partition must be a CPPartition"),
        (lambda: build_cp_context(part, None, 0, "cpu", verify=True), ValueError, r"initialized torch.distributed"),
        (lambda: build_cp_context(part, [0, 1], 0, "cpu"), TypeError,
         r"group must be a torch.distributed ProcessGroup or None .*got list .*dist.new_group\(ranks\)"),
        (lambda: build_cp_context(part, "cp", 0, "cpu"), TypeError, r"group must be .*got str"),
        (lambda: build_cp_context(part, None, 0, None), TypeError, r"^build_cp_context: device must be a torch.device"),
        (lambda: part.global_tokens(-1), ValueError, r"^CPPartition.global_tokens: rank must be an int in \[0, 1\)"),
        (lambda: part.local_cu_seqlens(1), ValueError, r"^CPPartition.local_cu_seqlens: rank .* got 1"),
        (lambda: part.local_tokens(True), ValueError, r"^CPPartition.local_tokens: rank .* got True"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    # integer-like ranks (numpy, 0-d tensors) are ranks; iterators of tensors are lists
    assert type(build_cp_context(part, None, torch.tensor(0), "cpu").rank) is int
    with pytest.raises(ValueError, match=r"xs\[1\]"):
        halo_exchange_multi(iter([x, x[1:]]), ctx)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is available here")
def test_context_on_a_missing_cuda_device_is_named():
    """Without a CUDA device, build_cp_context names its device argument and why (torch's own error
    names neither)."""
    with pytest.raises(RuntimeError, match=r"^build_cp_context: device must be an available CUDA device, got cuda "
                                           r"\(torch .* (built without CUDA|sees no CUDA GPU)\)"):
        build_cp_context(cp_partition([0, 10, 20], 2), None, 0, "cuda")


_VERIFY_CALL_WORKER = textwrap.dedent("""
    import datetime, json, os, sys, torch, torch.distributed as dist
    from flashinfer_cake.cp import (build_cp_context, cake_causal_conv1d_cp, cp_partition, halo_exchange,
                                    halo_exchange_multi)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["CP_TEST_STORE"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = json.loads(sys.argv[1])
    ctx = build_cp_context(cp_partition([0, 10, 20], world, "zigzag"), None, rank, "cpu", verify=True)
    x = torch.zeros(ctx.num_tokens + cfg["extra"][rank], cfg["C"][rank], dtype=torch.float64)
    calls = (("exchange", lambda: halo_exchange(x, ctx)),
             ("multi", lambda: halo_exchange_multi([x, x[:, :4].contiguous()], ctx)),
             ("conv", lambda: cake_causal_conv1d_cp(torch.zeros(ctx.num_tokens, 16, dtype=torch.bfloat16),
                                                    torch.zeros(16, 4), ctx)),
             ("handle", lambda: cake_causal_conv1d_cp(  # rank 1's bad handle: every rank raises
                 torch.zeros(ctx.num_tokens, 16, dtype=torch.bfloat16), torch.zeros(16, 4), ctx,
                 recompute_handle=None if rank == 0 else object())))
""") + _CALLS_REPORTED


@pytest.mark.parametrize("cfg, exchange_error", [
    ({"C": [8, 8], "extra": [0, 0]}, None),
    ({"C": [8, 16], "extra": [0, 0]}, "made different calls"),  # unchecked, gloo aborts or returns garbage
    ({"C": [8, 8], "extra": [0, 1]}, "its arguments"),  # rank 1's own error: rank 0 is not left waiting
])
def test_verify_context_checks_every_call_on_every_rank(cfg, exchange_error, tmp_path):
    """A context built with verify=True checks each call across the ranks before its collective:
    where the calls differ or one rank's arguments fail, every rank raises the same ValueError. The
    conv's call too: on this CPU-only machine its tensors fail the CUDA rule on every rank, and
    both ranks report both."""
    results = run_ranks(2, cfg, str(tmp_path / "store"), timeout=90, worker=_VERIFY_CALL_WORKER)
    for key, fn in (("exchange", "halo_exchange"), ("multi", "halo_exchange_multi")):
        ex = [r[key] for r in results]
        if exchange_error is None:
            assert ex == [None, None]
        else:
            assert ex[0] is not None and ex[0] == ex[1] and exchange_error in ex[0], ex
            assert ex[0].startswith(f"{fn}: the ranks of the CP group"), ex[0]
    conv = [r["conv"] for r in results]
    assert conv[0] is not None and conv[0] == conv[1], conv
    assert "cake_causal_conv1d_cp: the ranks of the CP group made different calls or failed" in conv[0]
    want = "ranks 0, 1: its arguments: cake_causal_conv1d_cp (x_local as x): x must be a CUDA tensor"
    assert want in conv[0], conv[0]
    handle = [r["handle"] for r in results]
    assert handle[0] is not None and handle[0] == handle[1], handle
    assert "rank 1: its arguments: cake_causal_conv1d_cp: recompute_handle must be a CPRecomputeHandle" in handle[0]


_EXCHANGES_WORKER = textwrap.dedent("""
    import datetime, json, os, sys, torch.distributed as dist
    cfg = json.loads(sys.argv[1])
    sys.path.insert(0, cfg["tests"])
    import cp_worker
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["CP_TEST_STORE"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    print(json.dumps({"rank": rank, "failures": cp_worker.exchanges(rank, world, "cpu")}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (as _WORKER: gloo's static destructors)
""")


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_gpu_workers_exchange_reference_over_gloo(world_size, tmp_path):
    """tests/cp_worker.py's halo-exchange cases (run over NCCL by test_cp_multi_gpu.py) on the host over
    gloo: its reference of every rank's halos and gradients agrees with the library here."""
    cfg = {"tests": os.path.dirname(os.path.abspath(__file__))}
    results = run_ranks(world_size, cfg, str(tmp_path / "store"), timeout=120, worker=_EXCHANGES_WORKER)
    assert [r["failures"] for r in results] == [[]] * world_size
