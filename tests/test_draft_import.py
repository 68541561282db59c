"""Another trainer's draft as our checkpoint (specforge/draft_import.py, `specforge import-draft`):
the same function as a server computes it, measured by our evaluation like our own epochs."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specforge.checkpoint import load_draft
from specforge.cli import main as cli
from specforge.config import TargetConfig
from specforge.draft_import import import_draft
from specforge.errors import SpecForgeWarning
from specforge.eval.engine_eval import load_run_config
from specforge.eval.stage import run_evaluation
from specforge.speculators_format import to_speculators
from specforge.utils.io import read_json
from tests.test_eval_prompts import configs
from tests.test_eval_profile import tiny_run  # noqa: F401 - the fixture: a run dir with one random draft


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """A tiny Llama deep enough (8 layers) for the default aux layers [1, 3, 4]."""
    from specforge.targets.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("deep_target"), num_hidden_layers=8)


def ours(deep_target, tmp_path):
    """Our checkpoint of a random draft for `deep_target` with the default layers, and its tensors."""
    from transformers import AutoModelForCausalLM

    from specforge.checkpoint import save_checkpoint
    from specforge.models.draft import Eagle3Config, Eagle3Draft

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(deep_target)
    vocab = model.config.vocab_size
    draft = Eagle3Draft(Eagle3Config.from_target(model.config, [1, 3, 4], draft_vocab_size=vocab // 2))
    used = torch.randperm(vocab)[: vocab // 2].sort().values  # a reduced vocab: draft id i is target id used[i]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_mapping(used - torch.arange(vocab // 2), t2d)
    with torch.no_grad():  # trained drafts carry the target's embedding (frozen)
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    path = save_checkpoint(draft, tmp_path / "ours")
    return path, load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())


def target(path):
    return TargetConfig(name="deep", path=str(path))


def deepseek_target(deep_target, tmp_path):
    """A DeepSeek-V3 target (SGLang adds its +1 only when the first id is 1) as wide as `deep_target`,
    with its weights: import-draft reads only the embedding and head, under the same names."""
    from transformers import AutoConfig, DeepseekV3Config

    llama = AutoConfig.from_pretrained(deep_target)
    path = tmp_path / "deepseek_target"
    DeepseekV3Config(num_hidden_layers=8, hidden_size=llama.hidden_size, vocab_size=llama.vocab_size,
                     tie_word_embeddings=llama.tie_word_embeddings, architectures=["DeepseekV3ForCausalLM"]
                     ).save_pretrained(path)
    shutil.copy(deep_target / "model.safetensors", path / "model.safetensors")
    return path


def speculators_dir(config, tensors, path, ids, **keys):
    """A speculators directory (as test_a_speculators_draft_imports_with_its_layers_renumbered checks
    it) of our draft `config` / `tensors`, with vLLM ids `ids` and further top-level `keys`."""
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                                    "rope_theta")}
    layer.update(model_type="llama", num_hidden_layers=1)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size":
        config["draft_vocab_size"], "norm_before_residual": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": ids, "transformer_layer_config": layer, **keys}))
    save_file(to_speculators(tensors), path / "model.safetensors")
    return path


def test_a_specforge_draft_imports_as_sglang_serves_it(deep_target, tmp_path):
    """A SpecForge / EAGLE-repository directory: no eagle_config (SGLang's default layers), no
    target_hidden_size / head_dim / t2d / embed_tokens, RoPE as transformers 5 writes it, weights
    in pytorch_model.bin. Imported, it is our checkpoint with the same tensors."""
    path, tensors, config = ours(deep_target, tmp_path)
    src = tmp_path / "specforge"
    src.mkdir()
    theirs = {k: v for k, v in config.items() if k not in (
        "eagle_config", "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "head_dim", "rope_theta",
        "rope_scaling", "specforge_target")}
    theirs["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    (src / "config.json").write_text(json.dumps(theirs))
    torch.save({k: v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight")}, src / "pytorch_model.bin")

    dst = import_draft(src, tmp_path / "imported", target(deep_target))
    again = load_file(dst / "model.safetensors")
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    imported = json.loads((dst / "config.json").read_text())
    assert imported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang's default capture
    assert imported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # the same layers for vLLM
    assert imported["rope_theta"] == config["rope_theta"] and imported["head_dim"] == config["head_dim"]
    assert "specforge_target" not in imported  # not trained here: checked by shapes alone
    assert load_draft(dst).config.aux_layer_ids == [1, 3, 4]


def test_our_checkpoint_from_before_vllms_ids_gets_them_by_importing_it(deep_target, tmp_path):
    """Checkpoints written before config.json carried vLLM's top-level ids read as they are, but vLLM
    would serve them with other layers: import-draft writes the same checkpoint with the key."""
    path, tensors, config = ours(deep_target, tmp_path)
    old = tmp_path / "old"
    shutil.copytree(path, old)
    (old / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                 if k != "eagle_aux_hidden_state_layer_ids"}))
    assert load_draft(old).config.aux_layer_ids == [1, 3, 4]
    dst = import_draft(old, tmp_path / "new", target(deep_target))
    assert json.loads((dst / "config.json").read_text()) == config
    again = load_file(dst / "model.safetensors")
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_a_speculators_draft_imports_with_its_layers_renumbered(deep_target, tmp_path):
    """speculators' layout as its save_pretrained writes it (0.9.0, checked): `layers.0.*`, the layer
    config nested with RoPE as rope_parameters and its verifier's sliding window, target_hidden_size
    null, ids in vLLM's numbering."""
    path, tensors, config = ours(deep_target, tmp_path)
    src = tmp_path / "speculators"
    src.mkdir()
    layer = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size")}
    layer.update(model_type="llama", num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=2048,
                 rope_parameters={"rope_theta": config["rope_theta"], "rope_type": "default"})
    (src / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size":
        config["draft_vocab_size"], "norm_before_residual": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": str(deep_target)}}}))
    save_file(to_speculators(tensors), src / "model.safetensors")
    with pytest.warns(UserWarning, match="sliding window of 2048 tokens"):
        dst = import_draft(src, tmp_path / "imported", target(deep_target))
    again = load_file(dst / "model.safetensors")
    assert all(torch.equal(again[k], tensors[k]) for k in tensors) and again.keys() == tensors.keys()
    loaded = load_draft(dst).config
    assert loaded.aux_layer_ids == [1, 3, 4] and loaded.rope_theta == config["rope_theta"]
    imported = json.loads((dst / "config.json").read_text())
    assert imported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM reads our copy as it read theirs
    assert imported["layer_types"] == ["sliding_attention"] and imported["sliding_window"] == 2048

    # its default residual (after hidden_norm) is not SGLang's layer: refused, naming the key
    spec = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**spec, "norm_before_residual": True}))
    with pytest.raises(ValueError, match=r"speculators/config.json: norm_before_residual: true"):
        import_draft(src, tmp_path / "refused", target(deep_target))
    assert not (tmp_path / "refused").exists()


def test_ids_sglang_takes_as_layer_inputs_are_renumbered(deep_target, tmp_path):
    """SpecForge's DeepSeek-style drafts (e.g. Kimi-K2.5's [2, 30, 58]) give ids SGLang takes as layer
    inputs (no +1 when the first id is not 1): ours are one lower, and SGLang's +1 restores them."""
    path, tensors, config = ours(deep_target, tmp_path)
    deepseek = deepseek_target(deep_target, tmp_path)
    src = tmp_path / "specforge_kimi"
    shutil.copytree(path, src)
    theirs = {k: v for k, v in config.items() if k not in ("eagle_aux_hidden_state_layer_ids", "specforge_target")}
    theirs["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
    (src / "config.json").write_text(json.dumps(theirs))
    dst = import_draft(src, tmp_path / "imported", target(deepseek))
    imported = json.loads((dst / "config.json").read_text())
    assert imported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert imported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: the inputs of layers 2, 4, 5

    # on a Llama target SGLang always adds its +1: the same ids are already ours
    dst = import_draft(src, tmp_path / "llama", target(deep_target))
    assert load_draft(dst).config.aux_layer_ids == [2, 4, 5]


def test_a_speculators_drafts_ids_are_not_renumbered_twice_and_those_sglang_cannot_serve_are_refused(
        deep_target, tmp_path):
    """speculators' ids are vLLM's (layer inputs): the layout already made them ours, and SGLang's +1
    rule for DeepSeek-style targets shifted them a second time: vLLM [3, 5, 6] (outputs of layers
    2, 4, 5) was imported as layers 1, 3, 4. Our layout cannot give SGLang those layers on such a
    target (it reads ids not starting at 1 as layer inputs): refused, naming the ids."""
    path, tensors, config = ours(deep_target, tmp_path)
    deepseek = deepseek_target(deep_target, tmp_path)
    src = speculators_dir(config, tensors, tmp_path / "spec_356", [3, 5, 6])
    with pytest.raises(ValueError, match=r"spec_356/config.json: eagle_aux_hidden_state_layer_ids \[3, 5, 6\] "
                                         r"\(vLLM's numbering: the outputs of layers \[2, 4, 5\]\): SGLang serves a "
                                         r"DeepseekV3ForCausalLM target's draft .* only when the first id is 1"):
        import_draft(src, tmp_path / "refused", target(deepseek))
    assert not (tmp_path / "refused").exists()

    # ours starting at 1 (vLLM's 2) SGLang serves as they are on that target
    src = speculators_dir(config, tensors, tmp_path / "spec_245", [2, 4, 5])
    dst = import_draft(src, tmp_path / "imported", target(deepseek))
    assert load_draft(dst).config.aux_layer_ids == [1, 3, 4]
    assert json.loads((dst / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def full_vocab(tensors, config, head=None):
    """Our draft's tensors and config over the whole vocab: no d2t / t2d, `head` as lm_head (None: none)."""
    tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d", "lm_head.weight")}
    if head is not None:
        tensors["lm_head.weight"] = head
    config = {k: v for k, v in config.items() if k not in ("eagle_aux_hidden_state_layer_ids", "specforge_target")}
    return tensors, {**config, "draft_vocab_size": config["vocab_size"]}


def test_a_null_draft_vocab_size_drafts_with_the_targets_lm_head(deep_target, tmp_path):
    """`draft_vocab_size: null` is SGLang's load_lm_head_from_target (nvidia/gpt-oss-120b-Eagle3 ships so,
    without lm_head.weight): the draft drafts with the target's head over the whole vocab. Import refused
    such a file without lm_head.weight and, with one, kept the file's own head that SGLang never serves."""
    from transformers import AutoModelForCausalLM

    path, tensors, config = ours(deep_target, tmp_path)
    target_head = AutoModelForCausalLM.from_pretrained(deep_target).get_output_embeddings().weight.detach()
    vocab, width = config["vocab_size"], config["hidden_size"]
    own_head = torch.randn(vocab, width).to(torch.bfloat16)
    for name, head in (("shared", None), ("own_head", own_head)):
        theirs, theirs_config = full_vocab(tensors, config, head)
        src = tmp_path / name
        src.mkdir()
        (src / "config.json").write_text(json.dumps({**theirs_config, "draft_vocab_size": None}))
        save_file(theirs, src / "model.safetensors")
        replaced = "in place of the file's own" if head is not None else "lm_head.weight$"
        with pytest.warns(SpecForgeWarning, match=rf"{name}/config.json: draft_vocab_size null: SGLang drafts with "
                                                  rf"the target's lm_head over the whole vocab .*{replaced}"):
            dst = import_draft(src, tmp_path / f"{name}_imported", target(deep_target))
        again = load_file(dst / "model.safetensors")
        assert torch.equal(again["lm_head.weight"], target_head.to(torch.bfloat16))
        assert torch.equal(again["d2t"], torch.zeros(vocab, dtype=torch.int64)) and bool(again["t2d"].all())
        assert json.loads((dst / "config.json").read_text())["draft_vocab_size"] == vocab

    # a reduced d2t cannot map the target's whole head: refused
    theirs, theirs_config = full_vocab(tensors, config)
    src = tmp_path / "reduced"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**theirs_config, "draft_vocab_size": None}))
    save_file({**theirs, "d2t": tensors["d2t"]}, src / "model.safetensors")
    with pytest.raises(ValueError, match=r"reduced/model.safetensors: d2t maps a reduced vocab, but .*reduced/"
                                         r"config.json has draft_vocab_size null"):
        import_draft(src, tmp_path / "reduced_imported", target(deep_target))

    # the key absent keeps its meaning: the file's own head over the whole vocab
    theirs, theirs_config = full_vocab(tensors, config, own_head)
    src = tmp_path / "absent"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({k: v for k, v in theirs_config.items() if k != "draft_vocab_size"}))
    save_file(theirs, src / "model.safetensors")
    dst = import_draft(src, tmp_path / "absent_imported", target(deep_target))
    assert torch.equal(load_file(dst / "model.safetensors")["lm_head.weight"], own_head)


def test_a_drafts_own_embedding_is_replaced_by_the_targets_as_sglang_serves_it(deep_target, tmp_path):
    """A draft trained with its own embedding (speculators' embed_requires_grad) as wide as the target:
    SGLang serves it with the target's embedding (set_embed), but import kept the file's, so our engine
    measured a draft no SGLang serves. The target's is written, with a warning (vLLM keeps the draft's)."""
    from transformers import AutoModelForCausalLM

    path, tensors, config = ours(deep_target, tmp_path)
    embedding = AutoModelForCausalLM.from_pretrained(deep_target).get_input_embeddings().weight.detach()
    trained = {**tensors, "embed_tokens.weight": tensors["embed_tokens.weight"] + 0.5}
    src = speculators_dir(config, trained, tmp_path / "trained_embedding", [2, 4, 5], embed_requires_grad=True)
    with pytest.warns(SpecForgeWarning, match=r"trained_embedding/model.safetensors: embed_tokens.weight is not the "
                                              r"target's embedding: SGLang serves .* vLLM would have kept the draft's"):
        dst = import_draft(src, tmp_path / "imported", target(deep_target))
    assert torch.equal(load_file(dst / "model.safetensors")["embed_tokens.weight"], embedding.to(torch.bfloat16))
    assert torch.equal(load_draft(dst).embed_tokens.weight, embedding.to(torch.bfloat16).float())


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rope_parameters_win_over_a_disagreeing_rope_theta_as_transformers_5_reads_them(
        deep_target, tmp_path, rope_scaling):
    """A config with both a top-level rope_theta and transformers 5's rope_parameters: transformers 5 (what
    servers parse configs with) takes rope_parameters' theta unless rope_scaling is set, which then
    replaces rope_parameters. Import took the top-level rope_theta: the draft served at 500000 was
    evaluated at 10000."""
    from transformers import LlamaConfig

    path, tensors, config = ours(deep_target, tmp_path)
    src = tmp_path / "both"
    shutil.copytree(path, src)
    theirs = {k: v for k, v in config.items() if k not in ("eagle_aux_hidden_state_layer_ids", "specforge_target")}
    theirs.update(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                  rope_scaling=rope_scaling)
    (src / "config.json").write_text(json.dumps(theirs))
    served = LlamaConfig.from_dict(json.loads(json.dumps(theirs))).rope_parameters  # a copy: it edits the dict
    assert served["rope_theta"] == (500000.0 if rope_scaling is None else 10000.0)
    dst = import_draft(src, tmp_path / "imported", target(deep_target))
    imported = json.loads((dst / "config.json").read_text())
    assert imported["rope_theta"] == served["rope_theta"] and imported["rope_scaling"] == rope_scaling


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: t.pop("d2t"), r"draft_vocab_size \d+ < vocab_size \d+ but the weights have no d2t"),
    (lambda c, t: c.update(architectures=["LlamaForCausalLM"]), r"not an EAGLE-3 draft"),
    # ids only where vLLM reads them: which numbering the draft was trained in is not knowable
    (lambda c, t: c.pop("eagle_config"), r"eagle_aux_hidden_state_layer_ids \[2, 4, 5\] at the top level only"),
    (lambda c, t: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 9], "use_aux_hidden_state": True},
                           eagle_aux_hidden_state_layer_ids=[2, 4, 10]),
     r"bad/config.json: the draft does not fit the target: .*the target has 8 decoder layers"),
    (lambda c, t: c.update(hidden_size=32, head_dim=8), r"bad/model.safetensors: .*fc.weight: \(64, 192\) != expected"),
    # vLLM takes the residual after hidden_norm, SGLang and our engine before: one layout cannot say both
    (lambda c, t: c.update(norm_before_residual=True), r"bad/config.json: norm_before_residual: true"),
])
def test_what_a_server_would_misread_is_refused(deep_target, tmp_path, edit, message):
    path, tensors, config = ours(deep_target, tmp_path)
    src = tmp_path / "bad"
    shutil.copytree(path, src)
    config = {k: v for k, v in config.items() if k != "target_hidden_size"}
    tensors = dict(tensors)
    edit(config, tensors)
    (src / "config.json").write_text(json.dumps(config))
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        import_draft(src, tmp_path / "dst", target(deep_target))
    assert not (tmp_path / "dst").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_imported_draft_is_measured_like_our_own(tiny_run, tmp_path, capsys):
    """`specforge import-draft` then `evaluate.py ckpt=... out_dir=...`: the same accept length as
    the draft it came from, and the run's own evaluation untouched."""
    from transformers import AutoModelForCausalLM

    target_path = load_run_config(tiny_run).target.path
    weights = load_file(tiny_run / "epoch_1" / "model.safetensors")  # trained drafts carry the target's embedding
    weights["embed_tokens.weight"] = AutoModelForCausalLM.from_pretrained(target_path).get_input_embeddings().weight
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, tiny_run / "epoch_1" / "model.safetensors")
    src = tmp_path / "theirs"
    shutil.copytree(tiny_run / "epoch_1", src)
    config = json.loads((src / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "target_hidden_size", "specforge_target"):
        config.pop(key, None)
    (src / "config.json").write_text(json.dumps(config))  # eagle_config kept: 4 layers have no default
    cli(["import-draft", str(src), str(tiny_run / "theirs"), "--target", target_path])
    assert "measure it: python evaluate.py" in capsys.readouterr().out

    run_cfg, ev = configs(tiny_run, "dtype=float32")
    run_evaluation(run_cfg, tiny_run, ev)
    run_evaluation(run_cfg, tiny_run / "theirs", ev, tmp_path / "eval_theirs")
    ours_, theirs = read_json(tiny_run / "eval" / "results.json"), read_json(tmp_path / "eval_theirs" / "results.json")
    (a,), (b,) = ours_["configs"], theirs["configs"]
    assert b["accept_length"] == a["accept_length"] and b["completion_tokens"] == a["completion_tokens"]
    assert b["epoch"] is None and b["checkpoint"] == str(tiny_run / "theirs")
    assert read_json(tiny_run / "eval" / "results.json") == ours_  # the run's own results untouched

    with pytest.raises(SystemExit, match=r"import-draft: .*theirs: exists"):
        cli(["import-draft", str(src), str(tiny_run / "theirs"), "--target", run_cfg.target.path])
    with pytest.raises(SystemExit):  # an unknown --kind was taken and ignored (a text target)
        cli(["import-draft", str(src), str(tmp_path / "other"), "--target", run_cfg.target.path, "--kind", "bogus"])
    assert not (tmp_path / "other").exists()
