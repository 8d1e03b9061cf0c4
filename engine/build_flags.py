"""The build settings as command-line flags, both ways: the options every `eddy` command that opens a model
takes, read into BuildSettings, and written back as flags for a child `eddy` of the same build (eddy bench's cold
start). Its own module so that the commands defined beside engine/cli.py (bench, serve) need not import the CLI."""
from __future__ import annotations

import argparse

from .config import DEVICES, DTYPE_CHOICES, KV_CHOICES, PIN_SLOTS, TARGET_CPUS, BuildSettings
from .devices import GPU_TARGETS


def model_name(text: str) -> str:
    # An empty name would silently mean the default model: someone who typed --model "$MODEL" meant another.
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a model (smollm2-135m-instruct, tiny-random, a .gguf "
                                         "file or a Hugging Face folder), or leave --model out for the default")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more (got {value})")
    return value


def add_build_options(p: argparse.ArgumentParser) -> None:
    d = BuildSettings()
    p.add_argument("--model", type=model_name, default=None, help="smollm2-135m-instruct (default), tiny-random, a .gguf file, a Hugging Face folder, or (eddy chat) "
                        "an OpenAI-compatible server's http(s)://HOST:PORT/v1")
    p.add_argument("--sinks", type=int, default=d.sinks, help=f"attention-sink tokens kept forever (default {d.sinks})")
    p.add_argument("--window", type=int, default=d.window, help=f"recent tokens kept (default {d.window})")
    p.add_argument("--max-sinks", type=int, default=None,
                   help=f"sink slots compiled, the most tokens a pinned system prompt may take (default: --sinks; "
                        f"{PIN_SLOTS} with --pin-system)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=d.dtype,
                   help="weight type; q8 = int8 with per-row scales, q4 = 4-bit codes in groups of 32 with a scale and "
                        "offset; auto (the default) = q4 for a 4-bit GGUF such as the default model, q8 otherwise")
    p.add_argument("--kv-dtype", choices=KV_CHOICES, default=d.kv_dtype,
                   help="KV cache type; 16 bits halve what attention reads over a long window; auto (the default) = "
                        "f32 for f32 weights, bf16 for bf16, f16 otherwise; f32 on a cuda GPU")
    p.add_argument("--device", choices=DEVICES, default=d.device)
    p.add_argument("--gpu-target", choices=[t for targets in GPU_TARGETS.values() for t in targets], default=None,
                   help="cuda or vulkan device: the target to build for (default: this machine's GPU; name one to "
                        "build for a GPU elsewhere: cuda sm_89 for Ada and Hopper, sm_80 for Ampere; vulkan rdna3, "
                        "ampere, ada, ..., or vp_android_baseline_2022 for any Vulkan 1.1 device)")
    p.add_argument("--target-cpu", choices=TARGET_CPUS, default=d.target_cpu,
                   help="cpu device: the CPU to compile for; host (default) is fastest but runs only on CPUs like "
                        "this one, x86-64-v3 (AVX2) is the portable choice for packages")


def settings_from(a: argparse.Namespace) -> BuildSettings:
    max_sinks = a.max_sinks if a.max_sinks is not None else (PIN_SLOTS if getattr(a, "pin_system", False) else 0)
    return BuildSettings(sinks=a.sinks, window=a.window, dtype=a.dtype, device=a.device, target_cpu=a.target_cpu,
                         max_sinks=max_sinks, kv_dtype=a.kv_dtype, gpu_target=a.gpu_target or "")


def build_arguments(settings: BuildSettings) -> list[str]:
    """The command-line flags that give `settings` (the inverse of settings_from), for a child `eddy` of the same build."""
    args = ["--sinks", str(settings.sinks), "--window", str(settings.window), "--dtype", settings.dtype,
            "--kv-dtype", settings.kv_dtype, "--device", settings.device, "--target-cpu", settings.target_cpu,
            "--max-sinks", str(settings.max_sinks)]
    return args + (["--gpu-target", settings.gpu_target] if settings.gpu_target else [])
