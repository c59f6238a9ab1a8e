"""The KV-cached, shape-static code predictor: the model and its 15-sub-step loop.

vllm-omni's ``CodePredictorWrapper.forward`` re-runs all layers over the padded 17-position buffer
for each of the 15 residual sub-steps. :class:`CachedCodePredictor` keeps a static KV cache per
layer instead: a 2-token prefill (projected talker hidden, projected layer-0 embedding), then one
token per sub-step, so each sub-step reads every weight once.

One sub-step (:meth:`CachedCodePredictor.substep`: layers, final norm, codebook head, sampling,
next embedding) takes only tensors: the position, the mask row and the head index are tensors and
the KV cache is written with ``index_copy_``, gpt-fast style. ``torch.compile(fullgraph=True)``
therefore builds one graph per batch bucket (and one for the prefill) and reuses it for all 15
sub-steps (``compiler.py``). Sampling noise is drawn eagerly (``noise.predictor_uniforms``) before
the compiled region, consuming the request generators exactly as the stock eager loop does, so
seeded codes are identical stock, eager and compiled.

The module shares the stock module's weights under the same parameter names (``model.*``,
``lm_head.*``, ``small_to_mtp_projection.*``), so the stock ``load_weights`` mapping still applies.
The stacked ``[15, V, H]`` head and embedding tables are non-persistent buffers whose slices the
stock ``lm_head`` / ``codec_embedding`` parameters are re-pointed at: they are not in the state
dict and do not double the memory; :meth:`CachedCodePredictor.refresh` rebuilds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.cpu_threads import set_torch_threads
from omni_cpu_fastpath.qwen3_tts.noise import predictor_uniforms

from .compiler import DEFAULT_BUCKETS, StepCompiler
from .layers import StackedEmbeddings, StackedHeads, cached_attention, rms_norm, rotate_half, sample_codes
from .stock_interface import StockPredictorInterface

# Any finite uniform works for greedy rows: their noise is computed and then not selected.
_GREEDY_UNIFORM = 0.5


class CachedCodePredictor(StockPredictorInterface, nn.Module):
    """KV-cached code predictor with the stock wrapper's forward signature, sharing its weights.

    Longer than most classes here because the static step, the sub-step and the loop share one
    set of precomputed tensors (RoPE tables, mask table, position and head indices) that must stay
    on the module for ``torch.compile`` to see them as constants; the stock interface
    (``stock_interface.py``), the compile policy (``compiler.py``) and teacher forcing
    (``qwen3_tts/parity.py``) live elsewhere.
    """

    # Tensors built from the config that the compiled step reads as constants: with the
    # parameters and persistent buffers they key its on-disk compile cache (compile_cache.py).
    digest_tensors = ("rope_cos", "rope_sin", "mask_table")
    _follow_threads: Callable[[], int] | None = None  # see follow_threads()

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
        self.compiler = StepCompiler(
            self, mode=compile, threads=threads, buckets=buckets, options=compile_options
        )
        cfg = stock.config
        # The stock children, so parameter names stay ``model.*``, ``lm_head.*``, ...
        self.model = stock.model
        self.lm_head = stock.lm_head
        self.small_to_mtp_projection = stock.small_to_mtp_projection
        self.config = cfg
        self.prefix = getattr(stock, "prefix", "code_predictor")
        self.talker_config = getattr(stock, "talker_config", None)
        self._stock = [stock]  # a list: kept for load_weights and sampling params, not a submodule

        self.num_code_groups = int(cfg.num_code_groups)
        self.num_steps = self.num_code_groups - 1
        self.max_seq = self.num_code_groups + 1
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads)
        self.scaling = self.head_dim**-0.5
        self.num_layers = len(self.model.layers)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of kv heads {self.num_kv_heads}"
            )
        self.check_stock_wrapper(stock)

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

    @property
    def stock(self) -> nn.Module:
        """vllm-omni's predictor module whose weights this one shares."""
        return self._stock[0]

    @torch.no_grad()
    def refresh(self, recompile: bool = True) -> None:
        """Rebuild the stacked tables from the stock weights (after a load, ``.to()`` or a swap).

        Compiled graphs froze the old weights, so they are dropped and, with compile=step, rebuilt.
        """
        self._build_rope_tables()
        if isinstance(self.heads, StackedHeads):
            self.heads.refresh(list(self.lm_head))
        if isinstance(self.embeddings, StackedEmbeddings):
            self.embeddings.refresh(list(self.model.codec_embedding))
        self.compiler.invalidate(recompile)

    def _apply(self, fn: Any, recurse: bool = True) -> CachedCodePredictor:
        # ``.to(dtype)`` replaces parameter storage: re-share the stacked tables afterwards, and
        # recompile (with compile=step) since the graphs froze the old weights. A call that moved
        # nothing (``.to("cpu")`` on CPU) keeps the compiled steps: compiling them again would
        # cost a second warm-up.
        before = self._storage_ids()
        super()._apply(fn, recurse)
        if hasattr(self, "heads") and self._storage_ids() != before:
            self.refresh()
        return self

    def _storage_ids(self) -> list[tuple[str, int, torch.dtype]]:
        return [(n, t.data_ptr(), t.dtype) for n, t in [*self.named_parameters(), *self.named_buffers()]]

    # ------------------------------------------------------------------ compile (see compiler.py)

    def warmup(self) -> bool:
        """Compile the step for every bucket now; False if it fell back to eager."""
        return self.compiler.warmup()

    def warm(self, rows: int) -> None:
        """One sampled call on ``rows`` zero rows: what compiles a bucket's shapes."""
        hid = torch.zeros(rows, 1, self.model.codec_embedding[0].weight.shape[1], dtype=self.dtype)
        self.forward_cached(torch.zeros(rows, 1, dtype=torch.long), hid, hid, do_sample=True)

    def linears_run_kernel(self) -> bool:
        """Whether every linear of the layers multiplies through the package's few-row kernel
        (int8 layers built with it), which a compiled step then calls as an op."""
        return all(
            getattr(m, "gemv", False)
            for layer in self.model.layers
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )

    compile_mode = property(lambda self: self.compiler.mode, doc="'step' or 'off' (also after a fallback)")
    compile_status = property(lambda self: self.compiler.status, doc="what runs the step, and why")
    compile_counts = property(lambda self: self.compiler.counts, doc="compiles per bucket")
    compile_seconds = property(lambda self: self.compiler.seconds, doc="time warmup() took")
    threads = property(lambda self: self.compiler.threads, doc="torch threads cap (0: none)")
    buckets = property(lambda self: self.compiler.buckets, doc="batch buckets compiled")

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
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_cache, v_cache = caches[2 * i], caches[2 * i + 1]
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            if torch.compiler.is_compiling():
                # Fused by Inductor (why, in cached_attention's docstring).
                out = cached_attention(q, k_cache, v_cache, mask, self.scaling)
            else:  # eager runs stock's SDPA, so served bf16 codes stay bit-equal to stock's
                out = F.scaled_dot_product_attention(
                    q,
                    k_cache,
                    v_cache,
                    attn_mask=mask[None, None],
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

    def substep(
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
        return code, logits, self.embed_code(code, head_idx, x.dtype)

    # ------------------------------------------------------------------ the loop's pieces

    def step_inputs(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pos, mask rows, head index)`` of sub-step ``s``: the prefill at 0, then one position."""
        if s == 0:
            return self._prefill_pos, self.mask_table[:2], self._head_idx[0]
        return self._pos[s + 1], self.mask_table[s + 1 : s + 2], self._head_idx[s]

    def prefill_inputs(self, last_talker_hidden: torch.Tensor, layer0_embed: torch.Tensor) -> torch.Tensor:
        """The two projected prefill tokens ``[B, 2, H]`` in the predictor's dtype."""
        bsz, dtype = int(last_talker_hidden.shape[0]), self.dtype
        x0 = self.small_to_mtp_projection(last_talker_hidden.reshape(bsz, 1, -1).to(dtype))
        x1 = self.small_to_mtp_projection(layer0_embed.reshape(bsz, 1, -1).to(dtype))
        return torch.cat([x0, x1], dim=1)

    def embed_code(self, code: torch.Tensor, head_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The next sub-step's input ``[B, 1, H]`` from the code just chosen by head ``head_idx``."""
        return self.small_to_mtp_projection(self.embeddings(code, head_idx).to(dtype)[:, None, :])

    def new_caches(self, rows: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Zeroed key and value caches of every layer, ``[rows, kv_heads, positions, head_dim]``."""
        shape = (rows, self.num_kv_heads, self.max_seq, self.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * self.num_layers)]

    # ------------------------------------------------------------------ forward

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
        self.check_inputs(bsz, generators, sample_uniforms, top_p, top_k)
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

        x = self.prefill_inputs(last_talker_hidden, layer0_embed)
        codes = torch.empty(bsz, self.num_code_groups, dtype=torch.long)
        codes[:, 0] = layer0_code.reshape(bsz)
        all_logits: list[torch.Tensor] | None = [] if return_logits else None
        compiler = self.compiler
        with step_stats.timer(step_stats.PREDICTOR_LOOP), compiler.thread_cap():
            padded = compiler.bucket_for(bsz)
            if padded:
                try:
                    with compiler.calling():
                        assert compiler.steps is not None
                        self._loop(
                            compiler.steps[padded], x, u, sampling, greedy, padded, codes, all_logits, True
                        )
                except Exception as exc:  # noqa: BLE001 - a compiled step that fails must not fail serving
                    if compiler.warming:  # warmup() decides: retry with other options, or eager
                        raise
                    compiler.drop(padded, exc)
                    padded = 0
                    if all_logits is not None:
                        all_logits.clear()
            if not padded:  # eager: compile off, failed, or a batch beyond the largest bucket
                self._loop(self.substep, x, u, sampling, greedy, bsz, codes, all_logits)
        logits_out = torch.stack(all_logits, dim=1) if all_logits is not None else None
        return codes, logits_out

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
        compiled: bool = False,
    ) -> None:
        """The 15 sub-steps on ``rows`` rows (the batch padded up to a compiled bucket)."""
        bsz = codes.shape[0]
        if rows != bsz:
            x = F.pad(x, (0, 0, 0, 0, 0, rows - bsz))
            u = F.pad(u, (0, 0, 0, rows - bsz), value=_GREEDY_UNIFORM)
        u = u.contiguous()
        caches = self.new_caches(rows, x.dtype)
        follow, start, used = self._follow_threads, torch.get_num_threads(), 0
        try:
            for s in range(self.num_steps):
                if follow is not None:
                    want = follow()
                    if want != torch.get_num_threads() and (not compiled or self.compiler.runs_at(want)):
                        set_torch_threads(want)
                    used += torch.get_num_threads()
                pos, mask, head_idx = self.step_inputs(s)
                with step_stats.timer(step_stats.PREDICTOR_SUBSTEP):
                    code, logits, x = step_fn(x, pos, mask, caches, head_idx, u[s], sampling, greedy)
                codes[:, s + 1] = code[:bsz]
                if all_logits is not None:
                    all_logits.append(logits[:bsz].float())
        finally:
            if torch.get_num_threads() != start:
                set_torch_threads(start)
        if follow is not None:
            step_stats.record(step_stats.PREDICTOR_THREADS, used / self.num_steps)

    def follow_threads(self, threads_now: Callable[[], int] | None, counts: Sequence[int] = ()) -> str | None:
        """Run each sub-step at ``threads_now()`` torch threads (one of ``counts``), read just before
        it, instead of at the call's count; ``None`` stops. Returns None where it will, else why not.

        A server whose other stage computes on the same cores steps the predictor down while it
        does. The compiled step needs one more trace per count, and its bits do not depend on the
        count (``compiler.StepCompiler.trace_at``). The count at the call is restored after its
        last sub-step.
        """
        if threads_now is None:
            self._follow_threads = None
            return None
        why = self.compiler.trace_at(counts)
        self._follow_threads = None if why else threads_now
        return why
