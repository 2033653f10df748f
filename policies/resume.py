"""Resume state: which key paths of a checkpoint are which class, under a layout and a policy.

Pure: sorted key paths (DCP's dotted FQNs) and sidecar file names in, a verdict out. The rules:
  - A class entry is a whole dotted path: it matches a key equal to it or starting with it plus
    "." ("optim" matches "optim.state.w.exp_avg", never "optim_0..." or "optimizer..."). The
    longest matching entry wins; the model's path is an entry of class "model".
  - Optimizer state is also known by its structure: a path whose children include "state" (with
    parameter names below) and "param_groups". Keys under those no entry claims are optimizer
    state (Lightning's "optimizer_0", any name). Keys under the model's path that have this
    structure stay in the model set and are reported: a release never takes them silently.
  - With the model at "" (torchtitan), every key no other class claims is the model.
  - A sidecar file the layout names (Lightning's meta.pt, accelerate's scheduler.bin) provides
    the classes of what reg read in it (its `FILE:PATH` entries); one present but unread
    (`FILE!WHY`) provides nothing, and says so.
  - Required classes (the layout's, or the policy's `required` when written) decide
    `resumable`; missing recommended ones are warnings naming what a resume loses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from policies.layouts import (
    CONSEQUENCES,
    LAYOUTS,
    READ,
    RESUME_CLASSES,
    UNREAD,
    Layout,
    Placement,
    class_path,
    detect,
    has_path,
    place,
)
from policies.loader import ResumePolicy
from registry.errors import InvalidCheckpoint, UsageError

EXAMPLES = 3  # keys named in a one-line message


@dataclass(frozen=True, slots=True)
class ResumeVerdict:
    layout: str
    model_path: str  # where the model is; "" = the keys no other class claims
    classes: dict[str, list[str]]  # class -> the paths (or sidecar files) that hold it
    model_keys: list[str]
    missing: list[str]  # required classes with no key
    unclassified: list[str]  # the largest wholly unclassified subtrees, as key paths
    optimizer_in_model: list[str]  # model keys with an optimizer's structure
    warnings: list[str] = field(default_factory=list)
    unclassified_sizes: dict[str, int] = field(default_factory=dict)  # subtree -> keys

    @property
    def resumable(self) -> bool:
        return not self.missing

    @property
    def strip(self) -> str:
        return f"{self.model_path}." if self.model_path else ""

    def model_names(self, fqns: Iterable[str], strip_prefix: str = "") -> dict[str, str]:
        """The model's own state_dict name -> checkpoint FQN, for those of `fqns` (tensors)
        that are model keys: the model's path and its dot stripped, then `strip_prefix`
        (`--strip-prefix`, checked), which every model key must have."""
        keys = set(self.model_keys)
        strip = self.strip
        out = {}
        for fqn in fqns:
            if fqn not in keys:
                continue
            name = fqn[len(strip) :] if strip and fqn.startswith(strip) else fqn
            if strip_prefix:
                if not name.startswith(strip_prefix):
                    raise UsageError(
                        f"--strip-prefix {strip_prefix}: the model tensor {fqn} does not start "
                        f"with {strip + strip_prefix}",
                        "strip a prefix every model tensor has, or none",
                    )
                name = name[len(strip_prefix) :]
            if not name:
                raise InvalidCheckpoint(
                    f"the model tensor {fqn!r} has no name once {strip + strip_prefix!r} is "
                    "stripped",
                    "a release names every tensor; strip less, or fix the checkpoint's names",
                )
            out[name] = fqn
        return out

    def summary(self) -> str:
        """One line: the layout and what is there or missing."""
        have = ", ".join(c for c in RESUME_CLASSES if c in self.classes) or "nothing"
        if self.missing:
            return f"{self.layout} layout: missing {', '.join(self.missing)} (has {have})"
        return f"{self.layout} layout: complete ({have})"

    def to_json(self) -> dict[str, object]:
        return {
            "layout": self.layout,
            "model_path": self.model_path,
            "resumable": self.resumable,
            "missing_state": self.missing,
            "resume_state": self.classes,
            "unclassified": self.unclassified,
            "warnings": self.warnings,
        }


def classify(
    keys: Sequence[str],
    sidecars: Iterable[str],
    policy: ResumePolicy,
    layout: str | None = None,
    *,
    roots: list[str] | None = None,
) -> ResumeVerdict:
    """`keys` sorted; `layout` None: the one the keys show (policies/layouts.py); `roots`: the
    keys' optimizer roots when already known."""
    sidecars = sorted(sidecars)
    chosen = LAYOUTS[layout] if layout else detect(keys, sidecars)
    placed, model_path, entries = _entries(chosen, keys, policy)
    roots = optimizer_roots(keys) if roots is None else roots
    if not placed.shapes:  # every key is a model file's tensor
        roots = []
    longest = _matcher(entries)
    root_of = _root_finder(roots)

    found: dict[str, set[str]] = {}
    model_keys: list[str] = []
    unclassified: list[str] = []
    in_model: list[str] = []
    for key in keys:
        match = longest(class_path(key))
        root = None
        if match is not None:
            path, cls = match
            if cls == "model" and roots:
                root = root_of(key)
        elif roots and (root := root_of(key)) is not None:
            path, cls = root or "(top level)", "optimizer"
        elif model_path == "":
            path, cls = class_path(key).split(".", 1)[0], "model"
        else:
            unclassified.append(key)
            continue
        if cls == "model":
            model_keys.append(key)
            if root is not None:
                in_model.append(key)
        found.setdefault(cls, set()).add(path)
    read, sidecar_warnings = sidecar_classes(chosen, sidecars)
    for cls, labels in read.items():
        found.setdefault(cls, set()).update(labels)

    subtrees = _subtrees(keys, unclassified)
    required = list(chosen.required if policy.required is None else policy.required)
    missing = [c for c in required if c not in found]
    warnings = [placed.note] if placed.note else []
    warnings += sidecar_warnings
    warnings += [
        f"no {c} state: {CONSEQUENCES[c]}"
        for c in chosen.recommended
        if c not in required and c not in found
    ]
    if in_model:
        warnings.append(
            f"the model set holds optimizer state ({len(in_model)} keys, e.g. "
            f"{', '.join(in_model[:EXAMPLES])}): a release would carry it"
        )
    return ResumeVerdict(
        layout=chosen.name,
        model_path=model_path,
        classes={c: sorted(found[c]) for c in RESUME_CLASSES if c in found},
        model_keys=model_keys,
        missing=missing,
        unclassified=sorted(subtrees),
        unclassified_sizes=subtrees,
        optimizer_in_model=in_model,
        warnings=warnings,
    )


def check_strip_prefix(value: str | None) -> str:
    """A `--strip-prefix` value: "" for none, else a dotted key path, returned ending in "."."""
    if not value:
        return ""
    path = value.removesuffix(".")
    if not _is_key_path(path):
        raise UsageError(
            f"--strip-prefix {value[:80]!r} is not a key path", 'e.g. "model." or "model"'
        )
    return path + "."


def names_path(model_path: str, strip_prefix: str) -> str:
    """The key path a release's names are relative to: the model's path, and the prefix
    stripped beyond it (two promotions with the same one have the same names)."""
    extra = strip_prefix.removesuffix(".")
    if not extra:
        return model_path
    return f"{model_path}.{extra}" if model_path else extra


def sidecar_classes(
    layout: Layout, sidecars: Iterable[str]
) -> tuple[dict[str, set[str]], list[str]]:
    """class -> the sidecar entries that provide it, and warnings: files the layout reads that
    were present but unread (and why), and files recorded before reg read them (listed with
    no entry either way), which keep the classes the layout assumed for them then."""
    found: dict[str, set[str]] = {}
    files: dict[str, str | None] = {}  # file -> why unread; "" = recorded unread; None = read
    for entry in sidecars:
        file, path, why = split_entry(entry)
        if not layout.files or not re.fullmatch(layout.files, file):
            continue
        if path is not None:
            files[file] = None
            for rule in layout.sidecars:
                if rule.matches(file, path):
                    label = f"{file}{READ}{rule.path}" if rule.path else file
                    found.setdefault(rule.cls, set()).add(label)
        elif why is not None:
            files[file] = why
        else:
            files.setdefault(file, "")
    warnings = []
    for file, why in sorted(files.items()):
        if why:
            warnings.append(
                f"{file} is present but unread ({why}): the state it may hold is not counted"
            )
        elif why == "" and (assumed := layout.legacy.get(file)):
            for cls in assumed:
                found.setdefault(cls, set()).add(file)
            warnings.append(
                f"{file} was recorded before reg read it: it is assumed to hold "
                f"{', '.join(assumed)}, as it was then"
            )
    return found, warnings


def split_entry(entry: str) -> tuple[str, str | None, str | None]:
    """A sidecar entry -> (file, content path or None, why unread or None); `FILE:` (the file
    was read) gives path "". See registry/formats/sidecars.py."""
    if UNREAD in entry:
        file, why = entry.split(UNREAD, 1)
        return file, None, why
    if READ in entry:
        file, path = entry.split(READ, 1)
        return file, path, None
    return entry, None, None


def _entries(
    chosen: Layout, keys: Sequence[str], policy: ResumePolicy
) -> tuple[Placement, str, dict[str, str]]:
    """The layout placed, the model's path and every class entry (path -> class) under this
    policy."""
    placed = place(chosen, keys)
    model_path = placed.model if policy.model_key is None else policy.model_key
    entries = {p: cls for cls, paths in placed.classes.items() for p in paths}
    entries |= {p: cls for cls, paths in policy.classes.items() for p in paths}
    if model_path:
        entries[model_path] = "model"
    return placed, model_path, entries


# A key set's heads: its distinct key paths cut to this many segments. Whether each class is
# present depends only on them while every entry and every optimizer root's `state` lie within
# that depth, which holds for every shipped layout: `reg ls` then classifies a few hundred
# heads instead of thousands of keys.
HEAD_DEPTH = 4


def heads(keys: Iterable[str]) -> list[str]:
    return sorted({".".join(k.split(".", HEAD_DEPTH)[:HEAD_DEPTH]) for k in keys})


def missing_from_heads(
    key_heads: Sequence[str],
    roots: list[str],
    sidecars: Iterable[str],
    policy: ResumePolicy,
    layout: str,
) -> list[str] | None:
    """The required classes a key set lacks, from its heads and optimizer roots; None when the
    policy's entries or the roots lie too deep for heads to decide it (classify the keys)."""
    chosen = LAYOUTS[layout]
    _, _, entries = _entries(chosen, key_heads, policy)
    too_deep = any(p.count(".") + 1 > HEAD_DEPTH for p in entries) or any(
        (r.count(".") + 1 if r else 0) + 2 > HEAD_DEPTH for r in roots
    )
    if too_deep:
        return None
    return classify(key_heads, sidecars, policy, layout, roots=roots).missing


def resume_overrides(policy: ResumePolicy) -> list[str]:
    """What a policy's [resume] section overrides in every layout, said before it applies: the
    shipped policy before layouts wrote `required` and `model_key`, and a copy of it now makes
    every torchtitan checkpoint miss "rng" and every stateful one miss its model."""
    out = []
    if policy.required is not None:
        out.append(
            f"[resume] required = {policy.required} replaces every layout's required classes "
            "(leave it out to use each layout's)"
        )
    if policy.model_key is not None:
        out.append(
            f"[resume] model_key = {policy.model_key!r} replaces every layout's model path "
            "(leave it out to use each layout's, or force one with --layout)"
        )
    return out


def suggest(
    keys: Sequence[str], sidecars: Iterable[str], policy: ResumePolicy, verdict: ResumeVerdict
) -> list[str]:
    """What would place keys the verdict leaves unclassified, a model it did not find or state
    it misses: another layout that does better, else a model_key for the largest unplaced
    subtree."""
    if not verdict.unclassified and verdict.model_keys and not verdict.missing:
        return []
    sidecars = list(sidecars)

    def cost(v: ResumeVerdict) -> tuple[int, int, int]:
        return (0 if v.model_keys else 1, len(v.missing), len(v.unclassified))

    present = set(sidecars)
    tried = [
        (cost(v), name)
        for name, layout in LAYOUTS.items()
        if name != verdict.layout
        and set(layout.marks) <= present  # never a trainer whose files are not there
        and (v := classify(keys, sidecars, policy, name)).model_keys
    ]
    better = sorted(t for t in tried if t[0] < cost(verdict))
    if better:
        return [f"--layout {better[0][1]}"]
    placeable = {p: n for p, n in verdict.unclassified_sizes.items() if _is_key_path(p)}
    if not verdict.model_keys and placeable:
        largest = max(sorted(placeable), key=lambda p: placeable[p])
        return [f'[resume] model_key = "{largest}"']
    if placeable:
        first = min(placeable)
        return [f'name their class in [resume.classes], e.g. train_state = ["{first}"]']
    return []


def _is_key_path(path: str) -> bool:
    """What a policy may name (see policies.loader): dotted, no empty segment."""
    return bool(path) and len(path) <= 1024 and all(path.split("."))


# A "state" segment marks a candidate optimizer root; the first eight in a key are looked at
# (a real key has one or two), so a crafted key of thousands costs a few passes over it.
STATE_SEGMENTS_LOOKED_AT = 8
_TRIED_MEMO = 65536  # candidates remembered as "not a root" (bounded: crafted keys are unique)


def optimizer_roots(keys: Sequence[str]) -> list[str]:
    """Paths whose children are "state" (with names below) and "param_groups": the shape of a
    torch optimizer's state_dict, flattened or not, whatever it is called; "" is the top level.
    Every such path is a root (one optimizer's state can sit beside another's)."""
    roots: set[str] = set()
    tried: set[str] = set()
    for key in keys:
        for cut in _cuts(key, "state", require_child=True):
            if cut in roots or cut in tried:
                continue
            if has_path(keys, _join(cut, "param_groups")):
                roots.add(cut)
            else:
                if len(tried) >= _TRIED_MEMO:
                    tried.clear()
                tried.add(cut)
    return sorted(roots)


def _cuts(key: str, segment: str, *, require_child: bool) -> list[str]:
    """The paths before the first occurrences of `segment` as a whole segment of `key` (with
    something after it when `require_child`)."""
    out = []
    if key.startswith(segment + ".") or (not require_child and key == segment):
        out.append("")
    i = key.find("." + segment)
    while i >= 0 and len(out) < STATE_SEGMENTS_LOOKED_AT:
        end = i + 1 + len(segment)
        if key.startswith(".", end) or (not require_child and end == len(key)):
            out.append(key[:i])
        i = key.find("." + segment, i + 1)
    return out


def _root_finder(roots: list[str]) -> Callable[[str], str | None]:
    """key -> the optimizer root whose "state" or "param_groups" subtree holds it, if any."""
    known = set(roots)

    def find(key: str) -> str | None:
        for cut in _cuts(key, "state", require_child=True):
            if cut in known:
                return cut
        for cut in _cuts(key, "param_groups", require_child=False):
            if cut in known:
                return cut
        return None

    return find


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _matcher(entries: dict[str, str]) -> Callable[[str], tuple[str, str] | None]:
    """key -> (the longest entry it equals or lies under, its class). Only a key's first
    `depth` segments can match, so each distinct such prefix is looked up once."""
    depth = max((p.count(".") + 1 for p in entries), default=0)
    memo: dict[str, tuple[str, str] | None] = {}

    def longest(key: str) -> tuple[str, str] | None:
        parts = key.split(".", depth)
        top = min(len(parts), depth)
        head = ".".join(parts[:top])
        if head in memo:
            return memo[head]
        found = None
        for d in range(top, 0, -1):
            path = ".".join(parts[:d])
            cls = entries.get(path)
            if cls is not None:
                found = (path, cls)
                break
        memo[head] = found
        return found

    return longest


SUBTREE_DEPTH = 8  # an unclassified subtree is named by at most this many segments


def _subtrees(keys: Sequence[str], unclassified: list[str]) -> dict[str, int]:
    """The unclassified keys as the shortest paths under which every key is unclassified
    (at most SUBTREE_DEPTH segments, else the key itself), each with how many keys it holds."""
    if not unclassified:
        return {}
    placed = sorted(set(keys) - set(unclassified))
    out: dict[str, int] = {}
    for key in unclassified:
        found, cut = key, -1
        for _ in range(SUBTREE_DEPTH):
            cut = key.find(".", cut + 1)
            if cut < 0:
                break
            if not has_path(placed, key[:cut]):
                found = key[:cut]
                break
        out[found] = out.get(found, 0) + 1
    return out
