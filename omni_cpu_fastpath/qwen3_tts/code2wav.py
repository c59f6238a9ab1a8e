"""``FastQwen3TTSCode2Wav``: vllm-omni's Qwen3-TTS codec decoder stage (code2wav), measured and faster on CPU.

Registered by ``omni_cpu_fastpath.serving.plugins.register_models`` under the stock architecture name
``Qwen3TTSCode2Wav`` when VLLM_OMNI_CPU_FASTPATH is on. The stage's request handling (payloads,
per-request decoder state, chunking) is the stock one; what changes:

- Timers, always: ``code2wav.forward_ms`` per forward call, ``code2wav.frames_decoded`` (codec
  frames the vocoder convolutions ran over, left context and batch padding included),
  ``code2wav.frames_emitted`` (frames whose audio the call returns) and
  ``code2wav.transformer_frames`` (frames through the decoder's transformer), so the work spent on
  context that is decoded again and thrown away shows as ``frames_decoded / frames_emitted``.
- VLLM_OMNI_CODE2WAV_FAST (auto: on on CPU), after the weights are loaded, in this instance's
  decoder only: every ``SnakeBeta`` becomes :class:`InplaceSnakeBeta` (the same operations in the
  same order, in place: bit-identical, fewer passes over memory) and every causal
  ``ConvTranspose1d`` whose kernel is a multiple of its stride becomes :class:`GemmCausalTransConv`
  (one matrix product per kernel phase; fp32 rounding differs from oneDNN's deconvolution, far
  below audibility). oneDNN's transposed convolutions run well below its forward convolutions'
  speed on AVX2 cores; the products run at GEMM speed. Every ungrouped stride-1 ``Conv1d`` becomes
  :class:`GemmConv1d`. Both run a short input (a chunk's low-rate layers, where a few output
  columns meet megabytes of weights) as one product of the unfolded input with the whole weight,
  through oneDNN's matmul (:func:`short_linear`), which streams those weights near the memory's
  speed where torch's convolution and its GEMM for a few columns do not; so do the ConvNeXt
  blocks' pointwise linears (:class:`ShortInputLinear`). Each codebook keeps its divided table
  (:class:`CachedCodebook`) instead of dividing it on every call. Parameter names are kept, so
  loading is unchanged.

- VLLM_OMNI_CODE2WAV_DTYPE (float32 by default) is the stage's dtype (the deploy config and the
  platform hook set it), so the stock decoder loads and computes in it; recorded here.

- VLLM_OMNI_CODE2WAV_STREAMING (off by default), on CPU: the decoder is our
  ``StreamingCodecDecoder`` (``code2wav_stream.py``), whose later chunks run the vocoder over their
  new frames only, from the causal convolutions' input tails kept in the request's state, instead
  of decoding 12 frames of left context again.

What serves is logged at load and recorded with ``step_stats.served`` as ``code2wav``,
``code2wav.streaming`` and ``code2wav.dtype``; a part that cannot be built leaves the stock
module in place, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm_omni.model_executor.models.common.snake_activation import SnakeBeta
from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav
from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
    modeling_qwen3_tts_tokenizer_v2 as stock_codec,
)
from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
    Qwen3TTSTokenizerV2CausalConvNet,
    Qwen3TTSTokenizerV2CausalTransConvNet,
)

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.errors import describe
from omni_cpu_fastpath.serving.stage_settings import STOCK_CHUNK_FRAMES, cpu_has_native_bf16

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

FORWARD_MS = step_stats.CODE2WAV_FORWARD
FRAMES_DECODED = "code2wav.frames_decoded"
FRAMES_EMITTED = "code2wav.frames_emitted"
TRANSFORMER_FRAMES = "code2wav.transformer_frames"


class InplaceSnakeBeta(SnakeBeta):
    """``x + inv_beta * sin(x * exp_alpha) ** 2`` with one temporary, updated in place.

    The stock eager path allocates a tensor per operation (five passes over memory); this one
    runs the same operations in the same order (``pow(t, 2)`` is ``t * t`` in ATen), so the
    result is bit-identical.
    """

    @classmethod
    def from_stock(cls, stock: SnakeBeta) -> InplaceSnakeBeta:
        new = cls(stock.in_features, alpha_logscale=stock.alpha_logscale)
        new.alpha, new.beta = stock.alpha, stock.beta  # shared, so loaded values stay
        new.no_div_by_zero = stock.no_div_by_zero
        new.precompute_exp_cache()
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._cached:
            self.precompute_exp_cache()
        exp_alpha = self._exp_alpha[:, None]
        inv_beta = self._inv_beta[:, None]
        t = hidden_states * exp_alpha
        t.sin_()
        t.mul_(t)
        t.mul_(inv_beta)
        return t.add_(hidden_states)


# Output columns up to which a convolution runs as one matrix product of its unfolded input
# (:func:`short_linear`); beyond, the work per weight is large enough for torch's own kernels.
SHORT_INPUT_COLUMNS = 256

_ONEDNN_LINEAR: dict[torch.dtype, bool] = {}


def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``) multiplies ``dtype`` here;
    probed once per dtype (its bf16 road needs AVX-512 where torch's product emulates it)."""
    if dtype not in _ONEDNN_LINEAR:
        try:
            ok = torch.backends.mkldnn.is_available()
            if ok:
                x, w = torch.ones(2, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype)
                got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                ok = torch.equal(got, F.linear(x, w))
        except Exception as exc:  # noqa: BLE001 - any failure means: torch's own product
            logger.info(
                "omni-cpu-fastpath: no oneDNN matmul in %s (%s); torch's product serves", dtype, describe(exc)
            )
            ok = False
        _ONEDNN_LINEAR[dtype] = bool(ok)
    return _ONEDNN_LINEAR[dtype]


def short_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows of ``x`` and a large ``weight``: oneDNN's matmul, which
    reads the weights once near the memory's speed, where torch's GEMM (MKL) packs them for a few
    columns at a fraction of it; torch's product where oneDNN does not serve the dtype."""
    if onednn_linear_available(x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class GemmConv1d(nn.Conv1d):
    """An ungrouped stride-1 unpadded ``Conv1d`` (the causal modules pad before it) that runs a short
    input as :func:`short_linear` over its unfolded input: output column ``t`` is
    ``W.reshape(C_out, C_in * k) @ x[:, t : t + span : dilation].flatten()``. Longer inputs take
    ``Conv1d``'s own forward. Shares the stock module's parameters, so their names do not change."""

    @classmethod
    def from_stock(cls, conv: nn.Conv1d) -> GemmConv1d:
        if (
            type(conv) is not nn.Conv1d
            or conv.groups != 1
            or conv.stride != (1,)
            or conv.padding != (0,)
            or conv.padding_mode != "zeros"
        ):
            raise ValueError(f"not an ungrouped stride-1 unpadded convolution: {conv}")
        new = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            dilation=conv.dilation,
            bias=conv.bias is not None,
            device="meta",
        )
        new.weight, new.bias = conv.weight, conv.bias  # shared, so loaded values stay
        return new

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        (kernel,), (dilation,) = self.kernel_size, self.dilation
        span = (kernel - 1) * dilation + 1
        batch, c_in, length = hidden_state.shape
        columns = length - span + 1
        if columns > SHORT_INPUT_COLUMNS or columns < 1:
            return super().forward(hidden_state)
        # (B, C_in, T, k) -> (B * T, C_in * k), in the weight's (C_in, k) order.
        unfolded = hidden_state.unfold(-1, span, 1)[..., ::dilation]
        rows = unfolded.permute(0, 2, 1, 3).reshape(batch * columns, c_in * kernel)
        out = short_linear(rows, self.weight.reshape(self.out_channels, c_in * kernel), self.bias)
        return out.view(batch, columns, self.out_channels).transpose(1, 2).contiguous()


class ShortInputLinear(nn.Linear):
    """A ``Linear`` (a ConvNeXt block's pointwise convolutions) that runs an input of at most
    :data:`SHORT_INPUT_COLUMNS` rows as :func:`short_linear`; more rows take ``Linear``'s own
    forward. Shares the stock module's parameters, so their names do not change."""

    @classmethod
    def from_stock(cls, linear: nn.Linear) -> ShortInputLinear:
        if type(linear) is not nn.Linear:
            raise ValueError(f"not a plain Linear: {linear}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # shared, so loaded values stay
        return new

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        rows = hidden_state.numel() // self.in_features
        if rows > SHORT_INPUT_COLUMNS or rows < 1:
            return super().forward(hidden_state)
        out = short_linear(hidden_state.reshape(rows, self.in_features), self.weight, self.bias)
        return out.view(*hidden_state.shape[:-1], self.out_features)


class CachedCodebook(stock_codec.EuclideanCodebook):
    """The stock codebook, whose ``decode`` divides the whole table by its usage counts on every
    call: here the divided table is kept until a parameter changes (its version counter moves),
    so every call looks up the same values as stock."""

    @classmethod
    def from_stock(cls, codebook: nn.Module) -> CachedCodebook:
        if type(codebook) is not stock_codec.EuclideanCodebook:
            raise ValueError(f"not a stock EuclideanCodebook: {codebook}")
        new = cls(codebook.dim, codebook.codebook_size, codebook.epsilon)
        new.cluster_usage, new.embedding_sum = codebook.cluster_usage, codebook.embedding_sum
        return new

    def __init__(self, dim: int, codebook_size: int, epsilon: float = 1e-5) -> None:
        super().__init__(dim, codebook_size, epsilon)
        self._table: torch.Tensor | None = None
        self._table_key: tuple[int, ...] = ()

    def embedding(self) -> torch.Tensor:
        """``embedding_sum / cluster_usage.clamp(min=epsilon)[:, None]``, as the stock ``decode``
        computes it, made again only after a parameter changed."""
        key = (
            self.embedding_sum._version,
            self.cluster_usage._version,
            self.embedding_sum.data_ptr(),
            self.cluster_usage.data_ptr(),
        )
        if self._table is None or key != self._table_key:
            with torch.no_grad():
                self._table = self.embedding_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]
            self._table_key = key
        return self._table

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes, self.embedding())


class GemmCausalTransConv(nn.Module):
    """A causal ``ConvTranspose1d`` (kernel ``m * stride``, right-trimmed to ``T * stride``) as GEMMs.

    Output sample ``t * s + r`` is ``sum_j W[:, :, j * s + r]^T x[t - j]`` for ``j < m``: one
    ``(C_out * s, C_in) @ (C_in, T)`` product per ``j`` on the input shifted by ``j``, then one
    interleave. A short input (at most :data:`SHORT_INPUT_COLUMNS` columns) is instead one
    :func:`short_linear` of its ``m`` shifted copies, stacked, with the phases side by side.
    Keeps the stock module as ``conv`` so the parameter names do not change.
    """

    def __init__(self, stock: Qwen3TTSTokenizerV2CausalTransConvNet) -> None:
        super().__init__()
        conv = stock.conv
        (stride,) = conv.stride
        (kernel,) = conv.kernel_size
        if (
            kernel % stride
            or conv.padding != (0,)
            or conv.output_padding != (0,)
            or conv.dilation != (1,)
            or conv.groups != 1
            or stock.right_pad != kernel - stride
        ):
            raise ValueError(f"not a causal transposed convolution with kernel a multiple of stride: {conv}")
        self.conv = conv
        self.stride = stride
        self.taps = kernel // stride
        self.out_channels = conv.out_channels
        # Set by attach_stream: the streaming vocoder's state of the rows in progress (code2wav_stream.py).
        self.stream: Any = None
        self.slot = -1
        self.pack()

    def attach_stream(self, stream: Any, slot: int) -> None:
        """Inside ``stream``, continue from the previous chunk's last ``taps - 1`` inputs (its ``slot``)."""
        self.stream, self.slot = stream, slot

    def pack(self) -> None:
        """(Re)build the per-phase weights from ``conv``: call after its weights change."""
        w = self.conv.weight.detach()  # (C_in, C_out, m * s)
        c_in, c_out, _ = w.shape
        s = self.stride
        # Row co * s + r of phase j is W[:, co, j * s + r]; the phases side by side, (C_out * s, m * C_in),
        # and each phase a view of its columns (the products take the row stride as it is).
        phases = [
            w[:, :, j * s : (j + 1) * s].permute(1, 2, 0).reshape(c_out * s, c_in) for j in range(self.taps)
        ]
        self.register_buffer("_wide", torch.cat(phases, dim=1).contiguous(), persistent=False)
        self._view_phases()
        bias = self.conv.bias
        self.register_buffer(
            "_bias_rows",
            None if bias is None else bias.detach().repeat_interleave(s).contiguous(),
            persistent=False,
        )

    def _view_phases(self) -> None:
        c_in = self._wide.shape[1] // self.taps
        self._phases = [self._wide[:, j * c_in : (j + 1) * c_in] for j in range(self.taps)]

    def _apply(self, fn: Any, recurse: bool = True) -> GemmCausalTransConv:
        # A dtype or device change replaces _wide; the phase views follow it.
        super()._apply(fn, recurse)
        self._view_phases()
        return self

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        stream = self.stream
        tail = None
        if stream is not None and stream.active:
            tail = stream.tail(self.slot)
            inputs = hidden_state if tail is None else torch.cat([tail, hidden_state], dim=-1)
            stream.keep(self.slot, inputs, self.taps - 1)
        batch, _, length = hidden_state.shape
        s, c_out = self.stride, self.out_channels
        if length <= SHORT_INPUT_COLUMNS:
            return self._short(hidden_state if tail is None else inputs, tail is not None)
        out = torch.empty(batch, c_out * s, length, dtype=hidden_state.dtype, device=hidden_state.device)
        bias = None if self._bias_rows is None else self._bias_rows[:, None]
        for b in range(batch):
            x = hidden_state[b]
            y = out[b]
            if bias is None:
                torch.mm(self._phases[0], x, out=y)
            else:
                torch.addmm(bias, self._phases[0], x, out=y)
            if tail is not None:
                # Phase j of column t reads input t - j, which is in the tail for t < j.
                xf, h = inputs[b], self.taps - 1
                for j in range(1, self.taps):
                    y.addmm_(self._phases[j], xf[:, h - j : h - j + length])
                continue
            for j in range(1, self.taps):
                if length > j:
                    y[:, j:].addmm_(self._phases[j], x[:, : length - j])
        # (B, C_out, s, T) -> (B, C_out, T, s): sample t * s + r.
        return out.view(batch, c_out, s, length).transpose(2, 3).reshape(batch, c_out, length * s)

    def _short(self, inputs: torch.Tensor, has_tail: bool) -> torch.Tensor:
        """The whole product at once: row ``t`` holds ``x[t], x[t - 1], ..., x[t - m + 1]`` (zeros
        before the first input where no tail precedes it)."""
        h = self.taps - 1
        if not has_tail:
            inputs = F.pad(inputs, (h, 0))
        batch, c_in, padded = inputs.shape
        length = padded - h
        shifted = torch.cat([inputs[:, :, h - j : h - j + length] for j in range(self.taps)], dim=1)
        rows = shifted.transpose(1, 2).reshape(batch * length, self.taps * c_in)
        out = short_linear(rows, self._wide, self._bias_rows)  # (B * T, C_out * s)
        # (B, T, C_out, s) -> (B, C_out, T, s): sample t * s + r.
        s, c_out = self.stride, self.out_channels
        return out.view(batch, length, c_out, s).permute(0, 2, 1, 3).reshape(batch, c_out, length * s)


def make_fast_decoder(decoder: nn.Module) -> list[str]:
    """Swap the decoder's SnakeBeta, the convolutions of its causal convolutions, its causal
    transposed convolutions, its ConvNeXt blocks' linears and its codebooks for the fast modules,
    in place.

    Returns what was swapped, one entry per kind (``"InplaceSnakeBeta x29"``); a module that
    cannot be swapped stays stock.
    """
    counts: dict[str, int] = {}
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if type(child) is SnakeBeta:
                new = InplaceSnakeBeta.from_stock(child)
            elif type(child) is nn.Conv1d and type(parent) is Qwen3TTSTokenizerV2CausalConvNet:
                try:
                    new = GemmConv1d.from_stock(child)
                except ValueError as exc:
                    logger.debug("omni-cpu-fastpath: %s stays stock: %s", name, exc)
            elif type(child) is Qwen3TTSTokenizerV2CausalTransConvNet:
                try:
                    new = GemmCausalTransConv(child)
                except ValueError as exc:
                    logger.debug("omni-cpu-fastpath: %s stays stock: %s", name, exc)
            elif type(child) is nn.Linear and type(parent) is stock_codec.Qwen3TTSTokenizerV2ConvNeXtBlock:
                new = ShortInputLinear.from_stock(child)
            elif type(child) is stock_codec.EuclideanCodebook:
                new = CachedCodebook.from_stock(child)
            if new is not None:
                setattr(parent, name, new)  # our own instance's submodule, through nn.Module
                counts[type(new).__name__] = counts.get(type(new).__name__, 0) + 1
    return [f"{kind} x{n}" for kind, n in counts.items()]


def _frame_rate_module(decoder: nn.Module) -> nn.Module:
    """The first module of the vocoder part: its input has one column per codec frame."""
    upsample = getattr(decoder, "upsample", None)
    if upsample is not None and len(upsample) > 0:
        return upsample[0][0]
    return decoder.decoder[0]


def short_chunks_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """Where the stock decoder serves the chunks: what the CPU deploy config's chunks, if shorter than
    vllm-omni's own, cost it (it decodes left context again with each), and the setting that
    avoids it; None where they are not shorter or no deploy config of ours set them."""
    frames = envs.get("VLLM_OMNI_CODE2WAV_DEPLOY_CHUNK_FRAMES", environ)
    if not isinstance(frames, int) or frames >= STOCK_CHUNK_FRAMES:
        return None
    context = int(stock_codec._DOWNSTREAM_CONTEXT_FRAME)
    asked = envs.raw("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", environ)
    return (
        f"the CPU deploy config hands code2wav {frames}-frame chunks (VLLM_OMNI_CODE2WAV_CHUNK_FRAMES="
        f"{asked}), sized for the streaming vocoder, and the stock decoder decodes {context} frames of "
        f"left context again with each ({frames + context} frames for {frames} new): set "
        f"VLLM_OMNI_CODE2WAV_CHUNK_FRAMES={STOCK_CHUNK_FRAMES} (vllm-omni's) for this server"
    )


class FastQwen3TTSCode2Wav(Qwen3TTSCode2Wav):
    """The stock code2wav stage, timed, with the fast decoder modules when the flag says."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        envs.validate_all()
        # Fails here, at start-up, when VLLM_OMNI_STEP_STATS_DIR is not writable.
        step_stats.configure()
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._on_cpu = torch.device(vllm_config.device_config.device).type == "cpu"
        self._streaming = bool(envs.get("VLLM_OMNI_CODE2WAV_STREAMING"))
        if self._streaming and self._on_cpu:
            # Imported here: it imports this module's GemmCausalTransConv.
            from omni_cpu_fastpath.qwen3_tts.code2wav_stream import StreamingCodecDecoder

            # Our own decoder instance, built as the stock stage builds its own (weights load after).
            self.decoder = StreamingCodecDecoder._from_config(self.decoder.config)
            self.decoder.eval()
        self._prepared = False
        self._frames_decoded = 0
        self._transformer_frames = 0
        self.served = ""
        self.served_streaming = ""
        self.served_dtype = ""

    def load_weights(self, weights: Any) -> set[str]:
        loaded = super().load_weights(weights)
        self._prepare()
        return loaded

    def _prepare(self) -> None:
        if self._prepared:
            return
        self._prepared = True
        self.served_dtype = self._describe_dtype()
        step_stats.served("code2wav.dtype", self.served_dtype)
        logger.info("omni-cpu-fastpath: code2wav decodes in %s", self.served_dtype)
        if not envs.get("VLLM_OMNI_CODE2WAV_FAST"):
            served = "stock decoder (VLLM_OMNI_CODE2WAV_FAST off)"
        elif not self._on_cpu:
            served = "stock decoder (not on CPU)"
        else:
            try:
                swapped = make_fast_decoder(self.decoder)
                served = f"fast decoder ({', '.join(swapped) or 'nothing to swap'})"
            except Exception as exc:  # a part left half-swapped still computes the stock math
                served = f"stock decoder (make_fast_decoder failed: {describe(exc)})"
                logger.exception("omni-cpu-fastpath: %s", served)
        self.served_streaming = self._enable_streaming()
        step_stats.served("code2wav.streaming", self.served_streaming)
        logger.info("omni-cpu-fastpath: code2wav chunks: %s", self.served_streaming)
        # Hooks on this instance's own modules: the frame counts hold for the stock and fast decoders.
        _frame_rate_module(self.decoder).register_forward_pre_hook(self._count_decoded)
        self.decoder.pre_transformer.register_forward_pre_hook(self._count_transformer, with_kwargs=True)
        self.served = served
        step_stats.served("code2wav", served)
        logger.info("omni-cpu-fastpath: FastQwen3TTSCode2Wav serves: %s", served)

    def _describe_dtype(self) -> str:
        """What the decoder computes in (the stage's dtype, which the platform hook and the CPU
        deploy config set from VLLM_OMNI_CODE2WAV_DTYPE before the weights load), and why."""
        current = str(next(self.decoder.parameters()).dtype).removeprefix("torch.")
        if not self._on_cpu:
            return f"{current} (the stage's dtype: not on CPU)"
        asked = envs.raw("VLLM_OMNI_CODE2WAV_DTYPE")
        why = f"VLLM_OMNI_CODE2WAV_DTYPE={asked}"
        if asked == "auto":
            why += ": this CPU " + ("multiplies bf16 natively" if cpu_has_native_bf16() else "emulates bf16")
        return f"{current} ({why})"

    def _enable_streaming(self) -> str:
        """Turn on the streaming vocoder (after any module swap); what serves the chunks, and why."""
        if not self._streaming:
            return "stock (VLLM_OMNI_CODE2WAV_STREAMING off)"
        if not self._on_cpu:
            return "stock (not on CPU)"
        try:
            return self.decoder.enable_streaming()
        except Exception as exc:  # nothing swapped: the stock chunks serve
            served = f"stock (enable_streaming failed: {describe(exc)})"
            short = short_chunks_warning()
            if short:
                served += f"; {short}"
            logger.warning("omni-cpu-fastpath: code2wav chunks: %s", served)
            return served

    def _count_decoded(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        hidden = args[0]
        self._frames_decoded += int(hidden.shape[0]) * int(hidden.shape[-1])

    def _count_transformer(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None:
            self._transformer_frames += int(embeds.shape[0]) * int(embeds.shape[1])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Weights loaded without load_weights (``--load-format dummy``) still get the fast decoder.
        if not self._prepared:
            self._prepare()
        self._frames_decoded = self._transformer_frames = 0
        with step_stats.timer(FORWARD_MS, sync=True):
            out = super().forward(*args, **kwargs)
        if step_stats.enabled():
            audios = out.multimodal_outputs.get("model_outputs") or []
            samples = sum(int(a.numel()) for a in audios if isinstance(a, torch.Tensor))
            step_stats.record(FRAMES_DECODED, self._frames_decoded)
            step_stats.record(FRAMES_EMITTED, samples // self._total_upsample)
            step_stats.record(TRANSFORMER_FRAMES, self._transformer_frames)
        return out


__all__ = [
    "CachedCodebook",
    "FastQwen3TTSCode2Wav",
    "GemmCausalTransConv",
    "InplaceSnakeBeta",
    "ShortInputLinear",
    "make_fast_decoder",
]
