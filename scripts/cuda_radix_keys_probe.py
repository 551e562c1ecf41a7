"""Measurement probe, not library code: do int32 radix keys work and pay on CUDA?

On CPU the radix selection (``fastsample.ops.select``) keys float32 weights by their bit patterns
as int32, since ``scatter_add_`` takes int32 indices from torch 2.8 on; other devices use
int64 keys until a run shows the int32 ones work there. This script (part of
``scripts/device_check.sh``) runs the top-p and top-k thresholds of ``(64, 128256)``
float32 weights on CUDA with both key widths, checks that they are bitwise equal, and times
them (CUDA events, medians of 20 calls).

    python scripts/cuda_radix_keys_probe.py
"""

from __future__ import annotations

import statistics

import torch

from fastsample.ops import select


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        # device_check.sh --rehearse runs it on CPU machines to keep the script from rotting.
        print("# cuda_radix_keys_probe: no CUDA device here; nothing measured")
        return
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(64, 128256, device=device, generator=gen) * 3
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    share = torch.full((64,), 0.9, dtype=torch.float64, device=device)
    count = torch.full((64,), 50.0, dtype=torch.float64, device=device)
    original = select.key_dtype
    results = {}
    for keys in (torch.int64, torch.int32):
        select.key_dtype = lambda dtype, device, keys=keys: (  # type: ignore[assignment]
            keys if dtype == torch.float32 else torch.int64
        )
        try:
            got = (
                select.descending_threshold(weights, share, "share"),
                select.descending_threshold(weights, count, "count"),
            )
            ms = _median_ms(lambda: select.descending_threshold(weights, share, "share"))
            results[keys] = (got, ms)
            print(f"{keys!s:<12} top-p threshold {ms:7.3f} ms")
        except RuntimeError as error:  # int32 indices not taken on this build
            print(f"{keys!s:<12} failed: {error}")
        finally:
            select.key_dtype = original
    if len(results) == 2:
        same = all(
            torch.equal(a, b)
            for a, b in zip(results[torch.int64][0], results[torch.int32][0], strict=True)
        )
        print(f"thresholds bitwise equal: {same}")


if __name__ == "__main__":
    main()
