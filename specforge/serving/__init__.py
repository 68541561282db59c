"""Serving: the embedded engine behind an SGLang-compatible HTTP server and the serving benchmark.

    sglang_launch   SGLang command lines (flag spellings per version, version detection)
    server_process  start a server process, wait for /health, always stop it
    server          `specforge serve`: the embedded engine on 127.0.0.1 with SGLang's protocol
    bench_client    async streaming benchmark (sglang.bench_serving's figures), comparison tables
    scenarios       workload presets (code, chat, completion), scalable for CPU
    runner          eval.engine=server | sglang: bench a URL, or launch base + checkpoint x tree

Importing these modules loads neither torch nor sglang: torch is loaded when a model or a tree is
used, sglang never (it runs as a separate process).
"""
