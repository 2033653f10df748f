"""The MLflow mirror: the catalog's runs, checkpoints and releases shown in MLflow's UI and served
to MLflow's clients; the catalog stays the source of truth (DESIGN §2). Nothing here imports
mlflow at import time: a command pays for it only when it drains or serves.

    drain.py      the drain: catalog events -> MLflow runs, metrics, model versions
                  (`python -m registry.integrations.mirror.drain`, started detached after a
                  command by `core.detached.spawn_drain`)
    releases.py   release versions as MLflow registered-model versions
    access.py     who may see what in the UI: reg's grants as MLflow permissions
    login.py      the UI's login: reg tokens checked, the UI read-only
    ui.py         `reg ui`: MLflow's server over the mirror

What the lifecycles call below this layer: MLflow's names of reg's things
(`catalog/mlflow_names.py`, a colliding model refused where it is created) and the release bytes
published for MLflow's artifact proxy (`storage/mlflow_artifacts.py`; a yank withdraws them).
"""
