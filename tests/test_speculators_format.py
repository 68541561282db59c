"""A speculators EAGLE-3 draft in our layout and back (specforge/speculators_format.py).

The conversion of a real speculators-trained draft (its step-0 logits equal after conversion) is
checked by benchmarks/peer_quality.py, which needs the peer's own virtualenv; here: the mapping."""
import pytest
import torch
from safetensors.torch import load_file

from specforge.checkpoint import save_checkpoint
from specforge.models.draft import Eagle3Draft
from specforge.speculators_format import from_speculators, options_of, to_speculators
from tests.test_ttt import tiny_draft


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_round_trip_is_bit_identical(options, tmp_path):
    draft = tiny_draft(**options)
    ours = {k: v.clone() for k, v in draft.state_dict().items()}
    theirs = to_speculators(ours)
    assert not any(k.startswith("midlayer.") for k in theirs)
    assert {k for k in theirs if k.startswith("layers.0.")} == {
        "layers.0." + k.removeprefix("midlayer.") for k in ours if k.startswith("midlayer.")}
    back = from_speculators(theirs)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    again = to_speculators(back)
    assert again.keys() == theirs.keys() and all(torch.equal(again[k], theirs[k]) for k in theirs)

    # what its training model holds beyond the servable draft is left out; the rest loads strictly
    # and writes a valid checkpoint with the same tensors
    theirs["verifier_norm.weight"] = torch.ones(draft.config.target_hidden_size)
    theirs["verifier_lm_head.weight"] = torch.zeros(draft.config.draft_vocab_size, draft.config.target_hidden_size)
    converted = Eagle3Draft(draft.config)
    converted.load_state_dict(from_speculators(theirs), strict=True)
    saved = load_file(save_checkpoint(converted, tmp_path / "epoch_1") / "model.safetensors")
    expected = load_file(save_checkpoint(draft, tmp_path / "ours") / "model.safetensors")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)


def test_a_draft_of_two_layers_is_refused():
    theirs = to_speculators(tiny_draft().state_dict())
    theirs["layers.1.mlp.up_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight: a draft with more than one decoder layer"):
        from_speculators(theirs)


def test_options_and_what_our_layout_cannot_express():
    config = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": True, "norm_output": True,
              "transformer_layer_config": {"num_hidden_layers": 1}}
    assert options_of(config) == {"norm_before_fc": False, "fc_norm": True, "norm_output": True}
    with pytest.raises(ValueError, match="norm_before_residual: true"):
        options_of({**config, "norm_before_residual": True})
    with pytest.raises(ValueError, match="num_hidden_layers: 2"):
        options_of({**config, "transformer_layer_config": {"num_hidden_layers": 2}})
