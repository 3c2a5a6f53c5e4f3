"""Draft-model speculative sampling, and the step loop every chain-style method shares.

Draft-model speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batch size 1:
  1. the root is the token the target already chose (prefill or the previous step's bonus);
  2. the draft model, a smaller causal LM with the target's tokenizer, proposes K tokens
     x_1..x_K one forward at a time, each from its own distribution q_i (the argmax in
     greedy/typical mode), each fed to the next forward on the device: nothing is read until the verdict,
     which brings the drafts with it (one host read a step; on a GPU each read idles the device);
  3. the target scores root, x_1..x_K in ONE forward (a chain: position past+i, causal mask),
     giving p_1..p_{K+1};
  4. greedy: accept the longest prefix with x_i = argmax p_i, bonus = argmax p_{n+1}
     (token-identical to plain greedy decoding). sample: accept x_i with probability
     min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the next token from
     normalize(max(0, p_i - q_i)) and stop; if all K are accepted draw a bonus from p_{K+1}.
     Every emitted token then follows p exactly, whatever the draft (decoding verifies with ``verify``'s
     "sampled" rule, this rule on a chain, at batch 1 as in batches);
     typical: Medusa's lossy rule on the chain (``verify.verify``);
  5. both KV caches roll back to prompt + accepted tokens (``TreeKVCache.truncate``). The draft
     never ran x_K, so after a fully accepted step it first catches up on x_K and the new root,
     in one forward.
Tokens per step (tau) = accepted + 1; proposed per step = K. ``adaptive`` moves K like
transformers' "heuristic" schedule: +2 after a fully accepted step, -1 otherwise, within 1..2K.

Draft = another checkpoint (``load_draft("path or hub id")``; its vocabulary, token strings and
special tokens must equal the target's, or it is refused), or a self-draft
(``load_draft("self:4")``): the target's first n decoder layers + its final norm + lm_head.
The self-draft is a shallow copy of the target's module objects that shares every weight
tensor, so it costs no download and no parameter memory, only its own (n-layer) KV cache. It
is untrained for the job (early-exit hidden states are not what the final norm/lm_head
expect), so its acceptance is low unless n is close to the full depth. A draft's forwards after its prompt run in
its own ``stepping()``: a LongRoPE draft checkpoint then rotates per position and captures its steps as the target
does (its steps ran under the prompt rule, never captured).

``verify_chain`` (one forward over root + proposal, verification through ``verify.verify`` with
a chain tree, cache roll-back) is how prompt lookup checks its guesses; ``chain_sampling`` is the
sampling rule every fixed-guess method verifies with.
"""

from __future__ import annotations

import copy
import dataclasses

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import backbone as backbones   # backbones.load_backbone looked up when called (tests replace it)
from ..errors import UserError
from ..runtime.batch_cache import RaggedKVCache, pad_layout
from ..runtime.batch_decode import BatchTreeDecoder, batch_capacity, root_only
from ..runtime.decode import prefill_token, seeded_generator
from ..runtime.graph_capture import to_device
from ..runtime.model import MedusaModel, check_backbone_config
from ..runtime.speculation import ScheduleCursor, SpeculationSchedule, draft_tokens, fixed, tree_label
from ..runtime.tree import MedusaTree, TreeBuffers, chain_tree
from ..runtime.verify import SamplingConfig, target_probs, verify
from .chain_choice import ChainShape
from .registry import Costs, Method, extra_parameters, kv_bytes_per_token, option, register

# -- shared plumbing ----------------------------------------------------------------------
_CHAINS: dict[int, object] = {}

def chain_buffers(length: int, device) -> TreeBuffers:
    """Tree buffers of a chain of ``length`` tokens (root included), built once per length/device."""
    if length not in _CHAINS:
        _CHAINS[length] = chain_tree(length)
    return _CHAINS[length].buffers(device)

def check_chain_schedule(schedule, most: int, key: str) -> None:
    """A chain schedule holds chains (or None) of at most ``most`` draft tokens; one line otherwise."""
    if schedule is None:
        return
    if not isinstance(schedule, SpeculationSchedule):
        raise UserError(f"a chain schedule must be a SpeculationSchedule (batch size -> chain_tree(k + 1) or "
                        f"None), got {type(schedule).__name__}")
    for b, choice in schedule.choices.items():
        if choice is not None and (not isinstance(choice, MedusaTree) or choice.num_nodes != choice.max_depth + 1):
            raise UserError(f"the chain schedule's choice at batch {b} ({tree_label(choice)}) is not a chain: give "
                            "chain_tree(k + 1) or None (plain) per batch size")
        if draft_tokens(choice) > most:
            raise UserError(f"the chain schedule's choice at batch {b} ({tree_label(choice)}) drafts more than "
                            f"{key}={most} tokens: raise {key} or give a shorter chain")


def chain_cursor(schedule, most: int) -> ScheduleCursor:
    """The cursor of a batched chain drafter: the schedule's lengths, or ``most`` at every batch size."""
    return ScheduleCursor(schedule if schedule is not None else fixed(chain_tree(most + 1)))


def chain_sampling(cfg: SamplingConfig) -> SamplingConfig:
    """The config ``verify`` gets for a deterministic proposal. In sample mode the "topk" rule
    (draw Y ~ p, accept the child that carries Y) is exact for point-mass proposals, which is
    what a chain of fixed guesses is (see verify.py); "sampled" would need a q we do not have."""
    return cfg if cfg.draft == "topk" else dataclasses.replace(cfg, draft="topk")

def _forward_chain(m: MedusaModel, tokens: list[int] | torch.Tensor, past: int, cache) -> torch.Tensor:
    """Run ``tokens`` (a list, or a device tensor [n]: nothing read) at positions past.. (causal) into ``cache``;
    returns hidden [n, H]."""
    ids = tokens.reshape(1, -1) if isinstance(tokens, torch.Tensor) else to_device([tokens], m.device)
    buf = chain_buffers(ids.shape[1], m.device)
    return m.hidden(ids, (buf.position_offsets + past)[None], cache, buf.additive_mask(past, m.dtype))[0]

def verify_chain(m: MedusaModel, cache, past: int, root: int, proposal: list[int] | torch.Tensor, cfg: SamplingConfig,
                 gen: Optional[torch.Generator], draft_probs: Optional[torch.Tensor] = None) -> tuple[list[int], int]:
    """Score root + a proposal (a list, or a device tensor [k]) in one target forward, keep the accepted prefix
    in ``cache``; one host read (the verdict, which brings the accepted tokens). A fixed proposal is verified as a
    point mass (``chain_sampling``); one drawn from ``draft_probs`` [k, V] (sample mode) by the "sampled" rule, which on
    a chain is speculative sampling, as the batched draft model verifies.

    Returns (accepted proposal tokens, bonus token); afterwards ``cache`` holds
    ``past + 1 + len(accepted)`` entries (prefix, root, accepted tokens).
    """
    if not isinstance(proposal, torch.Tensor):
        proposal = to_device(list(proposal), m.device, torch.long)
    tokens = torch.cat([torch.full((1,), int(root), dtype=torch.long, device=m.device), proposal])   # no host copy
    h = _forward_chain(m, tokens, past, cache)
    buf = chain_buffers(tokens.numel(), m.device)
    rule = chain_sampling(cfg) if draft_probs is None else dataclasses.replace(cfg, draft="sampled")
    verdict = verify(buf, tokens, m.logits(h), rule, draft_probs, gen)
    n = len(verdict.path) - 1
    cache.truncate(past + 1 + n)
    return verdict.accepted_tokens(tokens), verdict.bonus

# -- the draft model ----------------------------------------------------------------------
MAX_DRAFT_K = 64   # a chain is verified in one forward pass: longer ones only cost (and a typo allocates GBs)


@dataclass
class DraftSettings:
    """The draft model (``load_draft``'s spec), k draft tokens per step, adaptive k."""

    draft: Any = option("self:4", "draft", "self:N (the backbone's first N layers) | a path or hub id | a model")
    k: int = option(4, "draft_k", f"draft tokens per step (at most {MAX_DRAFT_K})")
    adaptive: bool = option(False, "draft_adaptive", "move k within 1..2k from the last step's acceptance")
    trust_remote_code: bool = option(False, "trust_remote_code", "for a draft checkpoint with custom code")
    # batches only: chains of at most k tokens per batch size (medusa-eval sizes them); None: k everywhere
    schedule: Any = option(None, None, "a SpeculationSchedule of chains (batched decoding)")

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_DRAFT_K:
            raise UserError(f"draft_k (draft tokens per step) must be an integer in 1..{MAX_DRAFT_K}, got {self.k!r}")
        parse_self_draft(self.draft)  # a malformed self:N fails before any model is loaded
        check_chain_schedule(self.schedule, self.k, "draft_k")

    def check_backbone(self, config, name: Optional[str] = None) -> None:
        """Refuse, from the backbone's config alone (before its weights load), a self:N deeper than it, and a draft
        checkpoint (``check_draft_checkpoint``) that cannot load or has another vocabulary, or (the backbone's
        ``name`` given) another tokenizer."""
        layers = parse_self_draft(self.draft)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        total = getattr(text, "num_hidden_layers", None)
        if layers and isinstance(total, int) and layers > total:
            # the default self:4 meets a shallow (debug) backbone under compare=true, where draft= was never given
            default = " (the default)" if self.draft == DraftSettings.draft else ""
            raise UserError(f"draft={self.draft}{default} takes more layers than the backbone's {total}: give "
                            f"draft=self:N with N in 1..{total}, or a draft checkpoint")
        if layers is None and isinstance(self.draft, str):
            check_draft_checkpoint(self.draft, getattr(text, "vocab_size", None), self.trust_remote_code, name)

    @property
    def k_max(self) -> int:
        return 2 * self.k if self.adaptive else self.k

    @property
    def extra_kv_tokens(self) -> int:
        """Target cache slots beyond prompt + max_new_tokens (one verification chain); the draft's
        own cache holds prompt + max_new_tokens + this + 1."""
        return self.k_max + 1

def self_draft(target: MedusaModel, num_layers: int) -> MedusaModel:
    """The target's first ``num_layers`` decoder layers + final norm + lm_head, sharing weights.

    Shallow copies of the causal-LM wrapper and the decoder body get their own module dict,
    a config saying ``num_layers`` layers, and a ModuleList holding the first layers (the same
    objects, so no tensor is copied). transformers' decoders loop over
    ``layers[:config.num_hidden_layers]`` and build masks from the config, so the stock
    forward runs the shallow stack.
    """
    model = target.model
    prefix = model.base_model_prefix
    body = getattr(model, prefix)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"{type(body).__name__} keeps no `layers` list: a self-draft needs a standard decoder stack")
    total = len(layers)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise UserError(f"a self-draft takes 1..{total} of the backbone's layers, got {num_layers!r}")
    cfg = copy.deepcopy(body.config)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    cfg.num_hidden_layers = num_layers
    short_body = copy.copy(body)
    short_body._modules = dict(body._modules)       # its own module table: the target's stays intact
    short_body.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    short_body.config = cfg
    short = copy.copy(model)
    short._modules = dict(model._modules)
    setattr(short, prefix, short_body)
    short.config = cfg
    draft = MedusaModel(model=short, tokenizer=target.tokenizer, heads=None, eos_token_ids=list(target.eos_token_ids))
    draft.self_draft_layers = num_layers
    return draft

def check_draft_checkpoint(name: str, target_vocab: Optional[int], trust_remote_code: bool = False,
                           target: Optional[str] = None) -> None:
    """A draft checkpoint (a path or hub id) refused, before any weights load, where ``load_draft`` would only
    refuse it after the target's: one it cannot find or read the config of (``backbone.load_backbone_config``'s
    refusals), a vocabulary other than the target's (``target_vocab``; ``check_vocabulary``), a tokenizer it
    cannot load, or (``target``: the target's name) one that is not the target's (``check_same_tokenizer``: same
    size, other ids). The configs and the tokenizers alone are read."""
    try:
        config = backbones.load_backbone_config(name, trust_remote_code=trust_remote_code)
        check_backbone_config(config, name)   # the draft decodes on the same runtime as the target
    except UserError as e:
        raise UserError(f"draft={name}: {e}") from None
    text = backbones.text_config(config)
    if isinstance(target_vocab, int) and isinstance(getattr(text, "vocab_size", None), int):
        check_vocabulary(target_vocab, text.vocab_size)
    try:
        tokenizer = backbones.load_tokenizer(name, trust_remote_code=trust_remote_code)
    except (UserError, OSError, ValueError) as e:   # transformers' own words span lines: one line here
        words = " ".join(str(e).split()) or type(e).__name__
        raise UserError(f"draft={name}: its tokenizer cannot be loaded ({words})") from None
    if target is not None:
        try:
            own = backbones.load_tokenizer(target, trust_remote_code=trust_remote_code)
        except (UserError, OSError, ValueError):
            return   # the target's own load says why, in its words
        check_same_tokenizer(own, tokenizer)


def check_vocabulary(target: int, draft: int) -> None:
    """A draft's vocabulary has the target's size (one line otherwise)."""
    if target != draft:
        raise UserError(f"the draft model's vocabulary has {draft} entries, the target's {target}: "
                        "a draft must use the target's tokenizer")


def check_draft_compatible(target: MedusaModel, draft: MedusaModel) -> None:
    """Refuse a draft that does not speak the target's tokens (one line, ``UserError``)."""
    check_vocabulary(target.vocab_size, draft.vocab_size)
    check_same_tokenizer(target.tokenizer, draft.tokenizer)


def check_same_tokenizer(tt, dt) -> None:
    """The draft's tokenizer ``dt`` maps tokens to the target's (``tt``) ids, with its special tokens (one line
    otherwise); nothing to check where either is unknown."""
    if tt is None or dt is None or tt is dt:
        return
    if tt.get_vocab() != dt.get_vocab():
        raise UserError("the draft model's tokenizer maps tokens to other ids than the target's: "
                        "a draft must use the target's tokenizer")
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    for name in specials:
        if getattr(tt, name, None) != getattr(dt, name, None):
            raise UserError(f"the draft model's tokenizer has another {name} ({getattr(dt, name, None)} vs "
                            f"{getattr(tt, name, None)}): a draft must use the target's tokenizer")
    if sorted(tt.all_special_ids) != sorted(dt.all_special_ids):
        raise UserError("the draft model's tokenizer has other special tokens than the target's: "
                        "a draft must use the target's tokenizer")


def parse_self_draft(spec) -> Optional[int]:
    """The layer count of a ``self:N`` spec (0 for bare ``self``: a quarter of the layers), None
    for any other spec; a malformed ``self...`` spec is a ``UserError`` (checked before loading)."""
    if not isinstance(spec, str) or not (spec == "self" or spec.startswith("self:")):
        return None
    arg = spec.partition(":")[2]
    if spec == "self":
        return 0
    if not arg.isdigit():
        raise UserError(f"self-draft must be written self:N (N layers of the backbone), got {spec!r}")
    if int(arg) < 1:
        raise UserError(f"a self-draft takes N >= 1 layers of the backbone, got {spec!r}")
    return int(arg)

def load_draft(spec, target: MedusaModel, trust_remote_code: bool = False) -> MedusaModel:
    """``"self:N"`` (the target's first N layers), a loaded ``MedusaModel`` / causal LM, or a
    name/path of a checkpoint with the target's tokenizer (loaded on the target's device/dtype)."""
    layers = parse_self_draft(spec)
    if layers is not None:
        n = max(1, target.config.num_hidden_layers // 4) if spec == "self" else layers
        return _static_like(target, self_draft(target, n), ("self", n))
    if isinstance(spec, MedusaModel):
        draft = spec
    elif isinstance(spec, str):
        model, tok, _ = backbones.load_backbone(spec, device=target.device, dtype=target.dtype,
                                                trust_remote_code=trust_remote_code)
        draft = MedusaModel(model=model, tokenizer=tok, heads=None)
    elif hasattr(spec, "get_output_embeddings"):
        draft = MedusaModel(model=spec, tokenizer=None, heads=None)
    else:
        raise UserError(f"draft must be self:N, a model name/path or a causal LM, got {type(spec).__name__}")
    check_draft_compatible(target, draft)
    if draft.device != target.device:
        raise UserError(f"the draft model is on {draft.device}, the target on {target.device}")
    return _static_like(target, draft)


def _static_like(target: MedusaModel, draft: MedusaModel, key=None) -> MedusaModel:
    """``draft`` with static steps of its own where the target has them (``graphs=``): its k forwards a step
    are what launches the most kernels from the host in draft decoding. A self-draft (``key``), rebuilt at every
    ``generate``, keeps the same steps (buffer and captures) across calls: the same layers compute the same."""
    if target.static is not None and draft.static is None:
        siblings = target.static.siblings
        if key and key not in siblings:   # made once: a sibling made and dropped would still be counted until GC
            siblings[key] = target.static.sibling(draft)
        draft.static = siblings[key] if key else target.static.sibling(draft)
    return draft

class DraftDecoder:
    """Speculative decoding state for one sequence (target + draft caches); see module docstring."""

    def __init__(self, target: MedusaModel, draft: MedusaModel, settings: Optional[DraftSettings] = None,
                 sampling: Optional[SamplingConfig] = None, seed: Optional[int] = None):
        check_draft_compatible(target, draft)
        self.m, self.draft = target, draft
        self.settings = settings or DraftSettings()
        self.cfg = sampling or SamplingConfig()
        self.gen = seeded_generator(target.device, seed)
        self.k = self.settings.k
        self.cache = self.dcache = None
        self.seq: list[int] = []     # prompt + every emitted token; seq[-1] is the root
        self.past = 0                # target cache length = len(seq) - 1

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        n = prompt.shape[1]
        capacity = n + max_new_tokens + self.settings.extra_kv_tokens
        self.cache = self.m.new_cache(capacity)
        self.dcache = self.draft.new_cache(capacity + 1)
        _, root = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        self.draft.hidden(prompt, torch.arange(n, device=prompt.device)[None], self.dcache)
        self.seq = prompt[0].tolist() + [root]
        self.past = n
        return root

    def _propose(self, k: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """k draft tokens [k] (and their q rows in sample mode), on the device: each is fed to the next draft forward
        without being read; the draft cache gains all but x_k."""
        d, sample = self.draft, not self.cfg.is_greedy and self.cfg.mode == "sample"
        feed = self.seq[self.dcache.length:]          # the root, after a full acceptance x_K first
        drafts, qs = [], []
        for _ in range(k):
            with d.stepping():   # a LongRoPE draft's own steps: per position, and captured (module docstring)
                h = _forward_chain(d, feed, self.dcache.length, self.dcache)[-1]
            logits = d.logits(h)
            if sample:
                q = target_probs(logits, self.cfg)
                tok = torch.multinomial(q, 1, generator=self.gen)
                qs.append(q)
            else:
                tok = logits.argmax(-1, keepdim=True)
            drafts.append(tok)
            feed = tok                                 # x_k itself runs only once accepted (next step)
        return torch.cat(drafts), (torch.stack(qs) if sample else None)

    def step(self) -> tuple[list[int], int]:
        k, past, root = self.k, self.past, self.seq[-1]
        drafts, q = self._propose(k)
        # greedy / typical: the fixed chain; sample: speculative sampling with the drafts' q, by the rule and the
        # draws of the batched draft model, so generate and generate_batch of one prompt sample alike from one seed
        accepted, bonus = verify_chain(self.m, self.cache, past, root, drafts, self.cfg, self.gen, q)
        n = len(accepted)
        new = accepted + [bonus]
        self.dcache.truncate(min(self.dcache.length, past + 1 + n))   # drop rejected draft entries
        self.seq += new
        self.past = past + 1 + n
        if self.settings.adaptive:
            self.k = min(self.k + 2, self.settings.k_max) if n == k else max(1, self.k - 1)
        return new, k

class BatchDraftDrafter:
    """Batched draft-model drafting (``BatchTreeDecoder``'s ``Drafter``): the draft model keeps its own
    ragged cache and proposes k tokens per row with k batched one-token forwards (the first also
    catches up on the tokens accepted last step: one or two per row, shorter rows padded with nodes
    nothing attends to); the target verifies the k-token chains of all rows in one forward. Exact
    sampling draws drafts from the draft's q and verifies with the "sampled" rule, which on a chain
    is speculative sampling. k per step comes from ``settings.schedule`` by the number of active rows
    (0: a plain step, the draft model idle; it catches up on the next drafting step), else settings.k
    (``draft_adaptive`` adapts k at batch 1 only)."""

    def __init__(self, target: MedusaModel, draft: MedusaModel, settings: DraftSettings):
        check_draft_compatible(target, draft)
        self.m, self.dm = target, draft
        self.cursor = chain_cursor(settings.schedule, settings.k)
        self.max_nodes, self.max_depth = settings.k + 1, settings.k
        self.dcache: Optional[RaggedKVCache] = None

    def _start(self, dec: BatchTreeDecoder) -> None:
        d = self.dm
        prompts = [h[:-1] for h in dec.history]
        self.dcache = d.new_batch_cache(len(prompts), dec.cache.capacity + 2)
        mask, pos = self.dcache.prefill_mask([len(p) for p in prompts], d.dtype)
        d.hidden(torch.tensor(pad_layout(prompts, "compact"), device=d.device), pos, self.dcache, mask)

    def _catch_up(self, dec: BatchTreeDecoder) -> torch.Tensor:
        """Run each row's tokens the draft has not seen (1 or 2); the last one's hidden state [B, H]."""
        c, dev = self.dcache, self.dm.device
        c.truncate_rows([len(h) - 1 for h in dec.history])   # drop rejected drafts
        feeds = [h[n:] for h, n in zip(dec.history, c.host_lengths)]
        width = max(len(f) for f in feeds)
        ids = to_device([[f[0]] * (width - len(f)) + f for f in feeds], dev)
        see = torch.zeros(len(feeds), width, width, dtype=torch.bool, device=dev)
        depth = torch.zeros(len(feeds), width, dtype=torch.long, device=dev)
        for b, f in enumerate(feeds):
            pad = width - len(f)
            see[b] = torch.eye(width, dtype=torch.bool, device=dev)   # padding sees itself only
            see[b, pad:, pad:] = torch.ones(len(f), len(f), dtype=torch.bool, device=dev).tril()
            depth[b, pad:] = torch.arange(len(f), device=dev)
        mask, pos = c.step_mask(see, depth, self.dm.dtype)
        h = self.dm.hidden(ids, pos, c, mask)[:, -1]
        c.keep([list(range(width - len(f), width)) for f in feeds])
        return h

    def draft(self, dec: BatchTreeDecoder):
        d, cfg = self.dm, dec.cfg
        k = draft_tokens(self.cursor.next(dec.batch))
        if k == 0:
            if self.dcache is not None:
                # drop last step's rejected drafts now: once plain steps have added tokens, the cache's
                # length can no longer tell them from accepted ones
                self.dcache.truncate_rows([len(h) - 1 for h in dec.history])
            return root_only(self.m.device), torch.empty(dec.batch, 0, dtype=torch.long, device=self.m.device), None
        if self.dcache is None:
            self._start(dec)
        sample = cfg.mode == "sample" and not cfg.is_greedy
        with d.stepping():   # a LongRoPE draft's own steps: per position, and captured (module docstring)
            return self._draft_chains(dec, d, cfg, k, sample)

    def _draft_chains(self, dec: BatchTreeDecoder, d: MedusaModel, cfg, k: int, sample: bool):
        h = self._catch_up(dec)
        tokens, qs = [], []
        one = torch.ones(1, 1, dtype=torch.bool, device=d.device)
        zero = torch.zeros(1, dtype=torch.long, device=d.device)
        for i in range(k):
            logits = d.logits(h)
            if sample:
                q = target_probs(logits, cfg)
                qs.append(q)
                tok = torch.multinomial(q, 1, generator=dec.gen)[:, 0]
            else:
                tok = logits.argmax(-1)
            tokens.append(tok)
            if i + 1 < k:                            # x_k itself runs only once accepted (next step)
                mask, pos = self.dcache.step_mask(one, zero, d.dtype)
                h = d.hidden(tok[:, None], pos, self.dcache, mask)[:, -1]
                self.dcache.keep([[0]] * len(tok))
        cand = torch.stack(tokens, dim=1)
        return chain_buffers(k + 1, self.m.device), cand, (torch.stack(qs, dim=1) if sample else None)

    def rows_kept(self, index: list[int]) -> None:
        if self.dcache is not None:
            self.dcache.select_rows(index)

    def cache_bytes(self, prompt_lengths, max_new_tokens: int) -> int:
        """The draft model's own ragged KV cache for this batch (the memory check counts it)."""
        capacity = batch_capacity(prompt_lengths, max_new_tokens, self.max_nodes, "compact", 0) + 2   # as _start
        return len(prompt_lengths) * capacity * kv_bytes_per_token(self.dm)


def batch_draft_decoder(m: MedusaModel, o: DraftSettings, sampling: Optional[SamplingConfig], seed, ragged):
    cfg = sampling or SamplingConfig()
    if cfg.mode == "sample" and not cfg.is_greedy:
        cfg = dataclasses.replace(cfg, draft="sampled")   # drafts are draws of q: speculative sampling
    return BatchTreeDecoder(m, BatchDraftDrafter(m, load_draft(o.draft, m, o.trust_remote_code), o), cfg, seed, ragged)


def draft_costs(m: MedusaModel, o: DraftSettings, run_length: int) -> Costs:
    """The draft's own weights (none for a self-draft) and KV cache, plus the target's chain slots."""
    draft = load_draft(o.draft, m, o.trust_remote_code)
    params = extra_parameters(draft.model, m.model)
    slack = o.extra_kv_tokens
    kv = slack * kv_bytes_per_token(m) + (run_length + slack + 1) * kv_bytes_per_token(draft)
    training = "none (self-draft)" if getattr(draft, "self_draft_layers", None) is not None else "draft"
    return Costs(params[0], params[1], kv, training)


register(Method(
    "draft", "draft-model speculative sampling; draft=self:N shares the backbone's first N layers, or a "
    "model path/name with the same tokenizer", DraftSettings,
    decoder=lambda m, o, sampling, seed: DraftDecoder(m, load_draft(o.draft, m, o.trust_remote_code), o,
                                                      sampling, seed),
    batch_decoder=batch_draft_decoder,
    shape=ChainShape("k", calibration=lambda o: dataclasses.replace(o, adaptive=False)),
    prepare=lambda m, o: dataclasses.replace(o, draft=load_draft(o.draft, m, o.trust_remote_code)),
    costs=draft_costs))
