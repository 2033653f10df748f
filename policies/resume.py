"""Resume-state inventory: which top-level keys of a checkpoint are which kind of resume state.

Pure: top-level key names in, classes out. A key belongs to the class whose prefix it starts with
(the longest prefix wins); the model is the `model_key` prefix, or with `model_key = ""` every
top-level key that belongs to no other class (torchtitan's layout).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from policies.loader import ResumePolicy


@dataclass(frozen=True, slots=True)
class ResumeInventory:
    classes: dict[str, list[str]]  # class -> top-level keys
    unclassified: list[str]
    missing: list[str]  # required classes with no key
    model_keys: list[str] = field(default_factory=list)

    @property
    def resumable(self) -> bool:
        return not self.missing


def classify(top_level_keys: Iterable[str], policy: ResumePolicy) -> ResumeInventory:
    prefixes: list[tuple[str, str]] = [
        (prefix, cls) for cls, names in policy.classes.items() for prefix in names
    ]
    if policy.model_key:
        prefixes.append((policy.model_key, "model"))
    prefixes.sort(key=lambda p: len(p[0]), reverse=True)

    classes: dict[str, list[str]] = {}
    unclassified: list[str] = []
    for key in sorted(set(top_level_keys)):
        cls = next((c for prefix, c in prefixes if key.startswith(prefix)), None)
        if cls is None and policy.model_key == "":
            cls = "model"
        if cls is None:
            unclassified.append(key)
        else:
            classes.setdefault(cls, []).append(key)
    missing = [c for c in policy.required if c not in classes]
    return ResumeInventory(classes, unclassified, missing, classes.get("model", []))
