"""The engine's few-row matmul kernels: the numbers of torch's linear, only inside the engine's
forwards, the kernel per row count timed on this machine once per weight geometry (or brought back
with a stored cost model)."""
from __future__ import annotations

import json

import pytest
import torch

from specforge.engine import few_rows
from specforge.engine.few_rows import (KERNELS, TIMED_ROWS, FewRowsLinear, choose_kernels, few_rows_linear,
                                       few_rows_linears, packable, plain_linears)

KERNELS_HERE = [k for k in KERNELS if few_rows._runs_here(k)]


@pytest.mark.parametrize("kernel", KERNELS_HERE)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 32, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_is_torch_linear(kernel, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 64, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(1, rows, 64, generator=g)  # [batch, rows, in] as the models call it
    linear = torch.nn.Linear(64, 300, bias=bias)
    linear.weight.data, linear.bias = w, None if b is None else torch.nn.Parameter(b)
    few_rows._copy([linear], {kernel})  # the copies it reads (packed for 4 and 8 rows, oneDNN's), as choose_kernels does
    got = few_rows_linear(x, w, b, {r: kernel for r in TIMED_ROWS}, getattr(linear, "few_rows_packed", None))
    assert got.shape == (1, rows, 300) and got.is_contiguous()
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_torch_linear():
    w, x = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(few_rows_linear(x, w, None, {2: "column"}), torch.nn.functional.linear(x, w))
    bf16 = torch.nn.Linear(4, 8).to(torch.bfloat16)
    assert choose_kernels([bf16]) == {}  # only fp32 weights are timed


def test_chosen_once_per_weight_geometry(monkeypatch):
    monkeypatch.setattr(few_rows, "_CHOSEN", {})
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    chosen = choose_kernels(list(model), repeats=1)
    assert set(chosen) <= set(TIMED_ROWS) and set(chosen.values()) <= set(KERNELS_HERE) - {"plain"}
    assert choose_kernels(list(model)) is chosen  # every engine over the model agrees
    twin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    assert choose_kernels(list(twin)) is chosen  # the same shapes (a target loaded twice): the same choice
    assert len(few_rows._CHOSEN) == 1
    choose_kernels([torch.nn.Linear(64, 128)], repeats=1)
    assert len(few_rows._CHOSEN) == 2  # other shapes: timed for themselves
    for m in model:  # the copies of the kernels chosen, and no others (unused copies freed)
        copies = set(m.few_rows_packed or {})
        assert ({4, 8} <= copies) == ("packed" in chosen.values())
        assert ("onednn" in copies) == ("onednn" in chosen.values())


def test_a_stored_choice_is_taken_untimed(monkeypatch):
    monkeypatch.setattr(few_rows, "_CHOSEN", {})
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Linear(96, 32))
    assert few_rows.kernels_of(list(model)) == {}  # nothing chosen yet
    stored = {few_rows.geometry(list(model)): {"1": "column", "3": "column"}}
    few_rows.remember_kernels(json.loads(json.dumps(stored)))  # as a cost model file brings it back
    monkeypatch.setattr(few_rows, "_time_kernels", lambda *a: pytest.fail("a remembered choice was timed again"))
    assert choose_kernels(list(model)) == {1: "column", 3: "column"}
    assert few_rows.kernels_of(list(model)) == stored
    with pytest.raises(ValueError, match="not among"):
        few_rows.remember_kernels({"abc": {"1": "fastest"}})
    if packable() and few_rows.onednn_ready():  # kernels whose copies do not fit now: plain instead
        few_rows.remember_kernels({few_rows.geometry(list(model)): {"1": "column", "8": "packed", "16": "onednn"}})
        monkeypatch.setattr(few_rows, "_copies_fit", lambda modules, copies: False)
        assert choose_kernels(list(model)) == {1: "column"}
        assert all(getattr(m, "few_rows_packed", None) is None for m in model)


@pytest.mark.parametrize("override", [{}, {1: "column", 3: "column"}, {4: "packed", 8: "packed"},
                                      {2: "onednn", 16: "onednn"}])
def test_the_override_replaces_the_timing(override, monkeypatch):
    if not all(few_rows._runs_here(k) for k in override.values()):
        pytest.skip("torch without MKL / oneDNN")
    monkeypatch.setattr(few_rows, "OVERRIDE", override)
    model = torch.nn.Linear(8, 8)
    assert choose_kernels([model]) == override
    x = torch.randn(4, 8)
    with few_rows_linears([model], override):
        torch.testing.assert_close(model(x), torch.nn.functional.linear(x, model.weight, model.bias))


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def test_linears_are_switched_inside_the_block_only(tiny_model):
    linears = plain_linears(tiny_model)
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        want = tiny_model(ids).logits
        with few_rows_linears(linears, {3: "column"}):
            assert all(type(m) is FewRowsLinear for m in linears)
            got = tiny_model(ids).logits
    assert all(type(m) is torch.nn.Linear for m in linears)  # a shared model is handed back as it was
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError), few_rows_linears(linears, {}):
        raise RuntimeError("a failing forward")
    assert all(type(m) is torch.nn.Linear for m in linears)


def test_a_subclass_gets_its_own_class_back():
    """The draft's lm_head (DraftHead, called with teacher rows in training) runs the few-row path
    in the engine and is a DraftHead again after it."""
    from specforge.models.head_loss import DraftHead

    head, plain = DraftHead(16, 32, bias=False), torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(head, torch.nn.Linear(32, 16), plain)
    assert plain_linears(model) == [model[1], plain]
    linears = plain_linears(model, subclasses=True)
    assert linears[0] is head and len(linears) == 3
    x = torch.randn(3, 16)
    with few_rows_linears(linears, {3: "column"}):
        assert type(head) is FewRowsLinear
        torch.testing.assert_close(head(x), x @ head.weight.T, rtol=1e-5, atol=1e-5)
    assert type(head) is DraftHead and type(plain) is torch.nn.Linear


def test_the_engine_runs_the_target_with_its_chosen_kernels(tiny_target_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from specforge.engine.speculative import SpeculativeEngine

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    engine = SpeculativeEngine(target, None)
    assert target.get_output_embeddings().kernels is engine.runner.kernels
    assert SpeculativeEngine(target, None).runner.kernels is engine.runner.kernels
    seen = []
    original = FewRowsLinear.forward

    def spy(self, x):
        seen.append(self.kernels)
        return original(self, x)

    monkeypatch.setattr(FewRowsLinear, "forward", spy)
    engine.generate_base(torch.tensor([1, 5, 9]), 2)
    assert seen and all(k is engine.runner.kernels for k in seen)
    assert not any(hasattr(m, "kernels") for m in engine.runner.linears)  # handed back as they were


def test_packed_copies_only_where_they_fit_in_memory():
    assert few_rows._copies_fit([torch.nn.Linear(64, 256)], 3)
    huge = torch.nn.Linear(200_000, 200_000, device="meta")  # 160 GB of fp32: two more copies never fit
    assert not few_rows._copies_fit([huge], 1)
