"""Decoding policies as objects in a registry (DESIGN.md, "One iteration"; docs/ARCHITECTURE.md, "Policies").

A draft step yields D tokens ``d_1..d_D`` with probabilities ``p_1..p_D``: ``d_1`` is the argmax of
the last pending row — exactly the AR prediction — and ``d_2..d_D`` come from the drafter. A verify
step (AR-causal over ``d_1..d_D``) yields ``v_1..v_D``, where ``v_i`` is the AR argmax after
``d_1..d_i``. Lists here are 0-based: ``draft[i]`` is ``d_(i+1)``, ``verify[i]`` is ``v_(i+1)``.

A policy only decides; the decode loop (``bitmtp.runtime.decode``) executes. Each iteration the loop
asks the policy:

1. :meth:`Policy.plan` — before the draft step: the block size D, the drafter, and when to verify
   (:class:`Verify`: never, always — before the iteration's one read —, or "decide" after the read);
2. :meth:`Policy.wants_verify` — only under ``Verify.DECIDE``, after the read: verify this draft?
3. :meth:`Policy.commit` — what the iteration commits, from the draft, its probabilities and (when a
   verify step ran) the verifier's tokens. A verified commit's acceptance length comes from
   :meth:`Policy.accept`, the rule the device resolve uses too (``bitmtp.decoding.accept``).

A new policy is one :class:`Policy` subclass with a ``name``, a frozen ``Params`` dataclass and a
``commit`` rule, made known by :func:`register_policy`. Hooks meant for what comes next (issues 23/25),
not used by the built-in policies:

* **per-iteration width and drafter** (an ``auto`` policy): :meth:`Policy.plan` sees the history of
  the generation (committed counts, verified flags) and may return another block size or drafter
  each iteration; the loop checks the plan (block 2..16, the engine's ``m_max``, the drafter's
  largest block) and switches the pool's drafter when the plan names another one.
* **a one-pass verify-and-draft schedule**: a new :class:`Verify` member that the loop learns to run;
  the policy side (plan → commit) stays as it is.
* **stochastic acceptance** (sampling): override :meth:`Policy.accept`, which receives the tensors
  and, as keyword arguments, the draft / verifier probabilities and a ``torch.Generator``. The loop
  passes a non-greedy rule to the device resolve (torch pools run it; the Vulkan runtime, whose WGSL
  mirror is greedy, refuses it).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol

import torch

from bitmtp.decoding.accept import accept_length, speculative_accept
from bitmtp.errors import BitMTPError


@dataclass(frozen=True)
class Commit:
    """What one iteration commits.

    ``tokens``: committed in order. ``exact_rows``: how many leading committed tokens already have
    exact KV rows (their rows came from an AR-causal verify step and stay; the rest become the
    pending suffix and are recomputed). ``verified``: whether a verify step ran.
    """

    tokens: tuple[int, ...]
    exact_rows: int
    verified: bool


class Verify(enum.Enum):
    """When an iteration runs the verify step (the decode loop's three schedules)."""

    #: commit from the draft alone
    NEVER = "never"
    #: run the verify step before the iteration's one read; its tokens are part of that read
    ALWAYS = "always"
    #: read the draft first, then ask :meth:`Policy.wants_verify`; a verify it asks for is resolved
    #: on the device and read with the next iteration's read (one read per iteration)
    DECIDE = "decide"


@dataclass(frozen=True)
class Plan:
    """What the next iteration runs: a draft step of block size ``block`` with ``drafter`` (None: the
    generation's drafter), and when to verify it."""

    block: int
    verify: Verify
    drafter: Any = None


class History(Protocol):
    """What a policy may read of the generation so far (``bitmtp.runtime.decode.DecodeStats`` is one):
    per decided iteration, the tokens it committed and whether a verify step decided it."""

    committed: Sequence[int]
    verified: Sequence[bool]


# -- parameters ---------------------------------------------------------------------------------------


def check_tau(tau: Any) -> float:
    """τ as a float in (0, 1], else BitMTPError naming ``tau`` and the fix."""
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and 0 < tau <= 1):
        raise BitMTPError(f"tau: the confidence threshold must be a number in (0, 1], e.g. 0.9; got {tau!r}")
    return float(tau)


def check_min_prefix(min_prefix: Any) -> int | None:
    """m as an int ≥ 0 (None: the default max(2, D // 2), resolved by :meth:`Policy.bind`)."""
    if min_prefix is None:
        return None
    if isinstance(min_prefix, bool) or not isinstance(min_prefix, int) or min_prefix < 0:
        # any m >= 0 is meaningful: m <= 1 is confidence-only, m > D speculative-only
        raise BitMTPError(f"min_prefix: m must be an integer >= 0 (m <= 1: confidence only, m > block_size: "
                          f"speculative only; leave it out for max(2, D // 2)), got {min_prefix!r}")
    return min_prefix


#: the decode loop's schedules: ``two-pass`` (a draft step, then a verify step), ``one-pass`` (one
#: step verifies the pending guesses and drafts the next; ``bitmtp.decoding.onepass``) and ``tree``
#: (one pass with a block of mask rows after the pending row and after every guess, so a next draft
#: exists at any accept length; mask-block adapters) and ``top2`` (one pass whose first mask-drafted guess
#: is verified together with its runner-up, the first mask row's second choice, in one more row:
#: mask-block adapters, greedy decoding)
SCHEDULES = ("two-pass", "one-pass", "tree", "top2")
#: the schedules run by the one-pass loop
ONE_PASS_SCHEDULES = ("one-pass", "tree", "top2")


def check_schedule(schedule: Any) -> str | None:
    """A schedule name from :data:`SCHEDULES` (None: the policy's default)."""
    if schedule is None or schedule in SCHEDULES:
        return schedule
    raise BitMTPError(f"schedule: expected one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")


def default_min_prefix(block_size: int) -> int:
    """Hybrid's default m for block size D: max(2, D // 2)."""
    return max(2, block_size // 2)


@dataclass(frozen=True)
class NoParams:
    """The parameters of a policy that has none."""


@dataclass(frozen=True)
class ConfidenceParams:
    """``tau``: the confidence threshold τ in (0, 1]."""

    tau: float = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "tau", check_tau(self.tau))


@dataclass(frozen=True)
class SpeculativeParams:
    """``schedule``: ``"two-pass"`` (draft step, then verify step), ``"one-pass"`` (one step verifies
    the guesses and drafts the next ones), ``"tree"`` (one pass, mask rows after every AR row) or
    ``"top2"`` (one pass, the first mask-drafted guess verified with its runner-up); None: two-pass."""

    schedule: str | None = None

    def __post_init__(self) -> None:
        check_schedule(self.schedule)


@dataclass(frozen=True)
class HybridParams:
    """``tau``: τ in (0, 1]; ``min_prefix``: m ≥ 0, or None for max(2, D // 2) once D is known."""

    tau: float = 0.9
    min_prefix: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tau", check_tau(self.tau))
        object.__setattr__(self, "min_prefix", check_min_prefix(self.min_prefix))


# -- the commit rules ---------------------------------------------------------------------------------


def _check_draft(draft: Sequence[int], name: str = "draft") -> None:
    if len(draft) < 1:
        raise BitMTPError(f"{name}: needs at least one token")


def confident_prefix(probs: Sequence[float], tau: float) -> int:
    """h: the length of the longest prefix of the draft whose every probability is ≥ τ.

    A NaN probability (a broken draft: NaN logits) is never confident: the test is ``p >= tau``, which
    is False for NaN, rather than ``p < tau``, which would be False too and count it as confident.
    """
    h = 0
    for p in probs:
        if not p >= tau:  # the first draft token not at the threshold (or NaN) ends the confident prefix
            break
        h += 1
    return h


def confidence_commit(draft: Sequence[int], probs: Sequence[float], tau: float) -> Commit:
    """Commit ``d_1..d_max(1, h)`` without verification.

    ``d_1`` is the AR prediction itself, so at least one token always commits even when nothing
    reaches τ. The committed tokens' KV came from mask rows (not AR-causal), so none of their rows
    is exact: they all become the pending suffix and are recomputed by the next draft step.
    """
    _check_draft(draft)
    if len(probs) != len(draft):
        raise BitMTPError(f"probs: {len(probs)} probabilities for {len(draft)} draft tokens")
    count = max(1, confident_prefix(probs, tau))
    return Commit(tuple(int(t) for t in draft[:count]), exact_rows=0, verified=False)


def speculative_commit(draft: Sequence[int], verify: Sequence[int],
                       accept: Callable[[Sequence[int], Sequence[int]], int] = speculative_accept) -> Commit:
    """Commit ``d_1..d_a`` and the verifier's next token ``v_a`` (lossless: exactly AR greedy).

    The verify step ran AR-causally over ``d_1..d_D``, so the rows of ``d_1..d_a`` are exact and stay
    (n += a); ``v_a`` becomes the pending suffix. ``accept``: the host form of the acceptance rule.
    """
    a = accept(draft, verify)
    return Commit(tuple(int(t) for t in draft[:a]) + (int(verify[a - 1]),), exact_rows=a, verified=True)


def hybrid_uses_verifier(h: int, min_prefix: int) -> bool:
    """Hybrid: commit by confidence when the confident prefix reaches m tokens, otherwise verify.

    The prefix counted is ``max(1, h)``: ``d_1`` is the AR prediction and commits in every policy,
    so it always counts. Hence hybrid with m ≤ 1 is exactly confidence-only, and with m > D (no
    prefix can reach m) exactly speculative-only.
    """
    return max(1, h) < min_prefix


# -- the policy objects -------------------------------------------------------------------------------


class Policy:
    """Base of the decoding policies. Subclasses set the class attributes and implement :meth:`commit`
    (and :meth:`plan` / :meth:`wants_verify` when they verify); see the module docstring.

    Construct with the parameters as keywords (``HybridPolicy(tau=0.5)``) or one ``Params`` instance.
    """

    #: the registry key, what ``generate(policy=...)`` and ``--policy`` accept
    name: ClassVar[str] = ""
    #: whether it runs draft steps (needs a drafter: an MTP adapter); False: one AR step per token
    drafts: ClassVar[bool] = True
    #: whether it may run verify steps
    needs_verify: ClassVar[bool] = False
    #: whether its output is exactly AR greedy's, whatever the drafter
    lossless: ClassVar[bool] = False
    #: its parameters, a frozen dataclass whose ``__post_init__`` validates them
    Params: ClassVar[type] = NoParams
    #: the drafter it uses when the caller names none: ``"adapter"`` (the loaded MTP adapter's) or
    #: another name of ``bitmtp.decoding.drafters.DRAFTER_NAMES``
    default_drafter: ClassVar[str] = "adapter"
    #: whether its one-pass planner plans with the measured step costs (the decode loop loads them then:
    #: ``bitmtp.runtime.calibration``)
    uses_costs: ClassVar[bool] = False
    #: whether it may verify a mask draft's runner-up beside it (the decode loop reads runner-ups then)
    plans_runner_ups: ClassVar[bool] = False

    @property
    def decode_schedule(self) -> str:
        """The decode loop's schedule for this policy (:data:`SCHEDULES`)."""
        return "two-pass"

    def planner(self, memory: Any) -> Any:
        """The one-pass planner of one generation (``bitmtp.decoding.onepass.Planner``); ``memory``: the
        engine's ``bitmtp.decoding.onepass.DecodeMemory``, kept across its generations (running estimates live
        there)."""
        from bitmtp.decoding.onepass import FixedPlanner

        return FixedPlanner()

    def __init__(self, params: Any = None, /, **kwargs: Any):
        if params is not None and kwargs:
            raise BitMTPError(f"policy: give {self.name!r} either a {self.Params.__name__} or keywords, not both")
        if params is None:
            known = {f.name for f in fields(self.Params)}
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise BitMTPError(f"{unknown[0]}: not a parameter of policy {self.name!r} (its parameters: "
                                  f"{sorted(known) or 'none'})")
            params = self.Params(**kwargs)
        elif not isinstance(params, self.Params):
            raise BitMTPError(f"policy: {self.name!r} takes {self.Params.__name__}, got {type(params).__name__}")
        self.params = params

    # -- per generation -------------------------------------------------------------------------

    def bind(self, block_size: int) -> Policy:
        """This policy with the defaults that depend on the generation's block size D resolved
        (hybrid's m); the decode loop runs bound policies. Returns ``self`` when nothing depends on D."""
        return self

    # -- per iteration ---------------------------------------------------------------------------

    def plan(self, block_size: int, history: History) -> Plan:
        """The next iteration's :class:`Plan`. ``block_size``: the generation's D; ``history``: the
        iterations decided so far. The plan after a verify resolved on the device is asked before that
        verify's commit is in ``history`` (its draft step is prepared on the device first)."""
        return Plan(block_size, Verify.ALWAYS if self.needs_verify else Verify.NEVER)

    def wants_verify(self, draft: Sequence[int], probs: Sequence[float]) -> bool:
        """Under ``Verify.DECIDE``: whether to verify this draft (read by the host)."""
        return self.needs_verify

    def commit(self, draft: Sequence[int], probs: Sequence[float], verify: Sequence[int] | None) -> Commit:
        """What the iteration commits. ``verify``: the verifier's tokens when a verify step ran, else None."""
        raise NotImplementedError(f"policy {self.name!r}: subclasses define commit()")

    def accept(self, draft: torch.Tensor, verify: torch.Tensor, **sampling: Any) -> torch.Tensor:
        """The acceptance length of verified drafts (tensors ``[..., D]`` → ``[...]``), used on the
        device (``verify_prep.resolve_verify``) and, through :meth:`host_accept`, on the host.
        ``sampling``: ``draft_probs``, ``verify_probs``, ``generator`` for a stochastic rule (none
        passed today). The default is the greedy rule, :func:`bitmtp.decoding.accept.accept_length`."""
        return accept_length(draft, verify)

    @property
    def device_accept(self) -> Callable[..., torch.Tensor] | None:
        """The rule for the device resolve: None for the greedy rule (which device pools also mirror
        natively), else this policy's :meth:`accept`."""
        return None if type(self).accept is Policy.accept else self.accept

    def host_accept(self, draft: Sequence[int], verify: Sequence[int]) -> int:
        """:meth:`accept` on the token lists of a read: converted to a tensor once, back to an int once."""
        if self.device_accept is None:
            return speculative_accept(draft, verify)
        pair = torch.tensor([[int(t) for t in draft], [int(t) for t in verify]], dtype=torch.long)
        return int(self.accept(pair[0], pair[1]))

    def _verified_commit(self, draft: Sequence[int], verify: Sequence[int]) -> Commit:
        return speculative_commit(draft, verify, self.host_accept)

    # -- plumbing ----------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.params == self.params

    def __hash__(self) -> int:
        return hash((type(self), self.params))

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self.params, f.name)!r}" for f in fields(self.params))
        return f"{type(self).__name__}({args})"


_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Make ``cls`` available by its ``name`` (``generate(policy=name)``, the CLI's ``--policy``
    choices when registered before the parser is built); returns ``cls``, so it works as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise BitMTPError(f"policy: register a subclass of bitmtp.decoding.Policy, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise BitMTPError(f"policy: {cls.__name__}.name must be a non-empty identifier-like string, got {name!r}")
    if _REGISTRY.get(name, cls) is not cls:
        raise BitMTPError(f"policy: {name!r} is already registered ({_REGISTRY[name].__name__}); "
                          "unregister_policy() it first or pick another name")
    _REGISTRY[name] = cls
    return cls


def unregister_policy(name: str) -> None:
    """Forget a registered policy (tests register their own and remove them afterwards)."""
    if name not in _REGISTRY:
        raise BitMTPError(f"policy: {name!r} is not registered; registered: {policy_names()}")
    del _REGISTRY[name]


def policy_names() -> tuple[str, ...]:
    """The registered policy names, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def get_policy(name: Any) -> type[Policy]:
    """The policy class registered as ``name``; BitMTPError listing :func:`policy_names` otherwise."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise BitMTPError(f"policy: expected one of {policy_names()} or a bitmtp.decoding.Policy instance, "
                          f"got {name!r}")
    return cls


def resolve_policy(policy: str | Policy, *, tau: Any = None, min_prefix: Any = None,
                   schedule: Any = None) -> Policy:
    """A :class:`Policy` from a registered name with the loose ``tau`` / ``min_prefix`` arguments of
    ``bitmtp.generate`` (None: the defaults, τ = 0.9 and m = max(2, D // 2)), or a Policy instance
    as it is (then ``tau`` and ``min_prefix`` must be left out: they belong to the instance).

    Both loose arguments are validated whatever the policy (a bad τ is an error also for ``"ar"``);
    each policy takes those its ``Params`` declares.
    """
    if isinstance(policy, Policy):
        for arg, value in (("tau", tau), ("min_prefix", min_prefix), ("schedule", schedule)):
            if value is not None:
                raise BitMTPError(f"{arg}: give it to the policy object (e.g. {type(policy).__name__}({arg}=...)) "
                                  f"or pass the policy by name; got {arg}={value!r} with {policy!r}")
        return policy
    cls = get_policy(policy)
    loose = {"tau": check_tau(0.9 if tau is None else tau), "min_prefix": check_min_prefix(min_prefix),
             "schedule": check_schedule(schedule)}
    known = {f.name for f in fields(cls.Params)}
    if schedule is not None and "schedule" not in known:
        takes = sorted(n for n, c in _REGISTRY.items() if "schedule" in {f.name for f in fields(c.Params)})
        raise BitMTPError(f"schedule: policy {cls.name!r} has one schedule; schedule= applies to {', '.join(takes)}")
    return cls(**{k: v for k, v in loose.items() if k in known})


@register_policy
class ARPolicy(Policy):
    """``ar``: one token per step (the baseline): the step's argmax commits; its row was AR-causal."""

    name = "ar"
    drafts = False
    lossless = True

    def commit(self, draft: Sequence[int], probs: Sequence[float], verify: Sequence[int] | None) -> Commit:
        _check_draft(draft)
        return Commit((int(draft[0]),), exact_rows=0, verified=False)


@register_policy
class ConfidencePolicy(Policy):
    """``confidence``: commit the confident prefix ``d_1..d_max(1, h)`` (p ≥ τ), unverified."""

    name = "confidence"
    Params = ConfidenceParams

    def commit(self, draft: Sequence[int], probs: Sequence[float], verify: Sequence[int] | None) -> Commit:
        if verify is not None:
            raise BitMTPError("verify: the confidence policy never verifies; pass verify=None")
        return confidence_commit(draft, probs, self.params.tau)


@register_policy
class SpeculativePolicy(Policy):
    """``speculative``: verify every block; commit ``d_1..d_a`` and ``v_a`` (exactly AR greedy)."""

    name = "speculative"
    needs_verify = True
    lossless = True
    Params = SpeculativeParams

    @property
    def decode_schedule(self) -> str:
        return self.params.schedule or "two-pass"

    def commit(self, draft: Sequence[int], probs: Sequence[float], verify: Sequence[int] | None) -> Commit:
        if verify is None:
            raise BitMTPError("verify: the speculative policy commits from the verifier's tokens; none were given")
        return self._verified_commit(draft, verify)


@register_policy
class HybridPolicy(Policy):
    """``hybrid``: the confidence commit when ``max(1, h) ≥ m``, otherwise verify (decided after the
    read; the verify is resolved on the device)."""

    name = "hybrid"
    needs_verify = True
    Params = HybridParams

    def bind(self, block_size: int) -> Policy:
        if self.params.min_prefix is not None:
            return self
        return type(self)(replace(self.params, min_prefix=default_min_prefix(block_size)))

    def _m(self) -> int:
        m = self.params.min_prefix
        if m is None:
            raise BitMTPError("min_prefix: this hybrid policy is not bound to a block size yet; call bind(D)")
        return m

    def plan(self, block_size: int, history: History) -> Plan:
        return Plan(block_size, Verify.DECIDE)

    def wants_verify(self, draft: Sequence[int], probs: Sequence[float]) -> bool:
        return hybrid_uses_verifier(confident_prefix(probs, self.params.tau), self._m())

    def commit(self, draft: Sequence[int], probs: Sequence[float], verify: Sequence[int] | None) -> Commit:
        if verify is not None:
            return self._verified_commit(draft, verify)
        if self.wants_verify(draft, probs):
            raise BitMTPError("verify: hybrid needs the verifier's tokens when the confident prefix is shorter than m")
        return confidence_commit(draft, probs, self.params.tau)
