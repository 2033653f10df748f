"""Promotion gates (DESIGN §5, §6): pure checks of a checkpoint and its validations against
the `[promotion]` policy. Each unmet gate is one sentence saying what to do."""

from __future__ import annotations

from dataclasses import dataclass

from policies.loader import PromotionPolicy

# Checks a validation reports but does not count toward `passed`: whether resume state is
# complete is the promotion gate's to decide, under the policy in force when it promotes.
ADVISORY_CHECKS = frozenset({"resume_state"})


@dataclass(frozen=True, slots=True)
class ValidationRecord:
    id: int
    passed: bool
    device: str  # cuda | cpu
    mode: str | None = None  # streamed | sharded | whole | resharded; None: whole (pre-0012)
    probed: bool = False  # its probe ran and passed


def satisfies_device(policy: PromotionPolicy, device: str) -> bool:
    return policy.require_device == "any" or device == policy.require_device


def satisfies_mode(policy: PromotionPolicy, mode: str | None) -> bool:
    return (mode or "whole") in policy.modes


def usable_validation(
    policy: PromotionPolicy, validations: list[ValidationRecord]
) -> ValidationRecord | None:
    """The newest passing validation that the policy accepts."""
    for v in sorted(validations, key=lambda v: v.id, reverse=True):
        if (
            v.passed
            and satisfies_device(policy, v.device)
            and satisfies_mode(policy, v.mode)
            and (v.probed or not policy.require_probe)
        ):
            return v
    return None


def mode_gate(policy: PromotionPolicy, validations: list[ValidationRecord]) -> str | None:
    """None when a recorded validation satisfies the policy or promotion's own validation
    (streamed, world size 1) would."""
    if usable_validation(policy, validations) is not None or "streamed" in policy.modes:
        return None
    return (
        f"policy [promotion] modes = [{', '.join(policy.modes)}] does not accept the streamed "
        "validation promotion runs itself, and no recorded validation it accepts passed: run "
        "`reg validate REF` in an accepted mode (sharded: --world-size M --model-factory "
        "module:function), then promote"
    )


def resumable_gate(policy: PromotionPolicy, resumable: bool, missing: list[str]) -> str | None:
    if policy.require_resumable and not resumable:
        return (
            f"the checkpoint is not resumable (missing {', '.join(missing)}) and the policy "
            "has [promotion] require_resumable = true"
        )
    return None


def device_gate(
    policy: PromotionPolicy, validations: list[ValidationRecord], here: str
) -> str | None:
    """None when a recorded validation satisfies the policy or one can run on `here`."""
    if usable_validation(policy, validations) is not None or satisfies_device(policy, here):
        return None
    failed = [v for v in validations if not v.passed]
    tried = f" (validation {failed[-1].id} failed)" if failed else ""
    return (
        f'policy [promotion] require_device = "{policy.require_device}" needs a passing '
        f"{policy.require_device} validation and this machine has no {policy.require_device}"
        f"{tried}: run `reg validate REF --device {policy.require_device}` on a GPU node, "
        "then promote from anywhere"
    )
