"""One module per platform: authenticate, parse, normalise to an ``Intake``."""
