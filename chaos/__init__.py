"""The fault campaign: the whole pipeline as real processes under injected faults, with
an exact accounting of every message."""
