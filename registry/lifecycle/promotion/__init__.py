"""Promotion: checkpoint -> validated, consolidated, immutable release (DESIGN §1, §5).

    plan      check the request, resolve the source (nothing written); the
              release's config.json (dtype, architectures rewritten)        plan.py, hf.py
    existing  the same checkpoint and options already made an active release: return it
    gates     resumable (policy); a passing validation the policy accepts     plan.py
    proved    the model's shards read once and proved against the manifest    proven.py
    reserve -> build -> commit, under a claim on the release row              stages.py

`run.promote` runs them. Nothing is visible until the commit. The source checkpoint is held
(protected from retention) from the gates to the commit. The result says whether the release is
a complete Hugging Face model folder (`hf`), never refusing one that is not.
"""
