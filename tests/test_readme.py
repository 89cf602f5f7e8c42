"""The README's Python examples: every name they import exists and every call of one fits its
signature (CPU: the examples are parsed, not run); on a GPU the single-process ones run as
written, and what they say holds (the raw backward's gradients are autograd's; the model's module
is the raw forward with nn.Conv1d's init; chunks chained through their final states give the uncut
batch's y)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def examples() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readme_has_its_examples():
    assert len(examples()) >= 5  # the forward, autograd and the raw backward, a model's module, chunked states, CP


@pytest.mark.parametrize("index", range(len(examples())))
def test_an_example_imports_names_that_exist_and_calls_them_as_they_take(index):
    """(An example goes on from the ones before it: their imports hold in it.)"""
    trees = [ast.parse(code) for code in examples()[:index + 1]]
    names = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flashinfer_cake":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"README example {index}: {node.module}.{alias.name}"
                    names[alias.asname or alias.name] = getattr(module, alias.name)
    calls = [node for node in ast.walk(trees[-1])
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names]
    for call in calls:  # placeholders bound to the signature: TypeError on an unknown keyword or too many
        inspect.signature(names[call.func.id]).bind(*call.args, **{k.arg: k.value for k in call.keywords})


def run(code: str, namespace: dict) -> dict:
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


@pytest.mark.gpu
def test_the_single_process_examples_run_as_written():
    forward, autograd, model, chunked = examples()[:4]
    ns = run(forward, {})
    x, weight, bias, cu, y = (ns[k] for k in ("x", "weight", "bias", "cu_seqlens", "y"))
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    ns = run(autograd, ns)
    assert torch.equal(ns["y"], y)  # autograd's forward is the raw one
    for raw, leaf in ((ns["dx"], x), (ns["dweight"], weight), (ns["dbias"], bias)):
        assert torch.equal(raw, leaf.grad)  # "the same gradients from the raw backward"

    # The module: its cu_seqlens, nn.Conv1d's init range, the raw forward's y, gradients in the parameters' dtype
    m = run(model, dict(ns))
    conv, cu_m = m["conv"], m["cu_seqlens"]
    assert cu_m.dtype == torch.int32 and cu_m.tolist() == [0, 5000, 5000, 16384]
    for p in (conv.weight, conv.bias):  # U(-1/2, 1/2): 4096 draws or more reach past 0.45 on both sides
        assert p.dtype == torch.float32 and p.max() <= 0.5 and p.min() >= -0.5 and p.max() > 0.45 and p.min() < -0.45
    xm = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    ym = conv(xm, cu_m)
    with torch.no_grad():
        assert torch.equal(ym, ns["cake_causal_conv1d_train_forward"](xm, conv.weight, cu_m, bias=conv.bias))
    ym.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32 and conv.bias.grad.shape == (4096,)

    # The chunked example on the first example's batch (documents of 5000, 0 and S - 5000 tokens),
    # cut at 3000 (inside document 0) and 9000 (inside document 2): each chunk's first document
    # continues the previous chunk's document `last`.
    S = x.shape[0]
    chunks = [(x[:3000], [0, 3000], None), (x[3000:9000], [0, 2000, 2000, 6000], 0), (x[9000:], [0, S - 9000], 2)]
    chunks = [(xc, torch.tensor(c, device="cuda", dtype=torch.int32), last) for xc, c, last in chunks]
    pieces, call = [], ns["cake_causal_conv1d"]

    def recorded(*args, **kwargs):  # the example keeps only the last chunk's y
        out = call(*args, **kwargs)
        pieces.append(out[0])
        return out

    run(chunked, {**ns, "chunks": chunks, "cake_causal_conv1d": recorded})
    assert len(pieces) == 3 and torch.equal(torch.cat(pieces), y)
    # Cut at 3000 and on the boundary at 5000 (documents 1 and 2 start the last chunk: last = None there)
    chunks = [(x[:3000], [0, 3000], None), (x[3000:5000], [0, 2000], 0), (x[5000:], [0, 0, S - 5000], None)]
    chunks = [(xc, torch.tensor(c, device="cuda", dtype=torch.int32), last) for xc, c, last in chunks]
    pieces.clear()
    run(chunked, {**ns, "chunks": chunks, "cake_causal_conv1d": recorded})
    assert len(pieces) == 3 and torch.equal(torch.cat(pieces), y)
