"""What vllm-omni's talker calls on its code predictor, for :class:`CachedCodePredictor`.

The talker was written against vllm-omni's ``CodePredictorWrapper``: it builds the predictor from
the loaded stock module, loads weights through it, sets its sampling parameters, asks for its
input embeddings and dtype, and calls ``forward(layer0_code, layer0_embed, last_talker_hidden,
...)`` for codes. This mixin gives the cached predictor that same surface.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from omni_cpu_fastpath import envs

from .compiler import DEFAULT_BUCKETS

if TYPE_CHECKING:
    from .model import CachedCodePredictor


class StockPredictorInterface:
    """The stock wrapper's construction, loading, sampling and forward calls."""

    @classmethod
    def from_stock(
        cls,
        stock: nn.Module,
        *,
        compile: str | None = None,
        threads: int | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        warmup: bool = True,
        compile_options: dict[str, Any] | None = None,
    ) -> CachedCodePredictor:
        """Wrap a loaded vllm-omni code predictor; ``compile``/``threads`` default to the flags."""
        if compile is None:
            compile = envs.get("VLLM_OMNI_PREDICTOR_COMPILE")
        if threads is None:
            threads = envs.get("VLLM_OMNI_PREDICTOR_THREADS")
        return cls(  # type: ignore[return-value]
            stock,
            compile=compile,
            threads=threads,
            buckets=buckets,
            warmup=warmup,
            compile_options=compile_options,
        )

    @staticmethod
    def check_stock_wrapper(stock: nn.Module) -> None:
        """Refuse wrappers configured for other models than the Qwen3-TTS predictor."""
        wrapper_cfg = getattr(stock, "_wrapper_config", None)
        if wrapper_cfg is not None and (
            wrapper_cfg.sampling_mode != "per_call" or wrapper_cfg.return_proj_buf
        ):
            raise ValueError(
                "CachedCodePredictor supports the Qwen3-TTS predictor (sampling_mode='per_call', no proj "
                f"buffer); got sampling_mode={wrapper_cfg.sampling_mode!r} "
                f"return_proj_buf={wrapper_cfg.return_proj_buf}"
            )

    def get_input_embeddings(self: CachedCodePredictor) -> nn.ModuleList:
        return self.model.codec_embedding

    def load_weights(self: CachedCodePredictor, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.stock.load_weights(weights)
        self.refresh()
        return loaded

    def set_sampling_params(self: CachedCodePredictor, top_k: int = 50, top_p: float = 0.8) -> None:
        self.stock.set_sampling_params(top_k=top_k, top_p=top_p)

    def configure_mtp_execution_buckets(self, sizes: Iterable[int]) -> None:
        # The stock wrapper sizes its CUDA-graph buckets here; ours are fixed at construction.
        return None

    @property
    def dtype(self: CachedCodePredictor) -> torch.dtype:
        # As the stock wrapper: the dtype of the model's first parameter (a codec embedding).
        return self.model.codec_embedding[0].weight.dtype

    def check_inputs(
        self: CachedCodePredictor,
        bsz: int,
        generators: Sequence[torch.Generator | None] | None,
        sample_uniforms: torch.Tensor | None,
        top_p: float,
        top_k: int,
    ) -> None:
        if generators is not None and len(generators) != bsz:
            raise ValueError(f"generators must have one entry per row: got {len(generators)} for batch {bsz}")
        if sample_uniforms is not None:
            expected = (bsz, self.num_steps, self.vocab_size)
            if tuple(sample_uniforms.shape) != expected:
                raise ValueError(
                    f"sample_uniforms must have shape {expected}, got {tuple(sample_uniforms.shape)}"
                )
        if not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if isinstance(top_k, bool) or int(top_k) != top_k:
            raise ValueError(f"top_k must be an integer (<= 0: off), got {top_k!r}")

    @torch.inference_mode()
    def forward(
        self: CachedCodePredictor,
        layer0_code: torch.Tensor,
        layer0_embed: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        do_sample: bool = True,
        temperature: float = 0.9,
        top_k: int = 50,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        sample_uniforms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Residual codebooks 1..15 for each row: ``[B, 16]`` long codes (column 0 is ``layer0_code``)."""
        codes, _ = self.forward_cached(
            layer0_code,
            layer0_embed,
            last_talker_hidden,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            generators=generators,
            sample_uniforms=sample_uniforms,
        )
        return codes
