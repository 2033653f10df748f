"""The MLflow mirror: the catalog's runs, checkpoints and releases shown in MLflow's UI and served
to MLflow's clients; the catalog stays the source of truth (DESIGN §2). Nothing here imports
mlflow at import time: a command pays for it only when it drains or serves.

    drain.py      the drain: catalog events -> MLflow runs, metrics, model versions
                  (`python -m registry.integrations.mirror.drain`, started detached by spawn.py)
    spawn.py      start the drain after a command, detached
    releases.py   release versions as MLflow registered-model versions
    artifacts.py  release bytes published for MLflow's artifact proxy; yanks withdraw them
    names.py      MLflow names of reg's things
    access.py     who may see what in the UI: reg's grants as MLflow permissions
    login.py      the UI's login: reg tokens checked, the UI read-only
    ui.py         `reg ui`: MLflow's server over the mirror
"""
