"""The lifecycles of DESIGN §1: functions over a `registry.lifecycle.context.Context`.

checkpoints/  push, read (show, pull, verify, pin), listing
releases      list, show, verify, pull, aliases, status
validation/   restore validation: run checks -> Outcome -> record
promotion/    gates -> reserve -> build -> commit, over a PromotionPlan
verify        verify [--repair] of one artifact, either kind, recorded
views         the JSON shapes of checkpoints and releases

GC, fsck, scrubs, the rebuild and administration are `registry.operations`; checkpoint
economics `registry.economics`; the MLflow mirror `registry.integrations.mirror`.
"""
