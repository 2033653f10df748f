"""The lifecycles of DESIGN §1: functions over a `registry.context.Context`.

checkpoints/  push, read (show, pull, verify, pin), listing
releases      list, show, verify, pull, aliases, status
validation/   restore validation: run checks -> Outcome -> record
promotion/    gates -> reserve -> build -> commit, over a PromotionPlan
gc            retention: plan, mark, delete, tombstone, sweep
rebuild       the catalog from the store's documents
"""
