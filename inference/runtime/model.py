"""A backbone with its heads, and the three kinds of forward decoding needs.

Loading both from disk is ``inference.loading.load_medusa``; ``attach_heads`` wraps heads already
in memory. ``MedusaModel`` refuses attention implementations that ignore custom 4D tree masks
(sdpa and eager apply them; flash-attention kernels do not), backbones positioned by ALiBi, and backbones with
layers other than full attention or sliding-window attention decoded within its window (``check_backbone_config``:
the config alone decides it, so the commands refuse it before the weights load), and moves an sdpa backbone to
``runtime.attention``'s function (the same math, grouped-query attention in the kernel on CPU).

``MedusaModel`` runs the decoder body (not ``*ForCausalLM.forward``) so the 49k-vocabulary
lm_head is applied only where logits are needed: the last prompt position, the tree nodes.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..backbone import HiddenStateTap, eos_token_ids, logit_scaling, scale_logits, text_config
from ..chat_template import template_args
from .attention import NAME as DECODING_ATTENTION, use_decoding_attention
from .batch_cache import RaggedKVCache
from .cache import TreeKVCache
from .static_batch import StaticRaggedKV
from .static_steps import StaticKV, StaticSteps
from .kernel_plan_cache import KernelPlanCache
from .linear_kernels import route_linear_kernels
from .rope_switch import per_position_longrope
from ..errors import UserError

_MASKING_ATTENTION = ("sdpa", "eager", DECODING_ATTENTION)
KERNEL_MODES = ("auto", "measure", "stock")


@dataclass
class MedusaModel:
    """A frozen backbone, its tokenizer and Medusa heads on one device, ready to decode.

    ``heads`` may be any module with ``spec.num_heads``, ``head_logits(hidden, k)`` and
    ``to_vocab_ids(ids)`` (``MedusaHeads``, or a stub in tests).
    """

    model: Any
    tokenizer: Any
    heads: Any
    eos_token_ids: list[int] = field(default_factory=list)
    adapter_applied: bool = False  # a Medusa-2 LoRA adapter was merged into ``model`` at load time
    kernel_plans: list = field(default_factory=list)  # linear_kernels routing (CPU), empty = stock kernels
    static: Optional[StaticSteps] = None  # static-shape steps (graphs=): runtime.static_steps.apply_graphs

    def __post_init__(self):
        self.model.eval()
        self.model.requires_grad_(False)
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl not in _MASKING_ATTENTION:
            raise UserError(f"the backbone uses attention {impl!r}, which ignores tree masks; "
                            "load it with attn_implementation='sdpa'")
        use_decoding_attention(self.model)   # sdpa -> the same, minus a KV-head copy per masked call on CPU
        base = getattr(self.model, self.model.base_model_prefix, None)
        if base is None or self.model.get_output_embeddings() is None:
            raise UserError(f"{type(self.model).__name__} has no decoder body + lm_head; Medusa needs a causal LM")
        self.body, self.lm_head = base, self.model.get_output_embeddings()
        self.config = cfg = text_config(self.model)
        check_backbone_config(cfg)   # a model object passed in (the commands check the config before loading)
        self._logit_scale, self._softcap = logit_scaling(self.model)
        # transformers 5.x calls the cache argument ``cache``; 4.x called it ``past_key_values``.
        params = inspect.signature(self.body.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if "position_ids" not in params:   # a draft node must attend at its depth's position, not its index's
            raise UserError(f"{type(self.body).__name__} takes no position ids, which the tree decoder gives every "
                            "draft node: this backbone cannot be tree-decoded")
        if not self.eos_token_ids:
            self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self._rope_switch = per_position_longrope(self.body)

    # -- properties --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def num_heads(self) -> int:
        return self.heads.spec.num_heads if self.heads is not None else 0

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def max_positions(self) -> Optional[int]:
        return position_limit(self.config)

    def new_cache(self, capacity: int) -> TreeKVCache | StaticKV:
        """A KV cache of ``capacity`` entries: a view of the static buffer with graphs (``static``), unless
        a fixed static capacity is too small (that request then decodes on the dynamic cache)."""
        view = self.static.cache(capacity) if self.static is not None else None
        return view if view is not None else TreeKVCache(self.config.num_hidden_layers, capacity)

    def new_batch_cache(self, batch: int, capacity: int, ragged: str = "compact") -> RaggedKVCache:
        """A batch's KV cache: compact rows on the static buffer with graphs (``static``), else its own."""
        view = self.static.batch_cache(batch, capacity) if self.static is not None and ragged == "compact" else None
        return view if view is not None else RaggedKVCache(self.config.num_hidden_layers, batch, capacity,
                                                           self.device, ragged)

    def on_static(self, cache) -> bool:
        """Whether ``cache`` is a view of the static buffer, not a dynamic cache a request fell back to (beyond a
        fixed capacity, or while another thread holds the buffer): a drafter's own static cache goes with it."""
        return isinstance(cache, (StaticKV, StaticRaggedKV))

    def stepping(self):
        """The context of a decoding step (after the prompt): LongRoPE backbones switch to their long factors per
        position there, as one-token decoding does (``rope_switch``); nothing changes for other backbones."""
        return self._rope_switch.stepping() if self._rope_switch is not None else nullcontext()

    # -- compute -----------------------------------------------------------------------
    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
               attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Last hidden states (after the final norm) [1, n, H]; appends n entries to ``cache``."""
        if isinstance(cache, (StaticKV, StaticRaggedKV)):
            return self.static.forward(cache, input_ids, position_ids, attention_mask)[0]
        return self.body_hidden(input_ids, position_ids, cache, attention_mask)

    def body_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
                    attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder body's forward as transformers runs it (``hidden`` without static steps).

        Positions are capped at the backbone's last one. Every request fits its positions (``check_budget``), so
        only draft nodes past the budget reach beyond it, and their outputs are never emitted; but a learned
        position table indexes out of range there, and dynamic RoPE picks its frequencies for the whole forward
        from its largest position: one such node re-rotated every token of the forward, accepted ones included,
        so output changed near the limit. A device op: nothing read on the host, capture-safe."""
        if self.max_positions:
            position_ids = position_ids.clamp(max=self.max_positions - 1)
        with self._rope_switch.runtime() if self._rope_switch is not None else nullcontext():
            out = self.body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=True, **{self._cache_kw: cache})
        return out.last_hidden_state

    def aux_tap(self, layer_ids) -> HiddenStateTap:
        """A tap reading hidden_states[i] for ``layer_ids`` during ``hidden_aux`` (EAGLE-3's features)."""
        return HiddenStateTap(self.model, layer_ids)

    def hidden_aux(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, tap: HiddenStateTap,
                   attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` plus the tap's layers from the same forward: ([1, n, H], [1, n, len(ids) * H])."""
        if isinstance(cache, (StaticKV, StaticRaggedKV)):
            return self.static.forward(cache, input_ids, position_ids, attention_mask, tap)
        with tap:
            h = self.hidden(input_ids, position_ids, cache, attention_mask)
        return h, tap.features()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scale_logits(self.lm_head(hidden), self._logit_scale, self._softcap)

    def route_kernels(self, plan_cache: Optional[Path] = None, remeasure: bool = False) -> None:
        """Let each linear of backbone and heads pick its fastest CPU product per row count
        (``linear_kernels``; measured here, ~8-12 s for SmolLM2, or read from ``plan_cache`` where an
        earlier launch on this machine measured the same shapes (``kernel_plan_cache``; ``remeasure``:
        measure all the same); prepacked weight copies where they win, which take that memory again).
        No-op off CPU."""
        cache = KernelPlanCache(plan_cache) if plan_cache is not None else None
        self.kernel_plans = route_linear_kernels(self.model, extra=[self.heads] if self.heads is not None else [],
                                                 cache=cache, remeasure=remeasure)

    def head_logits(self, hidden: torch.Tensor, count: Optional[int] = None) -> list[torch.Tensor]:
        """The first ``count`` (default: all) heads' logits at ``hidden`` (local vocabulary for
        truncated heads). A tree of depth d needs only heads 0..d-1; each costs a projection."""
        n = self.num_heads if count is None else min(count, self.num_heads)
        return [self.heads.head_logits(hidden, k) for k in range(n)]

    def draft_tree(self, buf, h_last: torch.Tensor, root, cfg, gen) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The heads' draft of tree ``buf`` (``heads.draft_tree``: tokens of nodes 1..N-1, draft
        distributions or None) from ``h_last`` [H] or a batch's [B, H] and the root token(s). With static
        steps, a deterministic draft (every one but draft=sampled's) is a captured call per tree
        (``captured_calls``): the root goes in as a tensor, a host number would be frozen into the graph."""
        if self.static is None or (cfg.mode == "sample" and cfg.draft == "sampled"):
            return self.heads.draft_tree(buf, h_last, root, cfg, gen, self.vocab_size)
        # an int root filled on the device: a copy from host memory would wait for the work queued before it
        root = (torch.full((), root, dtype=torch.long, device=h_last.device) if isinstance(root, int)
                else torch.as_tensor(root, dtype=torch.long, device=h_last.device))

        def draft(h, r):
            return self.heads.draft_tree(buf, h, r, cfg, None, self.vocab_size)[:1]

        rows = h_last.shape[0] if h_last.dim() > 1 else None
        name = f"draft{buf.shape_key}:{id(self.heads):x}"    # heads swapped on the model: another graph
        (cand,) = self.static.calls.run(name, draft, (h_last, root), rows, keep=(buf, self.heads))
        return cand, None

    def encode_chat(self, prompt: str | list[dict], system: Optional[str] = None) -> list[int]:
        """Token ids of a user prompt (or a message list) with the chat template applied."""
        if self.tokenizer is None:
            raise UserError("this model was loaded without a tokenizer; pass token ids instead")
        return chat_ids(self.tokenizer, prompt, system)


def check_backbone_config(config, name: Optional[str] = None) -> None:
    """What the tree decoder refuses in a backbone's config alone, its weights unread (``name``: the backbone as
    the user gave it, for the message): ALiBi positions, and a layer that attends otherwise than fully and causally
    (``attention_kinds``) but for sliding-window layers of a known window. Tree masks and the KV cache give every
    layer every position, so such a layer would see what the backbone itself never sees, and the decoded text would
    no longer be the backbone's; within a sliding window full attention is the same, and requests are kept within
    it (``position_limit``: Gemma-2/3, gpt-oss, Command-R7B). ``MedusaModel`` checks a model object it is given; the
    commands check the config before the weights load (``cli_checks.check_options_fit``)."""
    cfg = text_config(config)
    who = f"backbone {name!r}" if name else f"the backbone ({getattr(cfg, 'model_type', None) or type(cfg).__name__})"
    if uses_alibi(cfg):
        raise UserError(f"{who} positions its tokens by ALiBi biases, which the tree decoder does not support (a draft "
                        "node's position is its depth's, given as position ids, which ALiBi ignores)")
    window = getattr(cfg, "sliding_window", None)
    decodable = {"full_attention", "sliding_attention"} if is_count(window, 1) else {"full_attention"}
    other = sorted(attention_kinds(cfg) - decodable)
    if other:
        raise UserError(f"{who} has {', '.join(other)} layers, which the tree decoder does not support (full or "
                        "sliding-window attention only)")


def uses_alibi(cfg) -> bool:
    """Whether a decoder config positions tokens by ALiBi biases (transformers builds them from the key's index in the
    sequence, not from position ids): every Bloom, Falcon with ``alibi``, MPT unless its ``attn_config`` turns it off."""
    attn = getattr(cfg, "attn_config", None)
    attn_alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", None)
    return (getattr(cfg, "model_type", None) == "bloom" or getattr(cfg, "alibi", None) is True
            or attn_alibi is True)


def attention_kinds(cfg) -> set[str]:
    """The kinds of attention a decoder config's layers use, as transformers names them (``layer_types``:
    full_attention, sliding_attention, linear_attention ...). A config without ``layer_types`` (Mistral-7B-v0.1,
    Starcoder2, Phi-3-mini-4k: every layer within one ``sliding_window``) counts as full attention: its requests are
    kept within the window instead (``position_limit``)."""
    layer_types = getattr(cfg, "layer_types", None)
    return {str(t) for t in layer_types} if layer_types else {"full_attention"}


def position_limit(cfg) -> Optional[int]:
    """The positions a request (prompt + new tokens) may fill for the tree decoder to decode as the backbone does:
    ``max_position_embeddings``, or a shorter ``sliding_window`` that some layers attend within (``layer_types``
    naming sliding_attention: Gemma-2/3, gpt-oss) or every layer (a config without ``layer_types``: Mistral-7B-v0.1;
    transformers' mask lets token i see j when i - j < window). Within the window sliding and full attention are the
    same; beyond it the tree decoder's masks and cache would give those layers positions the backbone never sees, so
    a request past it is refused like one past the positions. None: no limit known."""
    cfg = text_config(cfg)
    positions = getattr(cfg, "max_position_embeddings", None)
    positions = positions if is_count(positions, 1) else None
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "layer_types", None):
        slides = is_count(window, 1) and "sliding_attention" in attention_kinds(cfg)
    else:
        slides = is_count(window, 1) and getattr(cfg, "use_sliding_window", True) is not False
    if slides and (positions is None or window < positions):
        return window
    return positions


def positions_named(cfg) -> str:
    """How a refusal names ``position_limit``: "N positions", or its sliding window when that is what limits."""
    limit = position_limit(cfg)
    positions = getattr(text_config(cfg), "max_position_embeddings", None)
    if limit is not None and limit != positions:
        return f"{limit}-token sliding window (decoded exactly only within it)"
    return f"{limit} positions"


def is_count(value, low: Optional[int] = 0) -> bool:
    """An int (never a bool) of at least ``low`` (None: any)."""
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def chat_ids(tokenizer, prompt: str | list[dict], system: Optional[str] = None, whose: str = "") -> list[int]:
    """``MedusaModel.encode_chat`` with a tokenizer alone (a prompt checked before the weights load; ``whose``: the
    template's owner, for the message)."""
    if not isinstance(prompt, (str, list, tuple)) or (system is not None and not isinstance(system, str)):
        raise UserError(f"a prompt is text or a list of chat messages (and a system message text), got "
                        f"{type(prompt if not isinstance(prompt, (str, list, tuple)) else system).__name__}")
    if not (prompt.strip() if isinstance(prompt, str) else prompt):   # as the commands refuse a blank prompt=
        raise UserError("the prompt is empty: give the user's text (or a list of chat messages)")
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system:
        msgs = [{"role": "system", "content": system}] + msgs
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer{whose} has no chat template, and prompts are rendered as chats: give a chat "
                        "model's backbone (an instruct model), or in Python pass token ids (tokenizer(text).input_ids)")
    from jinja2 import TemplateError   # lazy: transformers' chat templates run on it, only when one is applied

    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **template_args(tokenizer))
    except TemplateError as e:   # the template's own refusal (Gemma's "System role not supported")
        raise UserError(f"the chat template{whose} refuses the prompt: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def kv_bytes_per_token(m: MedusaModel) -> int:
    """Bytes one token occupies in ``m``'s KV cache (all layers), as the backbone's attention really caches it: one
    token run into a one-entry cache, whose buffers are then summed (once per model). A formula from the config
    counts keys and values per KV head, which latent attention (DeepSeek's MLA: one compressed latent plus a shared
    rotary key per layer in transformers 5) does not store: 128 heads x 2 x 64 against 512 + 64 per layer."""
    measured = getattr(m, "_kv_token_bytes", None)
    if measured is None:
        cache = TreeKVCache(m.config.num_hidden_layers, 1)
        ids = torch.zeros(1, 1, dtype=torch.long, device=m.device)
        with torch.no_grad():
            m.body_hidden(ids, ids, cache)
        measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer._k, layer._v)
                       if t is not None)
        m._kv_token_bytes = measured
    return measured


def apply_kernels(m: MedusaModel, kernels: str, plan_cache: Optional[Path] = None) -> MedusaModel:
    """``auto``: route the model's linears (``MedusaModel.route_kernels``), with the choices ``plan_cache``
    holds for this machine where it has them; ``measure``: route measuring every choice afresh (and store
    them in ``plan_cache``); ``stock``: leave them."""
    check_kernels(kernels)
    if kernels in ("auto", "measure"):
        m.route_kernels(plan_cache, remeasure=kernels == "measure")
    return m


def check_kernels(kernels: str) -> None:
    if kernels not in KERNEL_MODES:
        raise UserError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {kernels!r}")
