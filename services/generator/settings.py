"""The generator service's typed settings (precedence and parsing: :mod:`services.common.settings`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.dtypes import DtypeSetting
from services.common.models import SMOLLM2_ALIAS
from services.common.settings import GenerationLimits


class GeneratorSettings(GenerationLimits):
    """The generator service: which model, which engine, and request limits."""

    section: ClassVar[str] = "generator"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_GENERATOR_", extra="forbid")

    port: int = Field(50051, ge=0, le=65535)
    model: str = Field(SMOLLM2_ALIAS, description="model folder, hub id, or the embedded default's alias")
    backend: Literal["auto", "vllm", "hf"] = Field("auto", description="auto: vLLM when importable, else HF")
    dtype: DtypeSetting = Field(
        "auto", description="the model's floating-point type; auto: bfloat16 where the device computes it "
        "natively, float32 where it does not (services.common.dtypes), chosen at start and logged"
    )
    max_model_len: int = Field(2048, ge=16, description="most prompt + response tokens per sequence")
    seed: int = Field(0, description="engine seed")
    kv_cache_memory_bytes: int | None = Field(
        2 * 1024**3, ge=1, description="vLLM KV-cache size; on CPU this is host memory. None: use the utilization"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM memory fraction if no KV size")
    enforce_eager: bool = Field(
        True, description="vLLM: skip graph compilation (faster start, slower steps). False compiles (torch.compile; "
        "on this project's 2-core CPU host 17 % faster decoding, about 50 s more at a first start); vLLM's CPU build "
        "compiles only with max_loras 0 (it runs eager whenever LoRA is enabled, and the generator says so)",
    )
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM: most sequences per scheduler step (None: vLLM's default)")
    vllm_busy_loop_s: float | None = Field(
        None, ge=0, description="vLLM: seconds its engine core and workers spin (sched_yield) after each message "
        "before they sleep (services/generator/vllm_plugin.py). None: 0 on a CPU host, where the spin takes the "
        "model's cores; vLLM's own (1 s) with CUDA",
    )
    vllm_engine_process: Literal["auto", "inline", "separate"] = Field(
        "auto", description="vLLM: inline runs its engine in the generator's process, stepped by a thread "
        "(services/generator/vllm_inline.py: on this project's 2-core CPU host vLLM's process split cost about 16 "
        "% of decoding); separate uses vLLM's AsyncLLM with its engine-core process (needed for tensor/data "
        "parallelism). auto: inline without CUDA and without parallelism, separate otherwise",
    )
    hf_max_batch_size: int = Field(32, ge=1, description="HF backend: sequences per generate() call")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM: GPUs one engine's weights are split over (Megatron-style tensor parallelism)"
    )
    data_parallel_size: int = Field(
        1, ge=1, description="vLLM: engine copies inside this one replica, each on tensor_parallel_size GPUs "
        "(a replica then needs tensor_parallel_size x data_parallel_size GPUs); more replicas scale the same way",
    )
    enable_sleep_mode: bool = Field(
        False, description="vLLM: set the memory pool up for Sleep/WakeUp (a trainer sharing the GPU); where the "
        "platform has no sleep mode (vLLM's CPU build) it stays off and Sleep says so. The HF backend always can",
    )
    max_loras: int = Field(
        4, ge=0, description="LoRA adapters sampled in one engine step (vLLM's max_loras; more adapters queue for a "
        "slot, never fail). 0: no adapters. The HF backend keeps every loaded adapter resident",
    )
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="highest adapter rank accepted (vLLM sizes its LoRA buffers for it)"
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, description="vLLM: adapters kept built in its LRU cache (None: max_loras); an evicted one is "
        "rebuilt from the tensors the generator keeps",
    )
    weights_staging_dir: str | None = Field(
        None, description="where streamed weight updates are staged on disk (None: the system temp folder)"
    )
