"""Resume state by whole key paths (policies/resume.py, policies/layouts.py): pure rules, each
with the checkpoint shape that motivated it."""

from __future__ import annotations

import pytest

from policies.layouts import check_layout, detect
from policies.loader import default_policy, parse_policy
from policies.resume import classify, optimizer_roots, suggest
from registry.errors import PolicyError, UsageError

POLICY = default_policy().resume

# The DCP tutorial's {"app": AppState(model, optimizer)}: optimizer state not flattened.
TUTORIAL = [
    "app.model.net1.bias",
    "app.model.net1.weight",
    "app.optim.param_groups.0.lr",
    "app.optim.param_groups.0.params",
    "app.optim.state.net1.weight.exp_avg",
    "app.optim.state.net1.weight.step",
]
# torchtitan: the model's own names at the top level, the optimizer flattened, no RNG; two model
# tensors named like train state and grad scaler entries.
TITAN = [
    "dataloader.dp_rank_0",
    "layers.0.attention.wq.weight",
    "lr_scheduler.last_epoch",
    "optimizer.param_groups.layers.0.attention.wq.weight.lr",
    "optimizer.state.layers.0.attention.wq.weight.exp_avg",
    "scaler_head.weight",
    "stepper.weight",
    "tok_embeddings.weight",
    "train_state.step",
]
# Lightning's ModelParallelStrategy: "state_dict", "optimizer_0", and meta.pt beside the shards.
LIGHTNING = [
    "optimizer_0.param_groups.0.lr",
    "optimizer_0.state.layer.weight.exp_avg",
    "state_dict.layer.bias",
    "state_dict.layer.weight",
]
DCP_FULL = [
    "dataloader.rank0.position",
    "lr_scheduler.last_epoch",
    "model.embed.weight",
    "optimizer.param_groups.0.lr",
    "optimizer.state.embed.weight.exp_avg",
    "rng.rank0.torch",
    "train_state.step",
]


def _policy(text: str):  # type: ignore[no-untyped-def]
    return parse_policy(text, "test.toml").resume


@pytest.mark.parametrize(
    ("keys", "sidecars", "layout"),
    [
        (TUTORIAL, [], "stateful"),
        (TITAN, [], "torchtitan"),
        (LIGHTNING, ["meta.pt"], "lightning"),
        (LIGHTNING, [], "lightning"),  # "state_dict" alone says Lightning
        (DCP_FULL, [], "dcp"),
        (["weight", "bias"], [], "torchtitan"),  # a bare model state_dict
    ],
)
def test_layout_is_detected_from_keys_and_files(keys, sidecars, layout):
    assert detect(sorted(keys), sidecars).name == layout


def test_stateful_tutorial_places_model_and_optimizer_under_the_wrapper():
    v = classify(TUTORIAL, [], POLICY)
    assert v.layout == "stateful" and v.model_path == "app.model"
    assert v.classes == {"model": ["app.model"], "optimizer": ["app.optim"]}
    assert v.resumable and v.missing == []
    assert v.model_names(TUTORIAL) == {
        "net1.bias": "app.model.net1.bias",
        "net1.weight": "app.model.net1.weight",
    }
    # what it lacks is said, not refused
    assert any(w.startswith("no rng state") for w in v.warnings)


def test_torchtitan_names_like_step_or_scaler_stay_model_tensors():
    v = classify(TITAN, [], POLICY)
    assert v.layout == "torchtitan" and v.model_path == ""
    assert set(v.model_names(TITAN)) == {
        "layers.0.attention.wq.weight",
        "scaler_head.weight",
        "stepper.weight",
        "tok_embeddings.weight",
    }
    assert "grad_scaler" not in v.classes and v.classes["train_state"] == ["train_state"]
    assert v.resumable  # torchtitan saves no RNG: a warning, not a refusal
    assert [w for w in v.warnings if w.startswith("no rng")]


def test_torchtitan_model_only_checkpoint_is_not_resumable():
    model_only = ["layers.0.attention.wq.weight", "tok_embeddings.weight"]
    v = classify(model_only, [], POLICY)
    assert v.missing == ["optimizer", "lr_scheduler", "train_state"]
    assert len(v.model_names(model_only)) == 2


META_PT = ["meta.pt", "meta.pt:", "meta.pt:global_step", "meta.pt:lr_schedulers"]  # as read


def test_lightning_optimizer_is_found_by_structure_and_meta_pt_carries_the_rest():
    v = classify(LIGHTNING, META_PT, POLICY)
    assert v.classes["optimizer"] == ["optimizer_0"]
    assert v.classes["train_state"] == ["meta.pt:global_step"] and v.resumable
    assert v.model_names(LIGHTNING) == {
        "layer.bias": "state_dict.layer.bias",
        "layer.weight": "state_dict.layer.weight",
    }
    without = classify(LIGHTNING, [], POLICY)
    assert without.missing == ["train_state"]


def test_entries_match_whole_segments_only():
    keys = sorted(["model.w", "optimizer_0.lr", "optimizer.state.w.exp_avg", "stepper.x"])
    v = classify(keys, [], _policy('[resume.classes]\noptimizer = ["optimizer"]'), "dcp")
    assert v.classes["optimizer"] == ["optimizer"]
    # "optimizer_0.lr" has no optimizer structure and no entry: unplaced, not optimizer state
    assert "optimizer_0" in v.unclassified and "stepper" in v.unclassified


def test_optimizer_in_the_model_set_is_reported():
    v = classify(TUTORIAL, [], _policy('[resume]\nmodel_key = "app"'), "dcp")
    assert v.model_path == "app"
    assert v.optimizer_in_model == [k for k in TUTORIAL if k.startswith("app.optim")]
    assert any("optimizer state" in w for w in v.warnings)


def test_optimizer_roots_by_structure():
    assert optimizer_roots(TUTORIAL) == ["app.optim"]
    assert optimizer_roots(sorted(TITAN)) == ["optimizer"]
    bare = ["param_groups.0.lr", "state.w.exp_avg"]
    assert optimizer_roots(bare) == [""]
    # "state" without "param_groups" beside it is not an optimizer
    assert optimizer_roots(["model.lstm.state.weight"]) == []


def test_written_required_replaces_every_layouts():
    strict = _policy('[resume]\nrequired = ["model", "optimizer", "rng"]')
    v = classify(TITAN, [], strict)
    assert v.missing == ["rng"] and not v.resumable
    lenient = _policy('[resume]\nrequired = ["model"]')
    assert classify(["layers.0.w"], [], lenient).resumable


def test_shipped_default_writes_no_required_and_no_model_key():
    assert POLICY.required is None and POLICY.model_key is None and POLICY.classes == {}


def test_policy_classes_add_whole_paths():
    keys = sorted([*DCP_FULL, "amp.scale"])
    assert classify(keys, [], POLICY).unclassified == ["amp"]
    v = classify(keys, [], _policy('[resume.classes]\ngrad_scaler = ["amp"]'))
    assert v.classes["grad_scaler"] == ["amp"] and v.unclassified == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[resume]\nrequired = ["momentum"]', "unknown resume class 'momentum'"),
        ('[resume.classes]\nmodel = ["m"]', "model is placed by model_key"),
        ('[resume.classes]\noptimizer = ["a..b"]', "not a dotted key path"),
        ('[resume]\nmodel_key = "app."', "not a dotted key path"),
    ],
)
def test_bad_resume_policy_is_refused(text, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(text, "p.toml")


def test_unclassified_keys_come_with_a_suggestion():
    forced = classify(TUTORIAL, [], POLICY, "dcp")
    assert forced.unclassified == ["app.model"] and "model" in forced.missing
    assert suggest(TUTORIAL, [], POLICY, forced) == ["--layout stateful"]
    odd = sorted(["net.weight", "net.bias", "extra.thing"])
    assert suggest(odd, [], POLICY, classify(odd, [], POLICY, "dcp")) == ["--layout torchtitan"]
    # a written model_key holds in every layout: the largest unplaced subtree is suggested
    elsewhere = _policy('[resume]\nmodel_key = "x"')
    v = classify(odd, [], elsewhere, "dcp")
    assert suggest(odd, [], elsewhere, v) == ['[resume] model_key = "net"']
    assert suggest(DCP_FULL, [], POLICY, classify(DCP_FULL, [], POLICY)) == []


def test_unknown_layout_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown layout 'zero3'"):
        check_layout("zero3")


@pytest.mark.parametrize("keys", [TUTORIAL, TITAN, LIGHTNING, DCP_FULL, ["layers.0.w"]])
@pytest.mark.parametrize(
    "text",
    [
        "",
        '[resume]\nrequired = ["model", "optimizer", "rng", "grad_scaler"]',
        '[resume]\nmodel_key = "app"',
        '[resume.classes]\ngrad_scaler = ["app.model.net1"]',
    ],
)
@pytest.mark.parametrize("layout", ["dcp", "torchtitan", "lightning", "stateful"])
def test_reg_ls_decides_from_heads_what_the_keys_decide(keys, text, layout):
    from policies.resume import heads, missing_from_heads

    keys, policy = sorted(keys), _policy(text)
    for sidecars in ([], ["meta.pt"]):
        expected = classify(keys, sidecars, policy, layout).missing
        found = missing_from_heads(heads(keys), optimizer_roots(keys), sidecars, policy, layout)
        assert found == expected


def test_heads_give_way_to_keys_when_entries_lie_deeper():
    from policies.resume import heads, missing_from_heads

    deep = _policy('[resume.classes]\ngrad_scaler = ["a.b.c.d.e"]')
    keys = ["a.b.c.d.e.f", "model.w"]
    assert missing_from_heads(heads(keys), [], [], deep, "dcp") is None
    nested = sorted(["x.y.z.state.w.exp_avg", "x.y.z.param_groups.0.lr", "model.w"])
    assert optimizer_roots(nested) == ["x.y.z"]
    assert missing_from_heads(heads(nested), ["x.y.z"], [], POLICY, "dcp") is None


def test_lightning_fsdp_and_fabric_keep_the_model_under_model():
    """FSDPStrategy writes {"model", "optimizer_0"} beside meta.pt (ModelParallel: state_dict)."""
    keys = sorted(["model.layer.weight", "optimizer_0.param_groups.0.lr", "optimizer_0.state.x.m"])
    v = classify(keys, META_PT, POLICY)
    assert v.layout == "lightning" and v.model_path == "model" and v.resumable
    assert v.model_names(keys) == {"layer.weight": "model.layer.weight"}


def test_a_stateful_wrapper_holding_an_optimizer_wins_and_the_other_is_unplaced():
    keys = sorted(
        [
            "ema.model.w",
            "trainer.model.w",
            "trainer.optim.param_groups.0.lr",
            "trainer.optim.state.w.exp_avg",
        ]
    )
    v = classify(keys, [], POLICY)
    assert v.layout == "stateful" and v.model_path == "trainer.model"
    assert v.unclassified == ["ema"]
    assert any("several keys hold a model (ema, trainer)" in w for w in v.warnings)


def test_a_class_name_is_never_a_stateful_wrapper():
    # a Hugging Face model under "model" ("model.model.*"): dcp, not a wrapper called "model"
    keys = sorted(["model.model.embed.weight", "model.lm_head.weight", "optimizer.state.a.b"])
    assert classify(keys, [], POLICY, "stateful").model_path == "app.model"
    assert classify(keys, [], POLICY).layout == "dcp"


def test_a_top_level_optimizer_shape_does_not_hide_one_in_the_model():
    keys = sorted(
        [
            "model.w",
            "model.opt.state.w.exp_avg",
            "model.opt.param_groups.0.lr",
            "state.dummy",
            "param_groups",
        ]
    )
    assert optimizer_roots(keys) == ["", "model.opt"]
    v = classify(keys, [], POLICY)
    assert v.optimizer_in_model == ["model.opt.param_groups.0.lr", "model.opt.state.w.exp_avg"]


def test_crafted_keys_cost_what_their_length_costs():
    """Thousands of roots, keys of thousands of "state" segments, deep unclassified paths: each
    key is looked at a bounded number of times (these ran for minutes before)."""
    many = sorted(
        [f"o{i}.state.x" for i in range(4000)] + [f"o{i}.param_groups" for i in range(4000)]
    )
    assert len(optimizer_roots(many)) == 4000
    v = classify(many, [], POLICY, "dcp")
    assert v.classes["optimizer"][:2] == ["o0", "o1"] and v.missing == ["model", "train_state"]
    deep = sorted(f"k{i}." + ".".join(["state"] * 2000) for i in range(50))
    assert optimizer_roots(deep) == []
    nested = sorted(["a." * 3000 + f"leaf{i}" for i in range(50)] + ["model.w"])
    v = classify(nested, [], POLICY)
    assert v.unclassified == ["a"] and v.unclassified_sizes == {"a": 50}


def test_suggestions_never_name_what_a_policy_refuses():
    keys = sorted(["", ".", "..", "model.w", "extra.x"])
    v = classify(keys, [], POLICY)
    assert v.unclassified == ["", "extra"]
    assert suggest(keys, [], POLICY, v) == [
        'name their class in [resume.classes], e.g. train_state = ["extra"]'
    ]
