"""Checkpoint economics: what checkpoints cost the training job (C_eff), what a
restart costs (RTO), how often the job fails, and the checkpoint interval that wastes least.

    model      the waste model and the formulas (Young, Daly, the availability optimum, regret,
               lost work, failure-rate confidence intervals); pure functions
    simulate   a seeded Monte Carlo simulator of the same model
    facts      what the catalog knows about a run, and the figures derived from it
    records    what the training loop reports (heartbeats, planned restarts, restore kinds)
    advise     `reg advise`: all of it, and one sentence of advice
    plot       `reg advise --plot`: expected waste vs interval as SVG
"""

from registry.economics.advise import advise

__all__ = ["advise"]
