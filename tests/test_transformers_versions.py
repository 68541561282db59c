"""What the code asks of transformers, by version: hidden states by index list from 5.23 on (all of
them before), and config.tie_last_hidden_states from 5.18 on. `make test` also runs the hidden-state
tests on the version SGLang pins (SPECFORGE_EXPECT_TRANSFORMERS says which one must be loaded)."""
import os

import pytest
import transformers

from specforge.targets import loader


@pytest.fixture
def version(monkeypatch):
    def set_version(v):
        monkeypatch.setattr(transformers, "__version__", v)
        loader._transformers_release.cache_clear()

    yield set_version
    loader._transformers_release.cache_clear()


def test_hidden_states_are_asked_by_index_only_where_transformers_keeps_the_tuple_whole(version):
    version("5.19.0")
    assert loader.hidden_states_request(i + 1 for i in [1, 4, 7]) is True
    version("5.23.0")
    assert loader.hidden_states_request(i + 1 for i in [1, 4, 7]) == [2, 5, 8]
    version("6.0.0.dev0")
    assert loader.hidden_states_request([3]) == [3]
    assert loader.hidden_states_request([]) is False


def test_a_transformers_that_ignores_tie_last_hidden_states_is_refused(version):
    config = transformers.LlamaConfig()
    version("5.17.0")
    with pytest.raises(RuntimeError, match="transformers 5.17.0 ignores config.tie_last_hidden_states"):
        with loader.untied_last_hidden_state(config):
            pass
    version("5.18.0")
    with loader.untied_last_hidden_state(config):
        assert config.tie_last_hidden_states is False
    assert not hasattr(config, "tie_last_hidden_states")


@pytest.mark.skipif("SPECFORGE_EXPECT_TRANSFORMERS" not in os.environ, reason="the main run's transformers")
def test_the_pinned_transformers_is_the_one_loaded():
    """The run over SGLang's pin would otherwise test the venv's own version and prove nothing."""
    assert transformers.__version__ == os.environ["SPECFORGE_EXPECT_TRANSFORMERS"]
