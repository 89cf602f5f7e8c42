"""One case for ncu, three calls (profile the third), 65536x1024: fwd / fwdst (4096 random documents, stateless /
initial + final states), bwd / bwd64 / bwd128 (one document; contiguous, column 64 of [S, C + 128], column 128 of
[S, C + 256]). Session 69 (r273, H200):

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:"causal_conv1d_(fwd|bwd)_kernel" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv --page details \
        python3 scripts/probes/ncu_cases.py fwdst > ncu_fwdst.csv
"""
import sys
import torch
import flashinfer_cake as fc

mode = sys.argv[1]
S, C = 65536, 1024
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
w = torch.randn(C, 4, device=dev, generator=g) * 0.3
b = torch.randn(C, device=dev, generator=g) * 0.1


def rows(pad, col):
    if pad == 0:
        return torch.randn(S, C, device=dev, generator=g).to(torch.bfloat16)
    buf = torch.full((S, C + pad), float("nan"), device=dev, dtype=torch.bfloat16)
    v = buf[:, col:col + C]
    v.copy_(torch.randn(S, C, device=dev, generator=g))
    return v


if mode.startswith("fwd"):
    D = 4096
    cut = torch.sort(torch.randperm(S - 1, device=dev, generator=g)[:D - 1] + 1).values
    cu = torch.cat([torch.zeros(1, device=dev, dtype=torch.int64), cut.long(),
                    torch.full((1,), S, device=dev, dtype=torch.int64)]).to(torch.int32)
    x = rows(0, 0)
    kw = {}
    if mode == "fwdst":
        kw = dict(initial_states=torch.randn(D, 3, C, device=dev, generator=g).to(torch.bfloat16),
                  final_states_out=torch.empty(D, 3, C, device=dev, dtype=torch.bfloat16))
    for _ in range(3):
        y = fc.cake_causal_conv1d_train_forward(x, w, cu, bias=b, **kw)
else:
    pad, col = {"bwd": (0, 0), "bwd64": (128, 64), "bwd128": (256, 128)}[mode]
    cu = torch.tensor([0, S], device=dev, dtype=torch.int32)
    x, dy = rows(pad, col), rows(pad, col)
    dx = rows(pad, col)
    for _ in range(3):
        fc.cake_causal_conv1d_train_backward(x, w, cu, dy, bias=b, dx=dx)
torch.cuda.synchronize()
print(mode, "ok")
