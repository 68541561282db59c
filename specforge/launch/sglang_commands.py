"""SGLang command lines, built in one place with the flag spellings of the installed version.

SGLang renames flags between releases (docs/contract.md §7), so every flag we pass goes through a small
table: canonical name -> spelling, per range of versions. The version is read from the installed
distribution's metadata (`importlib.metadata`, no import of sglang, which needs CUDA), or given
explicitly to build commands for another machine.

Supported: SGLang 0.5.20 to 0.5.23 (flags read from the 0.5.20 and 0.5.23 wheels). Older versions
are refused; newer ones get the newest spellings with a warning (a renamed flag then fails at
launch with SGLang's own "unrecognized arguments" error, in the server log).
"""
from __future__ import annotations

import importlib.metadata
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from packaging.version import InvalidVersion, Version

from specforge.engine.tree_spec import TreeSpec
from specforge.errors import InputError, SpecForgeWarning
from specforge.targets.layers import check_aux_layer_ids

# Canonical option name -> flag, as spelled by SGLang 0.5.20 (read from its server_args fields).
_FLAGS_0_5_20 = {
    "model_path": "--model-path",
    "host": "--host",
    "port": "--port",
    "speculative_algorithm": "--speculative-algorithm",
    "speculative_draft_model_path": "--speculative-draft-model-path",
    "speculative_num_steps": "--speculative-num-steps",
    "speculative_eagle_topk": "--speculative-eagle-topk",
    "speculative_num_draft_tokens": "--speculative-num-draft-tokens",
    "disable_radix_cache": "--disable-radix-cache",
    "chunked_prefill_size": "--chunked-prefill-size",
    "dtype": "--dtype",
    "trust_remote_code": "--trust-remote-code",
    "chat_template": "--chat-template",
    "tp_size": "--tp-size",
    "mem_fraction_static": "--mem-fraction-static",
    "context_length": "--context-length",
    "max_running_requests": "--max-running-requests",
    "cuda_graph_max_bs": "--cuda-graph-max-bs-decode",  # --cuda-graph-max-bs in older releases
    "served_model_name": "--served-model-name",
    "random_seed": "--random-seed",
    "log_level": "--log-level",
    "skip_server_warmup": "--skip-server-warmup",
    "enable_return_hidden_states": "--enable-return-hidden-states",
    "mm_process_config": "--mm-process-config",  # JSON; its "image" entries go to the HF image processor
}
# 0.5.23 adds aux hidden-state capture (docs/contract.md §7).
_FLAGS_0_5_23 = {
    **_FLAGS_0_5_20,
    "enable_return_aux_hidden_states": "--enable-return-aux-hidden-states",
    "return_aux_hidden_state_layer_ids": "--return-aux-hidden-state-layer-ids",
}


@dataclass(frozen=True)
class FlagTable:
    """Flag spellings valid from `since` (inclusive); `checked` is the release we read them from."""

    since: str
    checked: str
    flags: Mapping[str, str]


FLAG_TABLES = (
    FlagTable("0.5.20", "0.5.20", _FLAGS_0_5_20),
    FlagTable("0.5.23", "0.5.23", _FLAGS_0_5_23),
)
MIN_VERSION = FLAG_TABLES[0].since
NEWEST_CHECKED = FLAG_TABLES[-1].checked
AUX_HIDDEN_STATES_MIN_VERSION = "0.5.23"


class SGLangVersionError(InputError, RuntimeError):
    """SGLang is missing, too old, or lacks a feature we need."""


def installed_sglang_version() -> str | None:
    """The installed SGLang version from package metadata (sglang itself is not imported)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported_versions() -> str:
    return f"SGLang >= {MIN_VERSION} (flags checked against {', '.join(t.checked for t in FLAG_TABLES)})"


def resolve_version(version: str | None = None) -> str:
    """`version` if given, else the installed one; raise a clear error when there is none."""
    if version is None:
        version = installed_sglang_version()
        if version is None:
            raise SGLangVersionError(
                "SGLang is not installed here (it needs CUDA: pip install 'specforge-eagle3[sglang]' "
                "on a GPU machine); pass the version explicitly to build commands for another machine. "
                f"Supported: {supported_versions()}."
            )
    return str(version)


def flag_table(version: str | None = None) -> FlagTable:
    """The spellings for `version` (default: installed). Older than supported: error; newer than
    the newest checked: the newest spellings, with a warning."""
    version = resolve_version(version)
    try:
        v = Version(version)
    except InvalidVersion:
        raise SGLangVersionError(f"SGLang version {version!r} is not a version number") from None
    if v.release[:3] < Version(MIN_VERSION).release:
        raise SGLangVersionError(
            f"SGLang {version} is not supported: its launch flags were never checked. "
            f"Supported: {supported_versions()}; upgrade SGLang."
        )
    if v.release[:3] > Version(NEWEST_CHECKED).release:
        warnings.warn(
            f"SGLang {version} is newer than the newest version whose flags were checked "
            f"({NEWEST_CHECKED}); using those spellings. If the server refuses a flag, see "
            "`python -m sglang.launch_server --help` and add a row to FLAG_TABLES.",
            category=SpecForgeWarning, stacklevel=3,
        )
    return [t for t in FLAG_TABLES if v.release[:3] >= Version(t.since).release][-1]


def render_options(options: Mapping[str, Any], version: str | None = None) -> list[str]:
    """Canonical options -> flags of that version. True: the bare flag; False/None: omitted;
    a list: the flag followed by its values."""
    table = flag_table(version)
    args: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = table.flags.get(name)
        if flag is None:
            if name in _FLAGS_0_5_23:
                raise SGLangVersionError(
                    f"SGLang {resolve_version(version)} has no flag for {name!r} "
                    f"(needs SGLang >= {AUX_HIDDEN_STATES_MIN_VERSION})"
                )
            raise ValueError(f"unknown SGLang option {name!r}; known: {sorted(table.flags)}")
        args.append(flag)
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            args += [str(x) for x in value]
        else:
            args.append(str(value))
    return args


def eagle3_options(draft_path, tree: TreeSpec | str | None = None) -> dict[str, Any]:
    """The canonical options that serve an EAGLE3 draft with its tree ("T_K_N" or a TreeSpec;
    None: SGLang chooses its own)."""
    opts: dict[str, Any] = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft_path)}
    if tree is not None:
        spec = TreeSpec.parse(tree) if isinstance(tree, str) else tree
        opts.update(speculative_num_steps=spec.steps, speculative_eagle_topk=spec.topk,
                    speculative_num_draft_tokens=spec.num_draft_tokens)
    return opts


def sglang_server_command(
    target_path,
    draft_path=None,
    tree=None,
    port: int = 30000,
    *,
    host: str = "127.0.0.1",
    version: str | None = None,
    options: Mapping[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """`python -m sglang.launch_server` for the target alone (draft_path=None) or with an EAGLE3
    draft and its tree (a TreeSpec or "T_K_N", checked by TreeSpec). The radix cache is disabled
    in both modes so base and EAGLE3 are measured alike. `options` are further canonical options
    (e.g. {"dtype": "bfloat16", "mem_fraction_static": 0.8, "cuda_graph_max_bs": 8});
    `extra_args` are appended verbatim."""
    if (draft_path is None) != (tree is None):
        raise ValueError("sglang_server_command: give both draft_path and tree (EAGLE3) or neither (base)")
    opts: dict[str, Any] = {"model_path": str(target_path)}
    if draft_path is not None:
        opts.update(eagle3_options(draft_path, tree))
    opts.update(disable_radix_cache=True, host=host, port=int(port))
    for name, value in (options or {}).items():
        if name in opts:
            raise ValueError(f"sglang_server_command: option {name!r} is set by the builder itself")
        opts[name] = value
    return [python or sys.executable, "-m", "sglang.launch_server",
            *render_options(opts, version), *map(str, extra_args)]


def check_aux_support(version: str | None) -> None:
    """SGLang (`version`, default: the installed one) returns aux hidden states, or raise."""
    v = resolve_version(version)
    if "enable_return_aux_hidden_states" not in flag_table(v).flags:
        raise SGLangVersionError(
            f"SGLang {v} cannot return aux hidden states; extraction through SGLang needs "
            f"SGLang >= {AUX_HIDDEN_STATES_MIN_VERSION} (or use extract.backend=embedded)"
        )


def _check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """SGLang captures aux id L as the input of decoder layer L+1, so the last layer (N-1) has no
    capture point: ids must lie in [0, N-2]."""
    return check_aux_layer_ids(
        [int(i) for i in layer_ids], what="aux_layer_ids", count=3, max_id=num_layers - 2,
        why_max=f"SGLang captures id L at the input of layer L+1, so the last of the {num_layers} layers has "
                "no capture point (use extract.backend=embedded for the last layer)")


def sglang_extraction_command(target_path, port: int, aux_layer_ids: Sequence[int] | None = None, *,
                              num_layers: int, host: str = "127.0.0.1", version: str | None = None,
                              options: Mapping[str, Any] | None = None, extra_args: Sequence[str] = (),
                              python: str | None = None) -> list[str]:
    """A target-only server for extraction (docs/contract.md §7): with `aux_layer_ids`, it returns the
    outputs of those decoder layers, concatenated (SGLang >= 0.5.23; our convention and SGLang's
    agree: id L = output of layer L); without, the final post-norm state. Both recompute every
    prompt in one chunk (radix cache off, chunked prefill off)."""
    opts: dict[str, Any] = {"enable_return_hidden_states": True, "chunked_prefill_size": -1}
    if aux_layer_ids is not None:
        check_aux_support(version)
        opts.update(speculative_algorithm="EAGLE3",  # the capture convention; no draft is given
                    enable_return_aux_hidden_states=True,
                    return_aux_hidden_state_layer_ids=_check_layer_ids(aux_layer_ids, num_layers))
    for name, value in (options or {}).items():
        if name in opts:
            raise ValueError(f"sglang_extraction_command: option {name!r} is set by the builder itself")
        opts[name] = value
    return sglang_server_command(target_path, port=port, host=host, version=version, options=opts,
                                extra_args=extra_args, python=python)
