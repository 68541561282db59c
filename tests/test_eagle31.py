"""EAGLE 3.1 draft options (`fc_norm`, `norm_before_fc`, `norm_output`): config.json and weight
names as servers read them, the forward they define, the TTT feature path, lossless drafting in the
engine, and EAGLE3 checkpoints left exactly as they were."""
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import LlamaConfig

from specforge.checkpoint import CheckpointError, expected_shapes, load_draft, read_checkpoint, save_checkpoint
from specforge.config import register_configs
from specforge.engine.speculative import SpeculativeEngine
from specforge.errors import InvalidInput
from specforge.models.draft import EAGLE31_OPTIONS, Eagle3Config, Eagle3Draft
from specforge.train.loop import build_draft
from specforge.train.ttt import Teacher, ttt_forward
from tests.test_checkpoint import edit_config, edit_weights
from tests.test_engine import random_draft, runs  # noqa: F401  (runs: the module-scoped fixture)
from tests.test_ttt import assert_unroll_equals_chained_drafting, random_batch, tiny_draft

CONF = str(Path(__file__).resolve().parents[1] / "conf")

OPTIONS = {
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "norm_before_fc": {"norm_before_fc": True},
    "eagle31": {"fc_norm": True, "norm_output": True},  # conf/draft/eagle31.yaml
    "norm_before_fc+norm_output": {"norm_before_fc": True, "norm_output": True},
}
EAGLE3 = {key: False for key in EAGLE31_OPTIONS}


def all_options(options: dict) -> dict:
    return {**EAGLE3, **options}


def option_weights(options: dict, target_hidden: int) -> dict:
    """The extra weights of EAGLE 3.1, named and shaped as SGLang and speculators load them."""
    want = {}
    if options.get("fc_norm"):
        want.update({f"fc_norm.{j}.weight": (target_hidden,) for j in range(3)})
    if options.get("norm_before_fc"):
        want["input_norm.weight"] = (3 * target_hidden,)
    return want


def perturb_norms(draft, seed=5, std=0.5):
    """Norm weights away from their ones initialisation, so that every option changes the numbers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * std)
    return draft


def option_draft(**options):
    return perturb_norms(tiny_draft(**options)).eval()


def rms_norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---- config.json and weights ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_round_trip_through_the_checkpoint(tmp_path, name):
    options = OPTIONS[name]
    draft = option_draft(**options)
    ckpt = save_checkpoint(draft, tmp_path / "epoch_1", dtype=torch.float32)

    cfg = json.loads((ckpt / "config.json").read_text())
    assert {key: cfg[key] for key in EAGLE31_OPTIONS} == all_options(options)  # top level, all three
    assert not set(EAGLE31_OPTIONS) & set(cfg["eagle_config"])
    th = draft.config.target_hidden_size
    tensors = load_file(ckpt / "model.safetensors")
    extra = {k: tuple(v.shape) for k, v in tensors.items() if k.startswith(("fc_norm", "input_norm"))}
    assert extra == option_weights(options, th)
    assert set(expected_shapes(draft.config)) == set(draft.state_dict())

    loaded = load_draft(ckpt, attention=draft.attention)
    assert loaded.config.eagle31_options == all_options(options)
    batch = random_batch(draft)
    ids, pos = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        for a, b in zip(draft.step(ids, draft.project(batch["aux"]), pos)[:2],
                        loaded.step(ids, loaded.project(batch["aux"]), pos)[:2]):
            assert torch.equal(a, b)
    again = save_checkpoint(loaded, tmp_path / "again", dtype=torch.float32)
    assert (again / "config.json").read_text() == (ckpt / "config.json").read_text()
    assert (again / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_eagle3_checkpoint_is_unchanged(tmp_path):
    """All options off: no new key in config.json, no new weight, and a config.json stating them
    false explicitly (as another trainer may write it) reads as EAGLE3."""
    draft = tiny_draft()
    assert draft.config.eagle31_options == EAGLE3
    assert not any(k.startswith(("fc_norm", "input_norm")) for k in draft.state_dict())
    ckpt = save_checkpoint(draft, tmp_path / "epoch_1")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert not set(EAGLE31_OPTIONS) & set(cfg)
    assert not any(k.startswith(("fc_norm", "input_norm")) for k in load_file(ckpt / "model.safetensors"))
    assert Eagle3Config.from_json_dict(cfg).eagle31_options == EAGLE3
    edit_config(ckpt, **EAGLE3)
    assert read_checkpoint(ckpt)[0] == draft.config
    assert draft.config.to_json_dict() == cfg


def test_fc_norm_and_norm_before_fc_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="fc_norm and norm_before_fc are mutually exclusive"):
        tiny_draft(fc_norm=True, norm_before_fc=True)
    ckpt = save_checkpoint(option_draft(fc_norm=True), tmp_path / "epoch_1")
    edit_config(ckpt, norm_before_fc=True)
    with pytest.raises(CheckpointError, match="config.json: fc_norm and norm_before_fc are both true"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize("name, changes, edit, message", [
    ("fc_norm", {}, lambda t: t.pop("fc_norm.1.weight"), r"missing weights \['fc_norm.1.weight'\]"),
    ("norm_before_fc", {}, lambda t: t.pop("input_norm.weight"), r"missing weights \['input_norm.weight'\]"),
    ("norm_before_fc", {}, lambda t: t.update({"input_norm.weight": torch.ones(24)}),
     r"input_norm.weight: \(24,\) != expected \(72,\)"),
    # the same weights under an EAGLE3 config: a server would drop them silently
    ("fc_norm", {"fc_norm": False}, None,
     r"unknown weights \['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'\]"),
    ("norm_before_fc", {"norm_before_fc": False}, None, r"unknown weights \['input_norm.weight'\]"),
    ("fc_norm", {"fc_norm": "yes"}, None, "fc_norm must be true or false"),
])
def test_bad_eagle31_checkpoints_are_refused(tmp_path, name, changes, edit, message):
    ckpt = save_checkpoint(option_draft(**OPTIONS[name]), tmp_path / "epoch_1")
    if changes:
        edit_config(ckpt, **changes)
    if edit:
        edit_weights(ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(ckpt)


# ---- the forward ------------------------------------------------------------------------------


def test_project_with_fc_norm_normalises_each_state():
    draft = option_draft(fc_norm=True, rms_norm_eps=0.1)  # a large eps: the draft's eps is the one used
    aux = random_batch(draft)["aux"]
    th = draft.config.target_hidden_size
    chunks = [rms_norm(aux[..., j * th : (j + 1) * th], draft.fc_norm[j].weight, 0.1) for j in range(3)]
    with torch.no_grad():
        torch.testing.assert_close(draft.project(aux), torch.cat(chunks, -1) @ draft.fc.weight.T)
        assert not torch.allclose(draft.project(aux), draft.fc(aux), atol=1e-3)
    assert draft.input_norm is None


def test_project_with_norm_before_fc_normalises_the_concatenation():
    draft = option_draft(norm_before_fc=True, rms_norm_eps=0.1)
    aux = random_batch(draft)["aux"]
    with torch.no_grad():
        want = rms_norm(aux, draft.input_norm.weight, 0.1) @ draft.fc.weight.T
        torch.testing.assert_close(draft.project(aux), want)
        # not the per-state norm: one RMS over the 3*H_target values
        assert not torch.allclose(draft.project(aux), option_draft(fc_norm=True).project(aux), atol=1e-3)
    assert draft.fc_norm is None


@pytest.mark.parametrize("norm_output", [False, True])
@torch.no_grad()
def test_step_returns_the_next_feature(norm_output):
    """The first output of `step` is what every caller feeds on: norm(out) with norm_output, else
    out; the logits are lm_head(norm(out)) either way."""
    draft = option_draft(norm_output=norm_output)
    batch = random_batch(draft)
    outs = []
    hook = draft.midlayer.register_forward_hook(lambda m, i, o: outs.append(o[0]))
    try:
        feat, logits, _ = draft.step(batch["input_ids"], draft.project(batch["aux"]), batch["position_ids"])
    finally:
        hook.remove()
    torch.testing.assert_close(logits, draft.lm_head(draft.norm(outs[0])))
    torch.testing.assert_close(feat, draft.norm(outs[0]) if norm_output else outs[0])


# ---- training ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_output", [False, True])
def test_ttt_feeds_the_next_step_its_feature(norm_output):
    draft = option_draft(norm_output=norm_output, fc_norm=True)
    batch = random_batch(draft)
    feats, outs = [], []
    original = draft.step

    def spy(input_ids, feat, *args, **kwargs):
        feats.append(feat.detach().clone())
        return original(input_ids, feat, *args, **kwargs)

    draft.step = spy
    hook = draft.midlayer.register_forward_hook(lambda m, i, o: outs.append(o[0].detach()))
    teacher = Teacher(torch.randn(draft.config.vocab_size, draft.config.target_hidden_size), draft.t2d)
    try:
        loss, _ = ttt_forward(draft, batch, teacher, 4, 0.8, skip_unscored=False)  # features at every position
    finally:
        hook.remove()
        del draft.step
    assert len(feats) == 4
    with torch.no_grad():
        torch.testing.assert_close(feats[0], draft.project(batch["aux"]))
        for k in range(1, 4):
            prev = outs[k - 1]
            torch.testing.assert_close(feats[k], draft.norm(prev) if norm_output else prev)
            assert torch.allclose(feats[k], prev) != norm_output
    loss.backward()  # the new norms are trained
    assert all(draft.fc_norm[j].weight.grad is not None for j in range(3))
    names = {id(p) for p in draft.trainable_parameters()}
    assert all(id(draft.fc_norm[j].weight) in names for j in range(3))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_ttt_unroll_equals_chained_drafting(name):
    assert_unroll_equals_chained_drafting(option_draft(**OPTIONS[name]))


# ---- config: conf/draft/eagle31.yaml -> build_draft ---------------------------------------------


def compose_cfg(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=["+exp=smollm2_weather", *overrides])


def tiny_target_config():
    return LlamaConfig(vocab_size=50, hidden_size=24, intermediate_size=48, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=4)


def tiny_vocab(vocab=50, draft_vocab=20):
    used = torch.arange(0, 2 * draft_vocab, 2)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return {"d2t": used - torch.arange(draft_vocab), "t2d": t2d}


def test_draft_group_eagle31_reaches_the_draft():
    cfg = compose_cfg("draft=eagle31")
    assert {key: cfg.draft[key] for key in EAGLE31_OPTIONS} == all_options(OPTIONS["eagle31"])
    assert cfg.draft.draft_vocab_size == 2048  # the experiment's values still apply
    assert {key: compose_cfg("draft=eagle3").draft[key] for key in EAGLE31_OPTIONS} == EAGLE3
    # the demo's measured default (docs/benchmarks.md): EAGLE 3.1
    assert {key: compose_cfg().draft[key] for key in EAGLE31_OPTIONS} == all_options(OPTIONS["eagle31"])
    embed = torch.randn(50, 24)
    draft = build_draft(cfg, tiny_target_config(), [0, 1, 2], tiny_vocab(), embed, embed)
    assert draft.config.eagle31_options == all_options(OPTIONS["eagle31"])
    assert draft.config.rms_norm_eps == draft.fc_norm[0].eps
    assert len(draft.fc_norm) == 3 and draft.input_norm is None
    plain = build_draft(compose_cfg("draft=eagle3"), tiny_target_config(), [0, 1, 2], tiny_vocab(), embed, embed)
    assert plain.config.eagle31_options == EAGLE3 and plain.fc_norm is None
    with pytest.raises(ValueError, match="fc_norm and norm_before_fc are mutually exclusive"):
        build_draft(compose_cfg("draft=eagle31", "draft.norm_before_fc=true"), tiny_target_config(),
                    [0, 1, 2], tiny_vocab(), embed, embed)


def test_conflicting_options_fail_before_any_stage_runs(tmp_path):
    from specforge.pipeline import run_pipeline

    cfg = compose_cfg("draft=eagle31", "draft.norm_before_fc=true", f"output_dir={tmp_path}")
    with pytest.raises(ValueError, match="draft.fc_norm and draft.norm_before_fc are both true"):
        run_pipeline(cfg)
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


def test_init_from_needs_the_same_options(tmp_path):
    embed = torch.randn(50, 24)
    ckpt = save_checkpoint(build_draft(compose_cfg("draft=eagle31"), tiny_target_config(), [0, 1, 2],
                                       tiny_vocab(), embed, embed), tmp_path / "epoch_1")
    same = compose_cfg("draft=eagle31", f"draft.init_from={ckpt}")
    assert build_draft(same, tiny_target_config(), [0, 1, 2], tiny_vocab(), embed, embed).config.fc_norm
    other = compose_cfg("draft=eagle3", f"draft.init_from={ckpt}")
    with pytest.raises(ValueError, match=r"draft.init_from: .* has the EAGLE 3.1 options .*"
                                         r"set draft.fc_norm=true draft.norm_output=true"):
        build_draft(other, tiny_target_config(), [0, 1, 2], tiny_vocab(), embed, embed)


def test_an_init_from_that_cannot_go_on_is_refused_before_the_data_stage(tmp_path):
    """Not after the data and extract stages: other options, other layers, another target."""
    from specforge.pipeline import run_pipeline

    target = tmp_path / "target"
    tiny_target_config().save_pretrained(target)  # its config is all the check reads
    embed = torch.randn(50, 24)
    ckpt = save_checkpoint(build_draft(compose_cfg("draft=eagle31"), tiny_target_config(), [0, 1, 2],
                                       tiny_vocab(), embed, embed), tmp_path / "epoch_1")
    run = [f"output_dir={tmp_path / 'out'}", f"target.path={target}", "target.fetch=null",
           "stages=[data,extract,train]", f"draft.init_from={ckpt}"]
    for overrides, message in [(["draft=eagle3", "target.aux_layer_ids=[0,1,2]"], "has the EAGLE 3.1 options"),
                               (["draft=eagle31", "target.aux_layer_ids=[0,1,3]"],
                                r"reads layers \[0, 1, 2\], the hidden states hold \[0, 1, 3\]")]:
        with pytest.raises(InvalidInput, match=message):
            run_pipeline(compose_cfg(*run, *overrides))
    LlamaConfig(**{**tiny_target_config().to_dict(), "hidden_size": 32}).save_pretrained(target)
    with pytest.raises(InvalidInput, match="the draft does not fit the target: target_hidden_size 24"):
        run_pipeline(compose_cfg(*run, "draft=eagle31", "target.aux_layer_ids=[0,1,2]"))
    assert not (tmp_path / "out").exists()


# ---- the engine -------------------------------------------------------------------------------

ENGINE_TREES = ["4_1_5", "3_2_6", "4_4_16"]  # a chain and two topk > 1 trees


@pytest.mark.parametrize("name", ["fc_norm", "norm_output", "norm_before_fc", "eagle31"])
def test_engine_is_lossless(runs, name):  # noqa: F811
    """fp32, T=0: speculative output == the target's greedy decoding, for a draft whose random
    norm weights make the option change the trees it drafts."""
    model, prompt, ref = runs
    vocab = sorted(set(ref.tolist()))
    vocab = sorted(vocab + [t for t in range(model.config.vocab_size) if t not in vocab][: 8 - len(vocab)])
    draft = random_draft(model, vocab_ids=vocab, draft_cfg=SimpleNamespace(**OPTIONS[name]))
    assert draft.config.eagle31_options == all_options(OPTIONS[name])
    deepest = 0
    for tree in ENGINE_TREES:
        engine = SpeculativeEngine(model, draft, tree)
        out, stats = engine.generate(prompt, 80)
        assert out.tolist() == ref.tolist(), tree
        deepest = max(deepest, max(stats.accepted_drafts))
    assert deepest >= 2

    # The option matters: the same weights without it draft other trees.
    twin = Eagle3Draft(replace(draft.config, **EAGLE3))
    twin.load_state_dict({k: v for k, v in draft.state_dict().items() if k in twin.state_dict()})
    scores = []
    for d in (draft, twin.eval()):
        engine = SpeculativeEngine(model, d, "4_4_16")
        with torch.inference_mode():
            engine.reset(64)
            token, state = engine.prefill(prompt)
            scores.append(engine.draft_tree(token, state).scores)
    assert not torch.allclose(scores[0], scores[1], atol=1e-6)
