"""T_K_N trees typed on the command line must reach the config as text, not as integers."""
from pathlib import Path

from hydra import compose, initialize_config_dir

from specforge.cli_args import quote_trees
from specforge.config import register_configs
from specforge.engine.tree_spec import TreeSpec

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_quote_trees_rewrites_only_tree_lists():
    argv = ["evaluate.py", "ckpt=x", "eval.trees=[5_1_6,8_2_16,10_2_32]", "train.epochs=3", "eval.trees=8_2_16"]
    assert quote_trees(argv) == ["evaluate.py", "ckpt=x", "eval.trees=['5_1_6','8_2_16','10_2_32']",
                                 "train.epochs=3", "eval.trees='8_2_16'"]


def test_trees_survive_hydra_composition():
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        default = compose("evaluate", overrides=["ckpt=x"])
        given = compose("evaluate", overrides=quote_trees(["ckpt=x", "eval.trees=[5_1_6,10_2_32]"]))
    assert list(default.eval.trees) == ["5_1_6", "8_2_16"]
    assert [TreeSpec.parse(t).name for t in given.eval.trees] == ["5_1_6", "10_2_32"]


def test_unquoted_tree_number_gets_a_hint():
    import pytest

    with pytest.raises(ValueError, match="quote it"):
        TreeSpec.parse("516")
