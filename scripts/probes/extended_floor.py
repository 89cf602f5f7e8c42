"""Probe (NOTES_bwd session 51's extended sequence, measured before it is built): what would a stateful
call cost if the kernels walked each document's 3 initial rows as ordinary rows before its tokens?

The identity (tests/test_reference_states.py::test_states_are_the_stateless_conv_of_the_extended_sequence):
the stateless conv of the sequence with each document's initial rows put before its tokens (documents of
n + 3 rows, cu_ext[d] = cu[d] + 3 d) gives y at the token rows and the final states as each document's
last 3 rows; its backward gives dx and dinitial_states likewise. So the stateless call on the extended
sequence moves the same bytes as the stateful call (forward: S + 3 N rows read, S + 3 N written;
backward: x, dy over S + 3 N rows against x, initial rows, dy and dfinal; dx and dinitial written), and
its time is what an extended-sequence route would take before the mapping's per-row cost.

Per shape and document mix (bench_harness.make_cu's "many" and "tiny"), medians of CUDA-event timings of
the raw functions with their outputs and workspace given (FP32 taps + FP32 bias): the stateless call on
[S, C], the stateful one (initial_states + final_states_out; backward initial_states + dfinal_states),
the stateless call on [S + 3 N, C] with cu_ext, and a copy of S·C elements (y.copy_(x)).
    python3 scripts/probes/extended_floor.py [--json out.json]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_harness import make_cu  # noqa: E402

from flashinfer_cake import (cake_causal_conv1d_train_backward, cake_causal_conv1d_train_backward_workspace,  # noqa: E402
                             cake_causal_conv1d_train_forward, cake_causal_conv1d_train_forward_workspace)

SHAPES = [(32768, 1024), (8192, 4096), (65536, 1024), (16384, 4096), (8192, 8192)]
BF16 = torch.bfloat16


def timed(fn, reps=60):
    for _ in range(5):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in evs:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in evs) * 1e3  # µs


def calls(S, C, cu, states, dev, gen):
    """(forward, backward) closures over fresh inputs and preallocated outputs."""
    N = cu.numel() - 1
    x = torch.randn(S, C, device=dev, dtype=BF16, generator=gen)
    dy = torch.randn(S, C, device=dev, dtype=BF16, generator=gen)
    w = torch.randn(C, 4, device=dev, generator=gen) * 0.5
    b = torch.randn(C, device=dev, generator=gen) * 0.1
    cu = cu.to(dev)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    fws = cake_causal_conv1d_train_forward_workspace(S, C, dev)
    bws = cake_causal_conv1d_train_backward_workspace(S, C, dev)
    st = {}
    if states:
        h0 = torch.randn(N, 3, C, device=dev, dtype=BF16, generator=gen)
        st = dict(fwd=dict(initial_states=h0, final_states_out=torch.empty_like(h0)),
                  bwd=dict(initial_states=h0, dfinal_states=torch.randn_like(h0), dinitial_states=torch.empty_like(h0)))

    def fwd():
        cake_causal_conv1d_train_forward(x, w, cu, bias=b, out=y, workspace=fws, **st.get("fwd", {}))

    def bwd():
        cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, workspace=bws, dx=dx, dweight=dw, dbias=db,
                                          **st.get("bwd", {}))
    return fwd, bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--mixes", default="many,tiny")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}; µs (median of 60); ext = the stateless call on [S + 3N, C]")
    print(f"{'shape':>12} {'mix':>5} {'N':>6} | {'fwd':>6} {'fwd+st':>7} {'fwd ext':>7} {'st/0':>5} {'ext/0':>5} "
          f"{'ext/st':>6} | {'bwd':>6} {'bwd+st':>7} {'bwd ext':>7} {'st/0':>5} {'ext/0':>5} {'ext/st':>6} | copy")
    for S, C in SHAPES:
        for mix in args.mixes.split(","):
            cu = make_cu(S, mix, cpu_gen)
            N = cu.numel() - 1
            cu_ext = cu + 3 * torch.arange(N + 1, dtype=torch.int32)
            f0, b0 = calls(S, C, cu, False, dev, gen)
            f1, b1 = calls(S, C, cu, True, dev, gen)
            f2, b2 = calls(S + 3 * N, C, cu_ext, False, dev, gen)
            src = torch.randn(S, C, device=dev, dtype=BF16, generator=gen)
            dst = torch.empty_like(src)
            t = {"fwd": timed(f0), "fwd_st": timed(f1), "fwd_ext": timed(f2),
                 "bwd": timed(b0), "bwd_st": timed(b1), "bwd_ext": timed(b2), "copy": timed(lambda: dst.copy_(src))}
            row = dict(S=S, C=C, mix=mix, N=N, us=t)
            rows.append(row)
            print(f"{S:>6}x{C:<5} {mix:>5} {N:>6} | {t['fwd']:6.1f} {t['fwd_st']:7.1f} {t['fwd_ext']:7.1f} "
                  f"{t['fwd_st'] / t['fwd']:5.2f} {t['fwd_ext'] / t['fwd']:5.2f} {t['fwd_ext'] / t['fwd_st']:6.3f} | "
                  f"{t['bwd']:6.1f} {t['bwd_st']:7.1f} {t['bwd_ext']:7.1f} {t['bwd_st'] / t['bwd']:5.2f} "
                  f"{t['bwd_ext'] / t['bwd']:5.2f} {t['bwd_ext'] / t['bwd_st']:6.3f} | {t['copy']:.1f}", flush=True)
            del f0, b0, f1, b1, f2, b2
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
