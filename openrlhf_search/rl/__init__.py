"""OpenRLHF's trainer subclasses and what they schedule: experience making, the loss, advantage estimators, the
async trainer, freezing, step timing, SFT."""
