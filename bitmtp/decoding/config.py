"""How to decode, validated once: :class:`DecodingConfig`.

``bitmtp.generate``, the command line, ``bitmtp serve`` and the Hugging Face patch all build one with
``bitmtp.api.decoding_config`` (or ``model.decoding_config``), which checks every option — the policy and its
parameters, the block size against the adapter, the drafter, the sampling parameters, ``max_new_tokens``, the
EOS ids and stop strings — and raises one :class:`~bitmtp.errors.BitMTPError` naming the option at fault. What
the engines receive is this frozen record: the solo engine's ``decode`` keywords (:meth:`solo_kwargs`) and the
batch engine's ``submit`` keywords (:meth:`batch_kwargs`) both come from it, so no entry point re-derives the
policy, its block size or its drafter on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding.drafters import CombinedDrafter, LookupDrafter, MaskBlockDrafter
from bitmtp.decoding.policies import Policy
from bitmtp.decoding.sampling import SamplingParams


@dataclass(frozen=True)
class DecodingConfig:
    """A validated set of decoding options (build it with ``bitmtp.api.decoding_config``).

    Attributes:
        policy: the policy object, bound to ``block_size``.
        block_size: D, tokens a drafting iteration drafts (1 for a policy that does not draft).
        drafter: the drafter a drafting policy runs with (None: none drafts).
        sampling: how tokens are chosen (greedy when its temperature is 0 and no penalty is set).
        max_new_tokens: most tokens to generate (≥ 1).
        eos: the stop token ids.
        stops: stop strings (matched in the text; they need a tokenizer).
        logprobs: also return each committed token's log-probability.
        notes: what the caller should know about how it decodes (copied into the stats).
    """

    policy: Policy
    block_size: int
    drafter: Any = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    eos: tuple[int, ...] = ()
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    notes: tuple[str, ...] = ()

    @property
    def batchable(self) -> bool:
        """Whether the batch engine decodes it (policies ``ar`` and ``auto``: AR's exact output)."""
        return not self.policy.drafts or self.policy.name == "auto"

    @property
    def drafts_as_a_batch(self) -> bool:
        """Whether a batch of one drafts as the solo engine would: ``ar``, or ``auto`` with its default drafter
        (prompt lookup, and a mask-block adapter's mask rows) — what ``generate`` decodes on the batch engine by
        default. ``auto`` with another drafter (an ``OracleDrafter``, a heads adapter) keeps the solo engine,
        which runs it."""
        if not self.policy.drafts:
            return True
        d = self.drafter
        return self.policy.name == "auto" and (isinstance(d, LookupDrafter) or self.mask_block is not None)

    @property
    def mask_block(self) -> Any:
        """The mask-block adapter module whose mask rows draft in batched steps: ``auto``'s lookup + adapter
        pair with a mask-block adapter; None otherwise (lookup guesses only)."""
        d = self.drafter
        if isinstance(d, CombinedDrafter) and isinstance(d.adapter, MaskBlockDrafter):
            return d.adapter.block
        return None

    def solo_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the solo engine's ``decode`` (``bitmtp.runtime.decode.decode``)."""
        return dict(max_new_tokens=self.max_new_tokens, eos=self.eos, policy=self.policy, block_size=self.block_size,
                    drafter=self.drafter, notes=self.notes, sampling=self.sampling, logprobs=self.logprobs)

    def batch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``BatchEngine.submit`` (``bitmtp.runtime.batch``): ``auto`` drafts there by
        prompt lookup and, with a mask-block adapter, by its mask rows."""
        return dict(max_new_tokens=self.max_new_tokens, eos=self.eos, sampling=self.sampling, logprobs=self.logprobs,
                    draft=self.policy.name == "auto", masks=self.mask_block, block_size=self.block_size,
                    notes=self.notes)


__all__ = ["DecodingConfig"]
