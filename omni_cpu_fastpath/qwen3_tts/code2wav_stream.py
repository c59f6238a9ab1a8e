"""The code2wav vocoder streamed: each chunk runs over its new frames only, from state kept per request.

In async-chunk mode the stock decoder (vllm-omni 0.30, ``_decode_suffix``) runs its vocoder (the
upsampling ConvNeXt blocks and the SnakeBeta/convolution decoder blocks after the transformer) over
each chunk's new frames plus ``_DOWNSTREAM_CONTEXT_FRAME`` frames of left context, and keeps only
the new frames' audio. Every time-mixing layer of that vocoder is causal (a convolution padded on
the left, a transposed convolution trimmed on the right), so the context only has to provide each
convolution's last inputs: :class:`StreamingCodecDecoder` keeps those tails in the request's own
state dict (``_decoder_state_cache[req_id]``, freed with the request) and runs the vocoder over the
new frames only.

- :class:`VocoderStream`: the tails of the rows of the current call (one slot per convolution).
- :class:`StreamingCausalConv`, :class:`StreamingCausalTransConv`: the stock causal convolutions,
  reading and writing their slot; outside a stream they compute exactly what the stock modules do.
  ``GemmCausalTransConv`` (``code2wav.py``) reads its slot the same way.
- :class:`StreamingCodecDecoder`: the stock decoder whose first chunks also seed the tails and whose
  later chunks run the vocoder over their new frames. Its transformer part, and the first chunks
  (x-vector and ICL, one request or a batch), are the stock code.

The left context is exact where the vocoder's receptive field fits in the stock context, which
:meth:`StreamingCodecDecoder.enable_streaming` checks; it refuses (and the stock chunks serve) any
vocoder layer it does not know. Once a request's transformer window rolls (more retained frames than
its sliding window), stock's context frames come from a shorter attention history than the ones the
previous chunk emitted, so the two then differ by more than rounding; before that they agree to fp32
rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm_omni.model_executor.models.common.snake_activation import SnakeBeta
from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
    modeling_qwen3_tts_tokenizer_v2 as stock_codec,
)
from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
    Qwen3TTSTokenizerV2CausalConvNet,
    Qwen3TTSTokenizerV2CausalTransConvNet,
    Qwen3TTSTokenizerV2ConvNeXtBlock,
    Qwen3TTSTokenizerV2Decoder,
    Qwen3TTSTokenizerV2DecoderDecoderBlock,
    Qwen3TTSTokenizerV2DecoderDecoderResidualUnit,
)

# The request state key that holds the vocoder's tails: one tensor (1, C, history) per slot.
STATE_KEY = "omni_cpu_fastpath.vocoder_tails"


class VocoderStream:
    """The convolution tails of the rows the vocoder is running over now, one slot per convolution."""

    def __init__(self) -> None:
        self.slots = 0
        self.active = False
        self._tails: list[torch.Tensor] | None = None
        self._kept: list[torch.Tensor | None] = []

    def tail(self, slot: int) -> torch.Tensor | None:
        """The slot's last inputs from the previous chunk; None on a first chunk (start from zeros)."""
        return None if self._tails is None else self._tails[slot]

    def keep(self, slot: int, inputs: torch.Tensor, history: int) -> None:
        """Keep the last ``history`` columns of what the slot's convolution ran over (zeros before)."""
        last = inputs[..., -history:]
        if last.shape[-1] < history:
            last = F.pad(last, (history - last.shape[-1], 0))
        # A copy: a view would keep the whole chunk's activation alive in the request state.
        self._kept[slot] = last.clone(memory_format=torch.contiguous_format)

    @contextmanager
    def run(self, tails: list[torch.Tensor] | None) -> Iterator[list[torch.Tensor | None]]:
        """Run the vocoder inside: from ``tails`` (None: zeros); yields the tails it leaves."""
        kept: list[torch.Tensor | None] = [None] * self.slots
        self.active, self._tails, self._kept = True, tails, kept
        try:
            yield kept
        finally:
            self.active, self._tails, self._kept = False, None, []


class StreamingCausalConv(nn.Module):
    """A stride-1 ``Qwen3TTSTokenizerV2CausalConvNet`` whose left padding is the previous chunk's inputs.

    Keeps the stock ``conv`` child, so parameter names do not change; outside a stream (and on a
    first chunk) it pads with zeros exactly as the stock module does.
    """

    def __init__(self, stock: Qwen3TTSTokenizerV2CausalConvNet, stream: VocoderStream, slot: int) -> None:
        super().__init__()
        if stock.stride != 1 or stock.conv.padding != (0,) or stock.padding <= 0:
            raise ValueError(f"not a left-padded stride-1 causal convolution: {stock.conv}")
        self.conv = stock.conv
        self.history = int(stock.padding)
        self.stream = stream
        self.slot = slot

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        stream = self.stream
        tail = stream.tail(self.slot) if stream.active else None
        if tail is None:
            # The stock padding: at stride 1 the right padding is always 0.
            padded = F.pad(hidden_state, (self.history, 0), mode="constant", value=0)
        else:
            padded = torch.cat([tail, hidden_state], dim=-1)
        if stream.active:
            stream.keep(self.slot, padded, self.history)
        return self.conv(padded).contiguous()


def trans_conv_history(conv: nn.ConvTranspose1d) -> int:
    """Input columns before the first new one that reach a causal transposed convolution's new outputs."""
    (stride,) = conv.stride
    (kernel,) = conv.kernel_size
    return math.ceil(kernel / stride) - 1


class StreamingCausalTransConv(nn.Module):
    """A ``Qwen3TTSTokenizerV2CausalTransConvNet`` that continues from the previous chunk's last inputs.

    The new outputs of ``conv(cat(tail, x))`` start ``history * stride`` samples in; outside a
    stream it computes exactly the stock module's ``conv(x)`` trimmed by ``right_pad``.
    """

    def __init__(
        self, stock: Qwen3TTSTokenizerV2CausalTransConvNet, stream: VocoderStream, slot: int
    ) -> None:
        super().__init__()
        conv = stock.conv
        self.conv = conv
        (self.stride,) = conv.stride
        self.right_pad = int(stock.right_pad)
        self.history = trans_conv_history(conv)
        self.stream = stream
        self.slot = slot

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        stream = self.stream
        tail = stream.tail(self.slot) if stream.active else None
        inputs = hidden_state if tail is None else torch.cat([tail, hidden_state], dim=-1)
        if stream.active:
            stream.keep(self.slot, inputs, self.history)
        out = self.conv(inputs)
        skip = 0 if tail is None else self.history * self.stride
        return out[..., skip : out.shape[-1] - self.right_pad].contiguous()


# Containers whose stock forward runs their children one after another (a residual unit adds its input).
_SEQUENTIAL = (
    nn.ModuleList,
    Qwen3TTSTokenizerV2DecoderDecoderBlock,
    Qwen3TTSTokenizerV2DecoderDecoderResidualUnit,
)


class StreamingUnsupported(ValueError):
    """The vocoder holds a layer whose left context the stream cannot keep."""


def _check_trans_conv(name: str, conv: nn.ConvTranspose1d, right_pad: int) -> None:
    (stride,) = conv.stride
    (kernel,) = conv.kernel_size
    if (
        conv.padding != (0,)
        or conv.output_padding != (0,)
        or conv.dilation != (1,)
        or conv.groups != 1
        or right_pad != kernel - stride
    ):
        raise StreamingUnsupported(
            f"{name}: not a causal transposed convolution ({conv}, right_pad {right_pad})"
        )


class StreamingCodecDecoder(Qwen3TTSTokenizerV2Decoder):
    """The stock codec decoder; after :meth:`enable_streaming`, later chunks vocode their new frames only.

    Until then (and for a request whose tails are missing) every method is the stock one.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._stream: VocoderStream | None = None
        # The request state dicts of the rows of the call in progress, and their real new frames.
        self._rows: list[dict[str, Any]] | None = None
        self._row_frames: list[int] | None = None

    # -- set-up -------------------------------------------------------------------------------

    def enable_streaming(self) -> str:
        """Make every causal convolution of the vocoder keep its tail; returns what streams.

        Call after the weights are loaded and after any module swap (``make_fast_decoder``).
        Raises :class:`StreamingUnsupported` (nothing changed) for a vocoder it does not know.
        """
        from omni_cpu_fastpath.qwen3_tts.code2wav import (
            GemmCausalTransConv,
            InplaceSnakeBeta,
            ShortInputLinear,
        )

        stateful: list[tuple[nn.Module, str, nn.Module]] = []
        reach = [0.0]  # left receptive field, in codec frames

        def walk(parent: nn.Module, key: str, module: nn.Module, name: str, rate: int) -> int:
            kind = type(module)
            if kind is Qwen3TTSTokenizerV2CausalConvNet:
                if module.stride != 1 or module.conv.padding != (0,):
                    raise StreamingUnsupported(f"{name}: a causal convolution of stride {module.stride}")
                if module.padding > 0:
                    stateful.append((parent, key, module))
                    reach[0] += module.padding / rate
                return rate
            if kind is Qwen3TTSTokenizerV2CausalTransConvNet or kind is GemmCausalTransConv:
                right_pad = module.right_pad if kind is Qwen3TTSTokenizerV2CausalTransConvNet else None
                if right_pad is not None:
                    _check_trans_conv(name, module.conv, right_pad)
                history = trans_conv_history(module.conv)
                if history > 0:
                    stateful.append((parent, key, module))
                    reach[0] += history / rate
                return rate * module.conv.stride[0]
            if kind is SnakeBeta or kind is InplaceSnakeBeta:
                return rate
            if kind is Qwen3TTSTokenizerV2ConvNeXtBlock:
                # Its forward mixes time only in dwconv; the rest acts per position.
                kinds = {n: type(c) for n, c in module.named_children()}
                want = {"dwconv": Qwen3TTSTokenizerV2CausalConvNet, "norm": nn.LayerNorm, "act": nn.GELU}
                rest = {n: t for n, t in kinds.items() if n not in ("pwconv1", "pwconv2")}
                pointwise = {kinds.get("pwconv1"), kinds.get("pwconv2")}
                if rest != want or pointwise - {nn.Linear, ShortInputLinear}:
                    raise StreamingUnsupported(f"{name}: a ConvNeXt block of other layers ({kinds})")
                return walk(module, "dwconv", module.dwconv, f"{name}.dwconv", rate)
            if kind in _SEQUENTIAL:
                for key_, child in module.named_children():
                    rate = walk(module, key_, child, f"{name}.{key_}", rate)
                return rate
            raise StreamingUnsupported(f"{name}: {kind.__name__} is not a vocoder layer the stream knows")

        if self._stream is not None:
            return self._describe(self._stream.slots, None)
        rate = walk(self, "upsample", self.upsample, "upsample", 1)
        walk(self, "decoder", self.decoder, "decoder", rate)
        context = int(stock_codec._DOWNSTREAM_CONTEXT_FRAME)
        if reach[0] > context:
            raise StreamingUnsupported(
                f"the vocoder's receptive field ({reach[0]:.2f} frames) exceeds the {context} frames of left "
                "context the stock chunks decode again, so stock's chunks are not exact to match"
            )
        stream = VocoderStream()
        for slot, (parent, key, module) in enumerate(stateful):
            if isinstance(module, GemmCausalTransConv):
                module.attach_stream(stream, slot)
            elif type(module) is Qwen3TTSTokenizerV2CausalConvNet:
                # Our own instance's submodules, swapped as make_fast_decoder swaps them.
                setattr(parent, key, StreamingCausalConv(module, stream, slot))
            else:
                setattr(parent, key, StreamingCausalTransConv(module, stream, slot))
        stream.slots = len(stateful)
        self._stream = stream
        return self._describe(stream.slots, reach[0])

    @staticmethod
    def _describe(slots: int, reach: float | None) -> str:
        field = (
            ""
            if reach is None
            else f", receptive field {reach:.2f} of {stock_codec._DOWNSTREAM_CONTEXT_FRAME} frames"
        )
        return f"streaming vocoder ({slots} convolution tails per request{field})"

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    # -- which requests the rows of a call are ------------------------------------------------

    @contextmanager
    def _rows_of(self, rows: list[dict[str, Any]], frames: list[int] | None = None) -> Iterator[None]:
        self._rows, self._row_frames = rows, frames
        try:
            yield
        finally:
            self._rows = self._row_frames = None

    def decode_suffix(
        self, new_codes: torch.Tensor, caches: dict[str, Any], prefix_frames: int
    ) -> torch.Tensor:
        with self._rows_of([caches], [int(new_codes.shape[-1])]):
            return super().decode_suffix(new_codes, caches, prefix_frames)

    def _decode_suffix_eager_batch(
        self,
        mode: str,
        target_frames: int,
        codes_list: list[torch.Tensor],
        request_caches: list[dict[str, Any]],
        new_frames_list: list[int],
        **kwargs: Any,
    ) -> list[torch.Tensor] | None:
        with self._rows_of(request_caches, list(new_frames_list)):
            return super()._decode_suffix_eager_batch(
                mode, target_frames, codes_list, request_caches, new_frames_list, **kwargs
            )

    def _decode_xvec_prefix_eager_batch(
        self, codes_list: list[torch.Tensor], request_caches: list[dict[str, Any]], **kwargs: Any
    ) -> list[torch.Tensor] | None:
        with self._rows_of(request_caches):
            return super()._decode_xvec_prefix_eager_batch(codes_list, request_caches, **kwargs)

    def _decode_icl_prefix_eager_batch(
        self, codes_list: list[torch.Tensor], request_caches: list[dict[str, Any]], **kwargs: Any
    ) -> list[torch.Tensor] | None:
        with self._rows_of(request_caches):
            return super()._decode_icl_prefix_eager_batch(codes_list, request_caches, **kwargs)

    # -- first chunks: the stock decode, seeding the tails -------------------------------------

    @contextmanager
    def _seeding(self, caches: dict[str, Any], batch: int) -> Iterator[None]:
        rows = self._rows if self._rows is not None else [caches]
        if self._stream is None or len(rows) != batch:
            for row in rows:
                row.pop(STATE_KEY, None)
            yield
            return
        with self._stream.run(None) as kept:
            yield
        for i, row in enumerate(rows):
            if any(t is None for t in kept):  # the vocoder did not run: nothing to continue from
                row.pop(STATE_KEY, None)
            else:
                row[STATE_KEY] = [t[i : i + 1] for t in kept if t is not None]

    def _decode_xvec_first_chunk(self, codes: torch.Tensor, caches: dict[str, Any]) -> torch.Tensor:
        with self._seeding(caches, int(codes.shape[0])):
            return super()._decode_xvec_first_chunk(codes, caches)

    def _decode_icl_first_chunk(self, codes: torch.Tensor, caches: dict[str, Any], *args: Any, **kwargs: Any):
        with self._seeding(caches, int(codes.shape[0])):
            return super()._decode_icl_first_chunk(codes, caches, *args, **kwargs)

    # -- later chunks ---------------------------------------------------------------------------

    def _decode_suffix(
        self,
        new_codes: torch.Tensor,
        old_quantized: torch.Tensor,
        old_conv: torch.Tensor,
        caches: dict[str, Any],
        prefix_frames: int,
        new_frames: int,
        rolling: bool,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, frames = self._rows, self._row_frames
        batch = int(new_codes.shape[0])
        states = None
        if self._stream is not None and rows is not None and frames is not None and len(rows) == batch:
            states = [row.get(STATE_KEY) for row in rows]
        if states is None or any(s is None for s in states):
            # A chunk the tails do not follow: these requests continue on the stock chunks.
            for row in rows or ():
                row.pop(STATE_KEY, None)
            return super()._decode_suffix(
                new_codes, old_quantized, old_conv, caches, prefix_frames, new_frames, rolling, attention_mask
            )
        # As the stock _decode_suffix (vllm-omni 0.30) up to the vocoder: the transformer's output.
        context_frames = stock_codec._CONV_CONTEXT_FRAME
        ref_hidden = caches["ref_hidden"]
        conv_context = torch.cat([ref_hidden, old_quantized], dim=-1)[:, :, -context_frames:]
        suffix_cache_length = int(self.config.sliding_window)

        new_quantized = self.quantizer.decode(new_codes)
        new_conv_input = torch.cat([conv_context, new_quantized], dim=-1)
        new_conv = self.pre_conv(new_conv_input)
        new_conv = new_conv[:, :, -new_codes.shape[-1] :].transpose(1, 2)

        if rolling:
            boundary_input = torch.cat(
                [ref_hidden[:, :, -context_frames:], old_quantized[:, :, :context_frames]],
                dim=-1,
            )
            boundary_conv = self.pre_conv(boundary_input)
            boundary_conv = boundary_conv[:, :, -context_frames:].transpose(1, 2)
            suffix_conv = torch.cat([boundary_conv, old_conv, new_conv], dim=1)
        else:
            suffix_conv = torch.cat([old_conv, new_conv], dim=1)

        next_quantized = torch.cat([old_quantized, new_quantized], dim=-1)[:, :, -suffix_cache_length:]
        next_conv = suffix_conv[:, -(suffix_cache_length - context_frames) :, :]

        hidden = torch.cat([caches["ref_conv"], suffix_conv], dim=1)
        hidden = hidden.transpose(1, 2).contiguous().transpose(1, 2)
        working_cache = copy.deepcopy(caches["past_key_values"])
        suffix_hidden = self.pre_transformer(
            inputs_embeds=hidden[:, prefix_frames:, :],
            attention_mask=attention_mask,
            past_key_values=working_cache,
            use_cache=True,
        ).last_hidden_state
        # Only the new frames go through the vocoder; a short row (right-padded in the batch) only its own.
        new_hidden = suffix_hidden[:, -new_frames:, :].permute(0, 2, 1)
        groups: dict[int, list[int]] = {}
        for row, n in enumerate(frames):
            groups.setdefault(min(int(n), new_frames), []).append(row)
        up = int(self.total_upsample)
        if len(groups) == 1 and new_frames in groups:
            return self._vocode_rows(new_hidden, list(range(batch)), rows, states), next_quantized, next_conv
        wav = new_hidden.new_zeros(batch, 1, new_frames * up)
        for n, members in groups.items():
            index = torch.tensor(members, device=new_hidden.device)
            wav[index, :, : n * up] = self._vocode_rows(new_hidden[index, :, :n], members, rows, states)
        return wav, next_quantized, next_conv

    def _vocode_rows(
        self,
        hidden: torch.Tensor,
        members: list[int],
        rows: list[dict[str, Any]],
        states: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """The vocoder over ``hidden`` (rows ``members``) from their tails; their tails advance."""
        assert self._stream is not None
        tails = [torch.cat([states[r][slot] for r in members], dim=0) for slot in range(self._stream.slots)]
        with self._stream.run(tails) as kept:
            for blocks in self.upsample:
                for block in blocks:
                    hidden = block(hidden)
            wav = hidden
            for block in self.decoder:
                wav = block(wav)
        for i, r in enumerate(members):
            rows[r][STATE_KEY] = [t[i : i + 1] for t in kept if t is not None]
        return wav.clamp(min=-1, max=1)


__all__ = [
    "STATE_KEY",
    "StreamingCausalConv",
    "StreamingCausalTransConv",
    "StreamingCodecDecoder",
    "StreamingUnsupported",
    "VocoderStream",
]
