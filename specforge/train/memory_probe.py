"""Before the first step: the heaviest micro-batch the run can meet, forward and backward, so that a
batch that does not fit the device fails in the first minute rather than hours into an epoch
(batches are shuffled: the one with the longest samples may come last).

The probe runs on the bare module, before a strategy wraps it: a sharded strategy (FSDP, ZeRO)
would hold less of the draft's weights and gradients, so it errs on the safe side. What the optimizer
will hold from its first step on (AdamW's two moments, DDP's gradient buckets) does not exist yet: on a
GPU that much is held aside while the probe runs (`state_bytes`). Its gradients are dropped and the
random state restored, so the training that follows is the one without it."""
from __future__ import annotations

import os
import resource

import torch

from specforge.errors import InvalidInput
from specforge.train.batches import collate, pack_rows

# the CPU allocator's failure is a plain RuntimeError; a GPU's is torch.OutOfMemoryError
CPU_ALLOC_FAILURE = "can't allocate memory"


def heaviest_micro_batch(lengths: list[int], batch_size: int, pack_tokens: int = 0) -> list[int]:
    """Sample indices of the heaviest micro-batch there can be: the `batch_size` longest samples
    (a micro-batch is padded to its longest). Packed: rows filled as full as the samples allow
    (first fit, longest first), the `batch_size` fullest, in an order that packing cuts back into
    the same rows."""
    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not pack_tokens:
        return longest_first[:batch_size]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in longest_first:
        fit = next((r for r, left in enumerate(room) if lengths[i] <= left), None)
        if fit is None:
            rows.append([i])
            room.append(pack_tokens - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    # the fullest rows, kept in the order they were opened: a row's first sample did not fit in the
    # rows before it when it came, nor after (rows only fill up), so packing cuts them so again
    fullest = sorted(sorted(range(len(rows)), key=lambda r: (room[r], r))[:batch_size])
    return [i for r in fullest for i in rows[r]]


def state_bytes(module: torch.nn.Module, strategy: str, world_size: int) -> int:
    """What a training step holds beyond the probe's weights, gradients and activations: the optimizer's
    fp32 moments (two per trainable value, AdamW's; Muon keeps one for its matrices: two errs on the safe
    side) and DDP's bucket copy of the gradients; a sharded strategy (fsdp, deepspeed) holds its share."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    copies = 2 + (strategy == "ddp")
    share = world_size if strategy in ("fsdp", "deepspeed") else 1
    return trainable * 4 * copies // share


def describe(lengths: list[int], indices: list[int], pack_tokens: int) -> str:
    """"4 samples of up to 2048 tokens (8192 padded)", or for packed rows their count and size."""
    if not pack_tokens:
        longest = max(lengths[i] for i in indices)
        return f"{len(indices)} samples of up to {longest} tokens ({len(indices) * longest} padded)"
    rows = pack_rows([lengths[i] for i in indices], pack_tokens)
    widest = max(sum(lengths[indices[j]] for j in row) for row in rows)
    return f"{len(rows)} packed rows of up to {widest} tokens ({len(rows) * widest} padded)"


def probe_memory(module: torch.nn.Module, samples, indices: list[int], device: torch.device, amp,
                 what: str, image_token_id: int | None = None, pack_tokens: int = 0, reserve: int = 0) -> str:
    """One forward and backward of `module` on the micro-batch `indices` (`samples`: a TeacherMemo);
    `what` describes it. -> a line for the run's summary (the GPU's peak memory, or the process's
    peak RSS on a CPU).
    A batch that does not fit is refused (InvalidInput), saying what to lower; on a CPU, memory
    that runs out is usually the kernel's kill, not an error: the caller says first what it probes.
    `reserve` (state_bytes): on a GPU, bytes held aside meanwhile for the optimizer's state to come."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    refused, held = None, None
    try:
        if cuda and reserve:
            held = torch.empty(reserve, dtype=torch.uint8, device=device)  # the optimizer's moments, DDP's buckets
        with torch.random.fork_rng(devices=[device] if cuda else []):
            batch = {k: v.to(device) for k, v in collate(samples.samples(indices), image_token_id=image_token_id,
                                                         pack_tokens=pack_tokens).items()}
            with amp:
                loss, _ = module(batch)
            loss.backward()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and CPU_ALLOC_FAILURE not in str(e):
            raise
        refused = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    finally:
        batch = loss = held = None  # noqa: F841 - nothing of the batch outlives the probe, nor its failure
        module.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.empty_cache()
    if refused is not None:  # raised out of the handler: the failure's traceback (its frames hold the batch) is gone
        beside = f" beside the optimizer state to come ({reserve / 2**30:.1f} GiB)" if cuda and reserve else ""
        raise InvalidInput(
            f"train: the heaviest micro-batch of this run ({what}) does not fit on {device}{beside}: {refused}. "
            "Lower train.batch_size (raising train.grad_accum keeps the global batch) or data.max_length, or "
            "pack the samples (train.pack_tokens); refused before the first step (train.memory_probe)")
    if cuda:
        peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
        return f"{what}: peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB on {device}"
    # the process's peak resident memory so far (the probe's, unless loading took more), of the machine's
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return f"{what}: peak RSS {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB on the CPU"
