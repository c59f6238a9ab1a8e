"""KV-cached, shape-static code predictor for Qwen3-TTS (drop-in for vllm-omni's wrapper).

vllm-omni 0.30's ``CodePredictorWrapper.forward`` re-runs all layers over the padded 17-position
buffer for each of the 15 residual sub-steps. :class:`CachedCodePredictor` keeps a static KV
cache per layer instead: a 2-token prefill (projected talker hidden, projected layer-0 embedding),
then one token per sub-step, so each sub-step reads every weight once - the memory-bandwidth floor
of batch-1 decoding.

One sub-step (``_substep``: layers, final norm, codebook head, sampling, next embedding) takes only
tensors: the position, the mask row and the head index are tensors and the KV cache is written
with ``index_copy_``, gpt-fast style. ``torch.compile(fullgraph=True)`` therefore builds one graph
per batch bucket (and one for the prefill) and reuses it for all 15 sub-steps. Sampling noise is
drawn eagerly (``noise.predictor_uniforms``) before the compiled region, consuming the request
generators exactly as the stock eager loop does, so seeded codes are identical stock, eager and
compiled.

The module shares the stock module's weights under the same parameter names (``model.*``,
``lm_head.*``, ``small_to_mtp_projection.*``), so the stock ``load_weights`` mapping still applies.
The stacked ``[15, V, H]`` head and embedding tables are non-persistent buffers whose slices the
stock ``lm_head`` / ``codec_embedding`` parameters are re-pointed at: they are not in the state
dict and do not double the memory; :meth:`CachedCodePredictor.refresh` rebuilds them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from omni_cpu_fastpath import envs, step_stats

from .noise import predictor_uniforms

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

# Batch sizes compiled at load with VLLM_OMNI_PREDICTOR_COMPILE=step; a batch is padded up to the
# next bucket, and one above the largest runs eager. A server compiles buckets_for(max_num_seqs).
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The buckets a runner of at most ``max_batch`` rows can reach: powers of two below it, and it."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}))


@contextlib.contextmanager
def _compiled_call_state() -> Iterator[None]:
    """The global state every compiled call runs under, at warm-up and when serving.

    Dynamo guards on global state such as the default dtype, and vLLM loads weights (when the
    served predictor compiles) under ``set_default_torch_dtype(model dtype)``: without this, a
    bf16 model compiled at load would miss its guards at the first request and recompile there,
    outside the warm-up's Inductor settings.
    """
    prev = torch.get_default_dtype()
    if prev is not torch.float32:
        torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        if prev is not torch.float32:
            torch.set_default_dtype(prev)


# Inductor settings that make batch-1 GEMV read weights near the bandwidth floor on CPU
# (docs: shared/notes/performance-anchors.md): freezing folds the weights into the graph so the
# CPP GEMM templates can pre-pack them.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "epilogue_fusion": False,  # as the stock predictor: keeps RMSNorm/RoPE fp32 math unfused
}


def bucket_compile_options(options: dict[str, Any], bucket: int) -> list[dict[str, Any]]:
    """The Inductor options to try, in order, for one batch bucket.

    Batch 1 is matrix-vector work: there the CPP template alone reads near the bandwidth floor,
    and autotuning against ATen only adds noise (it times in-cache weights on a shared box and the
    on-disk cache keeps a bad pick), so it goes first with ATen as the fallback. From 2 rows up
    ATen's kernels can win (int8 at 8 rows: ``_weight_int8pack_mm`` 2x the template), so those
    buckets autotune as ``options`` say.
    """
    if bucket == 1 and options.get("max_autotune_gemm_backends") == "CPP,ATEN":
        return [{**options, "max_autotune_gemm_backends": "CPP"}, dict(options)]
    return [dict(options)]


# Any finite uniform works for greedy rows: their noise is computed and then not selected.
_GREEDY_UNIFORM = 0.5


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF/vllm-omni RMSNorm: variance in fp32, scale applied in the input dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.library.custom_op("omni_cpu_fastpath::stacked_linear", mutates_args=())
def stacked_linear(x: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, table[index])`` for a ``[S, N, K]`` table and a 0-d index tensor.

    Opaque to the compiler on purpose: inside a graph, ``table[index]`` would be an index_select
    that copies the whole head (8 MB at 0.6b) before the GEMM reads it again; here it is a view.
    """
    return F.linear(x, table[int(index)])


@stacked_linear.register_fake
def _(x: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], table.shape[1]))


class StackedHeads(nn.Module):
    """The 15 codebook heads as one ``[S, V, H]`` table: ``forward(h, step)`` indexes it by tensor.

    ``weight`` is a non-persistent buffer; the source ``nn.Linear`` weights are re-pointed at its
    slices, so a weight load into them updates the table and nothing is stored twice.
    """

    def __init__(self, heads: Sequence[nn.Linear]) -> None:
        super().__init__()
        self._sources = list(heads)  # a plain list: not submodules, so no duplicate state-dict names
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        self.weight = _stack_and_share([h.weight for h in self._sources], self.weight)

    def forward(self, h: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        # h [B, H], step a 0-d long tensor -> logits [B, V]
        if torch.compiler.is_compiling():
            # A tensor index keeps one graph for all 15 heads; the op reads the head in place.
            return stacked_linear(h, self.weight, step)
        return F.linear(h, self.weight[int(step)])  # eager: a view, no copy of the head


class StackedEmbeddings(nn.Module):
    """The 15 residual codebook embeddings as one ``[S, V, E]`` table (same sharing as the heads)."""

    def __init__(self, embeddings: Sequence[nn.Embedding]) -> None:
        super().__init__()
        self._sources = list(embeddings)
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        self.weight = _stack_and_share([e.weight for e in self._sources], self.weight)

    def forward(self, code: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        # code [B] long, step a 0-d long tensor -> [B, E]; one flat gather, no data-dependent int
        steps, vocab, dim = self.weight.shape
        return self.weight.view(steps * vocab, dim).index_select(0, step * vocab + code)


def _stack_and_share(params: Sequence[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
    """``[S, ...]`` table of ``params``; each param is re-pointed at its slice (no second copy)."""
    first = params[0].data
    size = (len(params), *first.shape)
    if first.is_contiguous() and all(
        p.dtype == first.dtype
        and p.shape == first.shape
        and p.is_contiguous()
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == first.storage_offset() + i * first.numel()
        for i, p in enumerate(params)
    ):
        # Already slices of one table (this or another wrapper of the same stock module built it,
        # and loads write straight into it): view that table again.
        if current.shape == size and current.data_ptr() == first.data_ptr():
            return current
        return torch.as_strided(first, size, (first.numel(), *first.stride()), first.storage_offset())
    stacked = torch.stack([p.detach() for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


class CachedCodePredictor(nn.Module):
    """KV-cached code predictor with the stock wrapper's forward signature, sharing its weights."""

    def __init__(
        self,
        stock: nn.Module,
        *,
        compile: str = "off",
        threads: int = 0,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        warmup: bool = True,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if compile not in ("off", "step"):
            raise ValueError(f"compile must be 'off' or 'step', got {compile!r}")
        if threads < 0:
            raise ValueError(f"threads must be >= 0 (0: no cap), got {threads}")
        if not buckets or any(int(b) < 1 for b in buckets):
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        cfg = stock.config
        # The stock children, so parameter names stay ``model.*``, ``lm_head.*``, ...
        self.model = stock.model
        self.lm_head = stock.lm_head
        self.small_to_mtp_projection = stock.small_to_mtp_projection
        self.config = cfg
        self.prefix = getattr(stock, "prefix", "code_predictor")
        self.talker_config = getattr(stock, "talker_config", None)
        self._stock = [stock]  # kept (unregistered) for load_weights and the sampling-mode checks

        self.num_code_groups = int(cfg.num_code_groups)
        self.num_steps = self.num_code_groups - 1
        self.max_seq = self.num_code_groups + 1
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.scaling = self.head_dim**-0.5
        self.eps = float(cfg.rms_norm_eps)
        self.num_layers = len(self.model.layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of kv heads {self.num_kv_heads}"
            )
        wrapper_cfg = getattr(stock, "_wrapper_config", None)
        if wrapper_cfg is not None and (
            wrapper_cfg.sampling_mode != "per_call" or wrapper_cfg.return_proj_buf
        ):
            raise ValueError(
                "CachedCodePredictor supports the Qwen3-TTS predictor (sampling_mode='per_call', no proj "
                f"buffer); got sampling_mode={wrapper_cfg.sampling_mode!r} "
                f"return_proj_buf={wrapper_cfg.return_proj_buf}"
            )

        self.heads = StackedHeads(list(self.lm_head))
        self.embeddings = StackedEmbeddings(list(self.model.codec_embedding))

        rope = getattr(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self._build_rope_tables()
        self.register_buffer(
            "mask_table", torch.ones(self.max_seq, self.max_seq, dtype=torch.bool).tril(), persistent=False
        )
        # Per-position index tensors, made once so the loop issues no eager ops between steps.
        self._pos = [torch.tensor([p]) for p in range(self.max_seq)]
        self._prefill_pos = torch.tensor([0, 1])
        self._head_idx = [torch.tensor(s) for s in range(self.num_steps)]

        self.compile_mode = compile
        self.threads = int(threads)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.compile_options = dict(INDUCTOR_OPTIONS if compile_options is None else compile_options)
        self._compiled: dict[int, Any] | None = None  # bucket -> compiled step
        self._compile_generation = 0
        self._warming = False
        self.compile_seconds: float | None = None
        # How many times each bucket was compiled (a served predictor compiles each once).
        self.compile_counts: dict[int, int] = {}
        self._failed_buckets: dict[int, str] = {}  # bucket -> why its compiled step was dropped
        # What runs the step, and why: "off", "step (...)", or "eager (... failed ...)".
        self.compile_status = "off" if compile == "off" else "step (not compiled yet)"
        if compile == "step" and warmup:
            self.warmup()

    def _build_rope_tables(self) -> None:
        # fp32 as HF computes them on the fly (inv_freq @ positions, then cos/sin); rebuilt from the
        # config rather than the stock inv_freq buffer, which a ``.to(bf16)`` would have rounded.
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        pos = torch.arange(self.max_seq, dtype=torch.float32)
        freqs = (inv_freq[:, None] @ pos[None, :]).transpose(0, 1)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = emb.cos()
        self.rope_sin = emb.sin()

    # ------------------------------------------------------------------ construction

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
        return cls(
            stock,
            compile=compile,
            threads=threads,
            buckets=buckets,
            warmup=warmup,
            compile_options=compile_options,
        )

    # Calls the talker makes on its code predictor.
    def get_input_embeddings(self) -> nn.ModuleList:
        return self.model.codec_embedding

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self._stock[0].load_weights(weights)
        self.refresh()
        return loaded

    def set_sampling_params(self, top_k: int = 50, top_p: float = 0.8) -> None:
        self._stock[0].set_sampling_params(top_k=top_k, top_p=top_p)

    def configure_mtp_execution_buckets(self, sizes: Iterable[int]) -> None:
        # The stock wrapper sizes its CUDA-graph buckets here; ours are fixed at construction.
        return None

    @property
    def dtype(self) -> torch.dtype:
        # As the stock wrapper: the dtype of the model's first parameter (a codec embedding).
        return self.model.codec_embedding[0].weight.dtype

    @torch.no_grad()
    def refresh(self, recompile: bool = True) -> None:
        """Rebuild the stacked tables from the stock weights (after a load, ``.to()`` or a swap).

        Compiled graphs froze the old weights, so they are dropped and, with compile=step, rebuilt.
        """
        self._build_rope_tables()
        if isinstance(self.heads, StackedHeads):
            self.heads._sources = list(self.lm_head)
            self.heads.refresh()
        if isinstance(self.embeddings, StackedEmbeddings):
            self.embeddings._sources = list(self.model.codec_embedding)
            self.embeddings.refresh()
        if self._compiled is not None:
            self._compiled = None
            if recompile and self.compile_mode == "step":
                self.warmup()

    def _apply(self, fn: Any, recurse: bool = True) -> CachedCodePredictor:
        # ``.to(dtype)`` replaces parameter storage: re-share the stacked tables afterwards, and
        # recompile (with compile=step) since the graphs froze the old weights.
        super()._apply(fn, recurse)
        if hasattr(self, "heads"):
            self.refresh()
        return self

    # ------------------------------------------------------------------ the static step

    def forward_static_step(
        self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, caches: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Run the layers on ``x [B, T, H]`` at positions ``pos [T]``; returns final-normed hidden.

        ``mask [T, S]`` is the boolean rows of ``mask_table`` for ``pos``; ``caches`` holds the
        ``[B, kv_heads, S, head_dim]`` key and value cache of each layer, written at ``pos``.
        """
        bsz, seq, _ = x.shape
        dtype = x.dtype
        cos = self.rope_cos[pos].to(dtype)[None, None]  # [1, 1, T, D]
        sin = self.rope_sin[pos].to(dtype)[None, None]
        attn_mask = mask[None, None]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        h = x
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            residual = h
            h = rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            qkv = attn.qkv_proj(h)
            q = qkv[..., :q_size].reshape(bsz, seq, self.num_heads, self.head_dim)
            k = qkv[..., q_size : q_size + kv_size].reshape(bsz, seq, self.num_kv_heads, self.head_dim)
            v = qkv[..., q_size + kv_size :].reshape(bsz, seq, self.num_kv_heads, self.head_dim)
            q = rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon).transpose(1, 2)
            k = rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon).transpose(1, 2)
            v = v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = caches[2 * i], caches[2 * i + 1]
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            out = F.scaled_dot_product_attention(
                q,
                k_cache,
                v_cache,
                attn_mask=attn_mask,
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            h = residual + attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, q_size))
            residual = h
            h = rms_norm(
                h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
            )
            mlp = layer.mlp
            gate, up = mlp.gate_up_proj(h).chunk(2, dim=-1)
            h = residual + mlp.down_proj(F.silu(gate) * up)
        return rms_norm(h, self.model.norm.weight, self.model.norm.variance_epsilon)

    def _substep(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        caches: Sequence[torch.Tensor],
        head_idx: torch.Tensor,
        u: torch.Tensor,
        sampling: torch.Tensor,
        greedy: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sub-step: layers -> head ``head_idx`` -> sample -> next projected input.

        Returns ``(code [B], logits [B, V], next_x [B, 1, H])``. ``sampling`` is
        ``[inv_temperature, kth-from-bottom index, top_p]`` as fp32, ``greedy`` a bool 0-d tensor.
        """
        hidden = self.forward_static_step(x, pos, mask, caches)[:, -1]
        logits = self.heads(hidden, head_idx)
        code = sample_codes(logits, u, sampling, greedy)
        emb = self.embeddings(code, head_idx)
        next_x = self.small_to_mtp_projection(emb.to(x.dtype)[:, None, :])
        return code, logits, next_x

    # ------------------------------------------------------------------ compile

    def _fresh_compiled(self, options: dict[str, Any]) -> Any:
        # Compile an nn.Module (not a bound method): only then are the weights module parameters
        # that Inductor's freezing folds into constants, which its CPP GEMM templates need.
        # Dynamo caches graphs on the forward's code object; a distinct code object per instance and
        # refresh gives each its own cache, so frozen (stale) weights of another instance never match.
        self._compile_generation += 1
        name = f"_CompiledStep_{id(self):x}_{self._compile_generation}"
        base = _StepModule.forward
        forward = types.FunctionType(base.__code__.replace(co_name=name), base.__globals__, name)
        module = type(name, (_StepModule,), {"forward": forward})(self)
        compiled = torch.compile(module, fullgraph=True, dynamic=False, options=dict(options))
        # A bound method, not the module: assigning a module would register it as our child.
        return compiled.__call__

    def warmup(self) -> bool:
        """Compile the step for every bucket (prefill and sub-step shapes); False if it fell back.

        Each bucket gets its own compiled step and options (:func:`bucket_compile_options`); a
        bucket whose first options fail is retried with the next before the whole step falls back
        to eager. After this, a call that would compile again fails instead (and that bucket runs
        eager, with the reason in ``compile_status``): every shape is compiled here, never first
        at a request.
        """
        t0 = time.perf_counter()
        compiled: dict[int, Any] = {}
        for b in self.buckets:
            attempts = bucket_compile_options(self.compile_options, b)
            for i, options in enumerate(attempts):
                try:
                    compiled[b] = self._compile_bucket(b, options)
                    break
                except Exception as exc:  # noqa: BLE001 - any compiler failure: retry or run eager
                    if i + 1 < len(attempts):  # (_compile_bucket has already dropped its step)
                        logger.warning(
                            "code predictor: compiling bucket %d with GEMM backends %s failed (%r); "
                            "retrying with %s",
                            b,
                            options.get("max_autotune_gemm_backends"),
                            exc,
                            attempts[i + 1].get("max_autotune_gemm_backends"),
                        )
                        continue
                    logger.warning("code predictor: torch.compile of the step failed, running eager: %r", exc)
                    self.compile_mode = "off"
                    self._set_compile_status(f"eager (torch.compile failed at load: {_short(exc)})")
                    return False
        self._compiled = compiled
        self.compile_seconds = time.perf_counter() - t0
        self._set_compile_status(
            f"step (buckets {_csv_ints(self.buckets)}, compiled at load in {self.compile_seconds:.1f} s)"
        )
        logger.info(
            "code predictor: compiled the static step for batch buckets %s in %.1f s",
            self.buckets,
            self.compile_seconds,
        )
        return True

    def _set_compile_status(self, status: str) -> None:
        self.compile_status = status
        step_stats.served("predictor.compile", status)

    def _compile_bucket(self, bucket: int, options: dict[str, Any]) -> Any:
        """A step compiled with ``options`` and warmed on ``bucket`` rows (prefill and sub-step)."""
        import torch._inductor.config  # noqa: F401 - torch.compile imports it lazily

        step = self._fresh_compiled(options)
        self.compile_counts[bucket] = self.compile_counts.get(bucket, 0) + 1
        self._compiled = {bucket: step}  # forward_cached pads to this bucket and calls it
        hid = torch.zeros(bucket, 1, self.model.codec_embedding[0].weight.shape[1], dtype=self.dtype)
        self._warming = True
        # Inductor reads ``freezing`` outside the per-compile ``options`` scope, so it is set here,
        # around the calls that compile (all of them happen in this warm-up).
        try:
            with (
                torch._inductor.config.patch(freezing=bool(options.get("freezing", False))),
                self._thread_cap(),
            ):
                self.forward_cached(torch.zeros(bucket, 1, dtype=torch.long), hid, hid, do_sample=True)
        finally:
            self._warming = False
            self._compiled = None
        return step

    # ------------------------------------------------------------------ forward

    def _thread_cap(self) -> _ThreadCap:
        return _ThreadCap(self.threads)

    def _check_inputs(
        self,
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
        self,
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

    @torch.inference_mode()
    def forward_cached(
        self,
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
        return_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The KV-cached loop; returns ``(codes [B, 16], logits [B, 15, V] or None)``."""
        bsz = int(layer0_code.shape[0])
        self._check_inputs(bsz, generators, sample_uniforms, top_p, top_k)
        dtype = self.dtype
        steps, vocab = self.num_steps, self.vocab_size
        use_sampling = bool(do_sample) and temperature > 0

        # Noise first, eagerly, in the stock loop's order (nothing is drawn for greedy calls).
        if use_sampling:
            if sample_uniforms is not None:
                u = sample_uniforms.to(torch.float32).transpose(0, 1)
            else:
                u = predictor_uniforms(bsz, steps, vocab, generator=generator, generators=generators)
                u = u.transpose(0, 1)
        else:
            u = torch.full((steps, bsz, vocab), _GREEDY_UNIFORM, dtype=torch.float32)
        k = int(top_k)
        k = vocab if k <= 0 or k >= vocab else k
        sampling = torch.tensor(
            [1.0 / max(temperature, 1e-6) if use_sampling else 1.0, float(vocab - k), float(top_p)],
            dtype=torch.float32,
        )
        greedy = torch.tensor(not use_sampling)

        x0 = self.small_to_mtp_projection(last_talker_hidden.reshape(bsz, 1, -1).to(dtype))
        x1 = self.small_to_mtp_projection(layer0_embed.reshape(bsz, 1, -1).to(dtype))
        x = torch.cat([x0, x1], dim=1)
        codes = torch.empty(bsz, self.num_code_groups, dtype=torch.long)
        codes[:, 0] = layer0_code.reshape(bsz)
        all_logits: list[torch.Tensor] | None = [] if return_logits else None
        with step_stats.timer(step_stats.PREDICTOR_LOOP), self._thread_cap():
            padded = next((b for b in sorted(self._compiled or ()) if b >= bsz), 0)
            if padded:
                try:
                    # Past warm-up, a call that would compile again fails (and runs eager below).
                    stance = "default" if self._warming else "fail_on_recompile"
                    with _compiled_call_state(), torch.compiler.set_stance(stance):
                        self._loop(self._compiled[padded], x, u, sampling, greedy, padded, codes, all_logits)
                except Exception as exc:  # noqa: BLE001 - a compiled step that fails must not fail serving
                    if self._warming:  # warmup() decides: retry with other options, or eager
                        raise
                    self._drop_bucket(padded, exc)
                    padded = 0
                    if all_logits is not None:
                        all_logits.clear()
            if not padded:  # eager: compile off, failed, or a batch beyond the largest bucket
                self._loop(self._substep, x, u, sampling, greedy, bsz, codes, all_logits)
        logits_out = torch.stack(all_logits, dim=1) if all_logits is not None else None
        return codes, logits_out

    def _drop_bucket(self, bucket: int, exc: Exception) -> None:
        """A compiled bucket failed at run time: batches pad to the next compiled bucket from now
        on (eager above the last one, or when none is left), and the status says why."""
        assert self._compiled is not None
        del self._compiled[bucket]
        why = f"the compiled step failed at run time: {_short(exc)}"
        self._failed_buckets.setdefault(bucket, why)
        logger.warning("code predictor: bucket %d dropped: %s", bucket, why)
        dropped = _csv_ints(sorted(self._failed_buckets))
        first = next(iter(self._failed_buckets.values()))
        left = sorted(self._compiled)
        if left:
            self._set_compile_status(f"step (buckets {_csv_ints(left)}; dropped {dropped}: {first})")
        else:
            self._compiled = None
            self.compile_mode = "off"
            self._set_compile_status(f"eager (dropped buckets {dropped}: {first})")

    def _loop(
        self,
        step_fn: Any,
        x: torch.Tensor,
        u: torch.Tensor,
        sampling: torch.Tensor,
        greedy: torch.Tensor,
        rows: int,
        codes: torch.Tensor,
        all_logits: list[torch.Tensor] | None,
    ) -> None:
        """The 15 sub-steps on ``rows`` rows (the batch padded up to a compiled bucket)."""
        bsz = codes.shape[0]
        if rows != bsz:
            x = F.pad(x, (0, 0, 0, 0, 0, rows - bsz))
            u = F.pad(u, (0, 0, 0, rows - bsz), value=_GREEDY_UNIFORM)
        u = u.contiguous()
        caches = [
            torch.zeros(rows, self.num_kv_heads, self.max_seq, self.head_dim, dtype=x.dtype)
            for _ in range(2 * self.num_layers)
        ]
        pos, mask = self._prefill_pos, self.mask_table[:2]
        for s in range(self.num_steps):
            with step_stats.timer(step_stats.PREDICTOR_SUBSTEP):
                code, logits, x = step_fn(x, pos, mask, caches, self._head_idx[s], u[s], sampling, greedy)
            codes[:, s + 1] = code[:bsz]
            if all_logits is not None:
                all_logits.append(logits[:bsz].float())
            if s + 2 < self.max_seq:
                pos, mask = self._pos[s + 2], self.mask_table[s + 2 : s + 3]

    @torch.inference_mode()
    def teacher_forced_logits(
        self,
        layer0_code: torch.Tensor,
        layer0_embed: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        codes: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[B, 15, V]`` (fp32) of each sub-step when the inputs are the given ``codes``.

        ``codes`` is ``[B, 16]`` (column 0 ignored) or ``[B, 15]`` residual codes; sub-step s sees
        the embeddings of codes 1..s-1 whatever it would have sampled. Runs eager.
        """
        bsz = int(layer0_code.shape[0])
        if (
            codes.dim() != 2
            or codes.shape[0] != bsz
            or codes.shape[1] not in (self.num_steps, self.num_code_groups)
        ):
            raise ValueError(
                f"codes must be [B, {self.num_code_groups}] or [B, {self.num_steps}] with B={bsz}, "
                f"got {tuple(codes.shape)}"
            )
        residual = codes[:, -self.num_steps :].long()
        if bool(((residual < 0) | (residual >= self.vocab_size)).any()):
            raise ValueError(f"codes must lie in [0, {self.vocab_size})")
        dtype = self.dtype
        with self._thread_cap():
            x0 = self.small_to_mtp_projection(last_talker_hidden.reshape(bsz, 1, -1).to(dtype))
            x1 = self.small_to_mtp_projection(layer0_embed.reshape(bsz, 1, -1).to(dtype))
            x = torch.cat([x0, x1], dim=1)
            caches = [
                torch.zeros(bsz, self.num_kv_heads, self.max_seq, self.head_dim, dtype=dtype)
                for _ in range(2 * self.num_layers)
            ]
            out = []
            pos, mask = self._prefill_pos, self.mask_table[:2]
            for s in range(self.num_steps):
                hidden = self.forward_static_step(x, pos, mask, caches)[:, -1]
                out.append(self.heads(hidden, self._head_idx[s]).float())
                if s + 2 < self.max_seq:
                    emb = self.embeddings(residual[:, s], self._head_idx[s])
                    x = self.small_to_mtp_projection(emb.to(dtype)[:, None, :])
                    pos, mask = self._pos[s + 2], self.mask_table[s + 2 : s + 3]
        return torch.stack(out, dim=1)


def sample_codes(
    logits: torch.Tensor, u: torch.Tensor, sampling: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> Gumbel-max, as tensors only (no data-dependent branches).

    Matches vllm-omni's predictor for temperature/top-k/Gumbel (``scaled < kth largest`` masked,
    ``argmax(scaled.float() - log(-log(u)))``) and vLLM's ``apply_top_k_top_p`` for top-p (on the
    ascending sort, drop tokens whose cumulative probability is <= 1 - p, never the largest); top-p
    is skipped when p == 1, as the stock predictor does. ``sampling`` = ``[inv_temperature,
    V - k, top_p]``; greedy rows take ``argmax(logits)``.
    """
    inv_temp, kth_from_bottom, top_p = sampling[0], sampling[1].long(), sampling[2]
    # A 0-d fp32 factor, like the stock Python float: the result stays in the logits dtype.
    scaled = logits * inv_temp
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=False)
    kth = sorted_vals.index_select(-1, kth_from_bottom.reshape(1))
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    # top-p on the top-k-masked distribution, in the sorted space as vLLM does.
    sorted_masked = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    probs_sum = sorted_masked.float().softmax(dim=-1).cumsum(dim=-1)
    drop = probs_sum <= 1 - top_p
    drop[..., -1] = False
    drop = drop & (top_p < 1.0)
    drop_unsorted = torch.zeros_like(drop).scatter(-1, sorted_idx, drop)
    scaled = scaled.masked_fill(drop_unsorted, float("-inf"))
    sampled = (scaled.float() - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _csv_ints(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)


class _StepModule(nn.Module):
    """The unit handed to torch.compile: one sub-step of ``pred`` (see ``_fresh_compiled``)."""

    def __init__(self, pred: CachedCodePredictor) -> None:
        super().__init__()
        self.pred = pred

    def forward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pred._substep(*args)


class _ThreadCap:
    """Caps torch's intra-op threads for the duration of a predictor call, then restores them."""

    __slots__ = ("n", "prev")

    def __init__(self, n: int) -> None:
        self.n = n
        self.prev = 0

    def __enter__(self) -> _ThreadCap:
        if self.n:
            self.prev = torch.get_num_threads()
            if self.n != self.prev:
                torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n and self.prev and self.prev != torch.get_num_threads():
            torch.set_num_threads(self.prev)


__all__ = [
    "CachedCodePredictor",
    "StackedEmbeddings",
    "StackedHeads",
    "DEFAULT_BUCKETS",
    "buckets_for",
    "INDUCTOR_OPTIONS",
    "bucket_compile_options",
    "stacked_linear",
    "rms_norm",
    "sample_codes",
]
