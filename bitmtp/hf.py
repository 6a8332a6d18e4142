"""Drop-in Hugging Face integration: ``bitmtp.patch(model)`` makes ``model.generate`` run through bitmtp.

How it plugs in: the patched ``generate`` passes transformers' public ``custom_generate`` callable hook,
so transformers still does everything it always does before decoding (merging the generation
config, building stopping criteria and logits processors, validating arguments, ``streamer.put``
of the prompt), and then calls :func:`_bitmtp_decode` instead of its own decoding loop. That
function decodes with bitmtp when the prepared call is batch 1 and has nothing bitmtp does not
reproduce: greedy or sampled (``do_sample=True``) with transformers' repetition penalty, temperature,
top-k, top-p and min-p processors — which map onto ``bitmtp.decoding.sampling`` — and no other logits
processor, no scores/attentions requested, a full attention mask; otherwise it runs transformers' own
loop, unchanged. Calls that are plainly not for bitmtp (beams, batches, assistant models, a
``custom_generate`` of the caller's) skip the hook entirely. Every fall-through warns once per reason
(:class:`bitmtp.errors.FallbackWarning`).

Sampling through the patch draws its seed from torch's global generator, so ``torch.manual_seed(s)``
before ``generate`` reproduces a call (the text differs from transformers' own sampling for the same
seed — another random stream — but follows the same distribution, token by token, whatever the policy).

Stop strings: transformers drops ``tokenizer`` before it calls a ``custom_generate`` callable, and then
cannot build its stop-string criterion; the patched ``generate`` therefore takes ``stop_strings`` and
``tokenizer`` out of the call and adds transformers' own ``StopStringCriteria`` to the stopping criteria
inside the hook (so the output stops at the same token as unpatched).

Weights: ``patch`` converts the HF module's weights once into a bitmtp decoder. Float tensors it
can use as they are are shared with the HF module (no copy); q/k/v and gate/up are concatenated into
one projection each, which copies them; ternary BitNet weights are repacked to 2 bits/weight. Dense
weights that are exactly GGML Q4_0/Q4_1/Q8_0 values (a model transformers loaded from such a GGUF) also get
a block copy, which the CPU kernels read instead (bit-identical results, ~1/5.6 of the float32
bytes per step; ``bitmtp.formats.ggml_blocks``). Measured for SmolLM2-135M-Instruct.Q4_1.gguf in
float32: 259 MB shared, 280 MB copied, 96 MB of blocks, plus the KV store (96 MB at the default
``capacity`` of 2048 tokens). The HF module is untouched and keeps serving the fall-through calls.

Threads: the patch owns one bitmtp engine (one KV store), so patched ``generate`` calls from several
threads decode one after another (each exactly as alone); fall-through calls run in transformers as
before. Token ids outside the vocabulary raise :class:`bitmtp.errors.TokenIdError`, an ``IndexError``
as the unpatched embedding lookup raises.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any

import torch

from bitmtp.errors import BitMTPError, FallbackWarning

log = logging.getLogger("bitmtp.hf")

_ATTR = "_bitmtp_patch"
#: generate() keyword arguments the hook passes through untouched to transformers
_FALL_THROUGH_KWARGS = ("assistant_model", "custom_generate", "prefix_allowed_tokens_fn", "negative_prompt_ids",
                        "synced_gpus", "assistant_tokenizer", "prompt_lookup_num_tokens")


class _Patch:
    def __init__(self, model, bm, original, config):
        self.model, self.bm, self.original = model, bm, original
        #: the decoding config every patched call decodes with (``bitmtp.decoding_config``: the bound policy, its
        #: block size and drafter); each call sets its own sampling, max_new_tokens and EOS ids on a copy
        self.config = config
        self.warned: set[str] = set()
        self.last_stats = None
        self.calls = {"bitmtp": 0, "transformers": 0}

    @property
    def policy(self) -> str:
        return self.config.policy.name

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def drafter(self) -> Any:
        return self.config.drafter

    def fall_through(self, why: str) -> None:
        self.calls["transformers"] += 1
        if why not in self.warned:  # warned once per reason
            self.warned.add(why)
            warnings.warn(f"bitmtp.patch: {why}; running transformers' own generate (no bitmtp speedup)",
                          FallbackWarning, stacklevel=4)


def patch(model: Any, adapter: Any = "auto", policy: Any = None, block_size: int | None = None,
          tau: float | None = None, min_prefix: int | None = None, *, capacity: int = 2048, backend: str | None = None,
          quantize: str | None = None) -> Any:
    """Make ``model.generate`` run through bitmtp where the arguments allow; returns ``model``.

    Args:
        model: a transformers ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``BitNetForCausalLM``.
        adapter: MTP adapter folder, ``"auto"`` (a shipped adapter trained on this model, if any) or
            ``None``. Without an adapter, a policy that needs one falls back to ``"auto"`` (lossless; drafts
            by prompt lookup where it pays, else AR on bitmtp's runtime).
        policy, block_size, tau, min_prefix: as in :func:`bitmtp.generate` (a policy name or a
            ``bitmtp.decoding.Policy`` instance). Left at None: ``"auto"`` with the adapter's D
            (:meth:`bitmtp.api.BitMTPModel.recommended`).
        capacity: KV store size in tokens (prompt + generated); longer calls fall through.
        backend, quantize: as in :func:`bitmtp.load`.
    """
    from bitmtp.api import BitMTPModel, load
    from bitmtp.decoding import get_policy

    if getattr(model, _ATTR, None) is not None:
        raise BitMTPError("model: already patched; call bitmtp.unpatch(model) first")
    if not (hasattr(model, "config") and hasattr(model, "generate")):
        raise BitMTPError(f"model: expected a transformers causal LM, got {type(model).__name__}")
    device = next(model.parameters()).device
    bm: BitMTPModel = load(model, capacity=capacity, backend=backend, quantize=quantize, device=device,
                      adapter=adapter)
    cls = None if policy is None else (get_policy(policy) if isinstance(policy, str) else type(policy))
    if bm.drafter is None and cls is not None and cls.drafts and cls.default_drafter == "adapter":
        log.info("bitmtp.patch: no MTP adapter for this model; decoding with policy 'auto' (prompt lookup where it "
                 "pays, else AR) on bitmtp's runtime")
        policy = "auto"
    if policy is None:
        policy, block_size = bm.recommended(None, block_size)
    config = bm.decoding_config(policy=policy, block_size=block_size, tau=tau, min_prefix=min_prefix)
    original = model.generate
    state = _Patch(model, bm, original, config)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        why = _plainly_not_ours(args, kwargs, model)
        if why:
            state.fall_through(why)
            return original(*args, **kwargs)
        # transformers hands a custom_generate callable only the keyword arguments of its own signature
        # that _sample lacks (the streamer and the tokenizer are dropped), so they travel in the partial;
        # stop strings too, which transformers cannot turn into a criterion without the tokenizer
        cfg = kwargs.get("generation_config") or model.generation_config
        stops = kwargs.pop("stop_strings", None) or getattr(cfg, "stop_strings", None)
        tokenizer = kwargs.pop("tokenizer", None)
        if stops and tokenizer is None:
            raise BitMTPError("stop_strings: pass the model's tokenizer too (generate(..., stop_strings=..., "
                              "tokenizer=tokenizer)), as transformers requires")
        hook = functools.partial(_bitmtp_decode, state=state, call_streamer=kwargs.get("streamer"),
                                 call_stops=(stops, tokenizer) if stops else None)
        return original(*args, custom_generate=hook, stop_strings=None, **kwargs)

    model.generate = generate
    setattr(model, _ATTR, state)
    return model


def unpatch(model: Any) -> Any:
    """Restore the model's original ``generate``; returns ``model``."""
    state = getattr(model, _ATTR, None)
    if state is None:
        raise BitMTPError("model: not patched by bitmtp")
    del model.generate  # the instance attribute: the class's generate shows through again
    delattr(model, _ATTR)
    return model


def patch_state(model: Any) -> _Patch | None:
    """The patch of ``model`` (its bitmtp model, call counts and ``last_stats``), or None."""
    return getattr(model, _ATTR, None)


def _plainly_not_ours(args, kwargs, model) -> str | None:
    for key in _FALL_THROUGH_KWARGS:
        if kwargs.get(key) is not None:
            return f"{key} was given"
    cfg = kwargs.get("generation_config") or model.generation_config
    if kwargs.get("num_beams", cfg.num_beams or 1) > 1:
        return "beam search"
    if kwargs.get("num_return_sequences", cfg.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1"
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if inputs is None:
        return "no input_ids"
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[0] != 1:
        return f"batch of {inputs.shape[0]}"
    return None


def _sampling_of(processors, do_sample: bool):
    """``(SamplingParams, None)`` for transformers' logits processors when they are ones bitmtp reproduces
    (``bitmtp.decoding.sampling`` applies them in transformers' order: repetition penalty, temperature,
    top-k, top-p, min-p), else ``(None, why not)``. The seed comes from torch's global generator."""
    from bitmtp.decoding.sampling import SamplingParams

    kw: dict[str, Any] = {"temperature": 1.0} if do_sample else {}
    others = []
    for p in processors or ():
        name = type(p).__name__
        keep = getattr(p, "min_tokens_to_keep", 1)
        if name == "RepetitionPenaltyLogitsProcessor" and getattr(p, "prompt_ignore_length", None) is None:
            kw["repetition_penalty"] = float(p.penalty)
        elif do_sample and name == "TemperatureLogitsWarper":
            kw["temperature"] = float(p.temperature)
        elif do_sample and name == "TopKLogitsWarper" and keep <= p.top_k:
            kw["top_k"] = int(p.top_k)
        elif do_sample and name == "TopPLogitsWarper" and keep <= 1:
            kw["top_p"] = float(p.top_p)
        elif do_sample and name == "MinPLogitsWarper" and keep <= 1:
            kw["min_p"] = float(p.min_p)
        else:
            others.append(name)
    if others:
        return None, f"logits processors ({', '.join(others)})"
    if do_sample:
        kw["seed"] = int(torch.randint(0, 2**62, (1,)).item())
    try:
        return SamplingParams(**kw), None
    except BitMTPError as exc:
        return None, str(exc)


def _ineligible(state: _Patch, input_ids, logits_processor, generation_config, model_kwargs) -> str | None:
    gc = generation_config
    if input_ids.shape[0] != 1:
        return f"batch of {input_ids.shape[0]}"
    if (gc.num_beams or 1) > 1:
        return "beam search"
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(gc, flag, False):
            return f"{flag}=True"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return "a padded attention mask"
    if input_ids.shape[1] >= state.bm.engine.capacity:
        return f"prompt of {input_ids.shape[1]} tokens at or over bitmtp's capacity {state.bm.engine.capacity}"
    return None


def _bitmtp_decode(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                   synced_gpus=False, streamer=None, *, state: _Patch, call_streamer=None, call_stops=None,
                   **model_kwargs):
    """transformers' decoding step, through bitmtp (see the module docstring for when it declines)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    streamer = streamer if streamer is not None else call_streamer
    if call_stops is not None:  # the criterion transformers could not build without the tokenizer
        from transformers import StoppingCriteriaList, StopStringCriteria

        stops, tokenizer = call_stops
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []),
                                                  StopStringCriteria(tokenizer, stops)])
    why = _ineligible(state, input_ids, logits_processor, generation_config, model_kwargs)
    sampling = None
    if not why:
        sampling, why = _sampling_of(logits_processor, bool(generation_config.do_sample))
    if why:
        state.fall_through(why)
        return type(model)._sample(model, input_ids, logits_processor=logits_processor,
                                   stopping_criteria=stopping_criteria, generation_config=generation_config,
                                   synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    gc = generation_config
    from bitmtp.api import start_generation
    from bitmtp.errors import TokenIdError

    prompt = input_ids[0].tolist()
    vocab = state.bm.args.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:  # unpatched, the embedding lookup raises IndexError for these: so does the patched call
        raise TokenIdError(f"input_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab}) (transformers "
                           "raises IndexError for them too); pass ids of this model's tokenizer")
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - len(prompt)
    eos = gc.eos_token_id
    eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in torch.as_tensor(eos)])
    bm = state.bm
    # the patch's config with this call's limits (each part checked: SamplingParams checks itself, transformers
    # its generation config)
    config = dataclasses.replace(state.config, sampling=sampling, max_new_tokens=max(1, max_new), eos=tuple(eos))
    # the engine generate() picks: on the CPU, ar / auto decode as a batch of one (calls from other threads share
    # its steps)
    chunks = start_generation(bm, prompt, config)
    seq = input_ids
    stopped = False
    try:  # the generation owns the engine's KV store until it ends: close it on every exit
        while True:
            try:
                chunk = next(chunks)
            except StopIteration:
                break
            if not chunk:
                continue
            emitted = []
            for tok in chunk:
                emitted.append(tok)
                seq = torch.cat([seq, torch.tensor([[tok]], device=seq.device, dtype=seq.dtype)], dim=1)
                # the caller's stopping criteria (max length and EOS are already the engine's): stop at the
                # same token transformers would
                if stopping_criteria is not None and bool(stopping_criteria(seq, None).all()):
                    stopped = True
                    break
            if streamer is not None and emitted:
                streamer.put(torch.tensor(emitted))
            if stopped:
                break
    finally:
        chunks.close()
    if streamer is not None:
        streamer.end()
    state.calls["bitmtp"] += 1
    # this call's own stats (filled as decoding ran, also when the criteria cut it): engine.last_stats
    # may already be another thread's generation
    state.last_stats = chunks.stats
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=seq)
    return seq

