"""Code-assistant conversations about Python's standard library, built offline from its docstrings.

A second demo dataset beside the weather assistant, of another kind: free-form code and prose
instead of one fixed TOON schema. Each conversation asks about one public function, class or
method of a standard-library module: write it, explain it, use it for its documented purpose,
and sometimes a follow-up (a test, an edge case). The reference answers quote the docstring; the
experiment (`conf/exp/smollm2_code.yaml`) regenerates them with the target, so the draft learns
what the target writes.

Held-out conversations ask about other modules than the training ones (a module goes to eval by
a hash of its name and the seed), so held-out accept length is measured on APIs the draft never
saw. The rows depend on the seed and on the running Python's docstrings (another CPython version
words some of them differently).

    python data_prep/stdlib_code.py --out data/stdlib_code --train 600 --eval 40 --seed 0
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specforge.utils.io import write_jsonl  # noqa: E402

# Modules whose public functions and classes mostly carry docstrings that say what they do.
MODULES = (
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools",
    "getopt", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.cookies",
    "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging",
    "math", "mimetypes", "numbers", "operator", "os", "os.path", "pathlib", "pickle", "platform",
    "pprint", "queue", "quopri", "random", "re", "secrets", "shlex", "shutil", "sqlite3", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit",
    "tokenize", "traceback", "types", "typing", "unicodedata", "urllib.parse", "uuid", "warnings",
    "weakref", "xml.etree.ElementTree", "zipfile", "zlib",
)
SYSTEM_PROMPT = "You are a helpful Python programming assistant. Answer with working code and short explanations."
EVAL_SHARE = 0.15  # of the modules, by hash: their APIs are asked about in held-out conversations only

ASKS = (
    "Write a Python function `{name}{signature}` that does the following: {summary}",
    "What does `{qualname}` do in Python? Show a short example.",
    "How do I use `{qualname}`? Its documentation says: \"{summary}\"",
    "I need this in Python: {summary_lc} Which standard-library function does it, and how do I call it?",
    "Explain `{qualname}{signature}` to a beginner, with one example and what it prints.",
    "Implement a simplified version of `{qualname}` without using the `{module}` module. It should: {summary_lc}",
)
CLASS_ASKS = (
    "What is `{qualname}` for? Show how to create one and use it.",
    "Write a small example program that uses `{qualname}`. The documentation says: \"{summary}\"",
    "Explain the class `{qualname}` and when I would choose it over writing my own class.",
)
FOLLOW_UPS = (
    "Now write a pytest test for it.",
    "What happens with empty or invalid input?",
    "Can you make it faster or shorter?",
    "Add type hints and a docstring.",
)


@dataclass(frozen=True)
class Api:
    module: str
    name: str  # as written in code: "dedent", "OrderedDict.move_to_end"
    signature: str  # "(text)" or "" where inspect cannot tell
    summary: str  # the docstring's first sentence
    doc: str  # the docstring's first paragraph
    is_class: bool

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def first_paragraph(doc: str) -> str:
    text = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(text.split())


def first_sentence(paragraph: str) -> str:
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return (match.group(1) if match else paragraph).strip()


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    text = re.sub(r"^\(self(, )?", "(", text)  # as a method is called
    return text if len(text) <= 80 and " at 0x" not in text else ""


def _api(module: str, name: str, obj, is_class: bool) -> Api | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    paragraph = first_paragraph(doc)
    summary = first_sentence(paragraph)
    # Docstrings that are a signature line (C functions: "dedent(text) -> str") or too short to ask about
    if len(summary) < 24 or re.match(r"^[\w.]+\(.*\)", summary) or "Deprecated" in summary:
        return None
    return Api(module, name, _signature(obj), summary, paragraph[:600], is_class)


def module_apis(module_name: str) -> list[Api]:
    """The public functions and classes the module defines (not re-exports), and the public methods
    its classes define themselves, in name order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    public = getattr(module, "__all__", None)
    apis = []
    for name in sorted(public if public is not None else dir(module)):
        if name.startswith("_") or not hasattr(module, name):
            continue
        obj = getattr(module, name)
        own = getattr(obj, "__module__", None) in (module_name, "_" + module_name.split(".")[-1], None)
        if inspect.isclass(obj) and own:
            apis.append(_api(module_name, name, obj, True))
            for method_name, method in sorted(vars(obj).items()):
                if not method_name.startswith("_") and callable(method):
                    apis.append(_api(module_name, f"{name}.{method_name}", method, False))
        elif (inspect.isfunction(obj) or inspect.isbuiltin(obj)) and own:
            apis.append(_api(module_name, name, obj, False))
    return [api for api in apis if api is not None]


def is_eval_module(module: str, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < EVAL_SHARE


@functools.lru_cache(maxsize=None)  # imports and inspects dozens of modules: once per (seed, split)
def split_apis(seed: int, split: str) -> tuple[Api, ...]:
    apis = [api for module in MODULES if is_eval_module(module, seed) == (split == "eval")
            for api in module_apis(module)]
    # One API per (module, name): a name some Python spells twice (an alias) is asked once
    return tuple({(a.module, a.name): a for a in apis}.values())


def reference_answer(api: Api) -> str:
    """The answer the row starts with: the documentation itself (the experiment regenerates it)."""
    call = f"{api.qualname}{api.signature}" if api.signature else api.qualname
    return f"`{call}` is in the `{api.module}` module.\n\n{api.doc}\n\n```python\nimport {api.module}\n```"


def conversation(api: Api, rng: random.Random, multi_turn: float) -> list[dict]:
    fields = {"name": api.name, "qualname": api.qualname, "module": api.module, "signature": api.signature,
              "summary": api.summary, "summary_lc": api.summary[0].lower() + api.summary[1:]}
    ask = rng.choice(CLASS_ASKS if api.is_class else ASKS).format(**fields)
    messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.7 else [])
    messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": reference_answer(api)}]
    if rng.random() < multi_turn:
        messages += [{"role": "user", "content": rng.choice(FOLLOW_UPS)},
                     {"role": "assistant", "content": f"Here it is, following `{api.qualname}`'s documentation."}]
    return messages


def generate(n: int, seed: int, split: str = "train", multi_turn: float = 0.2) -> list[dict]:
    """n conversations of a split; beyond the split's APIs they repeat with other asks. The order of
    the APIs is drawn from the seed alone, so a smaller n is a prefix of a larger one."""
    apis = split_apis(seed, split)
    if not apis:
        raise SystemExit(f"no {split} APIs for seed {seed}")
    order = random.Random(f"{seed}:{split}:order").sample(range(len(apis)), len(apis))
    rows = []
    for i in range(n):
        api = apis[order[i % len(order)]]
        rng = random.Random(f"{seed}:{split}:{i}")
        rows.append({"id": f"{split}-{i:05d}", "messages": conversation(api, rng, multi_turn)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/stdlib_code", help="output directory (train.jsonl, eval.jsonl)")
    p.add_argument("--train", type=int, default=600, help="number of training conversations")
    p.add_argument("--eval", type=int, default=40, help="number of held-out conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--multi-turn", type=float, default=0.2, help="fraction with a follow-up question")
    args = p.parse_args(argv)
    if args.train < 1 or args.eval < 1:
        p.error(f"--train and --eval must be >= 1 (the experiment trains on one and measures on the other), "
                f"got {args.train} and {args.eval}")
    if not 0.0 <= args.multi_turn <= 1.0:
        p.error(f"--multi-turn is a fraction in [0, 1], got {args.multi_turn}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train), ("eval", args.eval)):
        rows = generate(n, args.seed, split, args.multi_turn)
        write_jsonl(out / f"{split}.jsonl", rows)
        print(f"{out / f'{split}.jsonl'}: {len(rows)} conversations "
              f"({len(split_apis(args.seed, split))} APIs of {split} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
