"""SGLang launch commands: golden command lines per version, version policy, extraction flags.
SGLang is not installed here (CUDA only): the version is given explicitly, as for another machine."""
import sys
import warnings

import pytest

from specforge.engine.tree_spec import TreeSpec
from specforge.launch import sglang_commands as sl

TARGET = "/models/Qwen3-8B"
DRAFT = "/runs/qwen3/epoch_3"


def test_golden_eagle3_command():
    cmd = sl.sglang_server_command(TARGET, DRAFT, "8_2_16", 30001, version="0.5.23", python="python")
    assert " ".join(cmd) == (
        "python -m sglang.launch_server --model-path /models/Qwen3-8B "
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path /runs/qwen3/epoch_3 "
        "--speculative-num-steps 8 --speculative-eagle-topk 2 --speculative-num-draft-tokens 16 "
        "--disable-radix-cache --host 127.0.0.1 --port 30001"
    )
    chain = sl.sglang_server_command(TARGET, DRAFT, TreeSpec.parse("5_1_6"), 30002, version="0.5.20",
                                    python="python")
    assert chain[chain.index("--speculative-num-steps"):chain.index("--disable-radix-cache")] == [
        "--speculative-num-steps", "5", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6"]


def test_golden_base_command_with_options():
    cmd = sl.sglang_server_command(
        TARGET, port=30000, version="0.5.20", python="python",
        options={"dtype": "bfloat16", "mem_fraction_static": 0.8, "cuda_graph_max_bs": 8,
                 "trust_remote_code": True, "tp_size": None},
        extra_args=["--attention-backend", "fa3"])
    assert " ".join(cmd) == (
        "python -m sglang.launch_server --model-path /models/Qwen3-8B --disable-radix-cache "
        "--host 127.0.0.1 --port 30000 --dtype bfloat16 --mem-fraction-static 0.8 "
        "--cuda-graph-max-bs-decode 8 --trust-remote-code --attention-backend fa3"
    )
    assert "--speculative-algorithm" not in cmd
    assert sl.sglang_server_command(TARGET, version="0.5.23")[0] == sys.executable


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="both draft_path and tree"):
        sl.sglang_server_command(TARGET, DRAFT, None, version="0.5.23")
    with pytest.raises(ValueError, match="candidates exist"):
        sl.sglang_server_command(TARGET, DRAFT, "2_2_8", version="0.5.23")
    with pytest.raises(ValueError, match="unknown SGLang option 'speculative_magic'"):
        sl.sglang_server_command(TARGET, version="0.5.23", options={"speculative_magic": 1})
    with pytest.raises(ValueError, match="set by the builder"):
        sl.sglang_server_command(TARGET, version="0.5.23", options={"port": 1})


def test_version_policy():
    with pytest.raises(sl.SGLangVersionError, match=r"0\.5\.19 is not supported.*>= 0\.5\.20"):
        sl.sglang_server_command(TARGET, version="0.5.19")
    with pytest.warns(UserWarning, match="newer than the newest version whose flags were checked"):
        cmd = sl.sglang_server_command(TARGET, DRAFT, "4_2_8", version="0.6.1")
    assert "--speculative-num-draft-tokens" in cmd
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sl.flag_table("0.5.23rc1")  # a pre-release of a checked version: no warning
        assert sl.flag_table("0.5.22").since == "0.5.20"
    with pytest.raises(sl.SGLangVersionError, match="not a version number"):
        sl.flag_table("latest")


def test_sglang_is_never_imported():
    assert sl.installed_sglang_version() is None  # CPU machine: the extra is not installed
    with pytest.raises(sl.SGLangVersionError, match="not installed"):
        sl.sglang_server_command(TARGET)
    assert "sglang" not in sys.modules


def test_golden_extraction_commands():
    aux = sl.sglang_extraction_command(TARGET, 30005, [1, 17, 32], num_layers=36, version="0.5.23", python="python",
                                       options={"dtype": "bfloat16", "mem_fraction_static": 0.4})
    assert " ".join(aux) == (
        "python -m sglang.launch_server --model-path /models/Qwen3-8B --disable-radix-cache --host 127.0.0.1 "
        "--port 30005 --enable-return-hidden-states --chunked-prefill-size -1 --speculative-algorithm EAGLE3 "
        "--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids 1 17 32 --dtype bfloat16 "
        "--mem-fraction-static 0.4")
    final = sl.sglang_extraction_command(TARGET, 30006, num_layers=36, version="0.5.20", python="python")
    assert " ".join(final) == (
        "python -m sglang.launch_server --model-path /models/Qwen3-8B --disable-radix-cache --host 127.0.0.1 "
        "--port 30006 --enable-return-hidden-states --chunked-prefill-size -1")


def test_extraction_commands_refuse_what_sglang_cannot_capture():
    with pytest.raises(sl.SGLangVersionError, match=r"SGLang >= 0\.5\.23"):
        sl.sglang_extraction_command(TARGET, 1, [1, 15, 28], num_layers=36, version="0.5.22")
    with pytest.raises(ValueError, match="3 distinct ascending"):
        sl.sglang_extraction_command(TARGET, 1, [15, 1, 28], num_layers=36, version="0.5.23")
    with pytest.raises(ValueError, match=r"aux layer id 35: .* must be <= 34"):
        sl.sglang_extraction_command(TARGET, 1, [1, 17, 35], num_layers=36, version="0.5.23")
    with pytest.raises(ValueError, match="set by the builder"):
        sl.sglang_extraction_command(TARGET, 1, num_layers=36, version="0.5.23", options={"chunked_prefill_size": 8})
    with pytest.raises(sl.SGLangVersionError, match="not installed"):  # this CPU machine
        sl.sglang_extraction_command(TARGET, 1, [1, 15, 28], num_layers=36)


def test_golden_vllm_serve_command():
    """vLLM drafts chains: num_speculative_tokens is the chain's T; a tree (topk > 1) is refused."""
    import json

    from specforge.launch.vllm_commands import vllm_serve_command

    cmd = vllm_serve_command(TARGET, DRAFT, "5_1_6")
    assert cmd[:4] == ["vllm", "serve", TARGET, "--speculative-config"] and len(cmd) == 5
    assert json.loads(cmd[4]) == {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 5}
    assert vllm_serve_command(TARGET, DRAFT, TreeSpec(3, 1, 4), trust_remote_code=True)[-1] == "--trust-remote-code"
    with pytest.raises(ValueError, match=r"tree 8_2_16: vLLM drafts a chain \(topk 1, e.g. '8_1_9'\)"):
        vllm_serve_command(TARGET, DRAFT, "8_2_16")
