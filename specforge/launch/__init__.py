"""Launching servers as processes, ours and SGLang's, for extraction and evaluation.

    process              start a server process, wait for /health, always stop it (also on signals)
    sglang_commands      `python -m sglang.launch_server` command lines (flag spellings per version)
    embedded_commands    `specforge serve` command lines, with the same arguments
    vllm_commands        `vllm serve` command lines for a trained draft (for the run report)

Importing these modules loads neither torch nor sglang nor vllm (servers only ever run as separate
processes).
"""
