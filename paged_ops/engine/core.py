"""The :class:`PagedEngine`: its constructor, public API and the step loop: the scheduler
decides the step (:class:`~.scheduler.Scheduler`), the runner runs its one forward pass
(:class:`~.runner.ModelRunner`), the sampler turns the logits into tokens
(:class:`~.sampling.Sampler`, or beam search), and the engine updates branches and outputs."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from ..block_manager import BlockManager
from .attention import ATTN_IMPLEMENTATION, register_paged_attention
from .fp8 import FP8_DTYPES, make_kv_scales
from .request import Branch, Request, RequestOutput, SeqGroup
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams, branch_generator
from .scheduler import Scheduler, SchedulerOutput
from .stats import StatsCollector, StepRecord
from .tp import tp_layout


class EngineOverloaded(RuntimeError):
    """:meth:`PagedEngine.add_request` while ``max_waiting_requests`` requests are waiting."""


class PagedEngine:
    """Continuous-batching generation for a transformers decoder-only model over paged KV:
    greedy, sampling (``n`` branches sharing the prompt's blocks) and beam search, offline
    (:meth:`generate`) or online (:meth:`add_request`, :meth:`step`, :meth:`abort`,
    :meth:`stream`).

    Args:
        model: a ``transformers`` causal LM whose attention layers dispatch through
            ``ALL_ATTENTION_FUNCTIONS`` and carry ``layer_idx`` (Llama, Mistral, Qwen2, ... ;
            GQA included). The engine switches it to the ``"paged_ops"`` attention
            implementation (calls outside the engine fall back to SDPA) and puts it in eval
            mode. Its device and dtype decide the caches' device and dtype. A model sharded
            by transformers' tensor-parallel plan (``from_pretrained(..., tp_plan="auto")``
            under ``torchrun``) works too: each rank runs its own engine with the same calls,
            caches only its local KV heads (``ValueError`` if a head count does not divide by
            the world size) and makes the same scheduling decisions from the same inputs,
            without communicating. The logits are bitwise identical on every rank (the
            sharded layers' outputs are all-reduced, ``lm_head`` is replicated), so the same
            seeded generators sample the same tokens everywhere; only a request without a
            seed costs a broadcast (of rank 0's random seed).
        num_blocks: GPU (model-device) blocks in the pool.
        block_size: token slots per block.
        num_cpu_blocks: blocks of the CPU swap pool (0: no swapping).
        preemption_mode: ``"recompute"`` or ``"swap"`` (needs ``num_cpu_blocks > 0``; falls
            back to recompute when the CPU pool is full). Default: ``"swap"`` if
            ``num_cpu_blocks > 0`` else ``"recompute"``.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: the token budget of one step (one forward pass): the running
            sequences' decode rows (one token each) come first and always run, prompt chunks
            fill the rest. A prompt longer than what is left is prefilled in chunks over
            several steps, while the running sequences keep decoding (chunked prefill).
        max_prefill_tokens_with_decodes: the most prompt tokens of a step that also runs
            decode rows (``None``: what the budget leaves). A mixed step's time grows with
            its prompt tokens, so a small value keeps the running sequences' inter-token
            latency even while long prompts prefill, at the cost of a later first token for
            those prompts; steps without decode rows still take the whole budget.
        watermark: fraction of the pool kept free when admitting a request while others run
            (headroom for their growth, fewer preemptions right after admission).
        compile: ``True`` wraps the model forward in ``torch.compile(dynamic=True)`` for every
            step; ``"decode"`` compiles the steps of decode rows only (steps with prompt chunks
            run eagerly); a ``dict`` is passed to ``torch.compile`` as keyword arguments (every
            step, ``dynamic=True`` unless given).
        eos_token_id: token id(s) that end a branch; default: the model's
            ``generation_config.eos_token_id`` (``None``: stop only at ``max_new_tokens``).
        step_callback: called as ``step_callback(engine, record)`` after every step (progress
            bars). :attr:`last_step_logits` holds that step's logits.
        enable_prefix_caching: share the KV blocks of common prompt prefixes.
            The block manager registers every full block under a hash of its token ids (and
            its whole prefix); a new request (or a sequence readmitted after a recompute
            preemption) whose leading full blocks are registered, in a running sequence or
            in a finished one whose blocks are still cached (ref count 0, evicted LRU only
            when the pool needs them), reuses them and prefills only the rest (attention runs
            over the paged cache, which holds the reused prefix). A block is registered in the
            step that writes it (prompt chunks and decode rows alike).
            ``stats.cached_prompt_tokens`` counts the positions served from the cache. Cached
            blocks outlive :meth:`generate`, so a later call hits blocks of an earlier one.
        kv_cache_dtype: element type of the KV caches: the model's dtype (default), or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (half or a quarter of the
            memory; stored = ``x / scale`` saturated, read = ``stored * scale``).
        kv_scale: fp8 only: the per-tensor scales. ``"auto"`` (default): one key scale and
            one value scale per layer, calibrated once, on the engine's first forward pass
            (the first prompt chunks), from that step's keys/values:
            ``scale = amax / (finfo.max / KV_SCALE_HEADROOM)``
            (headroom 4: later values up to 4x the calibration amax still fit; fp8's
            relative precision does not depend on the scale, the headroom only moves the
            underflow threshold by two binades). The scales never change afterwards (cached
            blocks stay valid). A float, or a ``(k_scale, v_scale)`` pair, fixes the scales of
            every layer (``1.0``: store the values as they are). :attr:`k_scales` and
            :attr:`v_scales` hold the tensors.
        max_waiting_requests: most requests waiting for admission (new ones, and running
            ones preempted by recompute); :meth:`add_request` beyond it raises
            :class:`EngineOverloaded` (``None``: no limit).
        cascade: in decode steps, attend the blocks that several sequences share (the
            prompt of ``n`` branches or beams, prefix-cache hits common to several requests)
            once per group instead of once per sequence, merging the partial attentions
            exactly (:mod:`paged_ops.engine.cascade`): tokens are unchanged up to rounding
            (fp32 math; partial outputs in the model's dtype). Layers with a sliding window,
            compiled steps and steps whose groups save fewer than
            ``cascade.MIN_SAVED_TOKENS`` token reads in all take the plain path.
            ``stats.cascade_steps`` counts the steps that used it.

    The pool is sized in blocks; :attr:`kv_bytes_per_block` gives the bytes one block takes
    over all layers (keys and values).
    """

    def __init__(self, model, *, num_blocks: int, block_size: int = 16,
                 num_cpu_blocks: int = 0, preemption_mode: str | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 watermark: float = 0.01,
                 compile: bool | str | dict = False, eos_token_id=...,
                 step_callback: Callable[[PagedEngine, StepRecord], None] | None = None,
                 enable_prefix_caching: bool = False,
                 kv_cache_dtype: torch.dtype | None = None,
                 kv_scale: float | tuple[float, float] | str = "auto",
                 max_waiting_requests: int | None = None, cascade: bool = True,
                 max_prefill_tokens_with_decodes: int | None = None):
        if preemption_mode is None:
            preemption_mode = "swap" if num_cpu_blocks > 0 else "recompute"
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {preemption_mode!r}")
        if preemption_mode == "swap" and num_cpu_blocks <= 0:
            raise ValueError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if max_prefill_tokens_with_decodes is not None and (
                not isinstance(max_prefill_tokens_with_decodes, int)
                or max_prefill_tokens_with_decodes < 1):
            raise ValueError(f"max_prefill_tokens_with_decodes must be an int >= 1 or None, "
                             f"got {max_prefill_tokens_with_decodes!r}")
        self.model = model
        self.config = config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        # A tensor-parallel rank caches only its own KV heads (sized from its projections).
        self.tp = tp_layout(model, self.num_heads, self.num_kv_heads, self.head_dim)
        self.num_heads, self.num_kv_heads = self.tp.num_heads, self.tp.num_kv_heads
        self.head_dim = self.tp.head_dim
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.num_cpu_blocks = int(num_cpu_blocks)
        self.preemption_mode = preemption_mode
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = float(watermark)
        self.watermark_blocks = math.ceil(watermark * num_blocks)
        self.step_callback = step_callback

        if eos_token_id is ...:
            gen = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset([eos_token_id])
        else:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_id)

        if kv_cache_dtype is None:
            kv_cache_dtype = self.dtype
        if kv_cache_dtype != self.dtype and kv_cache_dtype not in FP8_DTYPES:
            raise ValueError(f"kv_cache_dtype must be the model's dtype ({self.dtype}) or an "
                             f"fp8 type ({FP8_DTYPES}), got {kv_cache_dtype}")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scale = kv_scale
        # Checked before anything is allocated.
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, "
                             f"got {max_waiting_requests}")

        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.block_manager = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                          enable_prefix_caching=self.enable_prefix_caching)
        k_scales, v_scales, calibrate, scale_target = make_kv_scales(
            kv_cache_dtype, kv_scale, self.num_layers, self.device)

        register_paged_attention(ATTN_IMPLEMENTATION)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        model.eval()

        self.runner = ModelRunner(
            model, self.block_manager, num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=self.block_size,
            num_blocks=self.num_blocks, num_cpu_blocks=self.num_cpu_blocks,
            kv_cache_dtype=kv_cache_dtype, device=self.device, dtype=self.dtype,
            num_heads=self.num_heads, compile=compile, k_scales=k_scales, v_scales=v_scales,
            calibrate=calibrate, scale_target=scale_target, cascade=bool(cascade))
        # fp8: one key and one value scale per layer (calibrated on the first forward pass).
        self.k_scales, self.v_scales = k_scales, v_scales
        self.key_caches, self.value_caches = self.runner.key_caches, self.runner.value_caches
        self.cpu_key_caches = self.runner.cpu_key_caches
        self.cpu_value_caches = self.runner.cpu_value_caches
        self.compile = compile
        self.sampler = Sampler()
        #: ``(seqs, logits)`` of the latest step: ``seqs`` lists the ``(request, branch)`` of
        #: each logits row (one row per sequence whose last token the step computed: decode
        #: rows and completed prefills, the latter before their forks).
        self.last_step_logits: tuple[list[tuple[int, int]], torch.Tensor] | None = None
        self.max_waiting_requests = max_waiting_requests
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            watermark_blocks=self.watermark_blocks, preemption_mode=preemption_mode,
            enable_prefix_caching=self.enable_prefix_caching, num_blocks=self.num_blocks,
            max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes)
        self._next_seq_id = 0
        self._next_request_id = 0
        self._requests: dict[int, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of requests finished between steps
        self._touched: dict[int, Request] = {}
        self._collector = StatsCollector(self.num_blocks, self.block_size)
        self.reset_stats()

    # ------------------------------------------------------------------ properties
    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over all layers, keys and values (of this rank's KV heads
        under tensor parallelism)."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * elem

    @property
    def capacity_tokens(self) -> int:
        """KV positions the GPU pool holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    # ------------------------------------------------------------------ online API
    def reset_stats(self) -> None:
        """Start :attr:`stats` afresh (:meth:`generate` does it at its start)."""
        self.stats = self.scheduler.stats = self._collector.reset()

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def _check_request(self, prompt: list[int], params: SamplingParams, what: str) -> None:
        """``ValueError`` for a request that is invalid or could never fit the pool."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # fields may have been changed since construction
        if not prompt:
            raise ValueError(f"{what} is empty")
        vocab = getattr(self.config, "vocab_size", None)
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"{what} has token ids outside [0, {vocab})")
        mnt = params.max_new_tokens
        if not mnt:
            return
        # Every sequence of the request may need its own blocks (after a recompute
        # preemption, beams are prefilled separately).
        seqs = params.num_beams
        need = len(prompt) + mnt - 1
        blocks = seqs * -(-need // self.block_size)
        if blocks > self.num_blocks:
            beams = f" x {seqs} beams" if seqs > 1 else ""
            raise ValueError(
                f"{what} ({len(prompt)} tokens) with max_new_tokens={mnt} may need "
                f"{need} KV positions{beams} = {blocks} blocks, but the pool has only "
                f"{self.num_blocks} blocks of {self.block_size} ({self.capacity_tokens} "
                f"positions)")

    def _num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting_requests()

    def add_request(self, prompt_token_ids: Sequence[int],
                    params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id (for :meth:`abort` and the outputs of :meth:`step`).

        ``ValueError`` if it is invalid or could never fit the pool (its prompt plus
        ``max_new_tokens - 1`` positions, for each beam of a beam search);
        :class:`EngineOverloaded` if ``max_waiting_requests`` requests are waiting. Either way
        nothing changes."""
        params = SamplingParams() if params is None else params
        prompt = [int(t) for t in prompt_token_ids]
        self._check_request(prompt, params, "prompt_token_ids")
        if self.max_waiting_requests is not None \
                and self._num_waiting_requests() >= self.max_waiting_requests:
            self.stats.rejected_requests += 1
            raise EngineOverloaded(
                f"PagedEngine overloaded: {self._num_waiting_requests()} requests are waiting "
                f"(max_waiting_requests={self.max_waiting_requests}); retry after step() has "
                f"admitted some")
        seed = params.seed
        if seed is None:
            seed = self.tp.shared_seed(self.device)
        rid = self._next_request_id
        self._next_request_id += 1
        req = Request(rid, prompt, params, seed, self._stop_ids(params))
        self.stats.prompt_tokens += len(prompt)
        if params.max_new_tokens == 0:
            req.finished = True
            if req.beam is not None:
                req.beam.done = True
            self._pending.append(self._output(req))
            return rid
        first = Branch(self._new_id(), req, 0, prompt, [], self._generator(req, 0),
                       logprobs=self._logprobs_list(req))
        req.branches.append(first)
        self._requests[rid] = req
        self.scheduler.waiting.append(SeqGroup(req, [first]))
        return rid

    def _generator(self, req: Request, index: int) -> torch.Generator | None:
        if req.params.greedy or req.beam is not None:
            return None
        return branch_generator(req.seed, index, self.device)

    @staticmethod
    def _logprobs_list(req: Request) -> list[dict[int, float]] | None:
        return None if req.params.logprobs is None else []

    def has_unfinished_requests(self) -> bool:
        """Whether a request is waiting, running or swapped out."""
        return self.scheduler.has_unfinished()

    def abort(self, request_id: int) -> None:
        """Stop a request now, whether it is waiting, running or swapped out: its blocks are
        freed at once; the next :meth:`step` reports it with finish reason ``"abort"`` for its
        unfinished branches. No-op for a finished request; ``KeyError`` for an unknown id."""
        req = self._requests.get(request_id)
        if req is None:
            if isinstance(request_id, int) and 0 <= request_id < self._next_request_id:
                return  # finished (and reported) already
            raise KeyError(f"unknown request id {request_id!r}")
        bm = self.block_manager
        groups = self.scheduler.remove_request(req)
        for b in [b for g in groups for b in g.branches] + req.branches:
            if b.seq_id in bm:
                bm.free(b.seq_id)
            if b.finish_reason is None:
                b.finish_reason = "abort"
        req.aborted = req.finished = True
        self.stats.aborted_requests += 1
        self._touched.pop(req.request_id, None)
        self._pending.append(self._output(req))
        del self._requests[request_id]

    def step(self) -> list[RequestOutput]:
        """Run one engine step (one forward pass: decode rows and prompt chunks); returns a
        :class:`RequestOutput` for every request that got tokens or finished (aborted ones
        included). With nothing to run it returns the pending outputs only.

        An exception from the model leaves the pool empty: every request is dropped."""
        outputs, self._pending = self._pending, []
        if not self.has_unfinished_requests():
            return outputs
        try:
            with torch.no_grad():
                self._step()
        except BaseException:
            self._drop_everything()
            raise
        touched, self._touched = self._touched, {}
        for req in touched.values():
            if req.beam is not None and not req.finished:
                continue  # a beam search reports once, when it ends
            outputs.append(self._output(req))
            if req.finished:
                self._requests.pop(req.request_id, None)
        return outputs

    def _drop_everything(self) -> None:
        bm = self.block_manager
        for sid in bm.seq_ids():
            bm.free(sid)
        # Blocks registered by the failed step may never have had their K/V written.
        bm.reset_prefix_cache()
        self.scheduler.clear()
        self._requests.clear()
        self._touched = {}

    def _output(self, req: Request) -> RequestOutput:
        toks, reasons = req.token_ids()
        new = [t[r:] for t, r in zip(toks, req.reported, strict=True)]
        req.reported = [len(t) for t in toks]
        lps = req.logprobs()
        return RequestOutput(req.request_id, req.prompt, toks, new, req.finished, reasons, lps)

    def stream(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Run ``prompts`` (one ``params`` for all, or one per prompt) and yield their
        :class:`RequestOutput` s as tokens arrive. Requests are added as
        ``max_waiting_requests`` allows; every prompt is checked before any is added. Other
        requests of the engine progress too (their outputs are not yielded). Closing the
        iterator early aborts its unfinished requests."""
        prompts = [[int(t) for t in p] for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        else:
            params = list(params)
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            self._check_request(p, sp, f"prompt {i}")
        todo = deque(zip(prompts, params, strict=True))
        mine: set[int] = set()
        try:
            while todo or mine:
                while todo and (self.max_waiting_requests is None or
                                self._num_waiting_requests() < self.max_waiting_requests):
                    p, sp = todo.popleft()
                    mine.add(self.add_request(p, sp))
                for out in self.step():
                    if out.request_id in mine:
                        if out.finished:
                            mine.discard(out.request_id)
                        yield out
        finally:
            for rid in mine:
                if rid in self._requests:
                    self.abort(rid)
            if mine:
                self._pending = [o for o in self._pending if o.request_id not in mine]

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 max_new_tokens: int | None = None, *, n: int = 1,
                 params: SamplingParams | None = None) -> list[list[list[int]]]:
        """Generate for every prompt; returns ``result[i][j]``: the new token ids of branch
        ``j`` of prompt ``i`` (beam search: the ``n`` best beams, best first).

        ``params`` governs when given; otherwise greedy with ``max_new_tokens`` and ``n``
        (``n`` greedy branches are equal, but still run as separate sequences sharing the
        prompt's blocks). A branch ends after ``max_new_tokens`` tokens or at an EOS or stop
        token (included in its output). Runs on an idle engine (``RuntimeError`` otherwise)
        and resets :attr:`stats`; ``ValueError`` if a prompt is empty or could never fit the
        pool (nothing runs then). Built on :meth:`stream`."""
        if params is None:
            params = SamplingParams(
                max_new_tokens=SamplingParams.max_new_tokens if max_new_tokens is None
                else max_new_tokens, n=n)
        if self.has_unfinished_requests():
            raise RuntimeError("PagedEngine.generate needs an idle engine: requests added "
                               "with add_request are unfinished (step() them or abort them)")
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        for i, p in enumerate(prompts):
            self._check_request(p, params, f"prompt {i}")
        self.reset_stats()
        first = self._next_request_id
        results: list[list[list[int]]] = [[[] for _ in range(params.n)] for _ in prompts]
        for out in self.stream(prompts, params):
            if out.finished:
                results[out.request_id - first] = out.token_ids
        self.stats.elapsed_s = self._collector.elapsed()
        return results

    # ------------------------------------------------------------------ the step
    def _new_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _step(self) -> None:
        """schedule -> execute -> sample -> update."""
        sched = self.scheduler.schedule()
        if not sched.seqs:
            sch = self.scheduler
            raise RuntimeError(
                "PagedEngine: no request can be scheduled (waiting "
                f"{len(sch.waiting)}, swapped {len(sch.swapped)}, free blocks "
                f"{self.block_manager.num_free_blocks})")
        logits = self.runner.execute(sched)
        self.last_step_logits = ([(b.request.request_id, b.index)
                                  for g in sched.groups for b in g.branches], logits)
        self._update(sched, logits)
        rec = self._collector.record(sched, self.scheduler, self.block_manager)
        if self.step_callback is not None:
            self.step_callback(self, rec)

    def _update(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        """Turn each completed group's logits rows (in order) into tokens: sampling (forking a
        new request's branches first) or a beam-search step; finished branches free their
        blocks and leave ``running``."""
        bm = self.block_manager
        st = self.stats
        rows: list[int] = []
        sample_branches: list[Branch] = []
        per_group: list[list[Branch]] = []
        row = 0
        for group in sched.groups:
            req = group.request
            n = len(group.branches)
            if req.beam is not None:
                self._beam_step(group, logits[row: row + n])
                per_group.append([])
            elif not req.started:
                # The prompt's prefill: fork the other branches; each samples its own token.
                first = group.branches[0]
                for j in range(1, req.params.n):
                    child = Branch(self._new_id(), req, j, req.prompt, [],
                                   self._generator(req, j), num_computed=first.num_computed,
                                   logprobs=self._logprobs_list(req))
                    bm.fork(first.seq_id, child.seq_id)
                    st.forks += 1
                    req.branches.append(child)
                per_group.append(list(req.branches))
                rows.extend([row] * len(req.branches))
            else:
                per_group.append(group.branches)
                rows.extend(range(row, row + n))
            sample_branches.extend(per_group[-1])
            req.started = True
            self._touched[req.request_id] = req
            row += n
        toks: list[int] = []
        lps: list = []
        if sample_branches:
            every = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
            toks, lps = self.sampler(logits if every else logits[rows],
                                     [b.request.params for b in sample_branches],
                                     [b.generator for b in sample_branches])
        it = iter(zip(toks, lps, strict=True))
        running = self.scheduler.running
        done: set[int] = set()
        for group, branches in zip(sched.groups, per_group, strict=True):
            req = group.request
            if req.beam is not None:
                if req.finished:
                    done.add(id(group))
                continue
            new_groups = []
            for b in branches:
                tok, lp = next(it)
                b.output.append(tok)
                if b.logprobs is not None:
                    b.logprobs.append(lp)
                st.tokens_generated += 1
                if self._finish_if_done(b):
                    continue
                new_groups.append(SeqGroup(req, [b]))
            if all(b.finish_reason is not None for b in req.branches):
                req.finished = True
            # Sampling branches run on as groups of one, in the group's place.
            if len(new_groups) != 1 or new_groups[0].branches != group.branches:
                done.add(id(group))
                if new_groups:
                    self._replace(running, group, new_groups)
        if done:
            running[:] = [g for g in running if id(g) not in done]

    @staticmethod
    def _replace(running: list[SeqGroup], group: SeqGroup, new: list[SeqGroup]) -> None:
        """Put ``new`` right after ``group`` in ``running`` (``group`` leaves afterwards)."""
        i = next(i for i, g in enumerate(running) if g is group)
        running[i + 1:i + 1] = new

    def _finish_if_done(self, b: Branch) -> bool:
        """After a token was appended: free the branch if it is done."""
        p = b.request.params
        tok = b.output[-1]
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            b.finish_reason = "stop"
        elif len(b.output) >= p.max_new_tokens:
            b.finish_reason = "length"
        else:
            return False
        self.block_manager.free(b.seq_id)
        return True

    def _beam_step(self, group: SeqGroup, logits: torch.Tensor) -> None:
        """One beam-search step of a group: the next beams fork from their parents (a
        parent's first child continues the parent's sequence, later ones share its blocks
        through ``fork``), parents without children are freed. Before the first step the
        group is the prompt alone, parent of every beam."""
        bm = self.block_manager
        req = group.request
        beam = req.beam
        k = beam.num_beams
        parents = group.branches
        if not req.started:
            parents = parents * k
            logits = logits.expand(k, -1)
        par, toks = beam.step(logits, [p.output for p in parents])
        self.stats.tokens_generated += k
        if beam.done:
            for sid in {p.seq_id for p in parents}:
                bm.free(sid)
            group.branches = []
            req.finished = True
            return
        used: set[int] = set()
        children: list[Branch] = []
        for j, pi in enumerate(par):
            p = parents[pi]
            if p.seq_id not in used:
                used.add(p.seq_id)
                p.index = j
                children.append(p)
            else:
                child = Branch(self._new_id(), req, j, req.prompt, list(p.output),
                               num_computed=p.num_computed)
                bm.fork(p.seq_id, child.seq_id)
                self.stats.forks += 1
                children.append(child)
        for sid in {p.seq_id for p in parents} - used:
            bm.free(sid)
        for b, tok in zip(children, toks, strict=True):
            b.output.append(tok)
        group.branches = children
