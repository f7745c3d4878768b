"""A paged-KV-cache generation engine for Hugging Face ``transformers`` decoder-only models.

:class:`PagedEngine` generates for many requests at once over one pool of KV-cache blocks:

* it owns a :class:`~paged_ops.block_manager.BlockManager` and one ``(key_cache, value_cache)``
  pair per layer from :func:`paged_ops.allocate_kv_cache`;
* the model is *not* re-implemented: the engine registers an attention function with
  transformers' public extension point (``AttentionInterface.register``) and switches the model
  to it (``model.set_attn_implementation``). Every forward pass gets the step's paged metadata
  (slot mapping, block tables, sequence lengths) through a ``paged_ctx`` keyword argument that
  transformers forwards to the attention function of every layer (:mod:`.attention`);
* each step is one forward pass (:mod:`.scheduler` decides it, :mod:`.runner` runs it): the
  running sequences' decode rows first, then prompt chunks up to ``max_num_batched_tokens``
  (chunked prefill: a long prompt is prefilled over several steps while the others keep
  decoding). Every layer writes the step's keys/values into the paged cache and attends over
  it with ``torch.ops.paged.attention`` (``query_start_loc`` for several rows per sequence).
  Pool exhaustion preempts the most recently admitted group, by recompute or by swapping to a
  CPU pool. No generated token is ever lost;
* tokens (:mod:`.sampling`, :mod:`.beam`): greedy, or sampled in fp32 (temperature, top-k,
  top-p), batched over the step's rows, with a generator per branch, so a branch's tokens do
  not depend on its batches or on chunking; optional logprobs;
  ``n > 1`` branches share the prompt's blocks (``BlockManager.fork``) and diverge by
  copy-on-write (``paged_ops.copy_blocks``); beam search equals transformers' and forks the
  surviving beams from their parents each step, freeing the dropped ones;
* requests come offline (:meth:`PagedEngine.generate`) or online
  (:meth:`PagedEngine.add_request`, :meth:`PagedEngine.step`, :meth:`PagedEngine.abort`,
  :meth:`PagedEngine.stream`), with :class:`EngineOverloaded` beyond
  ``max_waiting_requests``;
* ``enable_prefix_caching=True`` shares the KV blocks of common prompt prefixes;
  ``kv_cache_dtype=torch.float8_e4m3fn`` stores the KV cache in fp8 with per-tensor scales
  (:mod:`.fp8`).

Example::

    from transformers import AutoModelForCausalLM
    from paged_ops.engine import PagedEngine, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(...)
    engine = PagedEngine(model, num_blocks=512, block_size=16)
    outs = engine.generate([[1, 2, 3], [4, 5]], params=SamplingParams(
        max_new_tokens=32, temperature=0.8, top_p=0.95, n=2, seed=0))
    outs[0][1]          # the new token ids of branch 1 of prompt 0
    engine.stats        # steps, preemptions, cow_copies, peak blocks, timeline, ...

Requires ``transformers`` (the optional ``[hf]`` extra); it is imported only when an engine is
created.
"""

from .attention import (
                        ATTN_IMPLEMENTATION,
                        StepContext,
                        paged_attention_forward,
                        register_paged_attention,
)
from .core import EngineOverloaded, PagedEngine
from .fp8 import KV_SCALE_HEADROOM
from .request import RequestOutput
from .sampling import SamplingParams
from .stats import EngineStats, StepRecord

__all__ = ["ATTN_IMPLEMENTATION", "KV_SCALE_HEADROOM", "EngineOverloaded", "EngineStats",
           "PagedEngine", "RequestOutput", "SamplingParams", "StepContext", "StepRecord",
           "paged_attention_forward", "register_paged_attention"]
