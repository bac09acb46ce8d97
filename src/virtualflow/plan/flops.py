"""Model FLOPs and throughput as LLM users read them: tokens per second and model FLOPs
utilisation (MFU). Pure: no torch, no processes.

**FLOPs of a transformer** (:func:`transformer_flops`), the convention of PaLM (Chowdhery et al.
2022, appendix B) and nanoGPT's ``estimate_mfu``: one token's forward and backward costs

    6 * N  +  12 * L * d_model * T

FLOPs, where ``N`` is the number of parameters that take part in a matrix multiply per token
(the weights of every linear layer, the output projection included; not the position
embedding table, which is only looked up), ``L`` the number of layers and ``T`` the sequence
length. The first term is 2 FLOPs per multiply-add of each weight in the forward and twice that
in the backward (gradients with respect to the input and to the weight); the second is the
attention's two ``T x T`` products (``Q K^T`` and ``A V``: ``2 * 2 * T * d_model`` per token and
layer in the forward, three times that forward plus backward), counted in full as PaLM does
(a causal mask does not halve it). Element-wise work (softmax, norms, activations, biases) is
not counted: it is *model* FLOPs, not hardware FLOPs, and activation recomputation (activation
checkpointing) is not counted either. One sample of ``T`` tokens is ``T`` times the per-token
figure.

**Throughput** (:func:`throughput`, :func:`run_throughput`): samples per second of one step is
``global_batch_size / step_time_s``; tokens per second multiplies it by the job's
``tokens_per_sample``; MFU is ``flops_per_sample * samples_per_s / (peak_flops_per_worker *
workers)``, the fraction of the workers' peak that the model's own FLOPs use.

**Peaks** (:func:`peak_tflops`): the dense (no sparsity) tensor-core peak of known CUDA devices
from their vendors' data sheets, by device name: the bf16/fp16 figure for mixed precision and
the TF32 figure for ``precision="32"``. Unknown devices and CPUs have none: MFU is then reported
only with ``--peak-tflops`` (``LaunchOptions.peak_tflops``).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

__all__ = ["PEAK_TFLOPS", "describe", "peak_tflops", "run_throughput", "throughput", "transformer_flops"]


def transformer_flops(n_params: int, n_layers: int, d_model: int, seq_len: int, *,
                      non_embedding_params: int | None = None) -> float:
    """Model FLOPs of one sample's forward and backward through a decoder-only transformer:
    ``seq_len * (6 * N + 12 * n_layers * d_model * seq_len)`` (see the module docstring), with
    ``N = non_embedding_params`` when given (the parameters used in matrix multiplies: leave
    out a learned position table, keep a token embedding tied to the output layer), else
    ``n_params`` (nanoGPT counts all parameters but the position table). Use it as
    ``Job.flops_per_sample``."""
    for name, value in (("n_params", n_params), ("n_layers", n_layers), ("d_model", d_model),
                        ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"transformer_flops: {name}={value!r} must be a positive int")
    n = n_params if non_embedding_params is None else non_embedding_params
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= n_params:
        raise ValueError(f"transformer_flops: non_embedding_params={non_embedding_params!r} must be a positive int "
                         f"no larger than n_params={n_params}")
    per_token = 6 * n + 12 * n_layers * d_model * seq_len
    return float(per_token * seq_len)


PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    # name fragment (matched in this order): (dense bf16/fp16 tensor TFLOP/s, dense TF32 TFLOP/s)
    "H100 PCIe": (756.0, 378.0),
    "H100 NVL": (835.0, 418.0),
    "H100": (989.4, 494.7),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    "H200": (989.4, 494.7),
    "H800": (989.4, 494.7),
    "GH200": (989.4, 494.7),
    "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0),
    "A800": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "L40": (181.0, 90.5),
    "L4": (121.0, 60.0),
    "A10G": (70.0, 35.0),
    "A10": (125.0, 62.5),
}
"""Dense peaks of one device (vendor data sheets; the sparsity figures halved), matched by a
fragment of ``torch.cuda.get_device_name()``; the first fragment found wins, so longer names
come first."""


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The peak TFLOP/s of the device named ``device_name`` for ``precision`` (``"32"``: TF32;
    mixed precision: bf16/fp16), or None when the device is not in :data:`PEAK_TFLOPS`."""
    for fragment, (half, tf32) in PEAK_TFLOPS.items():
        if fragment in device_name:
            return tf32 if precision == "32" else half
    return None


def throughput(samples: int, step_time_s: float, workers: int, *, tokens_per_sample: int | None = None,
               flops_per_sample: float | None = None, peak_tflops_per_worker: float | None = None
               ) -> dict[str, float | None]:
    """One step's ``samples_per_s``, ``tokens_per_s`` (None without ``tokens_per_sample``) and
    ``mfu`` (a fraction; None without ``flops_per_sample`` or a peak); all None for a step
    without a positive duration."""
    return run_throughput([(samples, step_time_s, workers)], tokens_per_sample=tokens_per_sample,
                          flops_per_sample=flops_per_sample, peak_tflops_per_worker=peak_tflops_per_worker)


def run_throughput(steps: Iterable[tuple[int, float, int]], *, tokens_per_sample: int | None = None,
                   flops_per_sample: float | None = None, peak_tflops_per_worker: float | None = None
                   ) -> dict[str, float | None]:
    """Throughput over several steps ``(samples, step_time_s, workers)``: samples (and tokens)
    over the summed time, and MFU as the model FLOPs over the summed worker-seconds times the
    peak (so a run that was resized weighs each step by the workers it had)."""
    samples = seconds = worker_seconds = 0.0
    for n, t, w in steps:
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            continue
        samples += n
        seconds += t
        worker_seconds += t * w
    if seconds <= 0:
        return {"samples_per_s": None, "tokens_per_s": None, "mfu": None}
    rate = samples / seconds
    mfu = None
    if flops_per_sample is not None and peak_tflops_per_worker and worker_seconds > 0:
        mfu = flops_per_sample * samples / (peak_tflops_per_worker * 1e12 * worker_seconds)
    return {"samples_per_s": rate, "tokens_per_s": rate * tokens_per_sample if tokens_per_sample else None,
            "mfu": mfu}


def describe(values: Mapping[str, float | None]) -> str:
    """``"1.2e+04 tokens/s, MFU 31.2%"`` (what is known of :func:`throughput`'s result), or ``""``."""
    parts = []
    if values.get("tokens_per_s") is not None:
        parts.append(f"{values['tokens_per_s']:,.0f} tokens/s")
    if values.get("mfu") is not None:
        parts.append(f"MFU {100 * values['mfu']:.1f}%")
    return ", ".join(parts)
