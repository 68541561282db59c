"""Half precision only where the device computes in it: on a CPU without native bf16 matmul (AVX2
only) torch's reference GEMM makes a bf16 run 50x or more slower than float32, so models run in float32."""
import torch
from omegaconf import OmegaConf

from specforge.targets.loader import compute_dtype, cpu_has_fast, load_target
from specforge.targets.tiny import build_tiny_llama
from specforge.train.loop import autocast_for

NATIVE_BF16 = cpu_has_fast(torch.bfloat16)
CPU_BF16 = torch.bfloat16 if NATIVE_BF16 else torch.float32


def test_compute_dtype_keeps_what_the_device_computes_natively():
    assert compute_dtype(torch.float32, "cpu") == torch.float32
    assert compute_dtype(torch.bfloat16, "cpu") == CPU_BF16
    assert compute_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16  # GPUs are not second-guessed
    assert cpu_has_fast(torch.float32)


def test_target_and_training_compute_in_that_dtype(tmp_path):
    path = build_tiny_llama(tmp_path / "tiny")
    cfg = OmegaConf.create({"path": str(path), "fetch": None, "kind": "causal_lm", "dtype": "bfloat16",
                            "trust_remote_code": False})
    model = load_target(cfg)
    assert {p.dtype for p in model.parameters()} == {CPU_BF16}
    with autocast_for("bf16", torch.device("cpu")):
        out = torch.nn.Linear(8, 8)(torch.randn(2, 8))
    assert out.dtype == CPU_BF16
